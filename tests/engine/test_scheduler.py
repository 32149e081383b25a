"""The scheduler over a precompiled engine: any mix of sampling options runs without compiling; prefill
row buckets."""

import itertools

from dsjax.engine.compiles import CompileClock
from dsjax.engine.engine import Engine
from dsjax.engine.generate import generate
from dsjax.engine.sampling import SAMPLER_MODES, SamplingModes, SamplingParams
from dsjax.engine.slots import prefill_buckets, prefill_rows
from dsjax.run_config import RunConfig


def test_every_mix_of_requests_has_its_sampler_program():
    options = [SamplingParams(temperature=t, top_k=k, top_p=p, logprobs=lp)
               for t, k, p, lp in itertools.product((0.0, 0.7), (0, 5), (1.0, 0.9), (None, 0, 3))]
    for mix in itertools.combinations(options, 3):
        assert SamplingModes.of(mix) in SAMPLER_MODES
    assert len(set(SAMPLER_MODES)) == len(SAMPLER_MODES) == 6


def test_a_precompiled_engine_compiles_nothing_whatever_the_requests_ask(load_case):
    model = load_case("mixed")
    engine = Engine(model, RunConfig(slots=2, max_len=32, chunk_size=8))
    # the empty cache, decode, the prefill chunk per row bucket (1, 2) and the sampler per mix of modes
    assert engine.precompile() == 2 + len(prefill_buckets(2)) + len(SAMPLER_MODES) == 10
    asks = [SamplingParams(temperature=0.0, max_tokens=3, logprobs=2),
            SamplingParams(temperature=0.8, max_tokens=3, seed=5),
            SamplingParams(temperature=0.8, top_p=0.9, max_tokens=4, seed=6, logprobs=1),
            SamplingParams(temperature=0.0, max_tokens=3)]
    with CompileClock() as clock:
        greedy = generate(model, [[3, 4, 5]], SamplingParams(temperature=0.0, max_tokens=3), engine=engine)[0]
        mixed = generate(model, [[3, 4, 5], [6, 7], [1] * 20, [3, 4, 5]], asks, engine=engine)
    assert clock.programs == 0
    # a row's tokens do not depend on which sampler program its batch took
    assert mixed[0].tokens == mixed[3].tokens == greedy.tokens
    assert len(mixed[0].logprobs[0].top) == 2 and mixed[3].logprobs is None


def test_prefill_rows_come_in_whole_shares_of_the_slot_axes():
    """A power of two of rows, rounded up so that the mesh axes splitting the cache's slots split the
    chunk too (else attention and the indexer would run their references): 8 devices and 16 slots give
    8 or 16 rows; 4 slots split over dp=2 only give 2 or 4; no mesh, plain powers of two."""
    import jax

    from dsjax.parallel.mesh import make_mesh

    counts = (1, 2, 3, 5, 8, 9)
    assert [prefill_rows(n, 16) for n in counts] == [1, 2, 4, 8, 8, 16]
    with jax.set_mesh(make_mesh("dp=2,ep=4")):
        assert [prefill_rows(n, 16) for n in counts] == [8, 8, 8, 8, 8, 16]
        assert [prefill_rows(n, 4) for n in (1, 2, 3, 4)] == [2, 2, 4, 4]
        assert prefill_rows(1, 5) == 1  # 5 slots: no axis splits them


def _held_back(monkeypatch, rows_held: set[int]):
    """Make the background thread wait, before lowering each bucket in `rows_held`, until released."""
    import threading

    from dsjax.engine import engine, steps

    gate, gate.reached = threading.Event(), threading.Event()
    lower = engine._lower

    def held(jitted, static, args):
        if jitted is steps.prefill_chunk and args[3].shape[0] in rows_held:  # the chunk's tokens: [rows, c]
            gate.reached.set()
            gate.wait(timeout=120)
        return lower(jitted, static, args)

    monkeypatch.setattr(engine, "_lower", held)
    return gate


def test_later_buckets_build_in_the_background_and_a_prefill_meanwhile_takes_a_larger_ready_one(
        load_case, monkeypatch):
    model = load_case("mixed")
    gate = _held_back(monkeypatch, {1})
    engine = Engine(model, RunConfig(slots=4, max_len=32, chunk_size=8))
    assert engine.precompile(buckets=[4], later=[1, 2]) == 2 + 1 + len(SAMPLER_MODES) + 2
    assert engine.pending_buckets() == [1, 2] and engine.prefill_size(1) == 4  # bucket 1 is held back
    prompts, asks = [[3, 4, 5]], SamplingParams(temperature=0.0, max_tokens=3)
    with CompileClock() as clock:
        early = generate(model, prompts, asks, engine=engine)  # one request, 4 rows: nothing compiled here
        assert clock.programs == 0
        gate.set()
        engine.background.join(timeout=300)
    assert engine.pending_buckets() == [] and engine.background_built == 2
    assert clock.programs == 0 and clock.background_programs >= 2  # counted apart from the work
    assert engine.prefill_size(1) == 1 and engine.prefill_size(2) == 2 and engine.prefill_size(3) == 4
    assert generate(model, prompts, asks, engine=engine)[0].tokens == early[0].tokens  # now through bucket 1
    assert engine.fallbacks == 0


def test_a_prefill_waits_for_a_bucket_only_when_no_ready_one_holds_its_rows(load_case, monkeypatch):
    import threading

    model = load_case("mixed")
    gate = _held_back(monkeypatch, {2})
    engine = Engine(model, RunConfig(slots=2, max_len=32, chunk_size=8))
    engine.precompile(buckets=[1], later=[2])
    assert engine.prefill_size(1) == 1
    threading.Timer(0.5, gate.set).start()
    assert engine.prefill_size(2) == 2  # waited for it: no ready bucket holds two rows
    assert engine.pending_buckets() == []


def test_close_stops_the_background_and_drops_a_bucket_it_is_still_lowering(load_case, monkeypatch):
    """The process then waits for no compile: only one XLA has started is finished (and stored)."""
    model = load_case("mixed")
    gate = _held_back(monkeypatch, {1})
    engine = Engine(model, RunConfig(slots=8, max_len=32, chunk_size=8))
    engine.precompile(buckets=[8], later=[1, 2, 4], modes=SAMPLER_MODES[:1])
    assert gate.reached.wait(timeout=120)  # lowering bucket 1
    engine.close()
    gate.set()
    engine.background.join(timeout=300)
    assert engine.background_built == 0 and engine.pending_buckets() == []
    assert engine.prefill_size(1) == engine.prefill_size(2) == 8  # none came: the ready size that holds them
