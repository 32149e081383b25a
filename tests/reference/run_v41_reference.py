"""Parity harness for DeepSeek-V4.1: runs NVIDIA NeMo AutoModel 0.7.0's `deepseek_v41` model (torch, CPU,
fp32) and writes what the dsjax V4.1 tests compare against. It runs in its own Python 3.11 environment
(`.venv-ref41`, made by `.ci/setup`), as `python run_v41_reference.py SPEC.json OUT_DIR`; the spec is
`tests/reference/spec_v41.py`'s SPEC as JSON (configs and vocabularies included: this environment has no
dsjax).

For every case in the spec it builds `DeepseekV41ForCausalLM` in fp32 on a CPU backend (eager attention,
torch linear layers, fp32 torch RMSNorm, torch RoPE without fusion, torch experts and dispatcher, the learned
gate in fp32: no TileLang anywhere), with a word-level tokenizer made from the case's vocabulary (id = index),
gives every parameter a non-trivial random value (nothing left at 0, 1 or identity; the Engram hash tables,
which NeMo derives from the tokenizer and config and never stores, are the only buffers left as built), and
writes into OUT/<case>/:
  ckpt/model.safetensors       every tensor in float32 under the release's names (NeMo's state-dict adapter,
                               `to_hf`; checked against the names of deepseek_v41_spec.md §4, §4.4's vision
                               names included when the config has a vision tower), one file
  ckpt/config.json             the case's release-format config as given (`rope_scaling` kept as is)
  ckpt/tokenizer.json          the tokenizer (with tokenizer_config.json); decode([i]) == vocabulary[i]
                               The checkpoint is reloaded into a fresh model through the adapter's `from_hf`,
                               with that tokenizer, and must give identical logits.
A case with a `vision` entry (the `vision` case: tiny-v4.1-vision) writes only ckpt/ and the vision_* files below;
the others write only ckpt/ and the following:
  input_ids_<T>.npy            int64 [B, T] for each T in seq_lens; positions are 0..T-1, no padding. Row 0 of
                               every T is a prefix of row 0 of the longest T. Ids 0..2 appear only as the BOS
                               (id 0) at position 0, the image token only inside the image span.
  image_mask_<T>.npy           bool [B, T]: the image span (row `image_span.row`, positions start..stop-1) for
                               the longest T, whose ids there are `image_token_id`; all False for the others.
  logits_identity_<T>.npy      fp32 [B, T, V], NeMo with its cache quantization (`quantize_cache`) replaced by
                               the identity: the tight fp32 target
  logits_quantized_<T>.npy     fp32 [B, T, V], NeMo as is (FP8 window KV, NVFP4 compressed KV, MXFP4 index Q/K)
  logits_identity_nomask_<T>.npy  the longest T again, identity variant, without the image mask
  capture_<variant>.npz        the longest T, per variant (identity, quantized):
      input_ids, image_mask, logits
      streams_L [B,T,N,H]      the streams block L receives (before its Engram update); L = n_layers: the
                               last block's output
      pre_mix_L [B,T,N]        the collapse weights block L receives (one-hot for L = 0); L = n_layers: the
                               last block's FFN `pre`, used for the final collapse
      engram_L [B,T,N,H]       the streams after layer L's Engram update (Engram layers only)
      topk_L [B,T,k]           the attention state's `topk_indices` after layer L (compressed layers), sorted,
                               -1 for picks that are not visible
      candidates [B,T,E]       bool, the candidate pool of `candidate_source_layer_id` (E = its entries)
      index_scores_L [B,T,E]   the scores layer L's indexer takes its top-k of (index sources): causally
                               masked with -inf, for Reindex layers inside the candidate pool also masked
      candidate_block_scores [B,T,E/block]  what the candidate source takes its top blocks of (block maxima,
                               the query's newest visible block pinned at +inf)
      route_scores_L [B,T,n_experts]  what layer L's router takes its top-k of: sqrt(softplus(logits)) plus
                               `ffn.gate.bias`, or `ffn.gate.bias_vl` on image tokens
      engram_hashes [B,T,n_engram_layers,heads]  NeMo's DeepseekV41NgramHash output (image mask as token mask)
      token_map [vocab]        NeMo's compressed token map (token id -> compressed id)
      final_hidden [B,T,H]     after the final collapse and norm (logits = final_hidden @ head.weight.T)
  generate_identity.npz        greedy decoding by full recompute (NeMo has no KV cache), identity variant, from
                               the first `prompt_len` tokens of row 0 of the longest T: prompt, tokens
                               [new_tokens], logits [new_tokens, V] (each step's last-position logits)

Vision case (ckpt/ as above, with the vision tower, aligner and image delimiters). For each image i of
`vision.image_sizes` (width, height), a seeded synthetic image (gradient + smooth blobs + pixel noise) put
through NeMo's own processor, `DeepseekV41Processor.__call__` (which calls `processing._preprocess_image`:
`_plan_image_grid` sizing, PIL `ImageOps.pad` to the canvas (bicubic, aspect kept, centred, gray 127; no
width clamp since max_wh_ratio is null), /255, (x - 0.5)/0.5, cast to bf16, 14x14 patches in row-major grid
order, each patch [3, 14, 14] = (channel, y, x)), then the ViT and the aligner:
  vision_image_<i>.png         the source image, RGB 8-bit (lossless; the processor read it back from this file)
  vision_patches_<i>.npy       fp32 [N, 3, 14, 14], N = n_vit_h * n_vit_w: the processor's `pixel_values`
                               (bf16 values, exactly)
  vision_grid_<i>.npy          int64 [2] (n_vit_h, n_vit_w): the processor's `image_grid_hws`
  vision_canvas_<i>.npy        int64 [2] (height, width) in pixels the image was resized and padded to
                               (`_plan_image_grid`'s height, width = 14 * the grid)
  vision_features_<i>.npy      fp32 [N, vision hidden]: `model.vision(patches, n_vit_h, n_vit_w)`, after the
                               final norm
  vision_rows_<i>.npy          fp32 [cells, hidden], cells = ceil(n_vit_h/3) * ceil(n_vit_w/3): the aligner's
                               output, row-major over the cells
  vision_tokens_<i>.npy        int64 scalar: the length of the image's span as the processor expands it,
                               rows * (cols + 1) + 2
One prompt, batch 1, made by the same processor from the words [BOS, `text_before` random tokens,
IMAGE_PLACEHOLDER, `text_after` random tokens] (random ids in [3, vocab) without the image token) and image
`prompt.image`:
  vision_input_ids.npy         int64 [1, T]; the whole span carries `image_token_id`
  vision_token_types.npy       int64 [1, T]: -1 text, 0 image start, 1 image, 2 newline, 3 image end (NeMo's)
  vision_image_mask.npy        bool [1, T]: token types >= 0 (the whole span, delimiters included)
  vision_logits_identity.npy   fp32 [1, T, V], identity cache quantization (as logits_identity_<T>)
  vision_logits_quantized.npy  fp32 [1, T, V], NeMo as is
These logits are NeMo's outer forward, `model(input_ids=, pixel_values=<the prompt's patches, i.e.
vision_patches_<prompt.image> in bf16>, image_grid_hws=, vision_token_types=)`, with no attention_mask and
default positions 0..T-1. With pixel_values given, NeMo embeds the ids, overwrites the span (IMAGE slots by the
aligner rows in reading order, delimiters by `image_start`/`image_newline`/`image_end`) and itself sets
`image_mask = vision_token_types >= 0`, which every block receives (`ffn.gate.bias_vl` routing, Engram gate
off) and whose complement is the Engram hasher's token mask; the harness checks all three by hooks, and that
the forward's aligner rows equal vision_rows_<prompt.image>. It also checks that the logits before the span
equal, and from the span on differ from, those of the same ids and mask with the span embedded as plain
image-token rows, and that the reloaded checkpoint gives identical rows and logits.

OUT/quant_cases.npz: NeMo's `quantize_cache` on one seeded fp32 input (`input`, values of many magnitudes, all-zero
rows, values exactly on rounding ties) for each supported (format, block): `<format>_<block>` outputs.
OUT/done is written last, only when everything succeeded; any failure exits nonzero with the reason.

How NeMo is run (runtime patches, all made by this file):
- `torch.topk` and `torch.Tensor.topk` are replaced, for the whole run, by a stable sort plus slice: ties go to
  the lower index (`jax.lax.top_k`'s rule). torch's CPU top-k orders exact ties arbitrarily, and tiny random
  models do produce exact ties (all-zero indexer scores: this case's quantized variant picks among them at
  layer 4), which can make a prefix's logits depend on the sequence length. This covers the indexer's top-k,
  the candidate-block top-k and the MoE router's top-k.
- The "identity" variant replaces `quantize_cache` in NeMo's `deepseek_v41.attention` module (the only module
  of the model's forward that calls it: window KV, compressed KV, index keys and index queries) by the identity.
- `DeepseekV41ForCausalLM.forward` takes no image mask (only `pixel_values`, which needs a vision tower; the text
  cases' configs have none). So for those cases the logits are `lm_head(model.model(input_ids, image_mask=...)[0])`,
  the same two steps the outer forward runs (checked bit-equal against it on every unmasked input). Image-span
  tokens are embedded as the image token's row of `embed.weight`; the mask routes them with `ffn.gate.bias_vl`,
  keeps them out of Engram (hash lookback blocked, gate zero) and is otherwise ignored, as in NeMo.
- The vision case calls the processor with the prompt already split into words, one per token
  (`is_split_into_words=True`, which it forwards to the tokenizer; the word-level tokenizer has no
  pre-tokenizer), and checks that the ids come out as intended. Its log line gives, per variant, how many of the
  prompt's top-k selections (router, indexer, candidate blocks) lie within fp32 rounding of a tie (the seed was
  chosen for none).
- `torch.compiler.set_stance("force_eager")`: NeMo's expert activation (`swiglu_clamped_deepep`) is wrapped in
  `torch.compile`; it runs eagerly here.
"""

