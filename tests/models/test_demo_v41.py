"""The trained small V4.1 (`models/demo-v4.1/`): its release-format checkpoint, its held-out loss through both
paths, and DSpark on it: greedy decoding with the drafter gives exactly the tokens plain decoding gives (fp32), and
the drafter's tokens are kept far more often than chance."""

import json
import os

import numpy as np
import pytest

import dsjax
from dsjax.config_v41 import V41Config
from dsjax.engine.acceptance import Acceptance
from dsjax.engine.engine import Engine
from dsjax.engine.sampling import SamplingParams
from dsjax.engine.scheduler import Request, run
from dsjax.engine.scoring import teacher_forced_logprobs
from dsjax.run_config import RunConfig
from dsjax.training.loss import evaluate

MODEL_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "models", "demo-v4.1")


@pytest.fixture(scope="module")
def shipped():
    """(model, held-out rows, metrics) as the folder holds them."""
    with open(os.path.join(MODEL_DIR, "metrics.json")) as f:
        metrics = json.load(f)
    return dsjax.load_model(MODEL_DIR), np.load(os.path.join(MODEL_DIR, "heldout.npy")).astype(np.int32), metrics


def test_it_is_the_preset_in_release_names(shipped):
    model = shipped[0]
    assert model.cfg == V41Config.preset("demo-v4.1")
    with open(os.path.join(MODEL_DIR, "model.safetensors.index.json")) as f:
        names = json.load(f)["weight_map"]
    assert "mtp.2.markov_head.head.weight" in names and "mtp.0.main_proj.weight" in names
    assert "layers.1.engram.embed.weight" in names and "layers.3.engram.k_weight" in names


@pytest.mark.heavy
def test_heldout_loss_through_prefill_and_cached_decode_equals_the_training_codes(shipped):
    model, heldout, metrics = shipped
    rows = heldout[:4]
    training = evaluate(model, rows)
    inference = float(-teacher_forced_logprobs(model, rows, prefill_tokens=128).astype(np.float64).mean())
    assert abs(inference - training) < 2e-3, (inference, training)
    assert training < metrics["heldout_unigram_entropy"] - 2.0, training  # it predicts something


@pytest.mark.heavy
def test_greedy_with_dspark_is_plain_greedy_and_the_drafter_beats_chance(shipped):
    model, heldout, _ = shipped
    base = RunConfig(slots=4, max_len=160, chunk_size=64, dtype="float32")
    requests = [Request(i, tuple(int(t) for t in heldout[i, :40 + 16 * i]), SamplingParams(temperature=0.0,
                                                                                              max_tokens=48), 0,
                        frozenset()) for i in range(6)]

    def generate(engine, acceptance=None):
        out = {}
        for ev in run(engine, requests, acceptance=acceptance):
            out.setdefault(ev.index, []).append(ev.token)
        return out

    want = generate(Engine(model, base))
    acceptance = Acceptance(model.cfg.dspark_block_size)
    got = generate(Engine(model, base.replace(speculative="dspark", drafts=5)), acceptance)
    assert got == want
    figures = acceptance.summary()
    # A random drafter's greedy drafts almost never match an 8,192-token argmax (1.0); this one's first does ~45%.
    assert figures["mean_accepted_length"] > 1.2, figures
