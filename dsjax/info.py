"""Parameter counts and memory of a model, from abstract shapes alone (nothing is allocated)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsjax.config import ModelConfig
from dsjax.layers.decoder_layer import DecoderLayer
from dsjax.model import DeepseekV4

COMPONENTS = ("embedding", "attention", "compressor", "indexer", "mhc", "norms", "router",
              "routed_experts", "shared_expert", "head")
# Linears that FP8 checkpoints keep in bf16 (the reference's skip list): compressor/indexer
# projections and the indexer's head weights; the router weight and lm_head are not linears there.
_FP8_SKIP = ("compressor.kv_proj", "compressor.gate_proj", "indexer.kv_proj", "indexer.gate_proj",
             "scorer.weights_proj")
_FP8_BLOCK = 128
_FP4_GROUP = 32


def component(path: str) -> str:
    """The component a variable path belongs to (for the breakdown)."""
    if path.startswith("embed_tokens"):
        return "embedding"
    if path.startswith("lm_head"):
        return "head"
    if "hc_head" in path or path.startswith(("attn_hc", "ffn_hc")):
        return "mhc"
    if ".indexer." in path:
        return "indexer"
    if ".compressor." in path:
        return "compressor"
    if path.startswith("self_attn."):
        return "attention"
    if path.startswith("mlp.gate."):
        return "router"
    if path.startswith("mlp.experts."):
        return "routed_experts"
    if path.startswith("mlp.shared_experts."):
        return "shared_expert"
    if path.endswith("layernorm.weight") or path == "norm.weight":
        return "norms"
    raise ValueError(f"no component for {path}")


@dataclass
class ModelInfo:
    total: int = 0
    active: int = 0
    by_component: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COMPONENTS, 0))
    bytes_bf16: int = 0
    bytes_fp8: int = 0
    bytes_fp4_experts: int = 0

    def summary(self) -> str:
        return (f"total {self.total / 1e9:.2f}B parameters ({self.total:,}), "
                f"active per token {self.active / 1e9:.2f}B ({self.active:,}); "
                f"bf16 {_gib(self.bytes_bf16)}, fp8 {_gib(self.bytes_fp8)}, "
                f"fp8+fp4 experts {_gib(self.bytes_fp4_experts)}")


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def _fp8_bytes(shape) -> int:
    rows, cols = shape[-2:]
    lead = math.prod(shape[:-2])
    return lead * (rows * cols + math.ceil(rows / _FP8_BLOCK) * math.ceil(cols / _FP8_BLOCK))  # ue8m0 scales


def _fp4_bytes(shape) -> int:
    # Experts are [E, in, out] here; FP4 packs two codes per byte with one ue8m0 scale per 32 inputs.
    n = math.prod(shape)
    return n // 2 + n // _FP4_GROUP


def _abstract_variables(cfg: ModelConfig):
    """(path, Variable of ShapeDtypeStruct, copies) for the whole model: the layer-free parts once and
    one abstract layer per distinct (attention, MLP) kind, counted as often as the kind occurs."""
    top = nnx.eval_shape(lambda: DeepseekV4(cfg.replace(num_hidden_layers=0, layer_types=(), mlp_layer_types=()),
                                            rngs=nnx.Rngs(0), dtype=jnp.bfloat16))
    yield from ((path, var, 1) for path, var in nnx.to_flat_state(nnx.state(top)))
    for kind in sorted(set(cfg.layer_kinds)):
        layer = nnx.eval_shape(lambda kind=kind: DecoderLayer(cfg, *kind, rngs=nnx.Rngs(0), dtype=jnp.bfloat16))
        copies = cfg.layer_kinds.count(kind)
        yield from ((path, var, copies) for path, var in nnx.to_flat_state(nnx.state(layer)))


def model_info(cfg: ModelConfig) -> ModelInfo:
    """Counts per component, per-token-active count and bytes at bf16 / FP8 / FP8 with FP4 experts."""
    info = ModelInfo()
    frac_inactive = 1 - cfg.num_experts_per_tok / cfg.n_routed_experts
    for path, var, copies in _abstract_variables(cfg):
        sds = var.get_value()
        name = ".".join(str(p) for p in path)
        n = math.prod(sds.shape)
        nbytes = n * np.dtype(sds.dtype).itemsize
        if not isinstance(var, nnx.Param):  # buffers (tid2eid, correction bias): memory, not parameters
            for attr in ("bytes_bf16", "bytes_fp8", "bytes_fp4_experts"):
                setattr(info, attr, getattr(info, attr) + copies * nbytes)
            continue
        comp = component(name)
        info.total += copies * n
        info.by_component[comp] += copies * n
        info.active += copies * (n - (round(n * frac_inactive) if comp == "routed_experts" else 0))
        info.bytes_bf16 += copies * nbytes
        is_linear = name.endswith(".weight") and comp not in ("embedding", "head", "router", "norms") \
            and len(sds.shape) == 2
        fp8 = _fp8_bytes(sds.shape) if (is_linear and not any(s in name for s in _FP8_SKIP)) \
            or comp == "routed_experts" else nbytes
        info.bytes_fp8 += copies * fp8
        info.bytes_fp4_experts += copies * (_fp4_bytes(sds.shape) if comp == "routed_experts" else fp8)
    return info