from __future__ import annotations

import time

STARTED = time.time()

import contextlib  # noqa: E402
import copy  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

torch.set_grad_enabled(False)
torch.set_num_threads(1)  # tiny models; several test workers may run this at once
# NeMo wraps its expert activations in torch.compile (inductor, max_autotune): run them eagerly instead. Eager is
# the plain reference, and compiling them on CPU took 7 s and needs a C++ compiler.
torch.compiler.set_stance("force_eager")

from tokenizers import Tokenizer, models  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

from nemo_automodel.components.models.common import BackendConfig  # noqa: E402
from nemo_automodel.components.models.deepseek_v41 import attention as nemo_attention  # noqa: E402
from nemo_automodel.components.models.deepseek_v41 import processing as nemo_processing  # noqa: E402
from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41Config  # noqa: E402
from nemo_automodel.components.models.deepseek_v41.model import DeepseekV41ForCausalLM  # noqa: E402
from nemo_automodel.components.models.deepseek_v41.quantization import quantize_cache  # noqa: E402

VARIANTS = ("identity", "quantized")


# ----------------------------------------------------------------------------------- top-k tie-breaking
_ORIGINAL_SORT = torch.sort
_RECORDED_TOPK_INPUTS: list[torch.Tensor] | None = None  # set while an indexer or a router runs (see capture)
_ALL_TOPK_CALLS: list[tuple[torch.Tensor, int]] | None = None  # every top-k of a forward (vision case's margins)


def stable_topk(input, k, dim=-1, largest=True, sorted=True, *, out=None):  # noqa: A002 (torch's signature)
    """`torch.topk` with ties broken towards the lower index (a stable sort, then the first k)."""
    if out is not None:
        raise NotImplementedError("stable_topk: out= is not supported")
    if _RECORDED_TOPK_INPUTS is not None:
        _RECORDED_TOPK_INPUTS.append(input.detach().clone())
    if _ALL_TOPK_CALLS is not None:
        _ALL_TOPK_CALLS.append((input.detach().clone(), k))
    values, indices = _ORIGINAL_SORT(input, dim=dim, descending=largest, stable=True)
    return torch.return_types.topk((values.narrow(dim, 0, k).contiguous(), indices.narrow(dim, 0, k).contiguous()))


def install_stable_topk() -> None:
    torch.topk = stable_topk
    torch.Tensor.topk = stable_topk
    x = torch.tensor([[1.0, 3.0, 3.0, -math.inf, 3.0, -math.inf]])
    got = x.topk(5, dim=-1, sorted=False).indices.tolist(), torch.topk(x, k=2)[1].tolist()
    if got != ([[1, 2, 4, 0, 3]], [[1, 2]]):
        raise RuntimeError(f"the stable top-k patch is not in effect: {got}")


# ----------------------------------------------------------------------------------- cache quantization
@contextlib.contextmanager
def cache_quantization(variant: str):
    """Run NeMo as is ("quantized") or with `quantize_cache` replaced by the identity ("identity")."""
    if variant == "quantized":
        yield
        return
    assert variant == "identity", variant
    original = nemo_attention.quantize_cache
    nemo_attention.quantize_cache = lambda values, *, format, block_size: values.clone()  # noqa: A002
    try:
        yield
    finally:
        nemo_attention.quantize_cache = original


