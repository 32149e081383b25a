"""Expert parallelism on 8 CPU devices: the same logits and greedy tokens as one device, no expert weight
ever all-gathered."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import dsjax
from dsjax import SamplingParams, generate
from dsjax.config import ModelConfig
from dsjax.engine.engine import Engine
from dsjax.model import with_kernels
from dsjax.parallel.mesh import make_mesh
from dsjax.parallel.shard import shard_model
from dsjax.quantize import quantize_model
from dsjax.run_config import RunConfig
from tests.helpers import assert_close

IDS = jnp.asarray(np.random.default_rng(0).integers(0, 500, (2, 11)))  # 22 tokens: padded to 24 for 8 shards


@pytest.fixture(scope="module")
def model():
    return dsjax.DeepseekV4(ModelConfig.preset("tiny"), rngs=nnx.Rngs(3), dtype=jnp.float32)


PROMPTS = [[5, 17, 300, 2], [7, 9], [11, 12, 13], [1]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=32)
RUN = RunConfig(slots=4, max_len=36, chunk_size=64)  # room for the longest prompt and 32 tokens


@pytest.fixture(scope="module")
def one_device_tokens(model):
    return [r.tokens for r in generate(model, PROMPTS, GREEDY, run=RUN)]


def forward(model, ids):
    return nnx.jit(lambda m, x: m(x))(model, ids)


# Each axis alone, and tp with dp; the meshes with ep and another axis are checked by their greedy tokens
# (test_greedy_decode_equals_one_device) and their experts' exchange within 1e-5
# (test_both_dispatch_designs_equal_one_device).
@pytest.mark.parametrize("spec", ["dp=8", "ep=8", "dp=4,tp=2"])
def test_logits_equal_one_device(model, spec):
    mesh = make_mesh(spec)
    with jax.set_mesh(mesh):
        out = forward(shard_model(model, mesh), IDS)
    assert_close(np.asarray(out), np.asarray(forward(model, IDS)), rtol=1e-5)


# The meshes that combine axes: each axis alone is checked on the forward (test_logits_equal_one_device[dp=8]
# and [ep=8]) and on the exchange (test_both_dispatch_designs_equal_one_device[*-ep=8]).
@pytest.mark.parametrize("spec", ["dp=2,ep=4", "dp=4,tp=2", "dp=2,ep=2,tp=2"])
def test_greedy_decode_equals_one_device(model, one_device_tokens, spec):
    mesh = make_mesh(spec)
    with jax.set_mesh(mesh):
        got = [r.tokens for r in generate(shard_model(model, mesh), PROMPTS, GREEDY, run=RUN)]
    assert got == one_device_tokens and all(len(t) == 32 for t in got)


def test_fp4_experts_split_over_the_expert_axis(model):
    quantized = quantize_model(model)
    mesh = make_mesh("dp=2,ep=4")
    sharded = shard_model(quantized, mesh)
    gate_up = sharded.groups[1].layers[0].mlp.experts.gate_up_proj[...]
    assert gate_up.dtype == jnp.int8 and gate_up.sharding.spec[1] == "ep"
    with jax.set_mesh(mesh):
        out = forward(sharded, IDS)
    assert_close(np.asarray(out), np.asarray(forward(quantized, IDS)), rtol=1e-5)


@pytest.mark.parametrize("spec", ["ep=8", "ep=4,tp=2"])
def test_split_weights_are_never_all_gathered(model, spec):
    """In the compiled sharded forward, no all-gather produces an array the size of a whole expert
    weight or (under tp) a whole query or output projection (stacked or one layer's): each device only
    ever holds its own experts and heads."""
    mesh = make_mesh(spec)
    sharded = shard_model(model, mesh)
    graphdef, state = nnx.split(sharded)
    with jax.set_mesh(mesh):
        hlo = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x)).lower(state, IDS).compile().as_text()
    whole = set()
    for path, var in nnx.to_flat_state(state):
        if path[-2:] in (("experts", "gate_up_proj"), ("experts", "down_proj"), ("q_b_proj", "weight"),
                         ("o_b_proj", "weight")):
            shape = tuple(var.get_value().shape)
            whole |= {shape, shape[1:]}
    gathered = {tuple(int(d) for d in m.group(1).split(",") if d)
                for m in re.finditer(r"= \w+\[([\d,]*)\]\{[^}]*\} all-gather", hlo)}
    assert gathered, "expected the token all-gathers of the expert-parallel path"
    assert not gathered & whole, gathered & whole


def test_an_expert_axis_that_does_not_divide_the_experts_is_refused():
    model = dsjax.DeepseekV4(ModelConfig.preset("tiny").replace(n_routed_experts=6, num_experts_per_tok=2),
                             rngs=nnx.Rngs(0), dtype=jnp.float32)
    mesh = make_mesh("dp=2,ep=4")
    with jax.set_mesh(mesh), pytest.raises(ValueError, match=r"expert axis \(4\) must divide n_routed_experts \(6\)"):
        forward(model, IDS)


def test_cache_slots_are_split_and_decoding_does_not_recompile(model):
    """Data-parallel attention: each device holds the cache of its own slots; the steps keep that layout,
    so the decode loop reuses its programs."""
    mesh = make_mesh("dp=2,ep=4")
    sharded = shard_model(model, mesh)
    params = SamplingParams(temperature=0.0, max_tokens=12)
    with jax.set_mesh(mesh):
        cache = Engine(sharded, RunConfig(slots=8, max_len=64, chunk_size=16)).new_cache()
        leaf = jax.tree.leaves(cache.groups)[0]
        assert leaf.sharding.spec[:2] == (None, ("dp", "ep")) and leaf.addressable_shards[0].data.shape[1] == 1
        assert cache.lengths.sharding.is_fully_replicated
        generate(sharded, [[5, 6, 7]] * 8, params, run=RunConfig(slots=8, max_len=15, chunk_size=64))
        warm = Engine.compilations()
        out = generate(sharded, [[9, 8, 7]] * 3 + [[1, 2, 3]] * 5, params,
                       run=RunConfig(slots=8, max_len=15, chunk_size=64))  # same shapes
        assert Engine.compilations() == warm and all(len(r.tokens) == 12 for r in out)


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                               axis_name):
    """`jax.lax.ragged_all_to_all`'s semantics from all-gathers (XLA:CPU has no ragged all-to-all), so
    that the ragged dispatch's offsets are checked on CPU devices. A `recv_sizes` that disagrees with
    what the senders send poisons the output."""
    me = jax.lax.axis_index(axis_name)
    ops = jax.lax.all_gather(operand, axis_name)
    starts, sizes, dests = (jax.lax.all_gather(a, axis_name) for a in (input_offsets, send_sizes, output_offsets))
    rows = jnp.arange(output.shape[0])
    for s in range(ops.shape[0]):
        dest, size, start = dests[s, me], sizes[s, me], starts[s, me]
        hit = ((rows >= dest) & (rows < dest + size)).reshape((-1,) + (1,) * (output.ndim - 1))
        output = jnp.where(hit, jnp.take(ops[s], jnp.clip(start + rows - dest, 0, operand.shape[0] - 1), axis=0),
                           output)
    bad = jnp.any(recv_sizes != sizes[:, me])
    return jnp.where(bad, jnp.full_like(output, -7 if output.dtype.kind == "i" else jnp.nan), output)


def routing(cfg, n, seed):
    """n tokens' inputs and top-k routing, half of them crowding onto experts 3 and 5."""
    rng = np.random.default_rng(seed)
    idx = np.stack([rng.choice(cfg.n_routed_experts, cfg.num_experts_per_tok, replace=False) for _ in range(n)])
    idx[: n // 2, :2] = (3, 5)
    return (jnp.asarray(rng.normal(size=(n, cfg.hidden_size)), jnp.float32),
            jnp.asarray(rng.random((n, cfg.num_experts_per_tok)), jnp.float32), jnp.asarray(idx, jnp.int32))


def sharded_experts_call(model, spec, design, x, w, idx):
    from dsjax.layers.expert_parallel import routed_experts_parallel

    mesh = make_mesh(spec)
    graphdef, state = nnx.split(shard_model(model, mesh).layer(1).mlp.experts)

    def call(state, x, w, idx):
        return routed_experts_parallel(nnx.merge(graphdef, state), x, w, idx, mesh, design,
                                       exchange=emulated_ragged_all_to_all)

    with jax.set_mesh(mesh):
        return jax.jit(call)(state, x, w, idx)


@pytest.mark.parametrize("spec", ["ep=8", "dp=2,ep=4", "dp=2,ep=2,tp=2"])
@pytest.mark.parametrize("design", ["gathered", "ragged"])
def test_both_dispatch_designs_equal_one_device(model, spec, design):
    x, w, idx = routing(model.cfg, 21, seed=1)  # 21 tokens: padded to the shard count
    want = model.layer(1).mlp.experts(x, w, idx)
    assert_close(np.asarray(sharded_experts_call(model, spec, design, x, w, idx)), np.asarray(want), rtol=1e-5)


def test_fp4_experts_split_over_tp_with_the_ragged_design():
    # FP4 scales cover 32 values of a row: an FFN width of 64 gives each of two tp devices whole scales
    cfg = ModelConfig.preset("tiny").replace(moe_intermediate_size=64)
    quantized = quantize_model(dsjax.DeepseekV4(cfg, rngs=nnx.Rngs(1), dtype=jnp.float32))
    x, w, idx = routing(cfg, 16, seed=2)
    want = quantized.layer(1).mlp.experts(x, w, idx)
    got = sharded_experts_call(quantized, "ep=4,tp=2", "ragged", x, w, idx)
    assert_close(np.asarray(got), np.asarray(want), rtol=1e-5)


def test_a_tp_that_splits_weights_but_not_their_scales_is_refused(model):
    quantized = quantize_model(model)  # FFN width 32: one FP4 scale per row of down_proj
    x, w, idx = routing(model.cfg, 16, seed=2)
    with pytest.raises(ValueError, match="splits some of the routed experts' arrays but not all"):
        sharded_experts_call(quantized, "ep=4,tp=2", "ragged", x, w, idx)


@pytest.mark.parametrize("spec", ["ep=8", "dp=4,ep=2"])
def test_the_backend_picks_the_design(spec):
    """Lowered for GPU or TPU, the MoE exchanges tokens by ragged all-to-all when that moves fewer bytes
    (k < ep); for CPU, and when k ≥ ep, by all-gather and reduce-scatter."""
    from dsjax.layers.expert_parallel import routed_experts_parallel

    model = dsjax.DeepseekV4(ModelConfig.preset("tiny"), rngs=nnx.Rngs(0), dtype=jnp.float32)  # k = 2
    mesh = make_mesh(spec)
    graphdef, state = nnx.split(shard_model(model, mesh).layer(1).mlp.experts)
    x, w, idx = routing(model.cfg, 16, seed=3)
    f = jax.jit(lambda s, x, w, idx: routed_experts_parallel(nnx.merge(graphdef, s), x, w, idx, mesh))
    few = mesh.shape["ep"] <= model.cfg.num_experts_per_tok
    for platform, ragged in (("cuda", not few), ("tpu", not few), ("cpu", False)):
        with jax.set_mesh(mesh):
            text = jax.export.export(f, platforms=[platform], disabled_checks=[  # XLA's own op, as a custom call
                jax.export.DisabledSafetyCheck.custom_call("ragged_all_to_all")])(state, x, w, idx).mlir_module()
        assert ("ragged_all_to_all" in text) == ragged, platform
        assert ("reduce_scatter" in text) != ragged, platform  # the all-gather design's combine


def test_tensor_parallelism_splits_heads_and_ffn_width(model):
    """Under tp=2 each device holds half of the query heads' weights and half of each expert's FFN."""
    mesh = make_mesh("dp=4,tp=2")
    sharded = shard_model(model, mesh).groups[1].layers[0]
    cfg = model.cfg
    q_b = sharded.self_attn.q_b_proj.weight[...]
    assert q_b.addressable_shards[0].data.shape[1:] == (cfg.num_attention_heads * cfg.head_dim // 2, cfg.q_lora_rank)
    gate_up = sharded.mlp.experts.gate_up_proj[...]
    assert gate_up.addressable_shards[0].data.shape[-1] == cfg.moe_intermediate_size
    down = sharded.mlp.experts.down_proj[...]
    assert down.addressable_shards[0].data.shape[-2] == cfg.moe_intermediate_size // 2


def test_decode_fed_the_step_in_flights_tokens_does_not_compile_again(model):
    """The scheduler feeds the first decode step after a prefill the host's tokens and the later ones the
    step in flight's (on the mesh): both reach the step replicated on the mesh, so one decode step
    (two tokens) compiles everything a longer run needs."""
    from dsjax.engine.scheduler import Request, run

    mesh = make_mesh("dp=2,ep=4")
    sharded = shard_model(model, mesh)

    def requests(n):
        return [Request(i, (5, 6, 7), SamplingParams(temperature=0.0, max_tokens=n), i, frozenset()) for i in range(8)]

    with jax.set_mesh(mesh):
        engine = Engine(sharded, RunConfig(slots=8, max_len=16, chunk_size=8))
        list(run(engine, requests(2)))
        warm = Engine.compilations()
        events = list(run(engine, requests(6)))
    assert Engine.compilations() == warm and len(events) == 8 * 6


def test_the_expert_kernel_runs_inside_the_expert_parallel_shard_map():
    """Inside the shard_map each device's FP4 experts go through the GPU kernel (lowered for cuda: the
    Triton call is there), and, interpreted on the CPU devices, split over ep=4 they give what the
    kernel gives on one device."""
    from dsjax.layers.expert_parallel import routed_experts_parallel

    cfg = ModelConfig.preset("tiny").replace(hidden_size=256, moe_intermediate_size=128)
    quantized = with_kernels(quantize_model(dsjax.DeepseekV4(cfg, rngs=nnx.Rngs(2), dtype=jnp.float32)), "interpret")
    experts = quantized.layer(1).mlp.experts
    x, w, idx = routing(cfg, 16, seed=4)
    x = x.astype(jnp.bfloat16)  # the kernel's activations
    mesh = make_mesh("dp=2,ep=4")
    graphdef, state = nnx.split(shard_model(quantized, mesh).layer(1).mlp.experts)
    f = jax.jit(lambda s, x, w, idx: routed_experts_parallel(nnx.merge(graphdef, s), x, w, idx, mesh))
    with jax.set_mesh(mesh):
        text = jax.export.export(f, platforms=["cuda"], disabled_checks=[
            jax.export.DisabledSafetyCheck.custom_call(t) for t in ("ragged_all_to_all", "__gpu$xla.gpu.triton")])(
            state, x, w, idx).mlir_module()
        got = f(state, x, w, idx)
    assert "dsjax_expert_matmul" in text
    assert_close(np.asarray(got, np.float32), np.asarray(experts(x, w, idx), np.float32), rtol=2e-2)


def test_stacked_experts_enter_the_shard_map_uncut():
    """A layer group's scan hands its FP4 experts to the expert-parallel MoE as slices of the whole stack:
    lowered for cuda on dp=2, ep=4, the kernel reads each device's part of the stack in place (no op
    cuts a layer's experts out); interpreted on the CPU devices, the logits are one device's."""
    from tests.test_model import _quantized_group_cfg

    ids = jnp.asarray(np.random.default_rng(1).integers(0, 512, (8, 6)), jnp.int32)
    one = with_kernels(dsjax.DeepseekV4(_quantized_group_cfg(), rngs=nnx.Rngs(0), dtype=jnp.bfloat16), "interpret")
    want = np.asarray(forward(one, ids), np.float32)
    mesh = make_mesh("dp=2,ep=4")
    graphdef, state = nnx.split(shard_model(one, mesh))
    f = jax.jit(lambda s, x: nnx.merge(graphdef, s).forward(x))
    with jax.set_mesh(mesh):
        text = jax.export.export(f, platforms=["cuda"], disabled_checks=[
            jax.export.DisabledSafetyCheck.custom_call(t) for t in ("ragged_all_to_all", "__gpu$xla.gpu.triton")])(
            state, ids).mlir_module()
        got = np.asarray(f(state, ids), np.float32)
    assert "dsjax_expert_matmul" in text
    # one layer's local experts, 2 of the 8: gate_up [2, 256, 64] and down [2, 128, 64] int8 (or int32 words)
    for shape in ("2x256x64xi8", "2x128x64xi8", "2x256x16xi32", "2x128x16xi32"):
        assert f"tensor<{shape}>" not in text and f"tensor<1x{shape}>" not in text, shape
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-2 * np.abs(want).max())
