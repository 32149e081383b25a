"""Model structure: layer grouping, scanned stacks, and compile cost that does not grow with depth."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsjax.config import CSA, HCA, HASH_MOE, MOE, ModelConfig
from dsjax.model import DeepseekV4, layer_groups, with_kernels


def test_layer_groups_cover_schedule_in_order():
    kinds = ModelConfig.preset("v4-flash").layer_kinds
    groups = layer_groups(kinds)
    assert [(g.start, len(g.pattern), g.repeats) for g in groups] == [(0, 1, 3), (3, 2, 20)]
    rebuilt = [g.pattern[p] for g in groups for r in range(g.repeats) for p in range(len(g.pattern))]
    assert tuple(rebuilt) == kinds
    assert groups[1].pattern == ((CSA, MOE), (HCA, MOE)) and groups[0].pattern == ((HCA, HASH_MOE),)


def _lowered_size(num_layers: int) -> int:
    cfg = ModelConfig.from_hf({**ModelConfig.preset("tiny").to_hf(), "num_hidden_layers": num_layers,
                               "layer_types": None, "mlp_layer_types": None})
    model = nnx.eval_shape(lambda: DeepseekV4(cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(model)

    def fwd(state, ids):
        return nnx.merge(graphdef, state)(ids)

    text = jax.jit(fwd).lower(state, jax.ShapeDtypeStruct((1, 16), jnp.int32)).as_text()
    return len(text)


def test_program_size_does_not_grow_with_depth():
    """The 43-layer schedule lowers to the same program as an 11-layer one: layers are scanned."""
    # The first lowering in a process emits a few more private functions than later ones (jax's
    # caches fill): measure after one, or the order of the two lowerings decides the outcome.
    _lowered_size(7)
    small, deep = _lowered_size(11), _lowered_size(43)
    assert abs(deep - small) / small < 0.02, (small, deep)


def test_layer_view_matches_stacked_weights():
    cfg = ModelConfig.preset("tiny")
    model = DeepseekV4(cfg, rngs=nnx.Rngs(3))
    layer = model.layer(2)
    group = model.groups[2]
    np.testing.assert_array_equal(np.asarray(layer.self_attn.kv_proj.weight[...]),
                                  np.asarray(group.layers[0].self_attn.kv_proj.weight[...][0]))


def _quantized_group_cfg() -> ModelConfig:
    """Three hash-routed MoE layers in one scanned group, FP4 experts the expert kernel can tile. (Hash
    routing depends on the token ids only: learned routing could pick other experts for a token after
    a rounding difference, and the logits would differ by more than rounding.)"""
    from dsjax.config import QuantConfig

    quant = QuantConfig(weight_block_size=(128, 128), scale_fmt="ue8m0", expert_dtype="fp4")
    return ModelConfig.from_hf({**ModelConfig.preset("tiny").to_hf(), "num_hidden_layers": 3,
                                "layer_types": ["sliding_attention"] * 3, "mlp_layer_types": ["hash_moe"] * 3,
                                "hidden_size": 128, "moe_intermediate_size": 128}).replace(
        quantization=quant)


def test_scan_hands_quantized_experts_over_as_stacked_slices():
    """Inside the group's scan each layer's quantized experts are a `StackedSlice` of the whole stack
    naming that layer; its other weights are sliced as before."""
    from dsjax.stacked import StackedSlice

    model = DeepseekV4(_quantized_group_cfg(), rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
    group = model.groups[0]
    assert group.group.repeats == 3
    layers_at, state = group._scanned()
    for i in range(3):
        layer = layers_at(jnp.int32(i), jax.tree.map(lambda a: a[i], state))[0]
        w, scale = layer.mlp.experts.stored("gate_up_proj")
        assert isinstance(w, StackedSlice) and isinstance(scale, StackedSlice)
        alone = model.layer(i)
        np.testing.assert_array_equal(np.asarray(w.array()), np.asarray(alone.mlp.experts.gate_up_proj[...]))
        np.testing.assert_array_equal(np.asarray(scale.array()),
                                      np.asarray(alone.mlp.experts.gate_up_proj_scale_inv[...]))
        np.testing.assert_array_equal(np.asarray(layer.self_attn.kv_proj.weight[...]),
                                      np.asarray(alone.self_attn.kv_proj.weight[...]))


def test_quantized_group_with_the_expert_kernel_matches_the_reference():
    """The quantized model, its experts read in place (through the reference, and through the
    interpreted expert kernel), gives the logits of its dequantized twin, whose float experts the scan
    slices as before (fp32 sums in another order); and lowered for cuda no op cuts a layer's experts
    out of the stack."""
    from dsjax.bench import random_model
    from dsjax.export import abstract_device, disabled_checks
    from dsjax.quantize import dequantize_model

    ids = jnp.asarray(np.random.default_rng(0).integers(0, 512, (2, 6)), jnp.int32)
    model = random_model(_quantized_group_cfg())  # random hash routing: each token its own experts
    want = np.asarray(dequantize_model(model).forward(ids))
    kernel = with_kernels(model, "interpret")
    for got in (model.forward(ids), jax.jit(lambda m, x: m.forward(x))(kernel, ids)):
        np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=2e-2 * np.abs(want).max())
    # the cached path's scan (`extend`) as well
    from dsjax.cache import init_cache

    start, n_valid = jnp.zeros(2, jnp.int32), jnp.full(2, ids.shape[1], jnp.int32)
    hidden, _ = model.extend(ids, init_cache(model, 2, 16), start, n_valid)
    np.testing.assert_allclose(np.asarray(model.logits(hidden)), want, rtol=0, atol=2e-2 * np.abs(want).max())

    abstract = nnx.eval_shape(lambda: DeepseekV4(_quantized_group_cfg(), rngs=nnx.Rngs(0), dtype=jnp.bfloat16))
    graphdef, state = nnx.split(abstract)
    h200 = jax.sharding.AbstractMesh((), (), abstract_device=abstract_device("cuda"))
    with jax.sharding.use_abstract_mesh(h200):
        text = jax.export.export(jax.jit(lambda s, x: nnx.merge(graphdef, s).forward(x)), platforms=["cuda"],
                                 disabled_checks=disabled_checks("cuda"))(
            state, jax.ShapeDtypeStruct(ids.shape, jnp.int32)).mlir_module()
    assert "dsjax_expert_matmul" in text
    # gate_up [E=8, 2I=256, H/2=64] and down [8, 128, 64] int8 per layer, or as the kernel's int32 words
    for shape in ("8x256x64xi8", "8x128x64xi8", "8x256x16xi32", "8x128x16xi32"):
        assert f"tensor<{shape}>" not in text and f"tensor<1x{shape}>" not in text


def test_with_kernels_sets_every_kernel_backed_operation_over_the_same_weights():
    """`with_kernels` is how a run picks its kernels (not the config): every module that calls a kernel op
    takes the choice, the weights are the very same arrays, and the original model is left as it was."""
    import pytest

    from dsjax.run_config import RunConfigError

    model = DeepseekV4(ModelConfig.preset("tiny"), rngs=nnx.Rngs(0), dtype=jnp.float32)
    chosen = with_kernels(model, "interpret")

    def kinds(m):
        return {(type(mod).__name__, mod.kernels) for _, mod in nnx.iter_modules(m) if hasattr(mod, "kernels")}

    assert kinds(chosen) == {(n, "interpret") for n in ("Attention", "Indexer", "RoutedExperts", "HyperConnection",
                                                         "Linear", "GroupedLinear")}
    assert {k for _, k in kinds(model)} == {"auto"}
    assert all(a is b for a, b in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(chosen))))
    assert nnx.split(chosen)[0] != nnx.split(model)[0]  # a different program, jit compiles it apart
    with pytest.raises(RunConfigError, match="kernels must be one of"):
        with_kernels(model, "triton")


def test_repacked_fp4_experts_give_the_same_logits_and_save_as_the_checkpoint():
    """`with_code_layout` moves the FP4 experts' codes into the kernels' layout once: the reference and the
    interpreted kernels give the same logits as from the checkpoint's layout, bit for bit; what a save
    writes (`stored_variables`) is the checkpoint's bytes; the programs differ (their key does); and
    "checkpoint" moves the codes back."""
    import pytest

    from dsjax.bench import random_model
    from dsjax.checkpoint.save import hf_tensors
    from dsjax.model import stored_variables, with_code_layout

    ids = jnp.asarray(np.random.default_rng(0).integers(0, 512, (2, 6)), jnp.int32)
    original = random_model(_quantized_group_cfg())
    want = {k: np.asarray(with_kernels(original, k).forward(ids)) for k in ("reference", "interpret")}
    saved = dict(hf_tensors(original))
    raw = {path: np.asarray(v.get_value()) for path, v in nnx.to_flat_state(nnx.state(random_model(
        _quantized_group_cfg())))}

    repacked = with_code_layout(random_model(_quantized_group_cfg()), "repacked")
    moved = {path for path, v in nnx.to_flat_state(nnx.state(repacked))
             if not np.array_equal(np.asarray(v.get_value()), raw[path])}
    assert moved == {("groups", 0, "layers", 0, "mlp", "experts", leaf) for leaf in ("gate_up_proj", "down_proj")}
    for k in ("reference", "interpret"):
        np.testing.assert_array_equal(np.asarray(with_kernels(repacked, k).forward(ids)), want[k], err_msg=k)
    assert {path: v for path, v in stored_variables(repacked)}.keys() == raw.keys()
    for path, v in stored_variables(repacked):
        np.testing.assert_array_equal(v, raw[path], err_msg=str(path))
    assert saved.keys() == dict(hf_tensors(repacked)).keys()
    for name, v in hf_tensors(repacked):
        np.testing.assert_array_equal(v, saved[name], err_msg=name)
    assert nnx.split(repacked)[0] != nnx.split(original)[0]

    back = with_code_layout(repacked, "checkpoint")
    for path, v in nnx.to_flat_state(nnx.state(back)):
        np.testing.assert_array_equal(np.asarray(v.get_value()), raw[path], err_msg=str(path))
    assert nnx.split(back)[0] == nnx.split(original)[0]
    with pytest.raises(ValueError, match="with_code_layout: code_layout must be one of .* got 'marlin'"):
        with_code_layout(back, "marlin")


def test_only_fp4_experts_are_repacked_and_only_where_the_gpu_kernels_read_them():
    import pytest

    from dsjax.model import expert_code_layout, with_code_layout
    from dsjax.run_config import RunConfigError

    assert [expert_code_layout(k, p) for k, p in (("auto", "gpu"), ("interpret", "cpu"), ("auto", "cpu"),
                                                  ("auto", "tpu"), ("reference", "gpu"))] == \
        ["repacked", "repacked", "checkpoint", "checkpoint", "checkpoint"]
    with pytest.raises(RunConfigError, match="kernels must be one of"):
        expert_code_layout("triton", "gpu")
    model = DeepseekV4(ModelConfig.preset("tiny"), rngs=nnx.Rngs(0), dtype=jnp.float32)  # float experts
    same = with_code_layout(model, "repacked")
    assert all(a is b for a, b in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(same))))
    assert nnx.split(same)[0] == nnx.split(model)[0]