# ----------------------------------------------------------------------------------- model and tokenizer
def build_tokenizer(vocab: list[str], config: dict) -> PreTrainedTokenizerFast:
    """A word-level fast tokenizer whose token i is vocab[i] (no normalizer, pre-tokenizer or decoder)."""
    if len(set(vocab)) != len(vocab):
        raise ValueError("the vocabulary has duplicate tokens")
    backend = Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocab)}, unk_token=vocab[-2]))
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=vocab[config["bos_token_id"]],
                                  eos_token=vocab[config["eos_token_id"]], pad_token=vocab[config["pad_token_id"]])
    bad = [i for i, t in enumerate(vocab) if tok.backend_tokenizer.decode([i], skip_special_tokens=False) != t]
    if len(tok) != len(vocab) or bad:
        raise RuntimeError(f"tokenizer round trip failed: len {len(tok)}, decode([i]) != vocab[i] for ids {bad}")
    return tok


CPU_BACKEND = dict(attn="eager", linear="torch", rms_norm="torch_fp32", rope="torch", rope_fusion=False,
                   experts="torch", dispatcher="torch", fake_balanced_gate=False, gate_precision=torch.float32,
                   enable_hf_state_dict_adapter=True)


def build_model(raw: dict, tokenizer) -> DeepseekV41ForCausalLM:
    """NeMo's model for a release-format config dict, built in fp32 on CPU backends."""
    raw = copy.deepcopy(raw)
    raw["dtype"] = "float32"
    raw["text_config"]["dtype"] = "float32"
    config = DeepseekV41Config(**raw)
    model = DeepseekV41ForCausalLM(config, backend=BackendConfig(**CPU_BACKEND), tokenizer=tokenizer).eval()
    wrong = [n for n, p in model.named_parameters() if p.dtype != torch.float32]
    if wrong:
        raise RuntimeError(f"parameters not in fp32: {wrong}")
    return model


DERIVED_BUFFERS = ("model.engram_hash.",)  # from the tokenizer and config; not in the checkpoint
# indexer.weights_proj: 4x the usual 1/sqrt(fan_in), so index scores are a few units (up to ~20) and their top-k
# margins sit far above absolute fp32 tolerances. (Exact-zero scores, all ReLU terms zero, come from the signs
# of q·k, not the scale: about 2^-8 of them with 8 index heads; test_v41_harness.py checks both.)
INDEXER_WEIGHTS_GAIN = 4.0
# Vision tower and aligner (`model.vision.*`, `model.aligner.*`): linear weights 1/sqrt(fan_in), biases
# N(0, VISION_BIAS_STD), RMSNorm weights by the shared rule (1 + N(0, 0.2)), image delimiters N(0, 1) like the
# token embeddings, and three gains. PATCH_EMBED_GAIN: smooth normalized patches have an RMS of about 0.5, so the
# patch embedding then has an RMS of about 0.9, most of it varying across patches, and stays the largest term
# of the ViT's residual (attention and MLP outputs about 0.6-0.8 each). VISION_QK_GAIN on the query and key rows
# of `attn.wqkv` (the first two thirds): attention logits of std about 3, so a patch attends to about e^5 of
# ~1,600 patches rather than nearly all of them (at gain 1 the attention output is nearly the same for every patch
# and 2D RoPE would barely matter). ALIGNER_OUT_GAIN: aligner rows of RMS about 1.2, like the token embeddings.
# The features (after the final norm) then have an RMS of about 1.1, about 0.9 of it varying across patches.
VISION_PREFIXES = ("model.vision.", "model.aligner.")
PATCH_EMBED_GAIN = 3.0
VISION_QK_GAIN = 2.0
VISION_BIAS_STD = 0.2
ALIGNER_OUT_GAIN = 2.0


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Every parameter and stored buffer gets a random value with a sensible scale; none stays 0/1/identity."""
    g = torch.Generator().manual_seed(seed)

    def normal(shape, std, mean=0.0):
        return torch.randn(shape, generator=g) * std + mean

    for name, p in list(model.named_parameters()) + list(model.named_buffers()):
        leaf = name.rsplit(".", 1)[-1]
        shape = p.shape
        if name.startswith(DERIVED_BUFFERS):
            continue
        if name.endswith("sinks_param.weight"):
            value = normal(shape, 1.0)
        elif leaf == "e_score_correction_bias":
            value = normal(shape, 0.3)
        elif leaf == "bias_vl":
            value = normal(shape, 0.5)
        elif name.startswith(VISION_PREFIXES) and leaf == "bias":
            value = normal(shape, VISION_BIAS_STD)
        elif name == "model.vision.patch_embed.proj.weight":
            value = normal(shape, PATCH_EMBED_GAIN / math.sqrt(shape[1]))
        elif name.startswith("model.vision.") and name.endswith(".attn.wqkv.weight"):  # rows: q, k, v
            value = normal(shape, 1.0 / math.sqrt(shape[1]))
            value[: 2 * shape[0] // 3] *= VISION_QK_GAIN
        elif name == "model.aligner.w2.weight":
            value = normal(shape, ALIGNER_OUT_GAIN / math.sqrt(shape[1]))
        elif name in ("model.image_start", "model.image_end", "model.image_newline"):
            value = normal(shape, 1.0)
        elif leaf == "fn":  # mHC: [24, N*H]; with the RMS factor the mixes come out with std ~2
            value = normal(shape, 2.0 / math.sqrt(shape[1]))
        elif leaf == "base":
            value = normal(shape, 0.5)
        elif leaf == "scale":
            value = torch.rand(shape, generator=g) + 0.5
        elif leaf in ("q_weight", "k_weight"):
            value = normal(shape, 0.3, mean=1.0)
        elif leaf == "weight" and p.dim() == 1:  # every RMSNorm
            value = normal(shape, 0.2, mean=1.0)
        elif name in ("model.embed_tokens.weight",) or name.endswith("engram.embed.weight"):
            value = normal(shape, 1.0)
        elif leaf in ("gate_and_up_projs", "down_projs"):  # [E, in, out]
            value = normal(shape, 1.0 / math.sqrt(shape[1]))
        elif name.endswith("indexer.weights_proj.weight"):
            value = normal(shape, INDEXER_WEIGHTS_GAIN / math.sqrt(shape[1]))
        elif leaf == "weight" and p.dim() == 2:  # [out, in]
            value = normal(shape, 1.0 / math.sqrt(shape[1]))
        else:
            raise RuntimeError(f"no random rule for {name} {tuple(shape)}")
        p.copy_(value)


def check_randomized(model: torch.nn.Module) -> None:
    for name, p in list(model.named_parameters()) + list(model.named_buffers()):
        if name.startswith(DERIVED_BUFFERS):
            continue
        x = p.detach().float()
        if (x.numel() > 1 and float(x.std()) == 0) or bool((x == 0).all()) or bool((x == 1).all()):
            raise RuntimeError(f"{name} was left trivial")


# ----------------------------------------------------------------------------------- release names
def expected_released_names(raw: dict) -> set[str]:
    """The release's tensor names for this config (deepseek_v41_spec.md §4.1, §4.2, §4.4 when the vision tower is
    on; no DSpark)."""
    text = raw["text_config"]
    names = {"embed.weight", "head.weight", "norm.weight"}
    vision_layers = raw.get("vision_config", {}).get("num_hidden_layers", 0)
    if vision_layers:
        names |= {"image_start", "image_end", "image_newline", "vision.patch_embed.proj.weight",
                  "vision.patch_embed.proj.bias", "vision.norm.weight", "aligner.w1.weight", "aligner.w1.bias",
                  "aligner.w2.weight", "aligner.w2.bias"}
        for i in range(vision_layers):
            names |= {f"vision.blocks.{i}.{s}" for s in ("norm1.weight", "norm2.weight", "attn.wqkv.weight",
                                                          "attn.wqkv.bias", "attn.wo.weight", "attn.wo.bias",
                                                          "mlp.w1.weight", "mlp.w2.weight")}
    ratios = text["compress_ratios"]
    for layer in range(text["num_hidden_layers"]):
        p = f"layers.{layer}."
        names |= {p + s for s in ("attn_norm.weight", "ffn_norm.weight", "attn.attn_sink", "attn.q_norm.weight",
                                  "attn.kv_norm.weight", "ffn.gate.weight", "ffn.gate.bias", "ffn.gate.bias_vl")}
        names |= {f"{p}hc_{site}_{part}" for site in ("attn", "ffn") for part in ("fn", "base", "scale")}
        names |= {f"{p}attn.{w}.weight" for w in ("wq_a", "wq_b", "wkv", "wo_a", "wo_b")}
        names |= {f"{p}ffn.shared_experts.{w}.weight" for w in ("w1", "w2", "w3")}
        names |= {f"{p}ffn.experts.{e}.{w}.weight" for e in range(text["n_routed_experts"]) for w in ("w1", "w2", "w3")}
        if layer in text["kv_source_layer_ids"]:
            names |= {p + s for s in ("attn.compressor.wkv.weight", "attn.compressor.norm.weight",
                                      "attn.indexer.wk.weight", "attn.indexer.k_norm.weight")}
            if ratios[layer] > 1:
                names.add(p + "attn.compressor.wgate.weight")
        if layer in text["index_source_layer_ids"]:
            names |= {p + "attn.indexer.wq_b.weight", p + "attn.indexer.weights_proj.weight"}
        if layer in text["engram_layer_ids"]:
            names |= {p + s for s in ("engram.embed.weight", "engram.wkv.weight", "engram.q_weight",
                                      "engram.k_weight")}
    return names


def released_state_dict(model, raw: dict) -> dict[str, torch.Tensor]:
    """The model's tensors under the release's names, through NeMo's adapter (`to_hf`)."""
    out = model.state_dict_adapter.to_hf(model.state_dict())
    out = {k: v.detach().to(torch.float32).clone().contiguous() for k, v in out.items()}
    expected = expected_released_names(raw)
    if set(out) != expected:
        raise RuntimeError(f"release names differ from the spec: extra {sorted(set(out) - expected)[:10]}, "
                           f"missing {sorted(expected - set(out))[:10]}")
    return out


