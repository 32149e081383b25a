"""Grammars compiled against the embedded model's tokenizer: the masks they give, the thinking part before them,
their errors and the cache's bound."""

import json
import threading
import os

import numpy as np
import pytest

import dsjax
from dsjax.engine.grammar import Constraint, GrammarError, Grammars, MaskFiller, full_masks, mask_words
from dsjax.engine.thinking_budget import ThinkingBudget

TOKENIZER = os.path.join(os.path.dirname(dsjax.__file__), "embedded", "model", "tokenizer.json")
VOCAB, EOS, THINK_END = 8200, 1, 8177  # more logits than the tokenizer's 8192 tokens, as models pad theirs


@pytest.fixture(scope="module")
def grammars():
    return Grammars(open(TOKENIZER, encoding="utf-8").read(), VOCAB, [EOS])


def allowed(matcher) -> list[int]:
    masks = np.zeros((2, mask_words(VOCAB)), np.int32)
    matcher.fill(masks, 1)
    assert not masks[0].any()  # only its own row
    bits = np.unpackbits(masks[1].view(np.uint8), bitorder="little")[:VOCAB]
    return np.flatnonzero(bits).tolist()


def follow(grammars, matcher, text: str) -> None:
    """Feed `text`'s tokens, checking each was allowed."""
    for t in grammars.tokenizer.tokenize_str(text):
        assert t in allowed(matcher), (text, grammars.tokenizer.decode_str([t]))
        matcher.consume(t)


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}, "tag": {"enum": ["x", "y"]}},
          "required": ["n", "tag"], "additionalProperties": False}


@pytest.mark.parametrize("kind, text, good", [
    ("json_schema", json.dumps(SCHEMA), '{"n": 12, "tag": "y"}'),
    ("regex", r"(yes|no)-[0-9]{2}", "no-42"),
    ("ebnf", 'root ::= "A" item*\nitem ::= "," [0-9]', "A,1,2"),
    ("lark", 'start: "a"+ "b"', "aaab"),
])
def test_a_match_ends_only_when_complete(grammars, kind, text, good):
    m = grammars.matcher(Constraint(kind, text))
    assert EOS not in allowed(m)
    follow(grammars, m, good)
    assert m.accepting and EOS in allowed(m) and m.error is None
    m.consume(EOS)
    assert m.error is None


def test_json_is_spaced_one_way(grammars):
    m = grammars.matcher(Constraint("json_schema", json.dumps(SCHEMA)))
    follow(grammars, m, '{"n":')
    texts = [grammars.tokenizer.decode_str([t]) for t in allowed(m)]
    assert texts and all(t.startswith(" ") and not t[1:2].isspace() for t in texts), texts


def test_the_thinking_part_is_free_but_for_the_stop_tokens(grammars):
    m = grammars.matcher(Constraint("regex", "[ab]{3}", after=THINK_END))
    free = allowed(m)
    assert EOS not in free and THINK_END in free and len(free) == VOCAB - 1
    follow(grammars, m, "let me think {not json} ...")
    m.consume(THINK_END)
    body = allowed(m)
    assert EOS not in body and THINK_END not in body
    assert {grammars.tokenizer.decode_str([t]) for t in body} <= {"a", "b", "aa", "ab", "ba", "bb", "aaa", "aab",
                                                                   "aba", "abb", "baa", "bab", "bba", "bbb"}
    follow(grammars, m, "bab")
    assert allowed(m) == [EOS]


def test_an_optional_grammar_may_end_before_its_trigger_and_holds_what_follows_it(grammars):
    m = grammars.matcher(Constraint("regex", "[ab]{3}", after=THINK_END, optional=True))
    assert EOS in allowed(m) and THINK_END in allowed(m)  # nothing yet: complete as it is
    follow(grammars, m, "plain text")
    assert EOS in allowed(m) and m.accepting
    m.consume(THINK_END)
    assert EOS not in allowed(m) and not m.accepting
    follow(grammars, m, "abb")
    assert allowed(m) == [EOS]
    with pytest.raises(ValueError, match="optional constraint needs the token"):
        Constraint("regex", "a", optional=True)


@pytest.mark.parametrize("kind, text, says", [
    ("json_schema", '{"type": "objectx"}', "objectx"),
    ("json_schema", '{"type": "object"', "not valid JSON"),
    ("regex", "[ab", "unclosed"),
    ("ebnf", "root ::= (", "EBNF"),
    ("lark", "start: missing_rule", "missing_rule"),
])
def test_invalid_grammars_are_named(grammars, kind, text, says):
    with pytest.raises(GrammarError, match=says):
        grammars.matcher(Constraint(kind, text))


def test_unknown_kinds_and_capacities_are_refused():
    with pytest.raises(ValueError, match="kind"):
        Constraint("xml", "<a/>")
    with pytest.raises(ValueError, match="capacity"):
        Grammars(open(TOKENIZER, encoding="utf-8").read(), VOCAB, [EOS], capacity=0)
    with pytest.raises(ValueError, match="stop tokens"):
        Grammars(open(TOKENIZER, encoding="utf-8").read(), VOCAB, [])


