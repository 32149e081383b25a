"""DeepSeek-V4.1 tensor names: the release's (`layers.3.attn.wq_a.weight`, spec §4) ↔ dsjax state paths
(`layers.3.attn.q_a_proj.weight`). The release has one spelling; a `model.` prefix some tools add is
accepted. Routed experts are per expert in the release and merged in dsjax."""

from __future__ import annotations

import re
from dataclasses import dataclass

# release layer-relative prefix → dsjax; first match wins, so longer prefixes come first.
LAYER_RULES = [
    ("hc_attn_fn", "attn_hc.fn"), ("hc_attn_base", "attn_hc.base"), ("hc_attn_scale", "attn_hc.scale"),
    ("hc_ffn_fn", "ffn_hc.fn"), ("hc_ffn_base", "ffn_hc.base"), ("hc_ffn_scale", "ffn_hc.scale"),
    ("attn.attn_sink", "attn.sinks"),
    ("attn.compressor.wkv.", "attn.compressor.kv_proj."),
    ("attn.compressor.wgate.", "attn.compressor.gate_proj."),
    ("attn.compressor.norm.", "attn.compressor.kv_norm."),
    ("attn.indexer.wk.", "attn.indexer.k_proj."),
    ("attn.indexer.wq_b.", "attn.indexer.q_b_proj."),
    ("attn.indexer.weights_proj.", "attn.indexer.scorer.weights_proj."),
    ("attn.wq_a.", "attn.q_a_proj."), ("attn.q_norm.", "attn.q_a_norm."), ("attn.wq_b.", "attn.q_b_proj."),
    ("attn.wkv.", "attn.kv_proj."), ("attn.wo_a.", "attn.o_a_proj."), ("attn.wo_b.", "attn.o_b_proj."),
    ("ffn.gate.bias_vl", "ffn.gate.bias_vl"),
    ("ffn.gate.bias", "ffn.gate.e_score_correction_bias"),
    ("ffn.shared_experts.w1.", "ffn.shared_experts.gate_proj."),
    ("ffn.shared_experts.w3.", "ffn.shared_experts.up_proj."),
    ("ffn.shared_experts.w2.", "ffn.shared_experts.down_proj."),
    ("engram.embed.weight", "engram.table"),
    ("engram.wkv.", "engram.kv_proj."),
]
TOP = {"embed.weight": "embed_tokens.weight", "head.weight": "lm_head.weight", "norm.weight": "norm.weight"}

# Release tensors dsjax does not use: read and kept beside the model, never silently dropped.
KEPT_PREFIXES = ("image_pad",)

# The image encoder's tensors: dsjax's module paths are the release's names (`layers/vision_v41.py`).
IMAGE_PREFIXES = ("vision.", "aligner.")
IMAGE_DELIMITERS = ("image_start", "image_end", "image_newline")

# dsjax variables computed from the tokenizer (Engram's hash tables): no checkpoint tensor holds them.
DERIVED = ("ngram_hash.",)

# The merged routed experts and their scales (dsjax holds one variable per layer, the release a tensor per expert).
MERGED_EXPERTS = tuple(m + s for m in ("ffn.experts.gate_up_proj", "ffn.experts.down_proj")
                       for s in ("", "_scale_inv"))

# A backbone layer (`layers.L.`) or a DSpark stage (`mtp.S.`): the same block names under either.
_LAYER = re.compile(r"(layers|mtp)\.(\d+)\.(.+)")
_EXPERT = re.compile(r"(layers|mtp)\.(\d+)\.ffn\.experts\.(\d+)\.(w[123])\.weight")


@dataclass(frozen=True)
class ExpertPart:
    """One release per-expert tensor: `w1` (gate), `w3` (up) or `w2` (down) of `expert` in `layer`."""

    path: str  # the merged dsjax variable: layers.L.ffn.experts.gate_up_proj or .down_proj (mtp.S. for DSpark)
    expert: int
    part: str


def strip_prefix(name: str) -> str:
    return name[len("model."):] if name.startswith("model.") else name


def is_draft(name: str) -> bool:
    """Whether a tensor (release name) or variable (dsjax path) is one of DSpark's stages (`mtp.S.*`)."""
    return strip_prefix(name).startswith("mtp.")


def is_kept(name: str) -> bool:
    return strip_prefix(name).startswith(KEPT_PREFIXES)


