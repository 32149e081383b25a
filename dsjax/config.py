"""The DeepSeek-V4 model configuration: one frozen dataclass tree, read from and written to HF `config.json`.

`ModelConfig.from_hf` derives every field the way transformers 5.23.0's `DeepseekV4Config` does
(legacy keys included); `to_hf` writes the explicit, modern form that both reload identically.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
import reprlib
import sys
from typing import Any, Mapping

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
ATTENTION_TYPES = (SLIDING, CSA, HCA)
HASH_MOE = "hash_moe"
MOE = "moe"
IMAGE_MOE = "image_moe"  # DeepSeek-V4.1: top-k routing with a separate selection bias for image tokens
TEXT_MOE = "text_moe"  # DeepSeek-V4.1's DSpark stages: top-k routing on fp32 logits, no image bias
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
        block = _Fields(raw, "quantization_config.").get("weight_block_size", "ints", minimum=1, nullable=True)
        return cls(weight_block_size=tuple(block or (128, 128)),
                   scale_fmt=raw.get("scale_fmt") or "float",
                   expert_dtype=raw.get("expert_dtype") or expert_dtype or "fp8")

    def to_hf(self) -> dict[str, Any]:
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": list(self.weight_block_size), "scale_fmt": self.scale_fmt,
                "expert_dtype": self.expert_dtype}


class ImageGrid:
    """The image-token contract both image encoders keep with deepseek-recipe: a W×H image (sides multiples
    of `patch_size`) is cut into cells of `merge_size`² patches, each one decoder embedding, and its span
    is `rows·(cols + 1) + 2` embeddings (a row end per row, a start and an end)."""

    patch_size: int
    merge_size: int

    def grid(self, width: int, height: int) -> tuple[int, int]:
        """(rows, cols) of cells for a preprocessed W×H image."""
        cell = self.patch_size * self.merge_size
        return -(-height // cell), -(-width // cell)

    def image_tokens(self, width: int, height: int) -> int:
        """Prompt positions of a preprocessed W×H image: its cells, a row end per row, start and end."""
        rows, cols = self.grid(width, height)
        return rows * (cols + 1) + 2


@dataclasses.dataclass(frozen=True)
class VisionConfig(ImageGrid):
    """The embedded demo model's image encoder (HF `vision_config`; dsjax's design, made before V4.1's
    encoder was public: `layers/demo_vision.py`; V4.1's is `config_v41.V41VisionConfig`): a ViT over
    `patch_size`-pixel patches with 2-D rotary positions, whose `merge_size`² neighbouring patches are
    merged into one decoder embedding. An image of W×H pixels (multiples of `patch_size`, as
    deepseek-recipe preprocesses them) becomes `rows·(cols + 1) + 2` embeddings with
    `cols = ⌈W / patch_size / merge_size⌉`, `rows = ⌈H / patch_size / merge_size⌉`: one per merged cell,
    one closing each row, one opening and one closing the image."""

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
        raw = _convert("vision_config", raw, "dict")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ConfigError(f"vision_config has unknown keys {unknown}; known: {sorted(known)}")
        fields = _Fields(raw, "vision_config.")
        values = {k: fields.get(k, "number" if k in ("rope_theta", "norm_eps") else "int", minimum=1) for k in raw}
        try:
            return cls(**values)
        except TypeError as e:
            raise ConfigError(f"vision_config: {e}") from None

    def to_hf(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    pixel_format = "demo"  # pixels x map to x·2/255 − 1 in fp32; a patch flattens (y, x, channel)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads



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
    # None: text only (V4-Flash). The embedded demo reads images through this encoder (V4.1-Flash has its own,
    # `config_v41.V41VisionConfig`).
    vision: VisionConfig | None = None

    def __post_init__(self):
        self.validate()

    family = "v4"
    q_head_norm = True  # the unweighted per-head RMSNorm of the queries (V4.1 has none)

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
        for t in set(self.layer_types) - {SLIDING}:
            if self.compress_rate(t) <= 0:
                raise ConfigError(f"compress rate for {t} must be positive")

    # ---------------------------------------------------------------- HF I/O
    @classmethod
    def from_hf(cls, path_or_dict: str | os.PathLike | Mapping[str, Any]) -> "ModelConfig":
        """Read a transformers `config.json` (a path to the file or its folder, or the parsed dict).

        Anything that does not describe a valid model raises ConfigError naming the field and what it
        expected, prefixed by the file's path when read from one."""
        if isinstance(path_or_dict, Mapping):
            return cls._from_raw(dict(path_or_dict))
        path, raw = _read_config(path_or_dict)
        try:
            return cls._from_raw(raw)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None

    @classmethod
    def _from_raw(cls, raw: dict[str, Any]) -> "ModelConfig":
        mt = raw.get("model_type", "deepseek_v4")
        if mt in ("deepseek_v41", "deepseek_v41_text"):
            raise ConfigError("this is a DeepSeek-V4.1 config: read it with dsjax.config_v41.V41Config (load_model, "
                              "generate, convert, `dsjax info`, `plan` and `bench` do); `dsjax export` takes V4 "
                              "models so far")
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


