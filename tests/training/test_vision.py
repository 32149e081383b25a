"""The synthetic image task and the encoder's training: images hold the colour they are labelled with,
training prompts are the job's, and training moves the encoder only."""

import io

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from PIL import Image

from dsjax.batch.jobfile import InputLine
from dsjax.batch.recipe import Recipe
from dsjax.config import ModelConfig
from dsjax.embedded import MODEL_DIR
from dsjax.model import DeepseekV4
from dsjax.training.vision import COLOURS, ShapeData, answer_of, shape_image, shape_request, train_encoder


def test_the_shape_has_the_colour_it_is_named_after():
    rng = np.random.default_rng(0)
    for _ in range(30):
        png, name = shape_image(rng)
        pixels = np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).astype(int)
        spread = pixels.max(axis=-1) - pixels.min(axis=-1)
        shape = pixels[spread > 60]  # the background is grey (noise is the same on every channel)
        assert len(shape) > 0.03 * spread.size
        mean = shape.mean(axis=0)
        assert min(COLOURS, key=lambda c: np.abs(np.asarray(COLOURS[c]) - mean).sum()) == name


@pytest.fixture(scope="module")
def setup():
    cfg = ModelConfig.from_hf({**ModelConfig.preset("tiny-vision").to_hf(), "vocab_size": 8192,
                               "max_position_embeddings": 1024, "eos_token_id": 1})
    model = DeepseekV4(cfg, rngs=nnx.Rngs(0), dtype=jnp.float32)
    recipe = Recipe(f"{MODEL_DIR}/tokenizer.json", 1024, (1,), vision=cfg.vision)
    return model, recipe


def test_training_batches_are_the_jobs_prompts(setup):
    model, recipe = setup
    data = ShapeData(recipe, 1, seed=3)
    b = data.batch(3)
    again = np.random.default_rng(3)
    for i in range(3):
        png, name = shape_image(again)
        assert name == b.colours[i]
        prep = recipe.prepare(InputLine(1, "x", "/v1/chat/completions", shape_request("x", png)["body"]))
        n = len(prep.prompt)
        answer = recipe.tokenizer.encode(name) + [1]
        np.testing.assert_array_equal(b.tokens_bt[i, :n + len(answer)], prep.prompt + answer)
        assert b.loss_bt[i].sum() == len(answer) and b.loss_bt[i, n - 1]
        assert b.image_start == prep.images[0].start


def test_training_moves_the_encoder_only_and_lowers_the_loss(setup):
    model, recipe = setup
    before = {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model))}
    logs = []
    trained = train_encoder(model, ShapeData(recipe, 1, seed=0), steps=4, batch_size=2, learning_rate=3e-3,
                            log=logs.append, eval_every=2)
    after = {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(trained))}
    moved = {p for p in before if not np.array_equal(before[p], after[p])}
    assert moved and all(p[0] == "vision" for p in moved)
    assert logs[-1]["step"] == 4 and logs[-1]["loss"] < logs[0]["loss"]


def test_answers_are_read_from_chat_records():
    ok = {"error": None, "response": {"body": {"choices": [{"message": {"content": " Red\n"}}]}}}
    assert answer_of(ok) == "red" and answer_of({"error": {"code": "x"}}) == ""
