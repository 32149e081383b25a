"""Routed experts (grouped matmul) and the shared expert against the reference."""

import jax.numpy as jnp
import numpy as np
import pytest

from dsjax.layers.experts import clamped_swiglu
from tests.helpers import CASES, assert_close


@pytest.mark.parametrize("case", list(CASES))
def test_routed_experts_match_reference(load_case, capture, case):
    model, cap = load_case(case), capture(case)
    for i in range(CASES[case]):
        experts = model.layer(i).mlp.experts
        x = jnp.asarray(cap[f"L{i}.experts.in0"])
        idx = jnp.asarray(cap[f"L{i}.experts.in1"].astype(np.int32))
        w = jnp.asarray(cap[f"L{i}.experts.in2"])
        assert_close(experts(x, w, idx), cap[f"L{i}.experts.out0"], what=f"{case} layer {i}")


@pytest.mark.parametrize("case", list(CASES))
def test_shared_expert_matches_reference(load_case, capture, case):
    model, cap = load_case(case), capture(case)
    for i in range(CASES[case]):
        shared = model.layer(i).mlp.shared_experts
        assert_close(shared(jnp.asarray(cap[f"L{i}.shared_experts.in0"])), cap[f"L{i}.shared_experts.out0"],
                     what=f"{case} layer {i}")


def test_swiglu_clamps_gate_from_above_only():
    gate = jnp.asarray([-20.0, 0.5, 20.0])
    up = jnp.asarray([20.0, -20.0, 3.0])
    out = np.asarray(clamped_swiglu(gate, up, 2.0))
    silu = lambda v: v / (1 + np.exp(-v))  # noqa: E731
    np.testing.assert_allclose(out, [silu(-20.0) * 2.0, silu(0.5) * -2.0, silu(2.0) * 2.0], rtol=1e-6)


def test_duplicate_and_unused_experts(load_case):
    """A token routed twice to one expert gets both contributions; empty groups are fine."""
    model = load_case("mixed")
    experts = model.layer(2).mlp.experts
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((5, model.cfg.hidden_size)), jnp.float32)
    idx = jnp.asarray([[3, 3]] * 5, jnp.int32)
    w = jnp.asarray(rng.random((5, 2)), jnp.float32)
    both = np.asarray(experts(x, w, idx))
    one = np.asarray(experts(x, w.sum(-1, keepdims=True), idx[:, :1]))
    np.testing.assert_allclose(both, one, rtol=1e-5, atol=1e-6)



@pytest.mark.parametrize("kernels", ["auto", "interpret"])
@pytest.mark.parametrize("expert_dtype", ["fp4", "fp8"])
def test_quantized_routed_experts_match_dequantized_matmul(expert_dtype, kernels):
    """RoutedExperts on low-precision storage (through the reference, or the interpreted GPU kernel)
    gives what the experts dequantized to bf16 first give, up to the order of the fp32 sums."""
    from flax import nnx

    from dsjax.config import ModelConfig, QuantConfig
    from dsjax.layers.experts import RoutedExperts, dense_experts, grouped_mlp

    quant = QuantConfig(weight_block_size=(128, 128), scale_fmt="ue8m0", expert_dtype=expert_dtype)
    cfg = ModelConfig.preset("tiny").replace(quantization=quant, hidden_size=128, moe_intermediate_size=128)
    experts = RoutedExperts(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
    experts.kernels = kernels
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((11, 128)), jnp.bfloat16)
    idx = jnp.asarray(np.argsort(rng.random((11, cfg.n_routed_experts)), -1)[:, :2], jnp.int32)
    w = jnp.asarray(rng.random((11, 2)), jnp.float32)
    dense = [dense_experts(*experts.stored(n), expert_dtype, cfg, jnp.bfloat16) for n in ("gate_up_proj", "down_proj")]
    got = np.asarray(experts(x, w, idx), np.float32)
    want = np.asarray(grouped_mlp(x, w, idx, *dense, cfg, kernels="reference"), np.float32)
    if kernels == "auto":  # the reference on CPU: the very same computation
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_allclose(got, want, rtol=2 ** -7, atol=2 ** -7 * np.abs(want).max())