def to_dsjax(name: str) -> str | ExpertPart | None:
    """The dsjax path of a release tensor (dotted), an ExpertPart for per-expert tensors, None when no rule
    knows it."""
    rest = strip_prefix(name)
    if rest in TOP:
        return TOP[rest]
    if rest.startswith(IMAGE_PREFIXES) or rest in IMAGE_DELIMITERS:
        return rest
    e = _EXPERT.fullmatch(rest)
    if e:
        stack, layer, expert, part = e.groups()
        merged = "down_proj" if part == "w2" else "gate_up_proj"
        return ExpertPart(f"{stack}.{layer}.ffn.experts.{merged}", int(expert), part)
    m = _LAYER.fullmatch(rest)
    if not m:
        return None
    stack, layer, tail = m.groups()
    for release, ours in LAYER_RULES:
        if tail.startswith(release):
            return f"{stack}.{layer}.{ours}{tail[len(release):]}"
    return f"{stack}.{layer}.{tail}"


def scale_path(path: str) -> str:
    """The dsjax path of the scales of the quantized variable `path`."""
    return path + "_scale" if path.endswith(".table") else path + "_scale_inv"


def to_release(path: str) -> str:
    """The release name of a dsjax path (merged experts excepted: they split per expert). Inverse of
    `to_dsjax`."""
    for release, ours in TOP.items():
        if path == ours:
            return release
    if path.startswith(IMAGE_PREFIXES) or path in IMAGE_DELIMITERS:
        return path
    m = _LAYER.fullmatch(path)
    if not m:
        raise ValueError(f"{path!r} is not a DeepSeek-V4.1 dsjax path")
    stack, layer, tail = m.groups()
    for release, ours in LAYER_RULES:
        if tail.startswith(ours):
            return f"{stack}.{layer}.{release}{tail[len(ours):]}"
    return f"{stack}.{layer}.{tail}"


