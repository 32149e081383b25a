"""The cached path against our own no-cache forward; batch invariance; compilation count."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsjax.engine.compiles import CompileClock
from dsjax.engine.engine import Engine
from dsjax.engine.generate import generate
from dsjax.engine.sampling import SamplingParams
from dsjax.run_config import RunConfig
from tests.helpers import assert_close


@pytest.mark.parametrize("case", ["mixed", "legacy"])
def test_cached_decode_equals_no_cache_forward_at_every_step(load_case, engine_for, case):
    """64 decode steps: each step's top-1 logprob and top alternatives equal a no-cache forward over
    prompt + generated tokens (one causal forward gives every prefix's logits)."""
    model = load_case(case)
    prompt = list(np.random.default_rng(5).integers(0, model.cfg.vocab_size, 11))
    sp = SamplingParams(temperature=0.0, max_tokens=64, stop_token_ids=[], logprobs=5)
    res = generate(model, [prompt], sp, engine=engine_for(case))[0]
    seq = prompt + res.tokens
    logp = np.asarray(jax.nn.log_softmax(model(jnp.asarray([seq]))[0], axis=-1))
    for i, lp in enumerate(res.logprobs):
        row = logp[len(prompt) - 1 + i]
        assert lp.token == int(np.argmax(row))
        assert_close([v for _, v in lp.top], row[[t for t, _ in lp.top]], rtol=1e-4, what=f"step {i}")
        assert abs(lp.logprob - row[lp.token]) <= 1e-4 * np.abs(row).max()


def test_batch_and_slot_invariance(load_case, engine_for):
    model = load_case("mixed")
    rng = np.random.default_rng(7)
    prompts = [list(rng.integers(0, model.cfg.vocab_size, n)) for n in (5, 17, 9, 30, 2, 12, 21, 8, 3)]
    greedy = SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[], logprobs=2)
    seeded = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=10, stop_token_ids=[],
                            logprobs=2)
    engine = engine_for("mixed")
    alone = [generate(model, [prompts[0]], sp, engine=engine)[0] for sp in (greedy, seeded)]
    for order in (list(range(9)), list(range(8, -1, -1))):  # the request lands in different slots
        batch = [prompts[i] for i in order]
        for sp, ref in zip((greedy, seeded), alone):
            res = generate(model, batch, sp, engine=engine)[order.index(0)]
            assert res.tokens == ref.tokens
            np.testing.assert_allclose([lp.logprob for lp in res.logprobs], [lp.logprob for lp in ref.logprobs],
                                       atol=1e-5)


