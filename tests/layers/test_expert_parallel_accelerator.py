"""On a GPU or TPU, the real `jax.lax.ragged_all_to_all` (XLA:CPU has none) runs the ragged design."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import dsjax
from dsjax.config import ModelConfig
from dsjax.layers.expert_parallel import _Local, ragged_dispatch
from tests.helpers import assert_close
from tests.layers.test_expert_parallel import RUN, routing

pytestmark = pytest.mark.skipif(jax.default_backend() == "cpu", reason="needs an accelerator")


@pytest.mark.parametrize("crowded", [False, True])
def test_ragged_all_to_all_dispatch_on_the_accelerator(crowded):
    """Every device of the machine's expert axis (one on a one-GPU machine: its pairs are sent to itself)
    sends pairs by ragged all-to-all; the result equals the experts run directly."""
    cfg = ModelConfig.preset("tiny")
    model = dsjax.DeepseekV4(cfg, rngs=nnx.Rngs(4), dtype=jnp.float32)
    experts = model.layer(1).mlp.experts
    n_dev = len(jax.devices())
    if cfg.n_routed_experts % n_dev:
        pytest.skip(f"{n_dev} devices do not divide {cfg.n_routed_experts} experts")
    mesh = jax.make_mesh((n_dev,), ("ep",), axis_types=(jax.sharding.AxisType.Explicit,))
    x, w, idx = routing(cfg, 8 * n_dev, seed=5)
    if crowded:
        idx = idx.at[:, 0].set(0)  # every token also goes to expert 0: one device receives most pairs
    local = _Local(experts, "ep", n_dev, None, cfg.n_routed_experts // n_dev)
    gate_up, down = experts.gate_up_proj[...], experts.down_proj[...]

    def run(x, w, idx, gate_up, down):
        return ragged_dispatch(local, x, w, idx, gate_up, down, None)

    with jax.set_mesh(mesh):
        args = [jax.reshard(a, P("ep")) for a in (x, w, idx, gate_up, down)]
        got = jax.jit(jax.shard_map(run, in_specs=(P("ep"),) * 5, out_specs=P("ep")))(*args)
    assert_close(np.asarray(got), np.asarray(experts(x, w, idx)), rtol=1e-5)


@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs two accelerators")
def test_expert_parallel_model_on_several_accelerators():
    """The whole model with its experts split over every accelerator (ragged all-to-all between them):
    logits and greedy tokens equal one accelerator's."""
    from dsjax import SamplingParams, generate
    from dsjax.parallel.mesh import make_mesh
    from dsjax.parallel.shard import shard_model

    n_dev = len(jax.devices())
    model = dsjax.DeepseekV4(ModelConfig.preset("tiny"), rngs=nnx.Rngs(3), dtype=jnp.float32)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 500, (2, 11)))
    prompts, greedy = [[5, 17, 300, 2], [7, 9], [11, 12, 13], [1]], SamplingParams(temperature=0.0, max_tokens=16)
    want_logits = np.asarray(model(ids))
    want_tokens = [r.tokens for r in generate(model, prompts, greedy, run=RUN)]
    mesh = make_mesh(f"ep={n_dev}")
    sharded = shard_model(model, mesh)
    with jax.set_mesh(mesh):
        logits = np.asarray(nnx.jit(lambda m, x: m(x))(sharded, ids))
        tokens = [r.tokens for r in generate(sharded, prompts, greedy, run=RUN)]
    assert_close(logits, want_logits, rtol=1e-5)
    assert tokens == want_tokens


@pytest.mark.parametrize("tokens", [1, 3, 5, 7, 64])
def test_bf16_experts_take_any_number_of_rows(tokens):
    """tokamax's GPU kernel (bf16 only) tiles rows by 8; 2·tokens (token, expert) pairs need not be."""
    cfg = ModelConfig.preset("tiny")
    model = dsjax.DeepseekV4(cfg, rngs=nnx.Rngs(4), dtype=jnp.float32)
    x, w, idx = routing(cfg, tokens, seed=6)
    want = model.layer(1).mlp.experts(x, w, idx)
    bf16 = dsjax.DeepseekV4(cfg, rngs=nnx.Rngs(4), dtype=jnp.bfloat16).layer(1).mlp.experts
    got = jax.jit(lambda x: bf16(x, w, idx))(x.astype(jnp.bfloat16))
    assert_close(np.asarray(got, np.float32), np.asarray(want), rtol=3e-2)