def load_released(folder: str, raw: dict) -> DeepseekV41ForCausalLM:
    """A fresh model (default init) loaded from ckpt/ through the adapter's `from_hf`, with ckpt/'s tokenizer."""
    tokenizer = PreTrainedTokenizerFast.from_pretrained(folder)
    with open(os.path.join(folder, "config.json")) as f:
        saved = json.load(f)
    if saved != raw:
        raise RuntimeError("config.json does not read back as the case's config")
    model = build_model(saved, tokenizer)
    native = model.state_dict_adapter.from_hf(load_file(os.path.join(folder, "model.safetensors")))
    result = model.load_state_dict(native, strict=False)
    view_loaded = getattr(model.state_dict_adapter, "view_loaded_native_keys", set()) or set()
    missing = set(result.missing_keys) - set(view_loaded)
    if missing or result.unexpected_keys:
        raise RuntimeError(f"from_hf load: missing {sorted(missing)[:10]}, unexpected {result.unexpected_keys[:10]}")
    return model.eval()


# ----------------------------------------------------------------------------------- forward passes
def logits_of(model, ids: torch.Tensor, mask: torch.Tensor | None, check_outer: bool = False) -> torch.Tensor:
    """fp32 logits [B, T, V]: the inner model with the image mask, then `lm_head` (see the module docstring);
    with check_outer (and no image tokens), also checked bit-equal against the outer forward's."""
    hidden, _ = model.model(ids, image_mask=mask)
    logits = model.lm_head(hidden)
    if check_outer and (mask is None or not bool(mask.any())):
        outer = model(input_ids=ids).logits
        if not torch.equal(outer, logits):
            raise RuntimeError("lm_head(model.model(...)) differs from the outer forward's logits")
    return logits.float()


def _np(x: torch.Tensor) -> np.ndarray:
    x = x.detach()
    return x.to(torch.float32).numpy() if x.is_floating_point() else x.numpy()


