"""What the V4.1 parity harness (run_v41_reference.py) runs: the tiny V4.1 preset as given, with its vocabulary.

The harness's environment has no dsjax, so the configs and the vocabulary travel in the spec itself."""

from __future__ import annotations

import copy

from dsjax.presets import PRESETS, tiny_v41_vocabulary

def _mixed() -> dict:
    config = copy.deepcopy(PRESETS["tiny-v4.1"])
    config["text_config"].update(
        num_hidden_layers=9, compress_ratios=[0, 2, 2, 2, 2, 1, 1, 1, 1], kv_source_layer_ids=[1, 5],
        index_source_layer_ids=[1, 3, 5, 7], candidate_source_layer_id=5, engram_layer_ids=[2, 4],
        sliding_window=6, index_topk=6)
    return config


CASES = [
    # Three lengths: 17 (odd: a ratio-2 pair left open; fewer entries than candidate blocks), 48 and 64 (past the
    # candidate pool of 4 blocks of 8). Row 1 of the longest carries an image span (ids = image_token_id).
    # Greedy decoding from row 0's first 20 tokens, 32 steps, by full recompute.
    {"name": "tiny", "config": copy.deepcopy(PRESETS["tiny-v4.1"]), "vocabulary": tiny_v41_vocabulary(),
     "seed": 41, "batch": 2, "seq_lens": [17, 48, 64], "image_span": {"row": 1, "start": 5, "stop": 14},
     "generate": {"prompt_len": 20, "new_tokens": 32}},
    # Every role at both ratios: Full 1, Reuse 2, Reindex 3 and Reuse 4 at ratio 2 (4 reusing 3's picks); Full 5
    # (the candidate source), Reuse 6, Reindex 7 inside the pool, Reuse 8 at ratio 1; Engram before 2 and 4; a
    # window of 6 and top-6 picks. Row 0 of the longest carries the image span.
    {"name": "mixed", "config": _mixed(), "vocabulary": tiny_v41_vocabulary(),
     "seed": 7, "batch": 2, "seq_lens": [23, 64], "image_span": {"row": 0, "start": 30, "stop": 40},
     "generate": {"prompt_len": 16, "new_tokens": 32}},
    # The tiny text model reading images (tiny-v4.1-vision): NeMo's processor, ViT and aligner on five synthetic
    # images (width, height): upscaled to min_pixels, as is, capped at max_image_tokens, 5:1 (max_wh_ratio is null:
    # padded, not clamped), square; then one prompt (BOS, 5 words, image 0's span, 6 words) through the whole
    # model. No text-only outputs for this case (see run_v41_reference.py).
    {"name": "vision", "config": copy.deepcopy(PRESETS["tiny-v4.1-vision"]), "vocabulary": tiny_v41_vocabulary(),
     "seed": 147, "vision": {"image_sizes": [[100, 80], [640, 480], [2000, 1500], [1500, 300], [700, 700]],
                             "prompt": {"image": 0, "text_before": 5, "text_after": 6}}},
]

# NeMo's cache quantize-dequantize on one fixed input, for each (format, block size) the model uses.
QUANT_CASES = {"shape": [3, 7, 512], "seed": 5, "formats": [["fp8", 32], ["nvfp4", 16], ["mxfp4", 32]]}

SPEC = {"cases": CASES, "quant_cases": QUANT_CASES}
