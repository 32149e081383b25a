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
