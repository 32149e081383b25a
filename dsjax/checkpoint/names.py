"""Tensor names: the three spellings a DeepSeek-V4 checkpoint may use, mapped to one (HF module names).

- HF module names: `model.layers.3.self_attn.q_a_proj.weight`, experts merged as
  `mlp.experts.gate_up_proj [E,2I,H]` / `down_proj [E,H,I]`.
- Original DeepSeek names: `layers.3.attn.wq_a.weight`, `hc_attn_fn`, `ffn.experts.5.w1.weight`, ...
- The hybrid `save_pretrained()` writes: original layer names under a `model.` prefix, with
  `model.embed_tokens.weight`, `model.norm.weight`, `model.hc_head.*` and a top-level `head.weight`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# Original layer-relative prefixes → HF; first match wins, so longer prefixes come first.
_LAYER_RULES = [
    ("attn_norm.", "input_layernorm."),
    ("ffn_norm.", "post_attention_layernorm."),
    ("hc_attn_fn", "attn_hc.fn"), ("hc_attn_base", "attn_hc.base"), ("hc_attn_scale", "attn_hc.scale"),
    ("hc_ffn_fn", "ffn_hc.fn"), ("hc_ffn_base", "ffn_hc.base"), ("hc_ffn_scale", "ffn_hc.scale"),
    ("attn.attn_sink", "self_attn.sinks"),
    ("attn.indexer.compressor.wkv.", "self_attn.compressor.indexer.kv_proj."),
    ("attn.indexer.compressor.wgate.", "self_attn.compressor.indexer.gate_proj."),
    ("attn.indexer.compressor.ape", "self_attn.compressor.indexer.position_bias"),
    ("attn.indexer.compressor.norm.", "self_attn.compressor.indexer.kv_norm."),
    ("attn.indexer.wq_b.", "self_attn.compressor.indexer.q_b_proj."),
    ("attn.indexer.weights_proj.", "self_attn.compressor.indexer.scorer.weights_proj."),
    ("attn.compressor.wkv.", "self_attn.compressor.kv_proj."),
    ("attn.compressor.wgate.", "self_attn.compressor.gate_proj."),
    ("attn.compressor.ape", "self_attn.compressor.position_bias"),
    ("attn.compressor.norm.", "self_attn.compressor.kv_norm."),
    ("attn.wq_a.", "self_attn.q_a_proj."), ("attn.q_norm.", "self_attn.q_a_norm."),
    ("attn.wq_b.", "self_attn.q_b_proj."), ("attn.wkv.", "self_attn.kv_proj."),
    ("attn.kv_norm.", "self_attn.kv_norm."), ("attn.norm.", "self_attn.kv_norm."),
    ("attn.wo_a.", "self_attn.o_a_proj."), ("attn.wo_b.", "self_attn.o_b_proj."),
    ("ffn.gate.bias", "mlp.gate.e_score_correction_bias"),
    ("ffn.gate.", "mlp.gate."),
    ("ffn.shared_experts.w1.", "mlp.shared_experts.gate_proj."),
    ("ffn.shared_experts.w3.", "mlp.shared_experts.up_proj."),
    ("ffn.shared_experts.w2.", "mlp.shared_experts.down_proj."),
]

_TOP = {
    "embed.weight": "model.embed_tokens.weight",
    "embed_tokens.weight": "model.embed_tokens.weight",
    "head.weight": "lm_head.weight",
    "lm_head.weight": "lm_head.weight",
    "norm.weight": "model.norm.weight",
    "hc_head_fn": "model.hc_head.hc_fn", "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
    "hc_head.hc_fn": "model.hc_head.hc_fn", "hc_head.hc_base": "model.hc_head.hc_base",
    "hc_head.hc_scale": "model.hc_head.hc_scale",
}

# The V4 demo's image encoder's tensors (`layers/demo_vision.py`): `model.vision.<dsjax path>` in HF names,
# `vision.<dsjax path>` in original ones, e.g. `model.vision.blocks.3.qkv.weight`.
VISION_PREFIX = "vision."

_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_EXPERT = re.compile(r"ffn\.experts\.(\d+)\.(w[123])\.weight")
_MTP = re.compile(r"(^|\.)mtp\.")


@dataclass(frozen=True)
class ExpertSlice:
    """One original per-expert tensor: `w1` (gate), `w3` (up) or `w2` (down) of expert `expert`."""

    hf_name: str  # the merged HF tensor it belongs to
    expert: int
    part: str


def to_hf(name: str) -> str | ExpertSlice | None:
    """The HF name of a checkpoint tensor, an ExpertSlice for per-expert originals, None for MTP (dropped),
    or the name unchanged when no rule applies (the caller reports it as unknown)."""
    if _MTP.search(name):
        return None
    rest = name[len("model."):] if name.startswith("model.") else name
    if rest in _TOP:
        return _TOP[rest]
    if rest.startswith(VISION_PREFIX):
        return "model." + rest
    m = _LAYER.fullmatch(rest)
    if not m:
        return name
    layer, tail = m.groups()
    prefix = f"model.layers.{layer}."
    e = _EXPERT.fullmatch(tail)
    if e:
        merged = "mlp.experts.down_proj" if e.group(2) == "w2" else "mlp.experts.gate_up_proj"
        return ExpertSlice(prefix + merged, int(e.group(1)), e.group(2))
    for orig, hf in _LAYER_RULES:
        if tail.startswith(orig):
            return prefix + hf + tail[len(orig):]
    return prefix + tail


_TOP_ORIGINAL = {"model.embed_tokens.weight": "embed.weight", "lm_head.weight": "head.weight",
                 "model.norm.weight": "norm.weight", "model.hc_head.hc_fn": "hc_head_fn",
                 "model.hc_head.hc_base": "hc_head_base", "model.hc_head.hc_scale": "hc_head_scale"}


def to_original(hf_name: str) -> str:
    """The original DeepSeek name of an HF-named tensor (the merged expert tensors excepted: the caller
    splits those into `ffn.experts.E.w1/w3/w2.weight`). Inverse of `to_hf`."""
    if hf_name in _TOP_ORIGINAL:
        return _TOP_ORIGINAL[hf_name]
    if hf_name.startswith("model." + VISION_PREFIX):
        return hf_name[len("model."):]
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", hf_name)
    if not m:
        raise ValueError(f"{hf_name!r} is not a DeepSeek-V4 HF tensor name")
    layer, tail = m.groups()
    for orig, hf in _LAYER_RULES:
        if tail.startswith(hf):
            return f"layers.{layer}.{orig}{tail[len(hf):]}"
    return f"layers.{layer}.{tail}"


# dsjax stores the merged expert tensors [E, in, out]; HF stores them [E, out, in].
TRANSPOSED_LEAVES = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def hf_names_for(groups_meta, path: tuple) -> list[tuple[str, int | None]]:
    """The HF names a dsjax state path holds, with the index along the stacked-layer axis of each
    (None for variables outside the layer groups)."""
    if path[0] != "groups":
        name = ".".join(str(p) for p in path)
        return [(name if name == "lm_head.weight" else f"model.{name}", None)]
    meta = groups_meta[path[1]]
    leaf = ".".join(str(p) for p in path[4:])
    return [(f"model.layers.{meta.layer_index(r, path[3])}.{leaf}", r) for r in range(meta.repeats)]
