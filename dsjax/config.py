"""The DeepSeek-V4 model configuration: one frozen dataclass tree, read from and written to HF `config.json`.

`ModelConfig.from_hf` derives every field the way transformers 5.23.0's `DeepseekV4Config` does
(legacy keys included); `to_hf` writes the explicit, modern form that both reload identically.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Mapping

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
ATTENTION_TYPES = (SLIDING, CSA, HCA)
KERNEL_CHOICES = ("auto", "reference", "interpret")
HASH_MOE = "hash_moe"
MOE = "moe"
MLP_TYPES = (HASH_MOE, MOE)

# Legacy per-layer `compress_ratios` ints; only these three values exist.
_LEGACY_RATIO_TO_TYPE = {0: SLIDING, 4: CSA, 128: HCA}
_DEFAULT_COMPRESS_RATES = {CSA: 4, HCA: 128}
_DEFAULT_NUM_HASH_LAYERS = 3
_DEFAULT_PARTIAL_ROTARY = 64 / 512
_SCORING_FUNCS = ("sqrtsoftplus", "sigmoid")


class ConfigError(ValueError):
    """A config.json that does not describe a valid DeepSeek-V4 model."""


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """One rotary table (`main` or `compress`). YaRN fields are used only when `rope_type == "yarn"`."""

    theta: float
    partial_rotary_factor: float
    rope_type: str = "default"
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None

    def rope_dim(self, head_dim: int) -> int:
        """Rotated channels per head: taken from the *main* head_dim, also for the indexer."""
        return int(head_dim * self.partial_rotary_factor)

    def scaling(self) -> float:
        """The factor cos and sin are multiplied by (YaRN's attention factor; 1 otherwise)."""
        if self.rope_type != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return float(self.attention_factor)

        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if self.mscale and self.mscale_all_dim:
            return mscale(self.factor, self.mscale) / mscale(self.factor, self.mscale_all_dim)
        return mscale(self.factor)

    def to_hf(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "rope_type": self.rope_type,
            "rope_theta": self.theta,
            "partial_rotary_factor": self.partial_rotary_factor,
        }
        for f in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
                  "attention_factor", "mscale", "mscale_all_dim"):
            v = getattr(self, f)
            if v is not None:
                out[f] = v
        return out


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """How a checkpoint stores its weights (HF `quantization_config`, `quant_method: fp8`).

    Linears hold e4m3 weights with one scale per `weight_block_size` block (`scale_fmt` "float": fp32,
    "ue8m0": powers of two); routed experts are FP8 the same way or, with `expert_dtype` "fp4", e2m1
    packed two per byte with a ue8m0 scale per row per 32 inputs. Only dynamic activation scaling exists.
    """

    weight_block_size: tuple[int, int] = (128, 128)
    scale_fmt: str = "float"
    expert_dtype: str = "fp8"

    def __post_init__(self):
        if self.scale_fmt not in ("float", "ue8m0"):
            raise ConfigError(f"quantization_config.scale_fmt must be 'float' or 'ue8m0', got {self.scale_fmt!r}")
        if self.expert_dtype not in ("fp8", "fp4"):
            raise ConfigError(f"quantization_config.expert_dtype must be 'fp8' or 'fp4', got {self.expert_dtype!r}")
        if len(self.weight_block_size) != 2 or min(self.weight_block_size) <= 0:
            raise ConfigError("quantization_config.weight_block_size must be two positive ints, got "
                              f"{list(self.weight_block_size)}")

    @classmethod
    def from_hf(cls, raw: Mapping[str, Any], expert_dtype: str | None = None) -> "QuantConfig":
        """Read a `quantization_config` dict; a top-level `expert_dtype` fills in a missing one (as the
        reference copies it)."""
        method = raw.get("quant_method", "fp8")
        if method != "fp8":
            raise ConfigError(f"quantization_config.quant_method is {method!r}; dsjax reads only 'fp8' "
                              "(block-scaled e4m3, optionally with fp4 experts)")
        fmt = raw.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ConfigError(f"quantization_config.fmt is {fmt!r}; DeepSeek-V4 weights are 'e4m3'")
        scheme = raw.get("activation_scheme", "dynamic")
        if scheme != "dynamic":
            raise ConfigError(f"quantization_config.activation_scheme is {scheme!r}; only 'dynamic' is "
                              "supported (static activation scales are not part of DeepSeek-V4 checkpoints)")
        return cls(weight_block_size=tuple(int(b) for b in raw.get("weight_block_size") or (128, 128)),
                   scale_fmt=raw.get("scale_fmt") or "float",
                   expert_dtype=raw.get("expert_dtype") or expert_dtype or "fp8")

    def to_hf(self) -> dict[str, Any]:
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": list(self.weight_block_size), "scale_fmt": self.scale_fmt,
                "expert_dtype": self.expert_dtype}


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """The V4.1 image encoder (HF `vision_config`; dsjax's design, no public reference): a ViT over
    `patch_size`-pixel patches with 2-D rotary positions, whose `merge_size`² neighbouring patches are
    merged into one decoder embedding. An image of W×H pixels (multiples of `patch_size`, as
    deepseek-recipe preprocesses them) becomes `rows·(cols + 1) + 2` embeddings with
    `cols = ⌈W / patch_size / merge_size⌉`, `rows = ⌈H / patch_size / merge_size⌉`: one per merged cell,
    one closing each row, one opening and one closing the image (`layers/vision.py`)."""

    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    patch_size: int = 14
    merge_size: int = 3
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6

    def __post_init__(self):
        for name in ("hidden_size", "num_layers", "num_heads", "intermediate_size", "patch_size", "merge_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(f"vision_config.{name} must be a positive int, got {getattr(self, name)!r}")
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 4:
            raise ConfigError(f"vision_config.hidden_size ({self.hidden_size}) must split into num_heads "
                              f"({self.num_heads}) heads of a multiple of 4 (2-D rotary: half rows, half columns)")

    @classmethod
    def from_hf(cls, raw: Mapping[str, Any]) -> "VisionConfig":
        if not isinstance(raw, Mapping):
            raise ConfigError(f"vision_config must be a dict, got {type(raw).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ConfigError(f"vision_config has unknown keys {unknown}; known: {sorted(known)}")
        try:
            return cls(**raw)
        except TypeError as e:
            raise ConfigError(f"vision_config: {e}") from None

    def to_hf(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def grid(self, width: int, height: int) -> tuple[int, int]:
        """(rows, cols) of merged cells for a preprocessed W×H image."""
        cell = self.patch_size * self.merge_size
        return -(-height // cell), -(-width // cell)

    def image_tokens(self, width: int, height: int) -> int:
        """Decoder embeddings the encoder gives a preprocessed W×H image."""
        rows, cols = self.grid(width, height)
        return rows * (cols + 1) + 2


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Every field the DeepSeek-V4 forward pass reads. Build it with `from_hf` or `preset`."""

    vocab_size: int
    hidden_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    q_lora_rank: int
    num_experts_per_tok: int
    n_routed_experts: int
    scoring_func: str
    routed_scaling_factor: float
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    compress_rate_csa: int
    compress_rate_hca: int
    rope_main: RopeConfig
    rope_compress: RopeConfig
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    swiglu_limit: float
    sliding_window: int
    o_groups: int
    o_lora_rank: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    rms_norm_eps: float
    partial_rotary_factor: float = 64 / 512
    max_position_embeddings: int = 1048576
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 0
    eos_token_id: tuple[int, ...] = (1,)
    pad_token_id: int | None = None
    num_nextn_predict_layers: int = 1
    initializer_range: float = 0.02
    # Top-level HF keys kept as-is so that to_hf() round-trips them (e.g. rope_theta, n_shared_experts).
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    # None: weights in a float dtype. Otherwise the low-precision storage the weights keep on the device.
    quantization: QuantConfig | None = None
    # None: text only (V4-Flash). V4.1-Flash reads images through this encoder.
    vision: VisionConfig | None = None
    # Not architecture: how decode attention and the indexer run. "auto" uses the Pallas kernels on
    # GPUs and TPUs and the pure-JAX references elsewhere; "reference" uses the references everywhere;
    # "interpret" runs the GPU kernels interpreted (any backend; slow, for tests). Never written to HF.
    kernels: str = "auto"

    def __post_init__(self):
        self.validate()

    # ---------------------------------------------------------------- derived
    @property
    def qk_rope_head_dim(self) -> int:
        """The reference's runtime attribute; the rotated width itself comes from each rope table."""
        return int(self.head_dim * self.partial_rotary_factor)

    def rope_for(self, attention_type: str) -> RopeConfig:
        """Pure sliding layers use `main`; CSA/HCA layers use `compress` for queries and window keys."""
        return self.rope_main if attention_type == SLIDING else self.rope_compress

    def compress_rate(self, attention_type: str) -> int:
        return {CSA: self.compress_rate_csa, HCA: self.compress_rate_hca}[attention_type]

    @property
    def layer_kinds(self) -> tuple[tuple[str, str], ...]:
        return tuple(zip(self.layer_types, self.mlp_layer_types))

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    # ---------------------------------------------------------------- checks
    def validate(self) -> None:
        n = self.num_hidden_layers
        for name, types, allowed in (("layer_types", self.layer_types, ATTENTION_TYPES),
                                     ("mlp_layer_types", self.mlp_layer_types, MLP_TYPES)):
            if len(types) != n:
                raise ConfigError(f"num_hidden_layers ({n}) must equal len({name}) ({len(types)})")
            bad = sorted({t for t in types if t not in allowed})
            if bad:
                raise ConfigError(f"{name} entries must be one of {allowed}; got {bad}")
        if self.scoring_func not in _SCORING_FUNCS:
            raise ConfigError(f"scoring_func must be one of {_SCORING_FUNCS}; got {self.scoring_func!r}")
        if self.num_attention_heads % self.o_groups:
            raise ConfigError(f"num_attention_heads ({self.num_attention_heads}) is not divisible by "
                              f"o_groups ({self.o_groups})")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ConfigError(f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds "
                              f"n_routed_experts ({self.n_routed_experts})")
        for label, rope in (("main", self.rope_main), ("compress", self.rope_compress)):
            rd = rope.rope_dim(self.head_dim)
            limit = self.head_dim if label == "main" else min(self.head_dim, self.index_head_dim)
            if rd % 2 or rd <= 0 or rd > limit:
                raise ConfigError(f"rope '{label}' rotates {rd} channels: it must be even, positive and at "
                                  f"most {limit} (head_dim {self.head_dim}, index_head_dim {self.index_head_dim})")
            if rope.rope_type not in ("default", "yarn"):
                raise ConfigError(f"rope '{label}': rope_type {rope.rope_type!r} is not supported "
                                  "(DeepSeek-V4 uses 'default' or 'yarn')")
            if rope.rope_type == "yarn" and (rope.factor is None
                                             or rope.original_max_position_embeddings is None):
                raise ConfigError(f"rope '{label}' is YaRN but lacks 'factor' or "
                                  "'original_max_position_embeddings'")
        if self.kernels not in KERNEL_CHOICES:
            raise ConfigError(f"kernels must be one of {KERNEL_CHOICES}; got {self.kernels!r}")
        for t in set(self.layer_types) - {SLIDING}:
            if self.compress_rate(t) <= 0:
                raise ConfigError(f"compress rate for {t} must be positive")

    # ---------------------------------------------------------------- HF I/O
    @classmethod
    def from_hf(cls, path_or_dict: str | os.PathLike | Mapping[str, Any]) -> "ModelConfig":
        """Read a transformers `config.json` (a path to the file or its folder, or the parsed dict)."""
        if isinstance(path_or_dict, Mapping):
            raw = dict(path_or_dict)
        else:
            p = os.fspath(path_or_dict)
            if os.path.isdir(p):
                p = os.path.join(p, "config.json")
            with open(p) as f:
                raw = json.load(f)
        mt = raw.get("model_type", "deepseek_v4")
        if mt != "deepseek_v4":
            raise ConfigError(f"model_type is {mt!r}; dsjax reads only 'deepseek_v4' configs")
        return cls(**_derive(raw))

    def to_hf(self) -> dict[str, Any]:
        """The transformers `config.json` dict (explicit layer types and nested rope parameters)."""
        return {
            "model_type": "deepseek_v4",
            "architectures": ["DeepseekV4ForCausalLM"],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "moe_intermediate_size": self.moe_intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": 1,
            "head_dim": self.head_dim,
            "q_lora_rank": self.q_lora_rank,
            "num_experts_per_tok": self.num_experts_per_tok,
            "n_routed_experts": self.n_routed_experts,
            "n_shared_experts": 1,
            "scoring_func": self.scoring_func,
            "routed_scaling_factor": self.routed_scaling_factor,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rope_theta,
            "compress_rope_theta": self.compress_rope_theta,
            "layer_types": list(self.layer_types),
            "mlp_layer_types": list(self.mlp_layer_types),
            "compress_rates": {CSA: self.compress_rate_csa, HCA: self.compress_rate_hca},
            "rope_parameters": {"main": self.rope_main.to_hf(), "compress": self.rope_compress.to_hf()},
            "partial_rotary_factor": self.partial_rotary_factor,
            "hc_mult": self.hc_mult,
            "hc_sinkhorn_iters": self.hc_sinkhorn_iters,
            "hc_eps": self.hc_eps,
            "swiglu_limit": self.swiglu_limit,
            "sliding_window": self.sliding_window,
            "o_groups": self.o_groups,
            "o_lora_rank": self.o_lora_rank,
            "index_n_heads": self.index_n_heads,
            "index_head_dim": self.index_head_dim,
            "index_topk": self.index_topk,
            "num_nextn_predict_layers": self.num_nextn_predict_layers,
            "rms_norm_eps": self.rms_norm_eps,
            "initializer_range": self.initializer_range,
            "hidden_act": "silu",
            "mlp_bias": self.mlp_bias,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_id) if len(self.eos_token_id) != 1 else self.eos_token_id[0],
            "pad_token_id": self.pad_token_id,
            **({"quantization_config": self.quantization.to_hf()} if self.quantization else {}),
            **({"vision_config": self.vision.to_hf()} if self.vision else {}),
        }

    @classmethod
    def preset(cls, name: str) -> "ModelConfig":
        """A named preset (`tiny`, `v4-flash`, `v4.1-flash`); presets are HF config dicts."""
        from dsjax.presets import PRESETS

        if name not in PRESETS:
            raise ConfigError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}")
        return cls.from_hf(PRESETS[name])


# ------------------------------------------------------------------------------------------ derivation
def _derive(raw: dict[str, Any]) -> dict[str, Any]:
    """Map a raw HF dict to ModelConfig kwargs, mirroring DeepseekV4Config.__post_init__."""
    g = raw.get
    n = int(g("num_hidden_layers", 43))
    head_dim = int(g("head_dim", 512))
    act = g("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"hidden_act {act!r} is not supported; DeepSeek-V4 uses 'silu'")
    kv_heads = g("num_key_value_heads", 1)
    if kv_heads not in (1, None):
        # The reference never reads it (one shared KV head always); say so rather than mislead.
        raise ConfigError(f"num_key_value_heads is {kv_heads}; DeepSeek-V4 attention has one shared KV head")

    rates = dict(_DEFAULT_COMPRESS_RATES)
    if g("compress_rates") is not None:
        rates = dict(g("compress_rates"))
    if g("compress_rate_csa") is not None:
        rates[CSA] = g("compress_rate_csa")
    if g("compress_rate_hca") is not None:
        rates[HCA] = g("compress_rate_hca")

    layer_types = g("layer_types")
    if layer_types is None and g("compress_ratios") is not None:
        try:
            layer_types = [_LEGACY_RATIO_TO_TYPE[int(r)] for r in g("compress_ratios")]
        except KeyError as e:
            raise ConfigError(f"compress_ratios may hold only 0, 4 or 128; got {e.args[0]}") from None
    if layer_types is None:
        layer_types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
    layer_types = tuple(layer_types[:n])

    mlp_types = g("mlp_layer_types")
    if mlp_types is None:
        n_hash = g("num_hash_layers")
        n_hash = _DEFAULT_NUM_HASH_LAYERS if n_hash is None else int(n_hash)
        mlp_types = [HASH_MOE] * min(n, n_hash) + [MOE] * max(0, n - n_hash)
    mlp_types = tuple(mlp_types[:n])

    given_prf = g("partial_rotary_factor")
    legacy_rope_dim = g("qk_rope_head_dim")
    if given_prf is not None:
        prf = float(given_prf)
    elif legacy_rope_dim is not None:
        prf = legacy_rope_dim / head_dim
    else:
        prf = _DEFAULT_PARTIAL_ROTARY
    rope_theta = float(g("rope_theta", 10000.0))
    compress_theta = float(g("compress_rope_theta", 160000.0))
    max_pos = int(g("max_position_embeddings", 1048576))
    main, compress = _derive_rope(raw, rope_theta, compress_theta, given_prf, prf, max_pos)

    eos = g("eos_token_id", 1)
    eos = () if eos is None else (tuple(int(e) for e in eos) if isinstance(eos, (list, tuple)) else (int(eos),))
    n_experts = g("n_routed_experts", g("num_local_experts", 256))
    qc = g("quantization_config")
    if qc is not None and not isinstance(qc, Mapping):
        raise ConfigError(f"quantization_config must be a dict, got {type(qc).__name__}")
    vc = g("vision_config")
    return dict(
        quantization=QuantConfig.from_hf(qc, g("expert_dtype")) if qc else None,
        vision=VisionConfig.from_hf(vc) if vc is not None else None,
        vocab_size=int(g("vocab_size", 129280)),
        hidden_size=int(g("hidden_size", 4096)),
        moe_intermediate_size=int(g("moe_intermediate_size", g("intermediate_size", 2048))),
        num_hidden_layers=n,
        num_attention_heads=int(g("num_attention_heads", 64)),
        head_dim=head_dim,
        q_lora_rank=int(g("q_lora_rank", 1024)),
        num_experts_per_tok=int(g("num_experts_per_tok", 6)),
        n_routed_experts=int(n_experts),
        scoring_func=g("scoring_func", "sqrtsoftplus"),
        routed_scaling_factor=float(g("routed_scaling_factor", 1.5)),
        layer_types=layer_types,
        mlp_layer_types=mlp_types,
        compress_rate_csa=int(rates[CSA]),
        compress_rate_hca=int(rates[HCA]),
        rope_main=main,
        rope_compress=compress,
        hc_mult=int(g("hc_mult", 4)),
        hc_sinkhorn_iters=int(g("hc_sinkhorn_iters", 20)),
        hc_eps=float(g("hc_eps", 1e-6)),
        swiglu_limit=float(g("swiglu_limit", 10.0)),
        sliding_window=int(g("sliding_window", 128)),
        o_groups=int(g("o_groups", 8)),
        o_lora_rank=int(g("o_lora_rank", 1024)),
        index_n_heads=int(g("index_n_heads", 64)),
        index_head_dim=int(g("index_head_dim", 128)),
        index_topk=int(g("index_topk", 512)),
        rms_norm_eps=float(g("rms_norm_eps", 1e-6)),
        partial_rotary_factor=prf,
        max_position_embeddings=max_pos,
        mlp_bias=bool(g("mlp_bias", False)),
        tie_word_embeddings=bool(g("tie_word_embeddings", False)),
        bos_token_id=g("bos_token_id", 0),
        eos_token_id=eos,
        pad_token_id=g("pad_token_id"),
        num_nextn_predict_layers=int(g("num_nextn_predict_layers", 1)),
        initializer_range=float(g("initializer_range", 0.02)),
        rope_theta=rope_theta,
        compress_rope_theta=compress_theta,
    )


def _derive_rope(raw, rope_theta, compress_theta, given_prf, prf, max_pos) -> tuple[RopeConfig, RopeConfig]:
    """Build (main, compress) as the reference does: a flat (YaRN) dict reaches only `compress`."""
    rp = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    rp = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in rp.items()}
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        subs = {}
        for label in ("main", "compress"):
            d = rp[label]
            d.setdefault("rope_type", d.get("type", "default"))
            d.setdefault("rope_theta", rope_theta)
            if given_prf is not None:
                d.setdefault("partial_rotary_factor", given_prf)
            if d["rope_type"] == "yarn":
                d.setdefault("original_max_position_embeddings", max_pos)
            subs[label] = d
        main_d, comp_d = subs["main"], subs["compress"]
        main_d.setdefault("partial_rotary_factor", 1.0)
        comp_d.setdefault("partial_rotary_factor", 1.0)
    else:
        flat = {k: v for k, v in rp.items() if k not in ("main", "compress")}
        if flat or rope_theta:
            flat.setdefault("rope_type", flat.get("type", "default"))
            if flat["rope_type"] == "yarn":
                if raw.get("original_max_position_embeddings") is not None:
                    flat["original_max_position_embeddings"] = raw["original_max_position_embeddings"]
                else:
                    flat.setdefault("original_max_position_embeddings", max_pos)
        main_d = {"rope_type": "default", "rope_theta": rope_theta, "partial_rotary_factor": prf}
        comp_d = {**flat, "rope_theta": compress_theta, "partial_rotary_factor": prf}
        comp_d.setdefault("rope_type", "default")
        if comp_d["rope_type"] == "yarn":
            comp_d.setdefault("attention_factor", 1.0)
    return _rope_from_dict(main_d, max_pos), _rope_from_dict(comp_d, max_pos)


def _rope_from_dict(d: Mapping[str, Any], max_pos: int) -> RopeConfig:
    def opt(key, typ):
        v = d.get(key)
        return None if v is None else typ(v)

    rope_type = d.get("rope_type", d.get("type", "default"))
    factor = opt("factor", float)
    omax = opt("original_max_position_embeddings", int)
    if rope_type == "yarn" and factor is None and omax:
        factor = max_pos / omax  # what the reference falls back to
    return RopeConfig(
        theta=float(d["rope_theta"]),
        partial_rotary_factor=float(d.get("partial_rotary_factor", 1.0)),
        rope_type=rope_type,
        factor=factor,
        original_max_position_embeddings=omax,
        beta_fast=opt("beta_fast", float),
        beta_slow=opt("beta_slow", float),
        attention_factor=opt("attention_factor", float),
        mscale=opt("mscale", float),
        mscale_all_dim=opt("mscale_all_dim", float),
    )
