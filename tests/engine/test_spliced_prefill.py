"""Spliced prefill: embeddings given for some prompt positions (an image's, at its placeholders) take
the place of those tokens' embeddings, across chunk boundaries, for several spans, in batches mixed
with text-only prompts; without any, prefill runs the text-only program unchanged."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsjax.config import ModelConfig
from dsjax.engine.compiles import CompileClock
from dsjax.engine.engine import Engine, Spliced
from dsjax.engine.pixels import cell_bucket, patchify
from dsjax.engine.sampling import SamplingArrays, SamplingParams
from dsjax.engine.scheduler import Request, run
from dsjax.model import DeepseekV4
from dsjax.run_config import RunConfig
from tests.helpers import assert_close

PLACEHOLDER = 7


@pytest.fixture(scope="module")
def model():
    # Learned routing only: a hash-routed layer routes by token id, and a spliced position keeps its
    # placeholder's id, so it would not be the same as the token whose embedding it carries.
    cfg = ModelConfig.from_hf({**ModelConfig.preset("tiny").to_hf(), "mlp_layer_types": ["moe"] * 4})
    return DeepseekV4(cfg, rngs=nnx.Rngs(5), dtype=jnp.float32)


def _case(model, rng):
    """Prompts with placeholder spans, what is spliced into them (the embeddings of other tokens), and
    the same prompts with those tokens written in."""
    lengths, spans = (21, 13, 9), ([(3, 12), (15, 17)], [], [(0, 1), (8, 9)])  # 3..11 crosses chunk 8
    prompts, plain, spliced = [], [], []
    table = np.asarray(model.embed_tokens.weight[...])
    for n, cuts in zip(lengths, spans):
        tokens = rng.integers(10, 500, n)
        hidden_tokens = tokens.copy()
        positions = np.concatenate([np.arange(a, b) for a, b in cuts]).astype(np.int64) if cuts else None
        if positions is not None:
            tokens[positions] = PLACEHOLDER
        prompts.append(tokens.tolist())
        plain.append(hidden_tokens.tolist())
        spliced.append(None if positions is None else Spliced(positions, table[hidden_tokens[positions]]))
    return prompts, plain, spliced


def test_spliced_embeddings_act_as_the_tokens_they_carry(model):
    """Splicing token V's embedding at a placeholder gives what the prompt with V written there gives:
    the sampled tokens, their log-probabilities, and the cache."""
    prompts, plain, spliced = _case(model, np.random.default_rng(0))
    engine = Engine(model, RunConfig(slots=4, max_len=32, chunk_size=8))
    sampling = SamplingArrays.of([SamplingParams(temperature=0.0, logprobs=3)] * 3, range(3))
    got_cache, got = engine.prefill(engine.new_cache(), prompts, [0, 1, 2], sampling, spliced=spliced)
    want_cache, want = engine.prefill(engine.new_cache(), plain, [0, 1, 2], sampling)
    np.testing.assert_array_equal(np.asarray(got.token), np.asarray(want.token))
    assert_close(np.asarray(got.logprob), np.asarray(want.logprob), rtol=1e-5)
    for g, w in zip(jax.tree.leaves(got_cache), jax.tree.leaves(want_cache)):
        assert_close(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=1e-5)
    # and the placeholders alone are not that prompt: the splice did something
    _, alone = engine.prefill(engine.new_cache(), prompts, [0, 1, 2], sampling)
    assert not np.allclose(np.asarray(alone.logprob)[[0, 2]], np.asarray(want.logprob)[[0, 2]])


def test_requests_with_spliced_embeddings_generate_as_the_plain_prompt(model):
    """Through the scheduler (continuous batching, decode after the prefill), mixed with a text-only
    request: the same greedy tokens as the prompts with the tokens written in."""
    prompts, plain, spliced = _case(model, np.random.default_rng(1))
    greedy = SamplingParams(temperature=0.0, max_tokens=6)

    def tokens(reqs):
        out = {}
        for ev in run(Engine(model, RunConfig(slots=2, max_len=32, chunk_size=8)), reqs):
            out.setdefault(ev.index, []).append(ev.token)
        return out

    def requests(ps, sp):
        return [Request(i, tuple(p), greedy, 0, frozenset(), s) for i, (p, s) in enumerate(zip(ps, sp))]

    assert tokens(requests(prompts, spliced)) == tokens(requests(plain, [None] * 3))


def test_text_only_prefill_runs_the_same_program(model):
    """`spliced` absent, or only None entries: the one text-only program, the same results."""
    engine = Engine(model, RunConfig(slots=2, max_len=32, chunk_size=8))
    sampling = SamplingArrays.of([SamplingParams(temperature=0.0)] * 2, range(2))
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [20, 21]]
    _, a = engine.prefill(engine.new_cache(), prompts, [0, 1], sampling)
    compiled = Engine.compilations()
    _, b = engine.prefill(engine.new_cache(), prompts, [0, 1], sampling, spliced=[None, None])
    assert Engine.compilations() == compiled
    np.testing.assert_array_equal(np.asarray(a.logprob), np.asarray(b.logprob))


@pytest.mark.parametrize("spliced,message", [
    ([Spliced(np.array([0, 1]), np.zeros((3, 64), np.float32))], r"must be \[2, 64\] for its 2 positions"),
    ([Spliced(np.array([0, 1]), np.zeros((2, 32), np.float32))], r"must be \[2, 64\]"),
    ([Spliced(np.array([0, 5]), np.zeros((2, 64), np.float32))], "within its 3 tokens"),
    ([Spliced(np.array([1, 1]), np.zeros((2, 64), np.float32))], "distinct"),
    ([None, None], "2 entries for 1 prompts"),
])
def test_bad_splices_are_refused(model, spliced, message):
    engine = Engine(model, RunConfig(slots=2, max_len=32, chunk_size=8))
    sampling = SamplingArrays.of([SamplingParams(temperature=0.0)], range(1))
    if all(s is None for s in spliced):
        spliced = [None, Spliced(np.array([0]), np.zeros((1, 64), np.float32))]
    with pytest.raises(ValueError, match=message):
        engine.prefill(engine.new_cache(), [[1, 2, 3]], [0], sampling, spliced=spliced)


def test_images_encode_in_padded_buckets_as_they_would_alone():
    """`Engine.encode_image` pads an image with blank cells to its bucket: the embeddings are those of the
    encoder run on the image alone, and two sizes in one bucket share one compiled encoder."""
    seeing = DeepseekV4(ModelConfig.preset("tiny-vision"), rngs=nnx.Rngs(5), dtype=jnp.float32)
    engine = Engine(seeing, RunConfig(slots=2, max_len=64, chunk_size=8))
    rng = np.random.default_rng(0)
    # 5x5 cells (the last row and column of cells partly padding patches) pad to 26 cells; 3x6 and 2x9
    # cells are 18 without padding, one bucket
    sizes = [(5 * 42 - 14, 5 * 42 - 28), (6 * 42, 3 * 42 - 14), (9 * 42 - 28, 2 * 42)]
    assert [cell_bucket(c) for c in (25, 18, 9, 8, 1000)] == [26, 18, 9, 8, 1024]
    before = Engine.compilations()
    for w, h in sizes:
        pixels = rng.integers(0, 256, (h, w, 3), np.uint8)
        got = engine.encode_image(pixels)
        a = patchify(pixels, seeing.cfg.vision)
        alone = seeing.vision(*(jnp.asarray(a[k]) for k in ("patches", "row", "col", "valid")),
                              *seeing.cfg.vision.grid(w, h))
        assert_close(got, np.asarray(alone), rtol=1e-5)
        assert got.shape == (seeing.cfg.vision.image_tokens(w, h), seeing.cfg.hidden_size)
    assert Engine.compilations() - before == 2
    blind = DeepseekV4(ModelConfig.preset("tiny"), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="no image encoder"):
        Engine(blind, RunConfig(slots=1, max_len=16)).encode_image(pixels)


def test_an_image_job_runs_text_through_the_spliced_program_with_the_same_results(model):
    """After `precompile(images=True)` every chunk takes the spliced program (one program per row bucket
    for an image job); a chunk of text then splices nothing and gives what the text-only program gives."""
    sampling = SamplingArrays.of([SamplingParams(temperature=0.0)] * 2, range(2))
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [20, 21]]
    text = Engine(model, RunConfig(slots=2, max_len=32, chunk_size=8))
    _, a = text.prefill(text.new_cache(), prompts, [0, 1], sampling)
    images = Engine(model, RunConfig(slots=2, max_len=32, chunk_size=8))
    assert images.precompile(images=True, buckets=[2]) == 1 + 1 + 1 + 6
    with CompileClock() as clock:
        _, b = images.prefill(images.new_cache(), prompts, [0, 1], sampling)
    assert clock.programs == 0 and images.spliced_prefill
    np.testing.assert_array_equal(np.asarray(a.token), np.asarray(b.token))
    np.testing.assert_array_equal(np.asarray(a.logprob), np.asarray(b.logprob))
