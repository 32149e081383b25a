"""`quantize_model`: a float DeepseekV4 → the same model holding DeepSeek's FP8/FP4 weight storage.

Used to make FP8 checkpoints of small models (tests, the embedded model) and by users who fine-tune
in float and ship FP8. What stays float follows the reference: norms, mHC, sinks, biases, router,
embedding, head, the compressors' and indexer's own projections and `weights_proj`.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from dsjax.config import QuantConfig
from dsjax.layers.experts import EXPERT_LEAVES, quantize_experts
from dsjax.layers.linear import quantize_weight
from dsjax.model import DeepseekV4

# What DeepSeek-V4 releases use: power-of-two scales and FP4 routed experts.
V4_QUANT = QuantConfig(weight_block_size=(128, 128), scale_fmt="ue8m0", expert_dtype="fp4")
# And DeepSeek-V4.1's: 32x32 blocks.
V41_QUANT = QuantConfig(weight_block_size=(32, 32), scale_fmt="ue8m0", expert_dtype="fp4")


def scale_leaf(leaf: str) -> str:
    """The variable holding the scales of weight variable `leaf`."""
    return f"{leaf}_scale_inv"


def quantize_model(model: DeepseekV4, quant: QuantConfig = V4_QUANT) -> DeepseekV4:
    """A new model with `quant` storage whose dequantized weights are `model`'s, quantized once."""
    if model.cfg.quantization is not None:
        raise ValueError("the model is already quantized; quantize its float original instead")
    cfg = model.cfg.replace(quantization=quant)
    abstract = nnx.eval_shape(lambda: DeepseekV4(cfg, rngs=nnx.Rngs(0), dtype=model.dtype))
    graphdef, state = nnx.split(abstract)
    flat = list(nnx.to_flat_state(state))
    source = {path: var.get_value() for path, var in nnx.to_flat_state(nnx.state(model))}
    values = {}
    for path, var in flat:
        if path in values or path[-1].endswith("_scale_inv"):
            continue
        want, have = var.get_value(), source[path]
        if want.dtype == have.dtype:
            values[path] = have
            continue
        quantizer = quantize_experts if path[-1] in EXPERT_LEAVES else quantize_weight
        values[path], values[path[:-1] + (scale_leaf(path[-1]),)] = quantizer(have, quant)
    for path, var in flat:
        v = values[path]
        if v.shape != var.get_value().shape or v.dtype != var.get_value().dtype:
            raise AssertionError(f"{path}: made {v.dtype}{v.shape}, expected {var.get_value()}")
        var.set_value(jnp.asarray(v))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def dequantize_model(model: DeepseekV4, dtype=None) -> DeepseekV4:
    """The float model (weights in `dtype`, default the model's) equal to `model`'s dequantized weights."""
    if model.cfg.quantization is None:
        raise ValueError("the model is not quantized")
    dtype = dtype or model.dtype
    cfg = model.cfg.replace(quantization=None)
    abstract = nnx.eval_shape(lambda: DeepseekV4(cfg, rngs=nnx.Rngs(0), dtype=dtype))
    graphdef, state = nnx.split(abstract)
    flat = list(nnx.to_flat_state(state))
    dense = {}
    for path, module in nnx.iter_graph(model):
        if hasattr(module, "dense_weight") and getattr(module, "block", None) is not None:
            dense[tuple(path) + ("weight",)] = module.dense_weight(jnp.float32)
        elif hasattr(module, "expert_weights") and module.storage is not None:
            for leaf in EXPERT_LEAVES:
                dense[tuple(path) + (leaf,)] = module.expert_weights(leaf, jnp.float32)
    source = {path: var.get_value() for path, var in nnx.to_flat_state(nnx.state(model))}
    for path, var in flat:
        want = var.get_value()
        v = dense.get(path, source.get(path))
        var.set_value(jnp.asarray(v).astype(want.dtype))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))
