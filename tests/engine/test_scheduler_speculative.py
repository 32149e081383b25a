"""Continuous batching with DSpark's speculative decoding (`scheduler.run` over an `Engine` that drafts): greedy
tokens, log-probabilities and finish reasons are those of plain decoding, with more requests than slots, stop tokens
inside a verified block and max_tokens and max_len ending requests; sampled tokens are distributed as the target's
(chi-square against the exact distribution, enumerated) and depend on the request's seed alone; the width is chosen
each step; the step times of each width are measured once and kept with the programs; `bench` reports the
acceptance."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy import stats

from dsjax.engine.acceptance import Acceptance
from dsjax.engine.engine import Engine
from dsjax.engine.programs import ProgramStore
from dsjax.engine.sampling import SamplingModes, SamplingParams
from dsjax.engine.scheduler import Request, run
from dsjax.model_v41 import DeepseekV41
from tests.helpers import dspark_model
from dsjax.run_config import RunConfig, RunConfigError

BASE = RunConfig(slots=4, max_len=40, chunk_size=16, dtype="float32")  # chunks longer than the window (8)
P_MIN = 1e-6  # fixed seeds: a pass or a failure is deterministic


def _model(vocab: int) -> DeepseekV41:
    """`helpers.dspark_model` with a small vocabulary, so that random drafts are often right (every count of kept
    drafts happens)."""
    return dspark_model(0, vocab_size=vocab, dspark_noise_token_id=vocab - 1, engram_pad_token_id=0,
                        engram_compressed_vocab_size=vocab, image_token_id=vocab - 2, bos_token_id=1, eos_token_id=2)


VOCAB = 6


@pytest.fixture(scope="module")
def model():
    return _model(VOCAB)


@pytest.fixture(scope="module")
def engine(model):
    """One drafting engine for the module: three drafts a step. Its programs are jit's, compiled as the tests first
    need them (`precompile`'s set is tested by the job, `tests/batch/test_job.py`): xdist may run this module's tests
    on several workers, each compiling what it runs."""
    return Engine(model, BASE.replace(speculative="dspark", drafts=3))


def _requests(n: int, seed: int, **sampling) -> list[Request]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        prompt = tuple(rng.integers(0, VOCAB - 2, int(rng.integers(3, 30))).tolist())
        stop = frozenset({int(rng.integers(0, VOCAB - 2))}) if i % 3 == 0 else frozenset()
        params = SamplingParams(max_tokens=int(rng.integers(1, 24)), logprobs=2 if i % 4 == 1 else None, **sampling)
        out.append(Request(i, prompt, params, 1000 + i, stop))
    return out


def _generate(engine, requests, acceptance: Acceptance | None = None) -> dict[int, list]:
    out = {}
    for ev in run(engine, requests, acceptance=acceptance):
        out.setdefault(ev.index, []).append(ev)
    return out


def test_greedy_with_dspark_gives_what_greedy_without_does(model, engine):
    """More requests than slots, stop tokens, logprobs, and a request that reaches the cache's length mid-block."""
    requests = _requests(11, seed=6, temperature=0.0)
    requests.append(Request(11, (3, 1, 0) * 10, SamplingParams(temperature=0.0, max_tokens=100), 0, frozenset()))
    want = _generate(Engine(model, BASE), requests)
    acceptance = Acceptance(model.cfg.dspark_block_size)
    got = _generate(engine, requests, acceptance)
    assert sorted(got) == sorted(want) == list(range(len(requests)))
    for i in want:
        assert [e.token for e in got[i]] == [e.token for e in want[i]], i
        assert [e.finish_reason for e in got[i]] == [e.finish_reason for e in want[i]], i
        np.testing.assert_allclose([e.logprob for e in got[i]], [e.logprob for e in want[i]], atol=1e-4)
        assert [e.top is None for e in got[i]] == [e.top is None for e in want[i]]
        for g, w in zip(got[i], want[i]):
            if w.top is not None:
                assert [t for t, _ in g.top] == [t for t, _ in w.top]
    assert {e.finish_reason for evs in want.values() for e in evs} >= {"stop", "length"}
    assert len(want[11]) == BASE.max_len - 30 and want[11][-1].finish_reason == "length"
    figures = acceptance.summary()
    assert figures["target_steps"] > 0 and figures["mean_accepted_length"] > 1
    assert all(r > 0 for r in figures["acceptance_by_position"][:3]), figures
    assert figures["acceptance_by_position"][3:] == [None, None] and figures["steps_by_width"] == {"4": acceptance.steps}


def test_the_width_is_chosen_each_step_from_the_confidences(model, monkeypatch):
    """The widths `auto` compiles, chosen each step from the confidences and the widths' step times, which a run
    measures first where no one did: equal times make the widest the best, drafts too dear make plain steps; the
    tokens stay those of greedy decoding."""
    engine = Engine(model, BASE.replace(speculative="dspark"))
    assert engine.widths == (1, 3, 6)
    measured = []
    monkeypatch.setattr(Engine, "measure_widths", lambda self: measured.append("measured") or setattr(
        self, "width_seconds", np.asarray([0.01, np.inf, 0.01, np.inf, np.inf, 0.01])))
    chosen = []
    choose = Engine.width_for
    monkeypatch.setattr(Engine, "width_for", lambda self, c, a: chosen.append(choose(self, c, a)) or chosen[-1])
    requests = _requests(5, seed=8, temperature=0.0)
    want = _generate(Engine(model, BASE), requests)

    def arriving():  # a job's first request sets off its `precompile`: the measuring comes after, on built programs
        measured.append("first request")
        yield from requests

    got = _generate(engine, arriving())
    assert {i: [e.token for e in evs] for i, evs in got.items()} == {i: [e.token for e in evs] for i, evs in want.items()}
    assert set(chosen) == {6} and measured == ["first request", "measured"]
    engine.width_seconds = np.asarray([0.01, 1, 1, 1, 1, 1])  # drafts cost too much: plain steps
    chosen.clear()
    got = _generate(engine, requests[:2])
    assert set(chosen) == {1} and measured == ["first request", "measured"]
    assert [e.token for e in got[0]] == [e.token for e in want[0]]


def test_a_sampled_requests_tokens_depend_on_its_seed_alone(engine):
    """The same requests in another order (other slots, other neighbours): each request's tokens are the same."""
    requests = _requests(9, seed=3, temperature=0.9, top_k=3)
    a, b = _generate(engine, requests), _generate(engine, requests[::-1])
    assert {i: [e.token for e in evs] for i, evs in a.items()} == {i: [e.token for e in evs] for i, evs in b.items()}


def _exact_marginals(model, prompt: tuple[int, ...], n: int) -> list[np.ndarray]:
    """The target's distribution of each of the first n generated tokens (temperature 1), by enumerating every
    sequence of the tokens before it (one forward shape: sequences padded at the end, which a causal model ignores)."""
    v, length = model.cfg.vocab_size, len(prompt) + n
    forward = jax.jit(lambda ids: jax.nn.softmax(model(ids), axis=-1))
    marginals, weights = [], {(): 1.0}  # the prefixes of generated tokens and their probabilities
    for j in range(n):
        prefixes = list(weights)
        ids = np.zeros((v ** (n - 1), length), np.int32)
        ids[:len(prefixes)] = [prompt + p + (0,) * (n - j) for p in prefixes]
        probs = np.asarray(forward(jnp.asarray(ids))[:len(prefixes), len(prompt) + j - 1], np.float64)
        marginal, weights = np.zeros(v), {p + (t,): weights[p] * row[t] for p, row in zip(prefixes, probs)
                                          for t in range(v)}
        for p, row in zip(prefixes, probs):
            marginal += weights[p + (0,)] / row[0] * row if row[0] > 0 else 0
        marginals.append(marginal)
    return marginals


@pytest.mark.heavy
def test_sampled_tokens_are_distributed_as_the_targets(model, engine):
    """600 seeds of one prompt, 4 tokens each (the first from the prefill's sampler, the others from verification
    steps): each position's tokens against the target's exact distribution there."""
    prompt, n_tokens, n_seeds = (3, 0, 1, 3, 2), 4, 600
    params = SamplingParams(temperature=1.0, max_tokens=n_tokens)
    requests = [Request(i, prompt, params, 7 * i + 1, frozenset()) for i in range(n_seeds)]
    acceptance = Acceptance(model.cfg.dspark_block_size)
    got = _generate(engine, requests, acceptance)
    tokens = np.asarray([[e.token for e in got[i]] for i in range(n_seeds)])
    assert acceptance.accepted[:2].min() > 75, acceptance.summary()  # kept drafts are a good part of the sample
    for position, q in enumerate(_exact_marginals(model, prompt, n_tokens)):
        counts = np.bincount(tokens[:, position], minlength=q.size)
        p = stats.chisquare(counts, q / q.sum() * n_seeds).pvalue
        assert p > P_MIN, (position, counts, np.round(q * n_seeds, 1), p)


def test_the_widths_step_times_are_kept_with_the_programs(model, engine, tmp_path, monkeypatch):
    engine.programs, engine.width_seconds = ProgramStore(str(tmp_path)), None
    try:
        seconds = engine.measure_widths(repeats=1)
    finally:
        engine.programs = None
    assert seconds.shape == (6,) and seconds[3] > 0 and np.isinf(np.delete(seconds, 3)).all()  # width 4 only
    monkeypatch.setattr(Engine, "speculate", lambda *a, **k: pytest.fail("measured again"))
    second = Engine(model, engine.run, programs=ProgramStore(str(tmp_path)))
    np.testing.assert_array_equal(second.measure_widths(repeats=1), seconds)
    other = Engine(model, engine.run.replace(slots=3), programs=ProgramStore(str(tmp_path)))  # other shapes
    with pytest.raises(pytest.fail.Exception, match="measured again"):
        other.measure_widths(repeats=1)


def test_the_widths_are_timed_after_the_background_compiles(engine, monkeypatch):
    import threading
    import time

    background = threading.Thread(target=time.sleep, args=(0.5,))
    alive_while_timed = []
    real = Engine.speculate
    monkeypatch.setattr(Engine, "speculate", lambda self, *a, **k: alive_while_timed.append(background.is_alive())
                        or real(self, *a, **k))
    engine.width_seconds, engine.background = None, background
    background.start()
    try:
        engine.measure_widths(repeats=1)
    finally:
        engine.background = None
    assert alive_while_timed == [False, False], alive_while_timed


def test_precompile_times_the_widths_before_its_background_compiles_start(model, monkeypatch):
    """A job must not wait for the background's prefill sizes (minutes on a GPU) before its first request: the
    widths are timed once the programs it needs now are built, before the background thread starts."""
    auto = Engine(model, BASE.replace(speculative="dspark"))
    started = []
    real = Engine.speculate
    monkeypatch.setattr(Engine, "speculate", lambda self, *a, **k: started.append(self.background is not None)
                        or real(self, *a, **k))
    try:
        # The greedy sampler only (the one the widths are timed with): the other mixes add nothing here.
        auto.precompile(modes=(SamplingModes(random=False, filtered=False, logprobs=False),), buckets=[1], later=[2])
    finally:
        auto.close()
    assert started and not any(started), started
    assert auto.width_seconds is not None and auto.measure_seconds > 0


def test_the_widths_are_timed_with_every_row_fed(engine, monkeypatch):
    fed = []
    real = Engine.speculate

    def speculate(self, *a, **k):
        cache, state, verdict = real(self, *a, **k)
        fed.append(np.asarray(jax.device_get(verdict.count)))
        return cache, state, verdict

    monkeypatch.setattr(Engine, "speculate", speculate)
    engine.width_seconds = None
    engine.measure_widths(repeats=1)
    assert len(fed) == 2 and all((count >= 1).all() and count.shape == (engine.num_slots,) for count in fed), fed


def test_drafting_needs_draft_stages_and_a_draft_count_within_the_block(model):
    from dsjax.model import DeepseekV4
    from dsjax.config import ModelConfig

    plain = DeepseekV4(ModelConfig.preset("tiny"), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="DSpark draft stages"):
        Engine(plain, BASE.replace(speculative="dspark"))
    with pytest.raises(ValueError, match="drafts at most 5"):
        Engine(model, BASE.replace(speculative="dspark", drafts=6))
    with pytest.raises(RunConfigError, match="drafts 2 needs speculative decoding"):
        BASE.replace(drafts=2)
    with pytest.raises(RunConfigError, match="drafts must be an integer"):
        BASE.replace(speculative="dspark", drafts=-1)
    with pytest.raises(RunConfigError, match="speculative must be one of"):
        BASE.replace(speculative="eagle")
    engine = Engine(model, BASE.replace(speculative="dspark", drafts=2))
    with pytest.raises(ValueError, match="width 4 is not one"):
        engine.speculate(None, None, np.ones(4, bool), None, 4)


def test_bench_reports_the_acceptance(model):
    from dsjax.bench import format_report, run_bench

    row = run_bench(model, 2, 8, 6, run=BASE.replace(chunk_size=8, speculative="dspark", drafts=3), breakdown=False)
    spec = row["speculative"]
    assert spec["target_steps"] > 0 and spec["drafts"] == 3 and spec["steps_by_width"] == {"4": spec["target_steps"]}
    assert "DSpark" in format_report(row) and row["compilations_after_warmup"] == 0