def capture(model, ids: torch.Tensor, mask: torch.Tensor | None) -> dict[str, np.ndarray]:
    """The intermediate values listed in the module docstring, for one forward."""
    global _RECORDED_TOPK_INPUTS
    text = model.config.text_config
    store: dict[str, np.ndarray] = {}
    hooks = []
    layers = list(model.model.layers.values())

    def block_in(index):
        def hook(module, args, kwargs):
            store[f"streams_{index}"] = _np(args[0])
            store[f"pre_mix_{index}"] = _np(args[1])
        return hook

    def block_out(module, args, kwargs, output):
        store[f"streams_{len(layers)}"] = _np(output[0])
        store[f"pre_mix_{len(layers)}"] = _np(output[1])

    def attn_out(index):
        def hook(module, args, kwargs, output):
            state = output.state
            if text.compress_ratios[index]:
                store[f"topk_{index}"] = _np(state.topk_indices)
            if index == text.candidate_source_layer_id:
                store["candidates"] = _np(state.candidates)
        return hook

    def record_topk_inputs(module, args, kwargs):
        global _RECORDED_TOPK_INPUTS
        _RECORDED_TOPK_INPUTS = []

    def indexer_out(index):
        def hook(module, args, kwargs, output):
            global _RECORDED_TOPK_INPUTS
            recorded, _RECORDED_TOPK_INPUTS = _RECORDED_TOPK_INPUTS, None
            scores = recorded[-1]  # the indexer's last top-k is the selection over its (masked) scores
            if scores.shape != output.topk_indices.shape[:2] + (output.index_keys.shape[1],):
                raise RuntimeError(f"layer {index}: unexpected index score shape {tuple(scores.shape)}")
            store[f"index_scores_{index}"] = _np(scores)
            if index == text.candidate_source_layer_id:  # its first top-k: over the candidate blocks
                store["candidate_block_scores"] = _np(recorded[0])
        return hook

    def gate_out(index):
        def hook(module, args, kwargs, output):
            global _RECORDED_TOPK_INPUTS
            recorded, _RECORDED_TOPK_INPUTS = _RECORDED_TOPK_INPUTS, None
            if len(recorded) != 1:
                raise RuntimeError(f"layer {index}: the router made {len(recorded)} top-k calls, expected 1")
            store[f"route_scores_{index}"] = _np(recorded[0].reshape(*ids.shape, -1))
        return hook

    def engram_out(index):
        def hook(module, args, kwargs, output):
            store[f"engram_{index}"] = _np(output)
        return hook

    def hashes_out(module, args, kwargs, output):
        store["engram_hashes"] = _np(output)

    for i, layer in enumerate(layers):
        hooks.append(layer.register_forward_pre_hook(block_in(i), with_kwargs=True))
        hooks.append(layer.attn.register_forward_hook(attn_out(i), with_kwargs=True))
        if layer.attn.indexer is not None:
            hooks.append(layer.attn.indexer.register_forward_pre_hook(record_topk_inputs, with_kwargs=True))
            hooks.append(layer.attn.indexer.register_forward_hook(indexer_out(i), with_kwargs=True))
        hooks.append(layer.ffn.gate.register_forward_pre_hook(record_topk_inputs, with_kwargs=True))
        hooks.append(layer.ffn.gate.register_forward_hook(gate_out(i), with_kwargs=True))
        if layer.engram is not None:
            hooks.append(layer.engram.register_forward_hook(engram_out(i), with_kwargs=True))
    hooks.append(layers[-1].register_forward_hook(block_out, with_kwargs=True))
    hooks.append(model.model.engram_hash.register_forward_hook(hashes_out, with_kwargs=True))
    try:
        hidden, _ = model.model(ids, image_mask=mask)
    finally:
        _RECORDED_TOPK_INPUTS = None
        for h in hooks:
            h.remove()
    store["final_hidden"] = _np(hidden)
    store["logits"] = _np(model.lm_head(hidden).float())
    store["token_map"] = _np(model.model.engram_hash.token_map)
    store["input_ids"] = _np(ids)
    store["image_mask"] = np.zeros(ids.shape, bool) if mask is None else _np(mask)
    return store


def generate_greedy(model, prompt: torch.Tensor, n_new: int) -> tuple[np.ndarray, np.ndarray]:
    """Greedy decoding by recomputing the whole sequence each step (batch 1, no image)."""
    seq = prompt.clone()
    tokens, step_logits = [], []
    for _ in range(n_new):
        last = logits_of(model, seq[None], None)[0, -1]
        nxt = int(torch.argmax(last))  # the first maximum
        tokens.append(nxt)
        step_logits.append(_np(last))
        seq = torch.cat([seq, torch.tensor([nxt], dtype=seq.dtype)])
    return np.array(tokens, np.int64), np.stack(step_logits)


# ----------------------------------------------------------------------------------- inputs
def make_inputs(case: dict) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """ids and image masks per T: random ids in [3, vocab) without the image token, BOS (0) at position 0,
    row 0 nested across T, the image span in the longest T."""
    rng = np.random.default_rng(case["seed"] + 1)
    cfg = case["config"]
    vocab_size, image_id = cfg["text_config"]["vocab_size"], cfg["image_token_id"]
    choices = np.array([i for i in range(3, vocab_size) if i != image_id])
    batch, lens = case["batch"], sorted(case["seq_lens"])
    longest = lens[-1]
    row0 = rng.choice(choices, longest)
    row0[0] = cfg["bos_token_id"]
    out = {}
    for t in lens:
        ids = rng.choice(choices, (batch, t))
        ids[:, 0] = cfg["bos_token_id"]
        ids[0] = row0[:t]
        mask = np.zeros((batch, t), bool)
        if t == longest:
            span = case["image_span"]
            mask[span["row"], span["start"]:span["stop"]] = True
            ids[mask] = image_id
        out[t] = (ids.astype(np.int64), mask)
    return out