def test_the_batch_invariant_mode_gives_a_request_the_same_bits_in_any_batch_and_slot(load_case):
    """One request alone and inside batches of 2, 7 and 32 at their first, middle and last places: the same tokens
    and bitwise-equal logprobs, greedy and sampled at temperature 0.7 and top_p 0.9 (prefills of one request; the
    decode step's shape never depends on the batch)."""
    model = load_case("mixed")
    engine = Engine(model, RunConfig(slots=32, max_len=64, chunk_size=16, batch_invariant=True))
    rng = np.random.default_rng(3)
    prompts = [list(rng.integers(0, model.cfg.vocab_size, n)) for n in rng.integers(2, 40, 32)]
    params = [SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[], logprobs=2),
              SamplingParams(temperature=0.7, top_p=0.9, seed=77, max_tokens=12, stop_token_ids=[], logprobs=2)]
    for sp in params:
        alone = generate(model, [prompts[0]], sp, engine=engine)[0]
        for size in (2, 7, 32):
            for at in sorted({0, size // 2, size - 1}):
                batch = prompts[1:size]
                batch.insert(at, prompts[0])
                res = generate(model, batch, sp, engine=engine)[at]
                assert res.tokens == alone.tokens, (sp.temperature, size, at)
                assert [lp.logprob for lp in res.logprobs] == [lp.logprob for lp in alone.logprobs], (size, at)
                assert [lp.top for lp in res.logprobs] == [lp.top for lp in alone.logprobs]


def test_seeded_sampling_is_reproducible_and_seeds_differ(load_case, engine_for):
    model, engine = load_case("legacy"), engine_for("legacy")
    prompt = [[3, 4, 5, 6]]
    sp = lambda seed: SamplingParams(temperature=1.0, seed=seed, max_tokens=12, stop_token_ids=[])  # noqa
    a = generate(model, prompt, sp(1), engine=engine)[0].tokens
    assert a == generate(model, prompt, sp(1), engine=engine)[0].tokens
    assert a != generate(model, prompt, sp(2), engine=engine)[0].tokens
    # Unseeded requests draw from the job seed: reproducible per job seed.
    un = SamplingParams(temperature=1.0, max_tokens=12, stop_token_ids=[])
    job = lambda seed: generate(model, prompt, un, seed=seed, engine=engine)[0].tokens  # noqa: E731
    assert job(5) == job(5) != job(6)


@pytest.mark.heavy
def test_hundred_prompts_refill_slots_with_fixed_compilations(load_case):
    model = load_case("mixed")
    rng = np.random.default_rng(11)
    prompts = [list(rng.integers(0, model.cfg.vocab_size, rng.integers(1, 60))) for _ in range(100)]
    sampling = [SamplingParams(temperature=float(rng.random() < 0.5), max_tokens=int(rng.integers(1, 12)),
                               stop_token_ids=[int(rng.integers(0, 256))]) for _ in prompts]
    engine = Engine(model, RunConfig(slots=8, max_len=72, chunk_size=16))
    engine.precompile()
    before = engine.compilations()
    with CompileClock() as clock:
        results = generate(model, prompts, sampling, engine=engine)
    assert clock.programs == 0  # every program came from precompile
    assert len(results) == 100
    for r, sp, p in zip(results, sampling, prompts):
        assert 1 <= len(r.tokens) <= sp.max_tokens and r.prompt_tokens == len(p)
        stopped = r.tokens[-1] in sp.stop_token_ids
        assert r.finish_reason == ("stop" if stopped else "length")
        assert not any(t in sp.stop_token_ids for t in r.tokens[:-1])
    first = engine.compilations()
    assert first - before <= 1 + 1 + 4 + 2  # cache, decode, prefill per row bucket (1, 2, 4, 8), 2 samplers
    more = [list(rng.integers(0, model.cfg.vocab_size, rng.integers(1, 60))) for _ in range(30)]
    generate(model, more, SamplingParams(temperature=0.0, max_tokens=5), engine=engine)
    assert engine.compilations() == first


def test_stop_token_ends_and_is_included(load_case, engine_for):
    model, engine = load_case("mixed"), engine_for("mixed")
    prompt = [[9, 8, 7]]
    free = generate(model, prompt, SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[]),
                    engine=engine)[0]
    stop_at = free.tokens[3]
    res = generate(model, prompt, SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[stop_at]),
                   engine=engine)[0]
    first = free.tokens.index(stop_at)
    assert res.tokens == free.tokens[:first + 1] and res.finish_reason == "stop"
    eos = generate(model, prompt, SamplingParams(temperature=0.0, max_tokens=8), engine=engine)[0]
    assert model.cfg.eos_token_id == (1,)
    assert (eos.finish_reason == "stop") == (1 in eos.tokens)


def test_max_len_bounds_the_sequence(load_case, engine_for):
    model, engine = load_case("mixed"), engine_for("mixed")
    res = generate(model, [list(range(1, 90))], SamplingParams(temperature=0.0, max_tokens=50, stop_token_ids=[]),
                   engine=engine)[0]
    assert len(res.tokens) == 96 - 89 and res.finish_reason == "length"


@pytest.mark.parametrize("prompts, message", [
    ([[]], "empty"),
    ([[1, 2, 999999]], "outside"),
    ([list(range(1, 97))], "no room"),
])
def test_bad_prompts_are_named(load_case, engine_for, prompts, message):
    with pytest.raises(ValueError, match=message):
        generate(load_case("mixed"), prompts, SamplingParams(max_tokens=2), engine=engine_for("mixed"))


def test_decode_steps_are_dispatched_before_the_previous_tokens_are_read(load_case, engine_for, monkeypatch):
    """The scheduler sends step t+1 (fed step t's tokens on the device) before it reads step t, and a
    request that a stop token ends in step t yields nothing from step t+1; the tokens equal those of
    one request alone."""
    from dsjax.engine import scheduler

    model, engine = load_case("mixed"), engine_for("mixed")
    prompts = [[9, 8, 7], [5, 4, 3, 2]]
    alone = [generate(model, [p], SamplingParams(temperature=0.0, max_tokens=6, stop_token_ids=[]),
                      engine=engine)[0].tokens for p in prompts]
    log = []
    decode, get = engine.decode, jax.device_get
    monkeypatch.setattr(engine, "decode", lambda *a: (log.append("decode"), decode(*a))[1])
    monkeypatch.setattr(scheduler.jax, "device_get", lambda x: (log.append("read"), get(x))[1])
    stop = alone[0][2]  # request 0 ends at its third token; request 1 runs on
    res = generate(model, prompts, [SamplingParams(temperature=0.0, max_tokens=6, stop_token_ids=[stop]),
                                    SamplingParams(temperature=0.0, max_tokens=6, stop_token_ids=[])], engine=engine)
    assert res[0].tokens == alone[0][:alone[0].index(stop) + 1] and res[0].finish_reason == "stop"
    assert res[1].tokens == alone[1] and res[1].finish_reason == "length"
    # prefill read, then decode 1, decode 2, read 1, decode 3, read 2, ...: two decodes before a read
    assert log[:4] == ["read", "decode", "decode", "read"], log
    assert log.count("decode") == 5  # 5 steps after the prefill's token; none past max_tokens