# ------------------------------------------------------------------------------------------ reading
def _read_config(path: str | os.PathLike) -> tuple[str, dict[str, Any]]:
    """(path of the config.json, its parsed object) for a path to the file or to its folder."""
    p = os.fspath(path)
    if os.path.isdir(p):
        if not os.path.exists(os.path.join(p, "config.json")):
            raise ConfigError(f"{p} has no config.json")
        p = os.path.join(p, "config.json")
    try:
        with open(p, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise ConfigError(f"{p} does not exist") from None
    except OSError as e:
        raise ConfigError(f"{p} cannot be read ({e.strerror or e})") from None
    if not data.strip():
        raise ConfigError(f"{p} is empty; expected a JSON object")
    try:
        raw = json.loads(data)  # from bytes: UTF-8 with or without a BOM, UTF-16 or UTF-32, as JSON allows
    except json.JSONDecodeError as e:
        raise ConfigError(f"{p} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{p} is not valid JSON (not UTF-8 text: {e.reason} at byte {e.start})") from None
    if not isinstance(raw, dict):
        got = "an array" if isinstance(raw, list) else "a string" if isinstance(raw, str) else json.dumps(raw)
        raise ConfigError(f"{p} must hold a JSON object, got {got}")
    return p, raw


def _is_number(value: Any) -> bool:
    # The comparison also refuses NaN, infinities and ints too large for a float.
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and abs(value) <= sys.float_info.max


# kind: (what a message says was expected, whether a value is one, its conversion)
_SCALARS = {
    "number": ("a finite number", _is_number, float),
    "bool": ("true or false", lambda v: isinstance(v, bool), bool),
    "str": ("a string", lambda v: isinstance(v, str), str),
    "dict": ("an object", lambda v: isinstance(v, Mapping), dict),
}
_INT_EXPECTED = {None: "an integer", 0: "a non-negative integer", 1: "a positive integer"}


def _convert(name: str, value: Any, kind: str, minimum: int | None = None) -> Any:
    """`value`, the field `name`, as `kind` ("int", a key of _SCALARS, or "ints"/"strs" for lists), or a
    ConfigError saying what was expected. JSON has one number type, so integral floats (4096.0) pass as
    ints; bools pass as neither ints nor numbers; numbers written as strings are refused. `minimum`
    (None, 0 or 1) bounds ints and the entries of "ints"."""
    def fail(expected: str):
        raise ConfigError(f"{name} must be {expected}, got {reprlib.repr(value)}")

    if kind in ("ints", "strs"):
        if not isinstance(value, (list, tuple)):
            fail("a list of " + ("integers" if kind == "ints" else "strings"))
        return [_convert(f"{name}[{i}]", v, kind[:-1], minimum) for i, v in enumerate(value)]
    if kind == "int":
        whole = isinstance(value, numbers.Integral) or (_is_number(value) and float(value).is_integer())
        if isinstance(value, bool) or not whole or (minimum is not None and int(value) < minimum):
            fail(_INT_EXPECTED[minimum])
        return int(value)
    expected, accepts, convert = _SCALARS[kind]
    if not accepts(value):
        fail(expected)
    return convert(value)


class _Fields:
    """Typed reads of one raw config dict, every value through `_convert`. `where` prefixes field names in
    messages ("rope_parameters.main."); a tuple of keys reads the first one present (legacy spellings)."""

    def __init__(self, raw: Mapping[str, Any], where: str = ""):
        self.raw, self.where = raw, where

    def get(self, keys: str | tuple[str, ...], kind: str, default: Any = None, minimum: int | None = None,
            nullable: bool = False) -> Any:
        """`default` when no key is present; None for an explicit null only if `nullable` (elsewhere a null
        is refused like any other wrong type)."""
        for key in (keys,) if isinstance(keys, str) else keys:
            if key in self.raw:
                value = self.raw[key]
                if value is None and nullable:
                    return None
                return _convert(self.where + key, value, kind, minimum)
        return default


# ------------------------------------------------------------------------------------------ derivation
def _derive(raw: dict[str, Any]) -> dict[str, Any]:
    """Map a raw HF dict to ModelConfig kwargs, mirroring DeepseekV4Config.__post_init__."""
    g = raw.get
    f = _Fields(raw)
    n = f.get("num_hidden_layers", "int", 43, minimum=1)
    head_dim = f.get("head_dim", "int", 512, minimum=1)
    act = g("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"hidden_act {act!r} is not supported; DeepSeek-V4 uses 'silu'")
    kv_heads = g("num_key_value_heads", 1)
    if kv_heads not in (1, None):
        # The reference never reads it (one shared KV head always); say so rather than mislead.
        raise ConfigError(f"num_key_value_heads is {kv_heads}; DeepSeek-V4 attention has one shared KV head")

    # Rates may be 0 for a type no layer uses; validate() requires the used ones to be positive.
    rates = dict(_DEFAULT_COMPRESS_RATES)
    given_rates = f.get("compress_rates", "dict", nullable=True)
    if given_rates is not None:
        rates = {t: _Fields(given_rates, "compress_rates.").get(t, "int", rates[t], minimum=0) for t in rates}
    for key, t in (("compress_rate_csa", CSA), ("compress_rate_hca", HCA)):
        given = f.get(key, "int", minimum=0, nullable=True)
        if given is not None:
            rates[t] = given

    layer_types = f.get("layer_types", "strs", nullable=True)
    ratios = f.get("compress_ratios", "ints", minimum=0, nullable=True)
    if layer_types is None and ratios is not None:
        try:
            layer_types = [_LEGACY_RATIO_TO_TYPE[r] for r in ratios]
        except KeyError as e:
            raise ConfigError(f"compress_ratios may hold only 0, 4 or 128; got {e.args[0]}") from None
    if layer_types is None:
        layer_types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
    layer_types = tuple(layer_types[:n])

    mlp_types = f.get("mlp_layer_types", "strs", nullable=True)
    if mlp_types is None:
        n_hash = f.get("num_hash_layers", "int", minimum=0, nullable=True)
        n_hash = _DEFAULT_NUM_HASH_LAYERS if n_hash is None else n_hash
        mlp_types = [HASH_MOE] * min(n, n_hash) + [MOE] * max(0, n - n_hash)
    mlp_types = tuple(mlp_types[:n])

    given_prf = f.get("partial_rotary_factor", "number", nullable=True)
    legacy_rope_dim = f.get("qk_rope_head_dim", "int", minimum=1, nullable=True)
    if given_prf is not None:
        prf = given_prf
    elif legacy_rope_dim is not None:
        prf = legacy_rope_dim / head_dim
    else:
        prf = _DEFAULT_PARTIAL_ROTARY
    rope_theta = f.get("rope_theta", "number", 10000.0)
    compress_theta = f.get("compress_rope_theta", "number", 160000.0)
    max_pos = f.get("max_position_embeddings", "int", 1048576, minimum=1)
    main, compress = _derive_rope(f, rope_theta, compress_theta, given_prf, prf, max_pos)

    eos = g("eos_token_id", 1)  # one id, a list of them, or null for none
    if eos is None:
        eos = ()
    elif isinstance(eos, (list, tuple)):
        eos = tuple(_convert("eos_token_id", eos, "ints", 0))
    else:
        eos = (_convert("eos_token_id", eos, "int", 0),)
    qc = f.get("quantization_config", "dict", nullable=True)
    vc = g("vision_config")
    return dict(
        quantization=QuantConfig.from_hf(qc, g("expert_dtype")) if qc else None,
        vision=VisionConfig.from_hf(vc) if vc is not None else None,
        vocab_size=f.get("vocab_size", "int", 129280, minimum=1),
        hidden_size=f.get("hidden_size", "int", 4096, minimum=1),
        moe_intermediate_size=f.get(("moe_intermediate_size", "intermediate_size"), "int", 2048, minimum=1),
        num_hidden_layers=n,
        num_attention_heads=f.get("num_attention_heads", "int", 64, minimum=1),
        head_dim=head_dim,
        q_lora_rank=f.get("q_lora_rank", "int", 1024, minimum=1),
        num_experts_per_tok=f.get("num_experts_per_tok", "int", 6, minimum=1),
        n_routed_experts=f.get(("n_routed_experts", "num_local_experts"), "int", 256, minimum=1),
        scoring_func=g("scoring_func", "sqrtsoftplus"),
        routed_scaling_factor=f.get("routed_scaling_factor", "number", 1.5),
        layer_types=layer_types,
        mlp_layer_types=mlp_types,
        compress_rate_csa=rates[CSA],
        compress_rate_hca=rates[HCA],
        rope_main=main,
        rope_compress=compress,
        hc_mult=f.get("hc_mult", "int", 4, minimum=1),
        hc_sinkhorn_iters=f.get("hc_sinkhorn_iters", "int", 20, minimum=0),
        hc_eps=f.get("hc_eps", "number", 1e-6),
        swiglu_limit=f.get("swiglu_limit", "number", 10.0),
        sliding_window=f.get("sliding_window", "int", 128, minimum=1),
        o_groups=f.get("o_groups", "int", 8, minimum=1),
        o_lora_rank=f.get("o_lora_rank", "int", 1024, minimum=1),
        index_n_heads=f.get("index_n_heads", "int", 64, minimum=1),
        index_head_dim=f.get("index_head_dim", "int", 128, minimum=1),
        index_topk=f.get("index_topk", "int", 512, minimum=1),
        rms_norm_eps=f.get("rms_norm_eps", "number", 1e-6),
        partial_rotary_factor=prf,
        max_position_embeddings=max_pos,
        # A null flag reads as false, as bool(None) always did.
        mlp_bias=bool(f.get("mlp_bias", "bool", False, nullable=True)),
        tie_word_embeddings=bool(f.get("tie_word_embeddings", "bool", False, nullable=True)),
        bos_token_id=f.get("bos_token_id", "int", 0, minimum=0, nullable=True),
        eos_token_id=eos,
        pad_token_id=f.get("pad_token_id", "int", minimum=0, nullable=True),
        num_nextn_predict_layers=f.get("num_nextn_predict_layers", "int", 1, minimum=0),
        initializer_range=f.get("initializer_range", "number", 0.02),
        rope_theta=rope_theta,
        compress_rope_theta=compress_theta,
    )


def _derive_rope(f: _Fields, rope_theta, compress_theta, given_prf, prf, max_pos) -> tuple[RopeConfig, RopeConfig]:
    """Build (main, compress) as the reference does: a flat (YaRN) dict reaches only `compress`."""
    given = {k: f.get(k, "dict", nullable=True) for k in ("rope_scaling", "rope_parameters")}
    source = "rope_scaling" if given["rope_scaling"] else "rope_parameters"  # the reference's `a or b`
    rp = given[source] or {}
    for label in ("main", "compress"):
        if rp.get(label) is not None:
            rp[label] = _convert(f"{source}.{label}", rp[label], "dict")
    if rp.get("main") is not None and rp.get("compress") is not None:
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
        where_main, where_comp = f"{source}.main.", f"{source}.compress."
    else:
        flat = {k: v for k, v in rp.items() if k not in ("main", "compress")}
        if flat or rope_theta:
            flat.setdefault("rope_type", flat.get("type", "default"))
            if flat["rope_type"] == "yarn":
                top = f.get("original_max_position_embeddings", "int", minimum=1, nullable=True)
                if top is not None:
                    flat["original_max_position_embeddings"] = top
                else:
                    flat.setdefault("original_max_position_embeddings", max_pos)
        main_d = {"rope_type": "default", "rope_theta": rope_theta, "partial_rotary_factor": prf}
        comp_d = {**flat, "rope_theta": compress_theta, "partial_rotary_factor": prf}
        comp_d.setdefault("rope_type", "default")
        if comp_d["rope_type"] == "yarn":
            comp_d.setdefault("attention_factor", 1.0)
        where_main, where_comp = "", f"{source}."
    return _rope_from_dict(main_d, max_pos, where_main), _rope_from_dict(comp_d, max_pos, where_comp)


def _rope_from_dict(d: Mapping[str, Any], max_pos: int, where: str) -> RopeConfig:
    """`where` names the dict the fields came from, for messages."""
    f = _Fields(d, where)
    rope_type = d.get("rope_type", d.get("type", "default"))
    factor = f.get("factor", "number", nullable=True)
    omax = f.get("original_max_position_embeddings", "int", minimum=1, nullable=True)
    if rope_type == "yarn" and factor is None and omax:
        factor = max_pos / omax  # what the reference falls back to
    return RopeConfig(
        theta=f.get("rope_theta", "number"),
        partial_rotary_factor=f.get("partial_rotary_factor", "number", 1.0),
        rope_type=rope_type,
        factor=factor,
        original_max_position_embeddings=omax,
        beta_fast=f.get("beta_fast", "number", nullable=True),
        beta_slow=f.get("beta_slow", "number", nullable=True),
        attention_factor=f.get("attention_factor", "number", nullable=True),
        mscale=f.get("mscale", "number", nullable=True),
        mscale_all_dim=f.get("mscale_all_dim", "number", nullable=True),
    )
