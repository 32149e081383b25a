"""The whole model's prefill and greedy decode with the kernels against the same model with the pure-JAX
references: natively on a GPU (64 steps), interpreted on CPU (a few steps, the same code)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsjax.bench import v41_slice
from dsjax.cache import init_cache
from dsjax.config import ModelConfig
from dsjax.config_v41 import V41Config
from dsjax.engine.engine import Engine
from dsjax.engine.generate import generate
from dsjax.engine.sampling import SamplingParams
from dsjax.model import DeepseekV4, with_kernels
from dsjax.model_v41 import DeepseekV41
from dsjax.presets import PRESETS
from dsjax.run_config import RunConfig

ON_GPU = jax.default_backend() == "gpu"


def model(kernels: str, dtype, wide: bool = False) -> DeepseekV4:
    """The tiny-kernels preset; `wide`: with V4's 64 query heads of width 512, the shape the Mosaic GPU
    attention kernel takes."""
    hf = {**PRESETS["tiny-kernels"], **({"num_attention_heads": 64, "head_dim": 512, "partial_rotary_factor": 1 / 8}
                                        if wide else {})}
    m = with_kernels(DeepseekV4(ModelConfig.from_hf(hf), rngs=nnx.Rngs(3), dtype=dtype), kernels)
    # Random sinks and compressor biases: the init's zeros would hide a sink or gate handled wrongly.
    for path, var in nnx.to_flat_state(nnx.state(m, nnx.Param)):
        if path[-1] in ("sinks", "position_bias"):
            var.set_value(jax.random.normal(jax.random.key(len(path)), var.get_value().shape, jnp.float32))
    return m


def step_jaxpr(m: DeepseekV4, kv_dtype, chunk: int) -> str:
    """The traced cache step for one token per slot (decode) or a chunk (prefill)."""
    engine = Engine(m, RunConfig(slots=2, max_len=64, chunk_size=16, kv_dtype=kv_dtype))
    ones = jnp.ones((2,), jnp.int32)
    return str(jax.make_jaxpr(lambda c: m.extend(jnp.ones((2, chunk), jnp.int32), c, ones * 40, ones * chunk))(
        engine.new_cache()))


def greedy_through_extend(m: DeepseekV4, prompts, steps: int, kv_dtype) -> tuple[np.ndarray, np.ndarray]:
    """One prefill chunk of every prompt, then `steps` greedy decode steps, through `DeepseekV4.extend`
    directly (the CPU form: the engine's row-count buckets would each compile again). Returns the
    tokens `[B, steps]`, their logprobs and the margins to the runner-up."""
    graphdef, params = nnx.split(m)
    cache = Engine(m, RunConfig(slots=len(prompts), max_len=64, kv_dtype=kv_dtype)).new_cache()

    @jax.jit
    def step(params, cache, tokens_bc, start_b, n_valid_b):
        model = nnx.merge(graphdef, params)
        hidden, cache = model.extend(tokens_bc, cache, start_b, n_valid_b)
        last = jnp.take_along_axis(hidden, (n_valid_b - 1)[:, None, None], axis=1)[:, 0]
        logp = jax.nn.log_softmax(model.logits(last[:, None])[:, 0], axis=-1)
        top2 = jax.lax.top_k(logp, 2)[0]
        return cache, jnp.argmax(logp, axis=-1), top2[:, 0], top2[:, 0] - top2[:, 1]

    width = max(map(len, prompts))
    tokens = jnp.asarray([p + [0] * (width - len(p)) for p in prompts], jnp.int32)
    n = jnp.asarray([len(p) for p in prompts], jnp.int32)
    cache, *first = step(params, cache, tokens, jnp.zeros_like(n), n)
    out = [first]
    for i in range(steps - 1):
        cache, *one = step(params, cache, out[-1][0][:, None], n + i, jnp.ones_like(n))
        out.append(one)
    return tuple(np.stack([np.asarray(o[j]) for o in out], 1) for j in range(3))


@pytest.mark.parametrize("kv_dtype,dtype,wide", [(None, jnp.float32, False), ("fp8", jnp.bfloat16, False),
                                                 (None, jnp.bfloat16, True)] if ON_GPU else
                         [("fp8", jnp.bfloat16, False)])
def test_greedy_decode_with_kernels_gives_the_references_tokens(kv_dtype, dtype, wide):
    steps = 64 if ON_GPU else 3
    kernels = "auto" if ON_GPU else "interpret"
    rng = np.random.default_rng(0)
    # Past the 16-token window and several entries; on CPU short, the interpreted kernels are slow.
    prompts = [list(rng.integers(0, 512, n)) for n in ((37, 5, 70) if ON_GPU else (29, 5))]
    sp = SamplingParams(temperature=0.0, max_tokens=steps, stop_token_ids=[], logprobs=3)
    out = {}
    for k in ("reference", kernels):
        m = model(k, dtype, wide)
        if k != "reference":  # decode runs both decode kernels, prefill the prefill kernels
            decode, prefill = step_jaxpr(m, kv_dtype, 1), step_jaxpr(m, kv_dtype, 16)
            for name, text in (("dsjax_sparse_decode", decode), ("dsjax_index_scores", decode),
                               ("dsjax_sparse_prefill", prefill), ("dsjax_index_scores", prefill)):
                assert name in text, name
            # bf16 rows and 64 heads of 512: CSA and sliding layers decode through the Mosaic kernel.
            assert ("dsjax_sparse_decode_mosaic" in decode) == wide
        if ON_GPU:
            engine = Engine(m, RunConfig(slots=len(prompts), max_len=80 + steps, chunk_size=16, kv_dtype=kv_dtype,
                                         kernels=k))
            out[k] = [(r.tokens, np.asarray([lp.logprob for lp in r.logprobs]),
                       [np.subtract(*sorted((v for _, v in lp.top), reverse=True)[:2]) for lp in r.logprobs])
                      for r in generate(m, prompts, sp, engine=engine)]
        else:
            out[k] = [(list(t), lp, gap) for t, lp, gap in zip(*greedy_through_extend(m, prompts, steps, kv_dtype))]
    for (ref_tokens, lp_ref, ref_gap), (got_tokens, lp_got, _) in zip(out["reference"], out[kernels]):
        if dtype == jnp.float32:
            assert got_tokens == ref_tokens
            np.testing.assert_allclose(lp_got, lp_ref, atol=1e-4)
        else:
            # bf16 activations: the kernels' fp32 softmax and fp16 P·V move attention outputs by ~1e-4 and
            # bf16 rounding downstream amplifies that (2.8e-2 in a logprob after 6 steps on the H200);
            # tokens may differ only where the reference's top two were that close, then the runs diverge.
            n = next((i for i, (a, b) in enumerate(zip(got_tokens, ref_tokens)) if a != b), len(ref_tokens))
            if n < len(ref_tokens):
                assert ref_gap[n] < 5e-2, f"step {n}: tokens differ though the reference's margin is {ref_gap[n]}"
            np.testing.assert_allclose(lp_got[:n], lp_ref[:n], atol=5e-2)


def v41_model(kernels: str) -> DeepseekV41:
    """tiny-v4.1's layers 2 and 3 (a ratio-2 Full KV source, with a window, entries and index keys, and a
    Reindex layer on its keys) at shapes the GPU kernels tile (16 query heads of 64, 16 index heads of 64),
    fp32, random sinks."""
    cfg = v41_slice(V41Config.preset("tiny-v4.1"), [2, 3]).replace(
        num_attention_heads=16, index_n_heads=16, index_head_dim=64)
    m = DeepseekV41(cfg, rngs=nnx.Rngs(0), dtype=jnp.float32)
    for path, var in nnx.to_flat_state(nnx.state(m, nnx.Param)):
        if path[-1] == "sinks":
            var.set_value(jax.random.normal(jax.random.key(len(path)), var.get_value().shape, jnp.float32))
    return with_kernels(m, kernels)


def test_v41_in_its_release_cache_storage_runs_the_kernels_and_gives_the_references_logits():
    """DeepSeek-V4.1 with its release's packed cache (`kv_dtype` "fp4": an MXFP8 window, NVFP4 entries,
    MXFP4 index keys): prefill and decode run the attention and indexer kernels (interpreted here) on the
    records, and the logits equal the references' (fp32: only summation orders differ)."""
    b, prompt, total = 2, 21, 23
    ids = jnp.asarray(np.random.default_rng(0).integers(3, 250, (b, total)), jnp.int32)
    logits = {}
    for kernels in ("reference", "auto" if ON_GPU else "interpret"):
        m = v41_model(kernels)
        graphdef, params = nnx.split(m)

        def step(params, cache, tokens, start, n_valid):
            model = nnx.merge(graphdef, params)
            hidden, cache = model.extend(tokens, cache, start, n_valid)
            return cache, model.logits(hidden)

        cache = init_cache(m, b, 32, kv_dtype="fp4")
        start, n = jnp.zeros((b,), jnp.int32), jnp.full((b,), prompt, jnp.int32)
        if kernels != "reference":
            for tokens, name in ((ids[:, :prompt], "dsjax_sparse_prefill"), (ids[:, :1], "dsjax_sparse_decode")):
                text = str(jax.make_jaxpr(step)(params, cache, tokens, start, n))
                assert name in text and "dsjax_index_scores" in text, name
        step = jax.jit(step)
        cache, out = step(params, cache, ids[:, :prompt], start, n)
        steps = [out[:, -1]]
        for p in range(prompt, total):
            cache, out = step(params, cache, ids[:, p:p + 1], jnp.full((b,), p, jnp.int32), jnp.ones((b,), jnp.int32))
            steps.append(out[:, 0])
        logits[kernels] = np.stack([np.asarray(s) for s in steps], 1)
    want, got = logits["reference"], logits["auto" if ON_GPU else "interpret"]
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
