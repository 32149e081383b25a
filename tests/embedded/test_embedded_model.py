"""The shipped model: size budget, original names, and its held-out loss through both paths."""

import json
import os

import numpy as np
import pytest

import dsjax
from dsjax.embedded import HERE, MODEL_DIR
from dsjax.engine.scoring import teacher_forced_logprobs
from dsjax.run_config import RunConfig
from dsjax.training.loss import evaluate, unigram_entropy
from tests.helpers import recipe_prompt_tokens


@pytest.fixture(scope="module")
def model():
    return dsjax.load_model(MODEL_DIR)


@pytest.fixture(scope="module")
def heldout():
    return np.load(os.path.join(MODEL_DIR, "heldout.npy")).astype(np.int32)


@pytest.fixture(scope="module")
def metrics():
    with open(os.path.join(MODEL_DIR, "metrics.json")) as f:
        return json.load(f)


def test_fits_the_package_budget_and_uses_original_names():
    total = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(HERE) for f in fs
                if "__pycache__" not in d)
    assert total <= 25_000_000, total
    with open(os.path.join(MODEL_DIR, "model.safetensors.index.json")) as f:
        names = json.load(f)["weight_map"]
    assert "embed.weight" in names and "layers.4.attn.indexer.wq_b.weight" in names
    assert "layers.5.ffn.experts.7.w3.weight" in names and not any(n.startswith("model.") for n in names)


def test_heldout_loss_through_prefill_and_cached_decode_equals_the_training_codes(model, heldout, metrics):
    assert heldout.shape == (16, 512)
    training = evaluate(model, heldout)
    inference = float(-teacher_forced_logprobs(model, heldout, prefill_tokens=128).astype(np.float64).mean())
    assert abs(inference - training) < 1e-3, (inference, training)
    # The numbers recorded next to the model (measured on the H200 that trained it) reproduce here.
    assert abs(training - metrics["heldout_ce_training_code"]) < 1e-3
    assert abs(inference - metrics["heldout_ce_inference_path"]) < 1e-3
    unigram = unigram_entropy(heldout, model.cfg.vocab_size)
    assert unigram == pytest.approx(metrics["heldout_unigram_entropy"], abs=1e-4)
    assert training < unigram - 3.0, (training, unigram)  # far below any context-free model


def test_it_reads_images_its_decoder_unchanged():
    """The shipped model reads images (the shapes task) with the decoder `scripts/train_tiny.py` trained:
    the held-out numbers above are that decoder's."""
    model = dsjax.load_model(MODEL_DIR)
    assert model.cfg.vision == dsjax.ModelConfig.preset("demo-vision").vision
    assert model.cfg.replace(vision=None) == dsjax.ModelConfig.preset("demo").replace(
        eos_token_id=model.cfg.eos_token_id, bos_token_id=model.cfg.bos_token_id)


def test_shapes_task_through_generate_beats_chance_by_far(tmp_path):
    """48 fresh images (not the training draws; `scripts/eval_vision.py` runs 100) through `dsjax generate`:
    the answers name the shape's colour far more often than chance (1 in 6); every record is a 200 whose
    prompt usage is the recipe's."""
    from dsjax.training.vision import task_accuracy

    result = task_accuracy(MODEL_DIR, 48, 1000, str(tmp_path), run=RunConfig(slots=16, max_len=256, chunk_size=128,
                           dtype="float32"), progress=False)
    print({k: v for k, v in result.items() if k != "records"})
    assert result["errors"] == 0
    assert all(r["response"]["status_code"] == 200 for r in result["records"])
    usage = {r["custom_id"]: r["response"]["body"]["usage"]["prompt_tokens"] for r in result["records"]}
    with open(tmp_path / "shapes.jsonl") as f:
        for line in list(f)[:5]:
            request = json.loads(line)
            assert usage[request["custom_id"]] == recipe_prompt_tokens(request["body"], f"{MODEL_DIR}/tokenizer.json")
    assert result["accuracy"] >= 0.8, result["per_colour"]

