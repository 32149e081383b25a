"""The DeepSeek-V4.1 model configuration: one frozen dataclass tree, read from and written to the release's
nested `config.json` (top level, `text_config`, `vision_config`, `quantization_config`).

Field names follow the release's `text_config` keys; where a V4 layer is shared (attention core, RoPE,
experts, mHC mixing) the field it reads has the name `ModelConfig` gives it, so one module serves both.
`layer_roles()` derives each layer's part in CSA2's cross-layer sharing from the source lists, as
DeepInfer's `_source_map` does (the nearest source not later than the layer).
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Mapping

from dsjax.config import ConfigError, ImageGrid, QuantConfig, RopeConfig, _Fields, _convert, _read_config

SLIDING_ONLY = "sliding"
FULL = "full"  # owns a compressor and index keys, selects its own top-k
REINDEX = "reindex"  # attends a source's entries with a selection of its own
REUSE = "reuse"  # attends a source's entries with the selection of the layer before it
MODES = (SLIDING_ONLY, FULL, REINDEX, REUSE)


@dataclasses.dataclass(frozen=True)
class LayerRole:
    """What one layer computes and shares (`V41Config.layer_roles`)."""

    index: int
    ratio: int  # 0 (window only), 1 or 2: tokens per compressed entry
    mode: str  # one of MODES
    kv_source: int | None  # the layer whose compressed entries and index keys this layer reads
    uses_candidates: bool  # a Reindex layer's selection is restricted to the candidate source's pool
    candidate_source: bool  # this layer's scores choose the candidate pool
    engram: int | None  # position in `engram_layer_ids` when Engram writes into the streams before it


@dataclasses.dataclass(frozen=True)
class V41VisionConfig(ImageGrid):
    """The release's `vision_config` (the ViT and its image sizing); `num_hidden_layers` 0 means text only."""

    num_hidden_layers: int = 32
    hidden_size: int = 1024
    num_attention_heads: int = 16
    intermediate_size: int = 2816
    patch_size: int = 14
    rope_theta: float = 10000.0
    downsample_ratio: int = 3
    max_image_tokens: int = 1024
    min_pixels: int = 295936
    max_wh_ratio: float | None = None

    @classmethod
    def from_hf(cls, raw: Mapping[str, Any]) -> "V41VisionConfig":
        raw = {k: v for k, v in _convert("vision_config", raw, "dict").items() if k != "model_type"}
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ConfigError(f"vision_config has unknown keys {unknown}; known: {sorted(known)}")
        f = _Fields(raw, "vision_config.")
        values = {}
        for k in raw:
            if k == "max_wh_ratio":
                values[k] = f.get(k, "number", nullable=True)
            elif k == "rope_theta":
                values[k] = f.get(k, "number")
            else:
                values[k] = f.get(k, "int", minimum=0 if k == "num_hidden_layers" else 1)
        out = cls(**values)
        if out.num_hidden_layers and (out.hidden_size % out.num_attention_heads
                                      or (out.hidden_size // out.num_attention_heads) % 4):
            raise ConfigError(f"vision_config.hidden_size ({out.hidden_size}) must split into num_attention_heads "
                              f"({out.num_attention_heads}) heads of a multiple of 4 channels (2-D rotary)")
        return out

    def to_hf(self) -> dict[str, Any]:
        return {"model_type": "deepseek_v41_vision", **dataclasses.asdict(self)}

    @property
    def merge_size(self) -> int:
        """Patches per side of the cell that becomes one decoder embedding."""
        return self.downsample_ratio

    # Pixels x map to bf16((x/255 − 0.5)/0.5) (computed in fp32, as the release's lookup table); a patch
    # flattens (channel, y, x).
    pixel_format = "v4.1"

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


@dataclasses.dataclass(frozen=True)
class V41Config:
    """Every field the DeepSeek-V4.1 forward pass reads. Build it with `from_hf` or `preset`."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    swiglu_limit: float
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: tuple[tuple[str, Any], ...]  # the release's dict, as sorted items (hashable)
    compress_rope_theta: float
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    scoring_func: str
    routed_scaling_factor: float
    sliding_window: int
    compress_ratios: tuple[int, ...]  # one per layer, then one per DSpark stage
    kv_source_layer_ids: tuple[int, ...]
    index_source_layer_ids: tuple[int, ...]
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    candidate_source_layer_id: int  # −1: no candidate pool
    candidate_topk_blocks: int
    candidate_block_size: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    engram_layer_ids: tuple[int, ...]
    engram_num_embeddings: tuple[int, ...]
    engram_max_ngram_size: int
    engram_vocab_size: int
    engram_n_heads: int
    engram_head_dim: int
    engram_pad_token_id: int
    engram_compressed_vocab_size: int
    num_nextn_predict_layers: int
    dspark_block_size: int
    dspark_noise_token_id: int
    dspark_target_layer_ids: tuple[int, ...]
    dspark_markov_rank: int
    dspark_n_routed_experts: int
    dspark_num_experts_per_tok: int
    image_token_id: int
    bos_token_id: int | None = 0
    eos_token_id: tuple[int, ...] = (1,)
    pad_token_id: int | None = 2
    initializer_range: float = 0.02
    quantization: QuantConfig | None = None
    vision: V41VisionConfig | None = None

    def __post_init__(self):
        self.validate()

    # ------------------------------------------------------------------ what the shared layers read
    family = "v4.1"
    tie_word_embeddings = False
    q_head_norm = False  # V4's per-head query RMSNorm is gone
    mlp_bias = False

    @property
    def partial_rotary_factor(self) -> float:
        return self.qk_rope_head_dim / self.head_dim

    @property
    def rope_main(self) -> RopeConfig:
        """The window-only layers' table (and DSpark's): theta 10000, no YaRN."""
        return RopeConfig(theta=self.rope_theta, partial_rotary_factor=self.partial_rotary_factor)

    @property
    def rope_compress(self) -> RopeConfig:
        """Every compressed layer's table, ratio 1 included: YaRN on frequencies only (no attention factor)."""
        s = dict(self.rope_scaling)
        if s.get("rope_type", s.get("type")) != "yarn":
            return RopeConfig(theta=self.compress_rope_theta, partial_rotary_factor=self.partial_rotary_factor)
        return RopeConfig(theta=self.compress_rope_theta, partial_rotary_factor=self.partial_rotary_factor,
                          rope_type="yarn", factor=float(s["factor"]),
                          original_max_position_embeddings=int(s["original_max_position_embeddings"]),
                          beta_fast=float(s.get("beta_fast", 32)), beta_slow=float(s.get("beta_slow", 1)),
                          attention_factor=1.0)

    def rope_for_ratio(self, ratio: int) -> RopeConfig:
        return self.rope_main if ratio == 0 else self.rope_compress

    @property
    def first_decoder_layer(self) -> int:
        """The causal encoder-decoder's boundary: the first ratio-1 layer (DeepInfer's `n_prefill_layer`);
        `num_hidden_layers` when no layer has ratio 1."""
        return next((i for i, r in enumerate(self.compress_ratios[:self.num_hidden_layers]) if r == 1),
                    self.num_hidden_layers)

    @property
    def engram_hash_heads(self) -> int:
        return (self.engram_max_ngram_size - 1) * self.engram_n_heads

    def layer_roles(self) -> tuple[LayerRole, ...]:
        roles, kv_source = [], None
        for i, ratio in enumerate(self.compress_ratios[:self.num_hidden_layers]):
            engram = self.engram_layer_ids.index(i) if i in self.engram_layer_ids else None
            if ratio == 0:
                roles.append(LayerRole(i, 0, SLIDING_ONLY, None, False, False, engram))
                continue
            if i in self.kv_source_layer_ids:
                kv_source = i
            indexes = i in self.index_source_layer_ids
            mode = FULL if kv_source == i else REINDEX if indexes else REUSE
            cand = self.candidate_source_layer_id
            roles.append(LayerRole(i, ratio, mode, kv_source,
                                   uses_candidates=mode == REINDEX and 0 <= cand < i,
                                   candidate_source=i == cand, engram=engram))
        return tuple(roles)

    def replace(self, **changes: Any) -> "V41Config":
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------------------------- checks
    def validate(self) -> None:
        n = self.num_hidden_layers
        if self.num_attention_heads % self.o_groups:
            raise ConfigError(f"num_attention_heads ({self.num_attention_heads}) is not divisible by o_groups "
                              f"({self.o_groups})")
        rd = self.qk_rope_head_dim
        if rd % 2 or rd > min(self.head_dim, self.index_head_dim):
            raise ConfigError(f"qk_rope_head_dim ({rd}) must be even and at most head_dim ({self.head_dim}) and "
                              f"index_head_dim ({self.index_head_dim})")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ConfigError(f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds n_routed_experts "
                              f"({self.n_routed_experts})")
        if self.scoring_func != "sqrtsoftplus":
            raise ConfigError(f"scoring_func is {self.scoring_func!r}; DeepSeek-V4.1 routes with 'sqrtsoftplus'")
        if len(self.compress_ratios) < n:
            raise ConfigError(f"compress_ratios has {len(self.compress_ratios)} entries for {n} layers")
        bad = sorted({r for r in self.compress_ratios if r not in (0, 1, 2)})
        if bad:
            raise ConfigError(f"compress_ratios may hold only 0, 1 or 2 in DeepSeek-V4.1; got {bad}")
        for name in ("kv_source_layer_ids", "index_source_layer_ids", "engram_layer_ids"):
            ids = list(getattr(self, name))
            if ids != sorted(set(ids)):
                raise ConfigError(f"{name} must be strictly increasing, got {ids}")
            if any(i >= n for i in ids):
                raise ConfigError(f"{name} {ids} names a layer past num_hidden_layers ({n})")
        if not set(self.kv_source_layer_ids) <= set(self.index_source_layer_ids):
            raise ConfigError(f"every KV source must be an index source: kv_source_layer_ids "
                              f"{list(self.kv_source_layer_ids)}, index_source_layer_ids "
                              f"{list(self.index_source_layer_ids)}")
        owner_ratio = None
        for i, ratio in enumerate(self.compress_ratios[:n]):
            if ratio == 0:
                if i in self.index_source_layer_ids:
                    raise ConfigError(f"layer {i} has compress ratio 0 but is listed as a KV or index source")
                continue
            if i in self.kv_source_layer_ids:
                owner_ratio = ratio
            if owner_ratio != ratio:
                raise ConfigError(f"compressed layer {i} (ratio {ratio}) needs a preceding KV source of the same "
                                  f"ratio; kv_source_layer_ids {list(self.kv_source_layer_ids)}")
        cand = self.candidate_source_layer_id
        if cand >= 0:
            if cand not in self.kv_source_layer_ids:
                raise ConfigError(f"candidate_source_layer_id {cand} must be a KV source "
                                  f"({list(self.kv_source_layer_ids)})")
            if self.candidate_block_size < 1 or self.candidate_topk_blocks < 1:
                raise ConfigError("candidate_block_size and candidate_topk_blocks must be positive")
            later = [s for s in self.kv_source_layer_ids if s > cand]
            users = [i for i in self.index_source_layer_ids if i > cand and i not in self.kv_source_layer_ids]
            if later and users and any(u > later[0] for u in users):
                raise ConfigError(f"Reindex layers after KV source {later[0]} would read candidates of layer {cand}'s "
                                  "entries; the candidate pool belongs to its own KV source")
        if len(self.engram_layer_ids) != len(self.engram_num_embeddings):
            raise ConfigError(f"engram_num_embeddings ({len(self.engram_num_embeddings)} entries) needs one row "
                              f"count per Engram layer ({list(self.engram_layer_ids)})")
        if self.engram_layer_ids and self.engram_max_ngram_size < 2:
            raise ConfigError("engram_max_ngram_size must be at least 2 when Engram layers exist")
        if self.engram_layer_ids and not 0 <= self.engram_pad_token_id < self.vocab_size:
            raise ConfigError(f"engram_pad_token_id {self.engram_pad_token_id} is outside the vocabulary "
                              f"({self.vocab_size})")
        for name in ("rms_norm_eps", "hc_eps", "rope_theta", "compress_rope_theta"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"{name} must be finite and positive, got {value!r}")
        s = dict(self.rope_scaling)
        if s and s.get("rope_type", s.get("type")) == "yarn" and (
                "factor" not in s or "original_max_position_embeddings" not in s):
            raise ConfigError("rope_scaling is YaRN but lacks 'factor' or 'original_max_position_embeddings'")
        if not 0 <= self.image_token_id < self.vocab_size:
            raise ConfigError(f"image_token_id {self.image_token_id} is outside the vocabulary ({self.vocab_size})")

    # ------------------------------------------------------------------------------------- HF I/O
    @classmethod
    def from_hf(cls, path_or_dict: str | os.PathLike | Mapping[str, Any]) -> "V41Config":
        """Read the release's nested `config.json` (a path to it or its folder, or the parsed dict); a bare
        text config (`model_type` "deepseek_v41_text") is read too. Errors name the field."""
        if isinstance(path_or_dict, Mapping):
            return cls._from_raw(dict(path_or_dict))
        path, raw = _read_config(path_or_dict)
        try:
            return cls._from_raw(raw)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None

    @classmethod
    def _from_raw(cls, raw: dict[str, Any]) -> "V41Config":
        mt = raw.get("model_type")
        if mt == "deepseek_v41_text":
            top, text = {}, raw
        elif mt == "deepseek_v41":
            top = raw
            text = _convert("text_config", raw.get("text_config", {}), "dict")
        else:
            raise ConfigError(f"model_type is {mt!r}; a DeepSeek-V4.1 config has 'deepseek_v41'")
        if "num_hash_layers" in text or "tid2eid" in text:
            raise ConfigError("DeepSeek-V4.1 has no hash-routed layers (num_hash_layers)")
        f, g = _Fields(text, "text_config." if top else ""), _Fields(top)
        if f.get("num_key_value_heads", "int", 1) != 1:
            raise ConfigError("num_key_value_heads must be 1 (one shared latent KV head)")
        if f.get("n_shared_experts", "int", 1) != 1:
            raise ConfigError("n_shared_experts must be 1 in DeepSeek-V4.1")
        act = text.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"hidden_act {act!r} is not supported; DeepSeek-V4.1 uses 'silu'")
        if not text.get("norm_topk_prob", True):
            raise ConfigError("norm_topk_prob false is not DeepSeek-V4.1's routing")
        n = f.get("num_hidden_layers", "int", 40, minimum=1)
        nextn = f.get("num_nextn_predict_layers", "int", 3, minimum=0)
        ratios = f.get("compress_ratios", "ints", None, minimum=0, nullable=True)
        if ratios is None:
            ratios = [0, 0] + [2] * 18 + [1] * 20 + [0] * nextn
        scaling = f.get("rope_scaling", "dict", nullable=True)
        if scaling is None and "rope_scaling" not in text:
            scaling = {"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                       "original_max_position_embeddings": 65536}
        qc = g.get("quantization_config", "dict", nullable=True) or f.get("quantization_config", "dict",
                                                                         nullable=True)
        vc = top.get("vision_config")
        vision = V41VisionConfig.from_hf(vc) if vc is not None else None
        eos = top.get("eos_token_id", text.get("eos_token_id", 1))
        eos = tuple(_convert("eos_token_id", eos, "ints", 0)) if isinstance(eos, (list, tuple)) else (
            () if eos is None else (_convert("eos_token_id", eos, "int", 0),))

        def ids(key, default):
            return tuple(f.get(key, "ints", default, minimum=0))

        return cls(
            vocab_size=f.get("vocab_size", "int", 129280, minimum=1),
            hidden_size=f.get("hidden_size", "int", 5120, minimum=1),
            num_hidden_layers=n,
            num_attention_heads=f.get("num_attention_heads", "int", 64, minimum=1),
            head_dim=f.get("head_dim", "int", 512, minimum=1),
            qk_rope_head_dim=f.get("qk_rope_head_dim", "int", 64, minimum=2),
            q_lora_rank=f.get("q_lora_rank", "int", 1280, minimum=1),
            o_groups=f.get("o_groups", "int", 8, minimum=1),
            o_lora_rank=f.get("o_lora_rank", "int", 1024, minimum=1),
            swiglu_limit=f.get("swiglu_limit", "number", 10.0),
            rms_norm_eps=f.get("rms_norm_eps", "number", 1e-20),
            max_position_embeddings=f.get("max_position_embeddings", "int", 1048576, minimum=1),
            rope_theta=f.get("rope_theta", "number", 10000.0),
            rope_scaling=tuple(sorted((scaling or {}).items())),
            compress_rope_theta=f.get("compress_rope_theta", "number", 160000.0),
            n_routed_experts=f.get("n_routed_experts", "int", 384, minimum=1),
            num_experts_per_tok=f.get("num_experts_per_tok", "int", 6, minimum=1),
            moe_intermediate_size=f.get("moe_intermediate_size", "int", 2304, minimum=1),
            scoring_func=text.get("scoring_func", "sqrtsoftplus"),
            routed_scaling_factor=f.get("routed_scaling_factor", "number", 1.5),
            sliding_window=f.get("sliding_window", "int", 128, minimum=1),
            compress_ratios=tuple(ratios),
            kv_source_layer_ids=ids("kv_source_layer_ids", [2, 8, 14, 20]),
            index_source_layer_ids=ids("index_source_layer_ids", [2, 8, 14, 20, 24, 28, 32, 36]),
            index_n_heads=f.get("index_n_heads", "int", 32, minimum=1),
            index_head_dim=f.get("index_head_dim", "int", 128, minimum=1),
            index_topk=f.get("index_topk", "int", 512, minimum=1),
            candidate_source_layer_id=f.get("candidate_source_layer_id", "int", 20, minimum=None),
            candidate_topk_blocks=f.get("candidate_topk_blocks", "int", 2048, minimum=1),
            candidate_block_size=f.get("candidate_block_size", "int", 8, minimum=1),
            hc_mult=f.get("hc_mult", "int", 4, minimum=1),
            hc_sinkhorn_iters=f.get("hc_sinkhorn_iters", "int", 20, minimum=0),
            hc_eps=f.get("hc_eps", "number", 1e-6),
            engram_layer_ids=ids("engram_layer_ids", [1, 14]),
            engram_num_embeddings=tuple(f.get("engram_num_embeddings", "ints", [384006168, 384016682], minimum=1)),
            engram_max_ngram_size=f.get("engram_max_ngram_size", "int", 4, minimum=1),
            engram_vocab_size=f.get("engram_vocab_size", "int", 16000000, minimum=2),
            engram_n_heads=f.get("engram_n_heads", "int", 8, minimum=1),
            engram_head_dim=f.get("engram_head_dim", "int", 256, minimum=1),
            engram_pad_token_id=f.get("engram_pad_token_id", "int", 2, minimum=0),
            engram_compressed_vocab_size=f.get("engram_compressed_vocab_size", "int", 99092, minimum=1),
            num_nextn_predict_layers=nextn,
            dspark_block_size=f.get("dspark_block_size", "int", 5, minimum=0),
            dspark_noise_token_id=f.get("dspark_noise_token_id", "int", 128799, minimum=0),
            dspark_target_layer_ids=ids("dspark_target_layer_ids", [37, 38, 39]),
            dspark_markov_rank=f.get("dspark_markov_rank", "int", 256, minimum=1),
            dspark_n_routed_experts=f.get("dspark_n_routed_experts", "int", 128, minimum=1),
            dspark_num_experts_per_tok=f.get("dspark_num_experts_per_tok", "int", 3, minimum=1),
            image_token_id=g.get("image_token_id", "int", f.get("image_token_id", "int", 129264, minimum=0),
                                 minimum=0),
            bos_token_id=g.get("bos_token_id", "int", text.get("bos_token_id", 0), minimum=0, nullable=True),
            eos_token_id=eos,
            pad_token_id=g.get("pad_token_id", "int", text.get("pad_token_id", 2), minimum=0, nullable=True),
            initializer_range=f.get("initializer_range", "number", 0.02),
            quantization=_v41_quant(qc) if qc else None,
            vision=vision if vision is not None and vision.num_hidden_layers > 0 else None,
        )

    def to_hf(self) -> dict[str, Any]:
        """The release's nested `config.json` dict."""
        text = {
            "model_type": "deepseek_v41_text",
            **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name not in ("quantization", "vision", "image_token_id", "bos_token_id", "eos_token_id",
                                 "pad_token_id")},
            "num_key_value_heads": 1, "n_shared_experts": 1, "hidden_act": "silu", "topk_method": "noaux_tc",
            "norm_topk_prob": True, "attention_bias": False, "attention_dropout": 0.0,
        }
        text = {k: list(v) if isinstance(v, tuple) else v for k, v in text.items()}
        text["rope_scaling"] = dict(self.rope_scaling)
        eos = list(self.eos_token_id) if len(self.eos_token_id) != 1 else self.eos_token_id[0]
        out = {
            "architectures": ["DeepseekV41ForCausalLM"],
            "model_type": "deepseek_v41",
            "dtype": "bfloat16",
            "image_token_id": self.image_token_id,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
            "pad_token_id": self.pad_token_id,
            "tie_word_embeddings": False,
            "text_config": text,
            "vision_config": (self.vision or V41VisionConfig(num_hidden_layers=0)).to_hf(),
        }
        if self.quantization is not None:
            out["quantization_config"] = self.quantization.to_hf()
        return out

    @classmethod
    def preset(cls, name: str) -> "V41Config":
        """A named V4.1 preset (`v4.1-flash`, `tiny-v4.1`)."""
        from dsjax.presets import PRESETS

        if name not in PRESETS or PRESETS[name].get("model_type") != "deepseek_v41":
            v41 = sorted(k for k, v in PRESETS.items() if v.get("model_type") == "deepseek_v41")
            raise ConfigError(f"unknown DeepSeek-V4.1 preset {name!r}; choose from {v41}")
        return cls.from_hf(PRESETS[name])


def _v41_quant(raw: Mapping[str, Any]) -> QuantConfig:
    q = QuantConfig.from_hf(raw)
    if q.weight_block_size != (32, 32) or q.scale_fmt != "ue8m0":
        raise ConfigError(f"quantization_config: DeepSeek-V4.1 stores FP8 weights in 32 × 32 blocks with ue8m0 "
                          f"scales; got weight_block_size {list(q.weight_block_size)}, scale_fmt {q.scale_fmt!r}")
    return q


def is_v41(raw: Mapping[str, Any]) -> bool:
    """Whether a parsed `config.json` describes a DeepSeek-V4.1 model."""
    return raw.get("model_type") in ("deepseek_v41", "deepseek_v41_text")


def model_config(path_or_dict: str | os.PathLike | Mapping[str, Any]):
    """The config of a checkpoint or dict of either family: a `V41Config` for DeepSeek-V4.1, else a V4
    `ModelConfig` (each raising ConfigError naming the field)."""
    from dsjax.config import ModelConfig

    raw = path_or_dict
    if not isinstance(raw, Mapping):
        _, raw = _read_config(path_or_dict)
    return (V41Config if is_v41(raw) else ModelConfig).from_hf(path_or_dict)
