"""The scheduler's sampler modes: decided on the host, widened once per need, never narrowed."""

from dsjax.engine.generate import generate
from dsjax.engine.sampling import SamplingModes, SamplingParams
from dsjax.engine.steps import Engine


def test_sampler_modes_widen_to_what_the_jobs_need_and_stay(load_case):
    model = load_case("mixed")
    engine = Engine(model, num_slots=2, max_len=32, chunk_size=8)
    assert engine.sampling_modes == SamplingModes(False, False, False)
    greedy = generate(model, [[3, 4, 5]], SamplingParams(temperature=0.0, max_tokens=3), engine=engine)[0]
    assert engine.sampling_modes == SamplingModes(False, False, False)
    asks = [SamplingParams(temperature=0.0, max_tokens=3, logprobs=2),
            SamplingParams(temperature=0.8, max_tokens=3, seed=5)]
    with_logprobs = generate(model, [[3, 4, 5], [6, 7]], asks, engine=engine)
    assert engine.sampling_modes == SamplingModes(random=True, filtered=False, logprobs=True)
    assert len(with_logprobs[0].logprobs[0].top) == 2
    compiled = engine.compilations()
    again = generate(model, [[3, 4, 5], [6, 7]], SamplingParams(temperature=0.0, max_tokens=3), engine=engine)
    # the wider steps serve greedy requests of the same shapes: same tokens, nothing compiled again
    assert again[0].tokens == greedy.tokens == with_logprobs[0].tokens
    assert engine.compilations() == compiled
    assert engine.sampling_modes == SamplingModes(random=True, filtered=False, logprobs=True)


def test_prefill_rows_come_in_whole_shares_of_the_slot_axes():
    """A power of two of rows, rounded up so that the mesh axes splitting the cache's slots split the
    chunk too (else attention and the indexer would run their references): 8 devices and 16 slots give
    8 or 16 rows; 4 slots split over dp=2 only give 2 or 4; no mesh, plain powers of two."""
    import jax

    from dsjax.engine.scheduler import _bucket
    from dsjax.parallel.mesh import make_mesh

    counts = (1, 2, 3, 5, 8, 9)
    assert [_bucket(n, 16) for n in counts] == [1, 2, 4, 8, 8, 16]
    with jax.set_mesh(make_mesh("dp=2,ep=4")):
        assert [_bucket(n, 16) for n in counts] == [8, 8, 8, 8, 8, 16]
        assert [_bucket(n, 4) for n in (1, 2, 3, 4)] == [2, 2, 4, 4]
        assert _bucket(1, 5) == 1  # 5 slots: no axis splits them
