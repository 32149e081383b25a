"""Parameter counts and memory of a model, from abstract shapes alone (nothing is allocated)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsjax.config import ModelConfig
from dsjax.layers.decoder_layer import DecoderLayer
from dsjax.model import DeepseekV4
from dsjax.quantize import V4_QUANT

COMPONENTS = ("embedding", "attention", "compressor", "indexer", "mhc", "norms", "router",
              "routed_experts", "shared_expert", "head", "vision")
# The stored formats `model_info` sizes: DeepSeek's FP8 release format with FP8 or FP4 routed experts.
FP8_STORAGE = replace(V4_QUANT, expert_dtype="fp8")


def component(path: str) -> str:
    """The component a variable path belongs to (for the breakdown)."""
    if path.startswith("vision."):
        return "vision"
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
    """Counts per component, per-token-active count, and the bytes of the weights as dsjax holds them in
    bf16, in FP8 (ue8m0 block scales) and in FP8 with FP4 routed experts; modules the reference keeps in
    fp32 or bf16 count at that width."""
    info = ModelInfo()
    float_cfg = cfg.replace(quantization=None)
    frac_inactive = 1 - cfg.num_experts_per_tok / cfg.n_routed_experts
    for path, var, copies in _abstract_variables(float_cfg):
        if not isinstance(var, nnx.Param):  # buffers (tid2eid, correction bias): memory, not parameters
            continue
        name = ".".join(str(p) for p in path)
        n = math.prod(var.get_value().shape)
        comp = component(name)
        info.total += copies * n
        info.by_component[comp] += copies * n
        # active per text token: the routed experts a token picks, and no image encoder
        info.active += 0 if comp == "vision" else copies * (
            n - (round(n * frac_inactive) if comp == "routed_experts" else 0))
    info.bytes_bf16 = _bytes(float_cfg)
    info.bytes_fp8 = _bytes(cfg.replace(quantization=FP8_STORAGE))
    info.bytes_fp4_experts = _bytes(cfg.replace(quantization=V4_QUANT))
    return info


def _bytes(cfg: ModelConfig) -> int:
    return sum(copies * math.prod(var.get_value().shape) * np.dtype(var.get_value().dtype).itemsize
               for _, var, copies in _abstract_variables(cfg))


# ---------------------------------------------------------------------------------------------- V4.1
V41_COMPONENTS = ("embedding", "head", "attention", "compressor", "indexer", "mhc", "norms", "router",
                  "routed_experts", "shared_expert", "engram_tables", "engram_projections", "dspark", "vision")
_BYTES = {"bf16": 2.0, "fp32": 4.0, "fp8": 1.0, "fp8_rows": 1.0, "fp4": 0.5}


def v41_component(name: str) -> str:
    """The component a release tensor belongs to."""
    if name.startswith("mtp."):
        return "dspark"
    if name.startswith(("vision.", "aligner.", "image_")):
        return "vision"
    for prefix, comp in (("embed.", "embedding"), ("head.", "head"), ("norm.", "norms")):
        if name.startswith(prefix):
            return comp
    tail = name.split(".", 2)[2]
    if tail.startswith("engram.embed"):
        return "engram_tables"
    if tail.startswith("engram."):
        return "engram_projections"
    if tail.startswith("hc_"):
        return "mhc"
    if tail.startswith("attn.compressor."):
        return "compressor"
    if tail.startswith("attn.indexer."):
        return "indexer"
    if tail.startswith("attn."):
        return "attention"
    if tail.startswith("ffn.gate."):
        return "router"
    if tail.startswith("ffn.experts."):
        return "routed_experts"
    if tail.startswith("ffn.shared_experts."):
        return "shared_expert"
    if tail.endswith("_norm.weight"):
        return "norms"
    raise ValueError(f"no component for {name}")


@dataclass
class V41Info:
    by_component: dict[str, int] = field(default_factory=lambda: dict.fromkeys(V41_COMPONENTS, 0))
    active: int = 0  # per decode token of text: the picked experts, 2 · 24 Engram rows, no DSpark, no vision
    release_bytes: float = 0.0  # the release's storage (FP8 32 × 32, FP4 experts, FP8 tables), scales included

    @property
    def backbone(self) -> int:
        """The text model without Engram, DSpark and the image encoder (the release's "552B")."""
        skip = ("engram_tables", "engram_projections", "dspark", "vision")
        return sum(n for c, n in self.by_component.items() if c not in skip)

    @property
    def engram(self) -> int:
        return self.by_component["engram_tables"] + self.by_component["engram_projections"]

    @property
    def total(self) -> int:
        return sum(self.by_component.values())


def v41_model_info(cfg) -> V41Info:
    """Parameter counts of a DeepSeek-V4.1 config by component, from the release's tensor list
    (`checkpoint.names_v41.release_shapes`), and the bytes of the release's storage."""
    from dsjax.checkpoint.names_v41 import release_shapes

    info = V41Info()
    frac = cfg.num_experts_per_tok / cfg.n_routed_experts
    for name, (shape, kind) in release_shapes(cfg).items():
        n = math.prod(shape)
        comp = v41_component(name)
        info.by_component[comp] += n
        if comp == "routed_experts":
            info.active += round(n * frac)
        elif comp == "engram_tables":
            info.active += cfg.engram_hash_heads * shape[1]
        elif comp not in ("dspark", "vision"):
            info.active += n
        scales = 0.0
        if kind == "fp8":
            scales = math.ceil(shape[0] / 32) * math.ceil(shape[1] / 32)
        elif kind in ("fp4", "fp8_rows"):
            scales = shape[0] * math.ceil(shape[1] / 32)
        info.release_bytes += n * _BYTES[kind] + scales
    return info


def v41_cache_bytes(cfg, kv_dtype: str = "fp4") -> dict[str, float]:
    """Cache bytes per token of the release's formats (`dsjax.cache_formats.V41_STORAGE`): the global part
    (compressed entries and index keys of the KV sources) per token of context, and the per-sequence window
    rings. `kv_dtype` as the cache's (`dsjax.cache.v41_layer_cache`): "fp4" (NVFP4 entries, the release's
    default) or "fp8" (MXFP8 entries)."""
    from dsjax.cache_formats import v41_row_bytes

    window_row, entry, key = v41_row_bytes(kv_dtype, cfg.head_dim, cfg.index_head_dim)
    roles = cfg.layer_roles()
    global_bytes = sum((entry + key) / r.ratio for r in roles if r.mode == "full")
    window = len(roles) * cfg.sliding_window * window_row
    return {"global_per_token": global_bytes, "entries_per_token": sum(entry / r.ratio for r in roles
                                                                          if r.mode == "full"),
            "index_keys_per_token": sum(key / r.ratio for r in roles if r.mode == "full"),
            "windows_per_sequence": float(window)}
