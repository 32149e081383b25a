"""The scheduler over a precompiled engine: any mix of sampling options runs without compiling; prefill
row buckets."""

import itertools

from dsjax.engine.compiles import CompileClock
from dsjax.engine.generate import generate
from dsjax.engine.sampling import SAMPLER_MODES, SamplingModes, SamplingParams
from dsjax.engine.steps import Engine, prefill_buckets, prefill_rows


def test_every_mix_of_requests_has_its_sampler_program():
    options = [SamplingParams(temperature=t, top_k=k, top_p=p, logprobs=lp)
               for t, k, p, lp in itertools.product((0.0, 0.7), (0, 5), (1.0, 0.9), (None, 0, 3))]
    for mix in itertools.combinations(options, 3):
        assert SamplingModes.of(mix) in SAMPLER_MODES
    assert len(set(SAMPLER_MODES)) == len(SAMPLER_MODES) == 6


def test_a_precompiled_engine_compiles_nothing_whatever_the_requests_ask(load_case):
    model = load_case("mixed")
    engine = Engine(model, num_slots=2, max_len=32, chunk_size=8)
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