# ----------------------------------------------------------------------------------- quantization cases
def quant_input(shape: list[int], seed: int) -> torch.Tensor:
    """fp32 values for `quantize_cache`: random rows of many magnitudes (per 16 channels, 2^-30..2^20), all-zero
    rows, and rows of 32-blocks whose amax fixes a power-of-two (or exact E4M3) scale and whose other values lie
    exactly on FP8 / FP4 rounding midpoints."""
    g = torch.Generator().manual_seed(seed)
    rows, width = shape[0] * shape[1], shape[2]
    assert width % 32 == 0
    x = torch.randn(rows, width, generator=g)
    mags = torch.exp2(torch.randint(-30, 21, (rows, width // 16), generator=g).float())
    x = x * mags.repeat_interleave(16, dim=1)
    e4m3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    e4m3 = torch.unique(e4m3[torch.isfinite(e4m3) & (e4m3 > 0)])
    fp8_mid = (e4m3[1:] + e4m3[:-1]) / 2
    fp4_mid = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    for r in range(rows):
        kind = r % 4
        if kind == 0 and r < 6:
            x[r] = 0.0
            continue
        if kind in (1, 2):
            for b in range(width // 32):
                e = int(torch.randint(-20, 12, (), generator=g))
                if kind == 1:  # FP8: amax 448·2^e, so the scale is exactly 2^e
                    amax, mids = 448.0 * 2.0**e, fp8_mid * 2.0**e
                else:  # FP4: amax 6·s with s a power of two (MXFP4) that E4M3 also holds exactly (NVFP4)
                    s = 2.0 ** max(e, -9)
                    amax, mids = 6.0 * s, fp4_mid * s
                pick = torch.randint(0, len(mids), (32,), generator=g)
                sign = torch.where(torch.rand(32, generator=g) < 0.5, -1.0, 1.0)
                block = mids[pick] * sign
                block[0], block[16] = amax, -amax
                x[r, 32 * b:32 * b + 32] = block
    return x.reshape(shape)


def write_quant_cases(spec: dict, out_dir: str) -> None:
    q = spec["quant_cases"]
    x = quant_input(q["shape"], q["seed"])
    out = {"input": x.numpy()}
    for fmt, block in q["formats"]:
        y = quantize_cache(x, format=fmt, block_size=block)
        if y.shape != x.shape or y.dtype != torch.float32 or not bool(torch.isfinite(y).all()):
            raise RuntimeError(f"quantize_cache({fmt}, {block}) gave {y.shape} {y.dtype} or non-finite values")
        out[f"{fmt}_{block}"] = y.numpy()
    np.savez(os.path.join(out_dir, "quant_cases.npz"), **out)


# ----------------------------------------------------------------------------------- vision case
def synthetic_image(width: int, height: int, rng: np.random.Generator) -> Image.Image:
    """A smooth random RGB image (width x height): per channel, a random linear gradient plus bicubic-upsampled
    random blobs (a 4x5 grid of uniform values), plus pixel noise of std 6, rounded and clipped to 0..255."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float64)
    x, y = x / max(width - 1, 1) - 0.5, y / max(height - 1, 1) - 0.5
    slopes = rng.uniform(-1.0, 1.0, (2, 3))
    gradient = 128.0 + 120.0 * (x[..., None] * slopes[0] + y[..., None] * slopes[1])
    coarse = Image.fromarray(rng.integers(0, 256, (4, 5, 3), dtype=np.uint8))
    blobs = np.asarray(coarse.resize((width, height), Image.Resampling.BICUBIC), np.float64)
    pixels = 0.5 * gradient + 0.5 * blobs + rng.normal(0.0, 6.0, (height, width, 3))
    return Image.fromarray(np.clip(np.rint(pixels), 0, 255).astype(np.uint8), "RGB")


def process(processor, words: list[str], image: Image.Image) -> dict[str, torch.Tensor]:
    """NeMo's `DeepseekV41Processor.__call__` on one pre-split prompt (one word = one token of the word-level
    tokenizer; `IMAGE_PLACEHOLDER` is `image_token_id`) with one image: input_ids, attention_mask,
    vision_token_types [1, T], pixel_values [N, 3, 14, 14] (bf16, as the processor makes them), image_grid_hws
    [1, 2]."""
    enc = processor(text=[words], images=[image], is_split_into_words=True, return_tensors="pt")
    out = {k: enc[k] for k in ("input_ids", "attention_mask", "vision_token_types", "pixel_values", "image_grid_hws")}
    if out["pixel_values"].dtype != torch.bfloat16:
        raise RuntimeError(f"the processor's patches are {out['pixel_values'].dtype}, expected bfloat16")
    return out


def topk_margins(calls: list[tuple[torch.Tensor, int]]) -> tuple[int, int, float]:
    """(selections, fragile ones, smallest gap between the k-th and (k+1)-th scores where they are not both
    exactly zero) over recorded top-k calls. A selection among more than k finite scores is fragile when those two
    scores are within 1e-5 of the call's largest |score| and not both exactly zero (test_v41_harness.py's
    `_assert_margins` rule)."""
    total, fragile, smallest = 0, 0, math.inf
    for scores, k in calls:
        srt = -np.sort(-scores.float().numpy().reshape(-1, scores.shape[-1]), axis=-1)
        if srt.shape[-1] <= k:
            continue
        srt = srt[np.isfinite(srt[:, k])]
        if not srt.size:
            continue
        kth, nxt = srt[:, k - 1], srt[:, k]
        gap = kth - nxt
        zero = (kth == 0) & (nxt == 0)
        robust = (gap > 1e-5 * np.abs(srt[np.isfinite(srt)]).max()) | zero
        total += len(srt)
        fragile += int((~robust).sum())
        if (~zero).any():
            smallest = min(smallest, float(gap[~zero].min()))
    return total, fragile, smallest


def vision_forward(model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, list]]:
    """fp32 logits [1, T, V] of NeMo's outer forward with the image (`pixel_values`, `image_grid_hws`,
    `vision_token_types`; no attention_mask, positions 0..T-1), and what reached the inner model: the
    `image_mask` every block received, the Engram hasher's `token_mask`, the aligner's outputs."""
    seen: dict[str, list] = {"image_mask": [], "token_mask": [], "rows": []}
    hooks = []

    def block_in(module, args, kwargs):
        seen["image_mask"].append(kwargs.get("image_mask"))

    def hash_in(module, args, kwargs):
        seen["token_mask"].append(kwargs.get("token_mask"))

    def aligner_out(module, args, output):
        seen["rows"].append(output.detach().clone())

    for layer in model.model.layers.values():
        hooks.append(layer.register_forward_pre_hook(block_in, with_kwargs=True))
    if model.model.engram_hash is not None:
        hooks.append(model.model.engram_hash.register_forward_pre_hook(hash_in, with_kwargs=True))
    hooks.append(model.model.aligner.register_forward_hook(aligner_out))
    try:
        logits = model(input_ids=batch["input_ids"], pixel_values=batch["pixel_values"],
                       image_grid_hws=batch["image_grid_hws"], vision_token_types=batch["vision_token_types"]).logits
    finally:
        for h in hooks:
            h.remove()
    return logits.float(), seen


def run_vision(case: dict, folder: str, model, reloaded, tokenizer) -> None:
    """The vision case's outputs (module docstring): per image the processor's patches, grid, canvas and span
    length, the ViT's features and the aligner's rows; one prompt with image 0 and its logits."""
    spec = case["vision"]
    cfg = case["config"]
    vcfg = model.config.vision_config
    vision, aligner = model.model.vision, model.model.aligner
    processor = nemo_processing.DeepseekV41Processor(tokenizer=tokenizer, config=model.config)
    placeholder = nemo_processing.IMAGE_PLACEHOLDER
    if tokenizer.convert_tokens_to_ids(placeholder) != cfg["image_token_id"]:
        raise RuntimeError(f"{placeholder} is not image_token_id in the vocabulary")
    rng = np.random.default_rng(case["seed"] + 2)
    log = []
    images, all_rows = [], []
    for i, (width, height) in enumerate(spec["image_sizes"]):
        image = synthetic_image(width, height, rng)
        path = os.path.join(folder, f"vision_image_{i}.png")
        image.save(path)
        with Image.open(path) as f:
            image = f.convert("RGB")  # what the PNG holds (lossless: checked)
        if image.size != (width, height):
            raise RuntimeError(f"image {i}: size {image.size}")
        images.append(image)
        enc = process(processor, [placeholder], image)
        types = enc["vision_token_types"][0]
        patches = enc["pixel_values"].to(torch.float32)  # bf16 values, exactly
        n_h, n_w = (int(v) for v in enc["image_grid_hws"][0])
        plan = nemo_processing._plan_image_grid(width, height, vcfg)  # what `_preprocess_image` resized/padded to
        rows_h, rows_w = -(-n_h // vcfg.downsample_ratio), -(-n_w // vcfg.downsample_ratio)
        if (plan.vit_height, plan.vit_width, plan.llm_height, plan.llm_width) != (n_h, n_w, rows_h, rows_w) or \
                (plan.height, plan.width) != (n_h * vcfg.patch_size, n_w * vcfg.patch_size):
            raise RuntimeError(f"image {i}: the processor's grid {n_h}x{n_w} disagrees with its plan {plan}")
        if len(types) != rows_h * (rows_w + 1) + 2 or int((types == nemo_processing.IMAGE).sum()) != rows_h * rows_w:
            raise RuntimeError(f"image {i}: span of {len(types)} tokens for {rows_h}x{rows_w} cells")
        if len(types) > vcfg.max_image_tokens or patches.shape != (n_h * n_w, 3, vcfg.patch_size, vcfg.patch_size):
            raise RuntimeError(f"image {i}: {len(types)} tokens, patches {tuple(patches.shape)}")
        features = vision(patches, n_h, n_w)
        rows = aligner(features, n_h, n_w)
        if rows.shape != (rows_h * rows_w, cfg["text_config"]["hidden_size"]):
            raise RuntimeError(f"image {i}: aligner rows {tuple(rows.shape)}")
        if not (torch.isfinite(features).all() and torch.isfinite(rows).all()):
            raise RuntimeError(f"image {i}: non-finite vision outputs")
        if i == 0:  # the reloaded checkpoint's tower gives the same (the prompt's logits check the rest)
            if not torch.equal(rows, reloaded.model.aligner(reloaded.model.vision(patches, n_h, n_w), n_h, n_w)):
                raise RuntimeError("the reloaded release checkpoint gives different vision rows")
        np.save(os.path.join(folder, f"vision_patches_{i}.npy"), _np(patches))
        np.save(os.path.join(folder, f"vision_grid_{i}.npy"), np.array([n_h, n_w], np.int64))
        np.save(os.path.join(folder, f"vision_canvas_{i}.npy"), np.array([plan.height, plan.width], np.int64))
        np.save(os.path.join(folder, f"vision_features_{i}.npy"), _np(features))
        np.save(os.path.join(folder, f"vision_rows_{i}.npy"), _np(rows))
        np.save(os.path.join(folder, f"vision_tokens_{i}.npy"), np.array(len(types), np.int64))
        all_rows.append(rows)
        log.append(f"{width}x{height} -> canvas {plan.width}x{plan.height}, grid {n_h}x{n_w}, cells {rows_h}x{rows_w}, "
                   f"{len(types)} tokens; features std {float(features.std()):.3g}, rows std {float(rows.std()):.3g}")
    means = torch.stack([r.mean(0) for r in all_rows])
    if float(torch.cdist(means, means).fill_diagonal_(math.inf).min()) < 1e-2 * float(means.norm(dim=-1).mean()):
        raise RuntimeError("two images' aligner rows have (nearly) the same mean: the images do not tell apart")

    # One prompt with image 0: BOS, text, image 0's span as the processor expands it, text.
    p = spec["prompt"]
    vocab, image_id = case["vocabulary"], cfg["image_token_id"]
    choices = np.array([i for i in range(3, cfg["text_config"]["vocab_size"]) if i != image_id])
    before, after = rng.choice(choices, p["text_before"]), rng.choice(choices, p["text_after"])
    words = [vocab[cfg["bos_token_id"]]] + [vocab[i] for i in before] + [placeholder] + [vocab[i] for i in after]
    batch = process(processor, words, images[p["image"]])
    ids, types = batch["input_ids"], batch["vision_token_types"]
    mask = types >= 0
    span = int(mask.sum())
    start = 1 + len(before)
    expected_ids = np.concatenate([[cfg["bos_token_id"]], before, np.full(span, image_id), after])
    if ids.shape != (1, len(expected_ids)) or not np.array_equal(ids[0].numpy(), expected_ids) or \
            not bool(mask[0, start:start + span].all()) or \
            span != int(np.load(os.path.join(folder, f"vision_tokens_{p['image']}.npy"))):
        raise RuntimeError(f"the processor's prompt differs from the intended one: {ids.tolist()}")
    if not torch.equal(batch["pixel_values"].to(torch.float32),
                       torch.from_numpy(np.load(os.path.join(folder, f"vision_patches_{p['image']}.npy")))):
        raise RuntimeError("the prompt's patches differ from the image's")
    np.save(os.path.join(folder, "vision_input_ids.npy"), _np(ids).astype(np.int64))
    np.save(os.path.join(folder, "vision_token_types.npy"), _np(types).astype(np.int64))
    np.save(os.path.join(folder, "vision_image_mask.npy"), _np(mask))

    global _ALL_TOPK_CALLS
    margins = []
    for variant in VARIANTS:
        with cache_quantization(variant):
            _ALL_TOPK_CALLS = []
            try:
                logits, seen = vision_forward(model, batch)
                total, fragile, smallest = topk_margins(_ALL_TOPK_CALLS)
            finally:
                _ALL_TOPK_CALLS = None
            margins.append(f"{variant} {fragile} of {total} (smallest nonzero gap {smallest:.3g})")
            if variant == "identity":
                again, _ = vision_forward(reloaded, batch)
                if not torch.equal(logits, again):
                    raise RuntimeError("the reloaded release checkpoint gives different logits with the image")
                plain = logits_of(model, ids, mask)  # the span embedded as the image token's row, same mask
        if len(seen["image_mask"]) != len(model.model.layers) or \
                not all(m is not None and torch.equal(m, mask) for m in seen["image_mask"]):
            raise RuntimeError(f"{variant}: the blocks did not receive the whole image span as image_mask")
        if model.model.engram_hash is not None and not torch.equal(seen["token_mask"][0], ~mask):
            raise RuntimeError(f"{variant}: Engram's hasher did not receive the span as masked")
        if len(seen["rows"]) != 1 or not torch.equal(seen["rows"][0], all_rows[p["image"]]):
            raise RuntimeError(f"{variant}: the forward's aligner rows differ from vision_rows_{p['image']}")
        if logits.shape != (1, len(expected_ids), cfg["text_config"]["vocab_size"]) or \
                not bool(torch.isfinite(logits).all()):
            raise RuntimeError(f"{variant}: logits {tuple(logits.shape)} or non-finite")
        np.save(os.path.join(folder, f"vision_logits_{variant}.npy"), _np(logits))
    ident = np.load(os.path.join(folder, "vision_logits_identity.npy"))
    quant = np.load(os.path.join(folder, "vision_logits_quantized.npy"))
    plain = _np(plain)
    diff = np.abs(ident - plain).max(-1)[0]
    if diff[:start].max() > 1e-5 * np.abs(ident).max() or diff[start:].min() < 1e-2:
        raise RuntimeError(f"the image does not change exactly the positions from the span on: {diff.tolist()}")
    log.append(f"prompt of {ids.shape[1]} tokens (span {start}..{start + span - 1}): logit std {ident.std():.3g}; "
               f"|image - plain span| min {diff[start:].min():.3g} from the span on; |quantized - identity| max "
               f"{np.abs(ident - quant).max():.3g}; top-k selections within fp32 rounding of a tie (router, "
               f"indexer, candidate blocks): " + ", ".join(margins))
    print(f"{case['name']}: " + "; ".join(log), file=sys.stderr)


# ----------------------------------------------------------------------------------- one case
def run_case(case: dict, out_dir: str) -> None:
    folder = os.path.join(out_dir, case["name"])
    ckpt = os.path.join(folder, "ckpt")
    os.makedirs(ckpt, exist_ok=True)
    raw, text = case["config"], case["config"]["text_config"]
    tokenizer = build_tokenizer(case["vocabulary"], raw)
    torch.manual_seed(case["seed"])
    model = build_model(raw, tokenizer)
    randomize(model, case["seed"])
    check_randomized(model)
    if model.model.engram_hash is not None:
        n = int(model.model.engram_hash.token_map.max()) + 1
        if n != text["engram_compressed_vocab_size"]:  # NeMo checks this at construction; keep it explicit
            raise RuntimeError(f"compressed vocabulary {n} != engram_compressed_vocab_size")

    # The release-format checkpoint, reloaded through NeMo's adapter.
    save_file(released_state_dict(model, raw), os.path.join(ckpt, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(ckpt, "config.json"), "w") as f:
        json.dump(raw, f, indent=2)
    tokenizer.save_pretrained(ckpt)
    reloaded = load_released(ckpt, raw)
    if "vision" in case:
        run_vision(case, folder, model, reloaded, tokenizer)
        return

    inputs = make_inputs(case)
    longest = max(inputs)
    for t, (ids_np, mask_np) in sorted(inputs.items()):
        np.save(os.path.join(folder, f"input_ids_{t}.npy"), ids_np)
        np.save(os.path.join(folder, f"image_mask_{t}.npy"), mask_np)
        ids = torch.from_numpy(ids_np)
        mask = torch.from_numpy(mask_np) if mask_np.any() else None
        for variant in VARIANTS:
            with cache_quantization(variant):
                logits = logits_of(model, ids, mask, check_outer=True)
                if variant == "identity" and not torch.equal(logits, logits_of(reloaded, ids, mask)):
                    raise RuntimeError(f"T={t}: the reloaded release checkpoint gives different logits")
            if not bool(torch.isfinite(logits).all()):
                raise RuntimeError(f"T={t} {variant}: non-finite logits")
            np.save(os.path.join(folder, f"logits_{variant}_{t}.npy"), _np(logits))
        if t == longest:
            with cache_quantization("identity"):
                nomask = logits_of(model, ids, None)
            np.save(os.path.join(folder, f"logits_identity_nomask_{t}.npy"), _np(nomask))

    ids, mask = (torch.from_numpy(a) for a in inputs[longest])
    for variant in VARIANTS:
        with cache_quantization(variant):
            store = capture(model, ids, mask)
        ref = np.load(os.path.join(folder, f"logits_{variant}_{longest}.npy"))
        if not np.array_equal(store["logits"], ref):
            raise RuntimeError(f"{variant}: the captured forward's logits differ from the plain forward's")
        np.savez(os.path.join(folder, f"capture_{variant}.npz"), **store)

    gen = case["generate"]
    prompt = ids[0, : gen["prompt_len"]]
    with cache_quantization("identity"):
        tokens, step_logits = generate_greedy(model, prompt, gen["new_tokens"])
    np.savez(os.path.join(folder, "generate_identity.npz"), prompt=prompt.numpy(), tokens=tokens, logits=step_logits)
    print(f"{case['name']}: {summary(folder, case)}", file=sys.stderr)


def summary(folder: str, case: dict) -> str:
    """Selection margins and the quantized/identity gap, for the log."""
    cap = np.load(os.path.join(folder, "capture_identity.npz"))
    k = case["config"]["text_config"]["index_topk"]
    parts = []
    for key in sorted(f for f in cap.files if f.startswith("index_scores_")):
        s = cap[key]
        finite = np.isfinite(s)
        srt = -np.sort(-s, axis=-1)[finite.sum(-1) > k]
        gap = srt[:, k - 1] - srt[:, k]
        zeros = float((s[finite] == 0).mean())
        parts.append(f"{key}: min gap {gap.min() if gap.size else float('nan'):.3g}, "
                     f"exact zeros {zeros:.1%}")
    for key in sorted(f for f in cap.files if f.startswith("route_scores_")):
        srt = -np.sort(-cap[key], axis=-1)
        n = case["config"]["text_config"]["num_experts_per_tok"]
        parts.append(f"{key}: min gap {(srt[..., n - 1] - srt[..., n]).min():.3g}")
    b = cap["candidate_block_scores"]
    srt = -np.sort(-b, axis=-1)
    nb = case["config"]["text_config"]["candidate_topk_blocks"]
    if b.shape[-1] > nb:
        srt = srt[np.isfinite(srt[..., nb])]
        parts.append(f"candidate blocks: min gap {(srt[:, nb - 1] - srt[:, nb]).min():.3g}")
    t = max(case["seq_lens"])
    a = np.load(os.path.join(folder, f"logits_identity_{t}.npy"))
    b = np.load(os.path.join(folder, f"logits_quantized_{t}.npy"))
    parts.append(f"|quantized - identity| max {np.abs(a - b).max():.3g} (logit std {a.std():.3g})")
    return "; ".join(parts)


def run_harness(name: str, run) -> None:
    """A harness's command line, `python NAME SPEC.json OUT_DIR`: `run(spec, out_dir)` with the stable top-k in
    place; OUT_DIR/done written only when it succeeded, any failure a nonzero exit naming it."""
    if len(sys.argv) != 3:
        sys.exit(f"usage: python {name} SPEC.json OUT_DIR")
    spec_path, out_dir = sys.argv[1], sys.argv[2]
    try:
        with open(spec_path) as f:
            spec = json.load(f)
        os.makedirs(out_dir, exist_ok=True)
        done = os.path.join(out_dir, "done")
        if os.path.exists(done):
            os.remove(done)
        install_stable_topk()
        run(spec, out_dir)
    except Exception as exc:  # noqa: BLE001
        traceback.print_exc()
        sys.exit(f"{name} failed: {type(exc).__name__}: {exc}")
    with open(done, "w") as f:
        f.write(f"ok in {time.time() - STARTED:.1f} s\n")


def run_all(spec: dict, out_dir: str) -> None:
    for case in spec["cases"]:
        run_case(case, out_dir)
    write_quant_cases(spec, out_dir)


if __name__ == "__main__":
    run_harness("run_v41_reference.py", run_all)