def test_each_grammar_compiles_once_and_the_cache_keeps_the_most_recent():
    g = Grammars(open(TOKENIZER, encoding="utf-8").read(), VOCAB, [EOS], capacity=2)
    a, b, c = (Constraint("regex", r) for r in ("a+", "b+", "c+"))
    m1, m2 = g.matcher(a), g.matcher(a)
    assert g.compiles == 1 and len(g) == 1
    follow(g, m1, "aa")  # matchers of one grammar are independent
    assert m2.accepting is False
    g.matcher(b), g.matcher(a), g.matcher(c)  # a was used after b: b goes
    assert g.compiles == 3 and len(g) == 2
    g.matcher(a)
    assert g.compiles == 3
    g.matcher(b)
    assert g.compiles == 4 and len(g) == 2
    # The same regex after the thinking part is another grammar.
    g.matcher(Constraint("regex", "a+", after=THINK_END))
    assert g.compiles == 5


def test_a_failed_matcher_allows_only_the_stop_tokens(grammars):
    m = grammars.matcher(Constraint("regex", "ab"))
    m.consume(grammars.tokenizer.tokenize_str("b")[0])  # not allowed: as if the mask had been ignored
    assert m.error is not None
    assert allowed(m) == [EOS]


def test_full_masks_allow_every_token():
    masks = full_masks(3, 70)
    assert masks.shape == (3, 3) and (masks == -1).all()


def test_a_batch_of_masks_on_llguidance_threads_is_each_matcher_s_own(grammars):
    """`MaskFiller` (threads) gives every row what its matcher gives alone: grammars part-way through, one that
    failed (stop tokens only), a thinking budget spent (its end only); rows without a matcher stay free."""
    rng = np.random.default_rng(0)
    texts = ['{"n": 12, "tag": "x"}', "{", '{"n": 3', "", '{"n": 7, "tag": "y"']
    matchers = []
    for text in texts * 4:
        m = grammars.matcher(Constraint("json_schema", json.dumps(SCHEMA)))
        for t in grammars.tokenizer.tokenize_str(text):
            m.consume(t)
        matchers.append(m)
    matchers[3].consume(grammars.tokenizer.tokenize_str("z")[0])  # refused: the matcher fails
    matchers.append(ThinkingBudget(THINK_END, 0, grammars.matcher(Constraint("regex", "a+", after=THINK_END))))
    rows = [int(r) for r in rng.permutation(30)[:len(matchers)]]
    filled = MaskFiller(30, VOCAB)(list(zip(rows, matchers)))
    assert filled.shape == (30, mask_words(VOCAB))
    for row, m in zip(rows, matchers):
        alone = np.zeros((1, mask_words(VOCAB)), np.int32)
        m.fill(alone, 0)
        assert (filled[row] == alone[0]).all(), row
    assert matchers[3].error is not None and allowed(matchers[3]) == [EOS]
    assert allowed(matchers[-1]) == [THINK_END]
    assert (filled[[r for r in range(30) if r not in rows]] == -1).all()
    assert len({filled[r].tobytes() for r in rows}) > 3  # the grammars' states differ


def test_masks_started_on_a_thread_equal_those_made_in_place_and_record_failures_on_the_caller_s(grammars):
    """`MaskFiller.start` fills the rows `__call__` does; a failure llguidance meets is set on its matcher only
    when the caller takes the result; `close` ends the thread, and a later `start` makes another."""
    def fresh():
        ms = [grammars.matcher(Constraint("json_schema", json.dumps(SCHEMA))) for _ in range(6)]
        for m, text in zip(ms, ['{"n": 1', "{", "", '{"n": 2, "tag": "q"}', '{"n": 3, "tag', "{"]):
            for t in grammars.tokenizer.tokenize_str(text):
                m.consume(t)
        return ms

    filler = MaskFiller(8, VOCAB)
    rows = [7, 0, 3, 5, 2, 6]
    made = filler(list(zip(rows, fresh())))
    ms = fresh()
    ms[1]._m.consume_token(grammars.tokenizer.tokenize_str("z")[0])  # llguidance's own failure, not seen yet
    pending = filler.start(list(zip(rows, ms)))
    pending._future.result()  # the thread is done
    assert ms[1].error is None  # and did not touch what a consumer may read
    got = pending.result()
    assert ms[1].error is not None and allowed(ms[1]) == [EOS]
    keep = [i for i in range(len(rows)) if i != 1]
    assert all((got[rows[i]] == made[rows[i]]).all() for i in keep)
    assert (got[[1, 4]] == -1).all()
    filler.close()
    assert (filler.start(list(zip(rows, fresh()))).result() == made).all()
    # `put` takes the finished masks (the failed row already cut to the stop tokens) on the masks' thread
    ms, names = fresh(), []
    ms[1]._m.consume_token(grammars.tokenizer.tokenize_str("z")[0])
    put = filler.start(list(zip(rows, ms)), lambda m: (names.append(threading.current_thread().name), ("put", m.copy()))[1])
    tag, masks = put.result()
    assert tag == "put" and names and names[0].startswith("dsjax-masks"), names
    assert (masks == got).all() and ms[1].error is not None
    filler.close()
