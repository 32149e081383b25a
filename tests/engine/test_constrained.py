"""Constrained decoding through the scheduler on the embedded model: outputs follow their grammars, other rows
are untouched, masks are computed while the model runs, and nothing compiles mid-run."""

import json
import threading

import jax
import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest

import dsjax
from dsjax.embedded import MODEL_DIR
from dsjax.engine.compiles import CompileClock
from dsjax.engine import scheduler
from dsjax.engine.grammar import Constraint, Grammars, MaskFiller, Matcher, PendingMasks

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
          "required": ["name", "n", "tags"], "additionalProperties": False}
PROMPT = [0, 8179, 300, 400, 500, 8180]


@pytest.fixture(scope="module")
def setup():
    model = dsjax.load_model(MODEL_DIR, dtype=jnp.float32)
    engine = dsjax.Engine(model, dsjax.RunConfig(slots=4, max_len=128, chunk_size=16))
    engine.precompile(masked=True)
    grammars = Grammars(open(f"{MODEL_DIR}/tokenizer.json", encoding="utf-8").read(), model.cfg.vocab_size,
                        model.cfg.eos_token_id)
    return model, engine, grammars


def text(grammars, tokens):
    return grammars.tokenizer.decode_str([t for t in tokens if t not in (1,)])


def test_outputs_follow_their_grammars_and_other_rows_are_untouched(setup):
    model, engine, grammars = setup
    greedy = dsjax.SamplingParams(temperature=0.0, max_tokens=100)
    sampled = dsjax.SamplingParams(temperature=0.9, top_p=0.95, max_tokens=100, seed=5)
    constraints = [Constraint("json_schema", json.dumps(SCHEMA)), Constraint("regex", r"(red|green|blue)!"),
                   None, Constraint("json_schema", json.dumps(SCHEMA), after=8177), None,
                   Constraint("ebnf", 'root ::= "x" [0-9] [0-9]')]
    params = [greedy, sampled, greedy, greedy, sampled, sampled]
    prompts = [PROMPT + [7 + i] for i in range(len(constraints))]
    with CompileClock() as clock:
        res = dsjax.generate(model, prompts, params, engine=engine,
                             matchers=[grammars.matcher(c) if c else None for c in constraints])
        alone = [dsjax.generate(model, [prompts[i]], params[i], engine=engine)[0] for i in (2, 4)]
    assert clock.programs == 0
    for i in (0, 1, 3, 5):
        assert res[i].finish_reason == "stop" and res[i].tokens[-1] == 1, (i, text(grammars, res[i].tokens))
    jsonschema.validate(json.loads(text(grammars, res[0].tokens)), SCHEMA)
    assert text(grammars, res[1].tokens) in ("red!", "green!", "blue!")
    thought, _, answer = text(grammars, res[3].tokens).partition("</think>")
    jsonschema.validate(json.loads(answer), SCHEMA)
    assert len(text(grammars, res[5].tokens)) == 3
    assert [res[2].tokens, res[4].tokens] == [a.tokens for a in alone]


def test_masks_are_computed_while_the_device_runs_the_model_and_the_tokens_are_handed_out(setup, monkeypatch):
    """Per step: the model dispatched, the step before read (the matchers advanced), the masks started, the
    tokens read handed out, then the masks awaited and the sampler dispatched; the masks' rows are filled and
    copied to the device on another thread, not the consumer's."""
    model, engine, grammars = setup
    log, threads, put_on, sampled_with = [], set(), [], []
    decode, sample, get, source, hand_out, start, result, placer = (
        engine.decode_logits, engine.sample, jax.device_get, Matcher.mask_source, scheduler._hand_out,
        MaskFiller.start, PendingMasks.result, engine.mask_placer)

    def mask_placer():
        put = placer()
        return lambda m: (put_on.append((threading.current_thread().name, type(m))), put(m))[1]

    def sample_logged(*a):
        log.append("sample")
        sampled_with.append(a[3] if len(a) > 3 else None)
        return sample(*a)

    monkeypatch.setattr(engine, "decode_logits", lambda *a: (log.append("model"), decode(*a))[1])
    monkeypatch.setattr(engine, "sample", sample_logged)
    monkeypatch.setattr(engine, "mask_placer", mask_placer)
    monkeypatch.setattr(scheduler.jax, "device_get", lambda x: (log.append("read"), get(x))[1])
    monkeypatch.setattr(Matcher, "mask_source",
                        lambda self, *a: (threads.add(threading.current_thread().name), source(self, *a))[1])
    monkeypatch.setattr(MaskFiller, "start", lambda self, *a: (log.append("masks"), start(self, *a))[1])
    monkeypatch.setattr(PendingMasks, "result", lambda self: (log.append("masks ready"), result(self))[1])
    monkeypatch.setattr(scheduler, "_hand_out", lambda *a: (log.append("hand out"), hand_out(*a))[1])
    res = dsjax.generate(model, [PROMPT], dsjax.SamplingParams(temperature=0.0, max_tokens=6), engine=engine,
                         matchers=[grammars.matcher(Constraint("regex", "[a-z ]{6}"))])[0]
    assert len(res.tokens) >= 3
    # the prefill (its masks on the caller's thread, no "masks" start), its read; then step 1 (nothing to read
    # before it), step 2, ...
    assert log[:2] == ["sample", "read"], log
    assert log[2:7] == ["model", "masks", "hand out", "masks ready", "sample"], log
    assert log[7:13] == ["model", "read", "masks", "hand out", "masks ready", "sample"], log
    assert threading.current_thread().name in threads  # the prefill's
    assert any(t.startswith("dsjax-masks") for t in threads), threads
    # each decode step's masks copied to the device by the masks' thread, not the consumer's
    assert [t for t, kind in put_on if t.startswith("dsjax-masks") and kind is np.ndarray] == (
        [t for t, _ in put_on if t.startswith("dsjax-masks")]), put_on
    assert len([t for t, _ in put_on if t.startswith("dsjax-masks")]) == log.count("masks") >= 2, put_on
    assert all(isinstance(m, jax.Array) for m in sampled_with[1:]), sampled_with  # decode steps: on the device
    assert not [t for t in threading.enumerate() if t.name.startswith("dsjax-masks")]  # closed with the run


def test_a_grammar_refuses_no_request_a_slot_it_left(setup):
    """A constrained request that ends frees its slot for an unconstrained one, whose tokens are its own."""
    model, engine, grammars = setup
    sp = dsjax.SamplingParams(temperature=0.0, max_tokens=20)
    prompts = [PROMPT + [40 + i] for i in range(6)]
    constraints = [Constraint("regex", "ok")] * 5 + [None]
    res = dsjax.generate(model, prompts, sp, engine=engine,
                         matchers=[grammars.matcher(c) if c else None for c in constraints])
    assert all(text(grammars, r.tokens) == "ok" for r in res[:5])
    assert res[5].tokens == dsjax.generate(model, [prompts[5]], sp, engine=engine)[0].tokens