# Storage kinds of release tensors: "fp8" (e4m3 + ue8m0 scales per 32 × 32 block), "fp4" (e2m1 pairs in int8 +
# ue8m0 per row per 32), "fp8_rows" (Engram tables: e4m3 + ue8m0 per row per 32), "bf16", "fp32".
def release_shapes(cfg) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every tensor of a release checkpoint of `cfg` (weights, not their scales): name → (logical shape, kind),
    DSpark's `mtp.*` and the image encoder's `vision.*` / `aligner.*` included (spec §4)."""
    h, n, nh, d = cfg.hidden_size, cfg.hc_mult, cfg.num_attention_heads, cfg.head_dim
    q, g, o = cfg.q_lora_rank, cfg.o_groups, cfg.o_lora_rank
    ni, c, inter = cfg.index_n_heads, cfg.index_head_dim, cfg.moe_intermediate_size
    mix = (2 + n) * n
    out: dict[str, tuple[tuple[int, ...], str]] = {
        "embed.weight": ((cfg.vocab_size, h), "bf16"), "head.weight": ((cfg.vocab_size, h), "bf16"),
        "norm.weight": ((h,), "bf16")}

    def block(prefix: str, experts: int, role=None) -> None:
        out.update({
            prefix + "attn_norm.weight": ((h,), "bf16"), prefix + "ffn_norm.weight": ((h,), "bf16"),
            prefix + "attn.attn_sink": ((nh,), "fp32"),
            prefix + "attn.wq_a.weight": ((q, h), "fp8"), prefix + "attn.q_norm.weight": ((q,), "bf16"),
            prefix + "attn.wq_b.weight": ((nh * d, q), "fp8"), prefix + "attn.wkv.weight": ((d, h), "fp8"),
            prefix + "attn.kv_norm.weight": ((d,), "bf16"), prefix + "attn.wo_a.weight": ((g * o, nh * d // g), "fp8"),
            prefix + "attn.wo_b.weight": ((h, g * o), "fp8"),
            prefix + "ffn.gate.weight": ((experts, h), "bf16"), prefix + "ffn.gate.bias": ((experts,), "fp32"),
            prefix + "ffn.shared_experts.w1.weight": ((inter, h), "fp8"),
            prefix + "ffn.shared_experts.w3.weight": ((inter, h), "fp8"),
            prefix + "ffn.shared_experts.w2.weight": ((h, inter), "fp8")})
        for site in ("attn", "ffn"):
            out.update({f"{prefix}hc_{site}_fn": ((mix, n * h), "fp32"), f"{prefix}hc_{site}_base": ((mix,), "fp32"),
                        f"{prefix}hc_{site}_scale": ((3,), "fp32")})
        for e in range(experts):
            out.update({f"{prefix}ffn.experts.{e}.w1.weight": ((inter, h), "fp4"),
                        f"{prefix}ffn.experts.{e}.w3.weight": ((inter, h), "fp4"),
                        f"{prefix}ffn.experts.{e}.w2.weight": ((h, inter), "fp4")})
        if role is None:
            return
        out[prefix + "ffn.gate.bias_vl"] = ((experts,), "fp32")
        if role.mode == "full":
            out.update({prefix + "attn.compressor.wkv.weight": ((d, h), "bf16"),
                        prefix + "attn.compressor.norm.weight": ((d,), "bf16"),
                        prefix + "attn.indexer.wk.weight": ((c, d), "bf16"),
                        prefix + "attn.indexer.k_norm.weight": ((c,), "bf16")})
            if role.ratio > 1:
                out[prefix + "attn.compressor.wgate.weight"] = ((d, h), "bf16")
        if role.mode in ("full", "reindex"):
            out.update({prefix + "attn.indexer.wq_b.weight": ((ni * c, q), "fp8"),
                        prefix + "attn.indexer.weights_proj.weight": ((ni, h), "bf16")})
        if role.engram is not None:
            rows = cfg.engram_num_embeddings[role.engram]
            out.update({prefix + "engram.embed.weight": ((rows, cfg.engram_head_dim), "fp8_rows"),
                        prefix + "engram.wkv.weight": (((n + 1) * h, cfg.engram_hash_heads * cfg.engram_head_dim),
                                                       "fp8"),
                        prefix + "engram.q_weight": ((n, h), "bf16"), prefix + "engram.k_weight": ((n, h), "bf16")})

    for role in cfg.layer_roles():
        block(f"layers.{role.index}.", cfg.n_routed_experts, role)
    stages = cfg.num_nextn_predict_layers
    for s in range(stages):
        block(f"mtp.{s}.", cfg.dspark_n_routed_experts)
    if stages:
        r, last = cfg.dspark_markov_rank, f"mtp.{stages - 1}."
        out.update({"mtp.0.main_proj.weight": ((h, len(cfg.dspark_target_layer_ids) * h), "fp8"),
                    "mtp.0.main_norm.weight": ((h,), "bf16"), last + "norm.weight": ((h,), "bf16"),
                    last + "markov_head.embed.weight": ((cfg.vocab_size, r), "bf16"),
                    last + "markov_head.head.weight": ((cfg.vocab_size, r), "bf16"),
                    last + "confidence_head.proj.weight": ((1, h + r), "bf16")})
    v = cfg.vision
    if v is not None:
        hv, vi = v.hidden_size, v.intermediate_size
        out.update({"vision.patch_embed.proj.weight": ((hv, 3 * v.patch_size ** 2), "bf16"),
                    "vision.patch_embed.proj.bias": ((hv,), "bf16"), "vision.norm.weight": ((hv,), "bf16"),
                    "aligner.w1.weight": ((h, v.downsample_ratio ** 2 * hv), "bf16"), "aligner.w1.bias": ((h,), "bf16"),
                    "aligner.w2.weight": ((h, h), "bf16"), "aligner.w2.bias": ((h,), "bf16"),
                    "image_start": ((h,), "bf16"), "image_end": ((h,), "bf16"), "image_newline": ((h,), "bf16")})
        for i in range(v.num_hidden_layers):
            p = f"vision.blocks.{i}."
            out.update({p + "norm1.weight": ((hv,), "bf16"), p + "norm2.weight": ((hv,), "bf16"),
                        p + "attn.wqkv.weight": ((3 * hv, hv), "bf16"), p + "attn.wqkv.bias": ((3 * hv,), "bf16"),
                        p + "attn.wo.weight": ((hv, hv), "bf16"), p + "attn.wo.bias": ((hv,), "bf16"),
                        p + "mlp.w1.weight": ((2 * vi, hv), "bf16"), p + "mlp.w2.weight": ((hv, vi), "bf16")})
    return out
