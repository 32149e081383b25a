"""What the DSpark parity harness (run_v41_dspark_reference.py) runs: the tiny V4.1 preset with three DSpark stages."""

from __future__ import annotations

import copy

from dsjax.presets import PRESETS, tiny_v41_vocabulary


def _with_dspark() -> dict:
    config = copy.deepcopy(PRESETS["tiny-v4.1"])
    text = config["text_config"]
    # Three stages as released, after the tiny preset's eight layers; features from its last three layers (two of
    # them decoder layers, one after an Engram-free encoder layer); fewer drafter experts than the target's, three
    # picked; a noise token inside the vocabulary.
    text.update(num_nextn_predict_layers=3, compress_ratios=text["compress_ratios"] + [0, 0, 0],
                dspark_block_size=5, dspark_noise_token_id=254, dspark_target_layer_ids=[5, 6, 7],
                dspark_markov_rank=8, dspark_n_routed_experts=6, dspark_num_experts_per_tok=3)
    return config


CASES = [
    # Two rows of 30 tokens; three blocks a row. Anchors near the start (a context shorter than the window of 8),
    # in the middle and at the last place a block fits (T − 5).
    {"name": "dspark", "config": _with_dspark(), "vocabulary": tiny_v41_vocabulary(), "seed": 53, "batch": 2,
     "seq_len": 30, "anchors": [[3, 14, 25], [1, 9, 20]]},
]

SPEC = {"cases": CASES}
