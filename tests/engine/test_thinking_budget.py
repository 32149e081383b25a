"""The thinking budget's masks: free until the budget is spent, then only the end of thinking, then the grammar."""

import numpy as np
import pytest

from dsjax.engine.grammar import Constraint, Grammars, full_masks
from dsjax.engine.thinking_budget import ThinkingBudget
from tests.engine.test_grammar import EOS, THINK_END, TOKENIZER, VOCAB, follow


def allowed(m) -> list[int]:
    """The tokens `m` allows in a row that starts as the scheduler's do: every token allowed."""
    masks = full_masks(2, VOCAB)
    m.fill(masks, 1)
    assert (masks[0] == -1).all()  # only its own row
    return np.flatnonzero(np.unpackbits(masks[1].view(np.uint8), bitorder="little")[:VOCAB]).tolist()


def test_the_end_of_thinking_is_forced_once_the_budget_is_spent_and_then_everything_is_free():
    m = ThinkingBudget(THINK_END, 3)
    for t in (5, 6, 7):
        assert len(allowed(m)) == VOCAB
        assert m.needs_mask == (m.left <= 1)  # the unmasked path until a step may have to be forced
        m.consume(t)
    assert allowed(m) == [THINK_END] and m.thinking
    m.consume(THINK_END)
    assert not m.thinking and m.forced and len(allowed(m)) == VOCAB and m.accepting and m.error is None
    assert not m.needs_mask
    early = ThinkingBudget(THINK_END, 3)
    early.consume(5)
    early.consume(THINK_END)  # ended by the model: never forced, never counted again
    for t in (5, 6, 7, 8):
        early.consume(t)
    assert not early.forced and len(allowed(early)) == VOCAB


def test_a_budget_around_a_grammar_forces_the_end_then_holds_the_answer_to_the_grammar():
    grammars = Grammars(open(TOKENIZER, encoding="utf-8").read(), VOCAB, [EOS])
    inner = grammars.matcher(Constraint("regex", "(yes|no)", after=THINK_END))
    m = ThinkingBudget(THINK_END, 2, inner)
    assert EOS not in allowed(m)  # the grammar's own rule before its trigger: no stop
    m.consume(9)
    m.consume(10)
    assert allowed(m) == [THINK_END]
    m.consume(THINK_END)
    answers = {grammars.tokenizer.decode_str([t]) for t in allowed(m)}
    assert answers and answers <= {"y", "ye", "yes", "n", "no"}
    follow(grammars, m, "no")
    assert m.accepting and allowed(m) == [EOS]


def test_bad_budgets_are_refused():
    for bad in (-1, 1.5, True, None):
        with pytest.raises(ValueError, match="thinking budget"):
            ThinkingBudget(THINK_END, bad)
