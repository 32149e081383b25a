"""The image encoder's weights in checkpoints: under `model.vision.` (HF) / `vision.` (original names),
through save, load, quantization, synthetic release checkpoints and `dsjax convert`."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import dsjax
from dsjax.checkpoint import names
from dsjax.checkpoint.convert import convert
from dsjax.checkpoint.safetensors_io import CheckpointError, iter_tensors
from dsjax.checkpoint.save import save_model
from dsjax.checkpoint.synthetic import write_synthetic
from dsjax.config import ModelConfig
from dsjax.quantize import quantize_model
from tests.helpers import assert_same_state


@pytest.fixture(scope="module")
def model():
    return dsjax.DeepseekV4(ModelConfig.preset("tiny-vision"), rngs=nnx.Rngs(3), dtype=jnp.float32)


def _names(folder) -> set[str]:
    return {name for name, _, _ in iter_tensors(str(folder))}


@pytest.mark.parametrize("naming, prefix", [("hf", "model.vision."), ("original", "vision.")])
def test_encoder_weights_round_trip_under_their_prefix(model, tmp_path, naming, prefix):
    save_model(model, tmp_path, naming=naming)
    vision = sorted(n for n in _names(tmp_path) if "vision" in n)
    assert vision and all(n.startswith(prefix) for n in vision)
    assert f"{prefix}blocks.1.qkv.weight" in vision and f"{prefix}row_end" in vision
    assert_same_state(model, dsjax.load_model(tmp_path))


def test_names_map_both_ways():
    assert names.to_hf("vision.blocks.0.fc1.bias") == "model.vision.blocks.0.fc1.bias"
    assert names.to_hf("model.vision.image_end") == "model.vision.image_end"
    assert names.to_original("model.vision.merge_in.weight") == "vision.merge_in.weight"


def test_a_text_only_model_is_unchanged_by_the_vision_code():
    """Same weights as before the encoder existed: it is made last, from the remaining random draws."""
    text = dsjax.DeepseekV4(ModelConfig.preset("tiny"), rngs=nnx.Rngs(3), dtype=jnp.float32)
    seeing = dsjax.DeepseekV4(ModelConfig.preset("tiny-vision"), rngs=nnx.Rngs(3), dtype=jnp.float32)
    assert text.vision is None
    text_state = dict(nnx.to_flat_state(nnx.state(text)))
    seeing_state = dict(nnx.to_flat_state(nnx.state(seeing)))
    assert {p for p in seeing_state if p[0] != "vision"} == set(text_state)
    for path, var in text_state.items():
        np.testing.assert_array_equal(np.asarray(var.get_value()), np.asarray(seeing_state[path].get_value()))


def test_missing_or_unexpected_encoder_weights_are_named(model, tmp_path):
    save_model(model, tmp_path / "seeing")
    text = dsjax.DeepseekV4(ModelConfig.preset("tiny"), rngs=nnx.Rngs(3), dtype=jnp.float32)
    save_model(text, tmp_path / "blind")
    # a config that reads images over weights that have no encoder, and the other way round
    (tmp_path / "blind" / "config.json").write_text((tmp_path / "seeing" / "config.json").read_text())
    with pytest.raises(CheckpointError, match="model.vision"):
        dsjax.load_model(tmp_path / "blind")
    save_model(text, tmp_path / "text-config")
    save_model(model, tmp_path / "extra")
    (tmp_path / "extra" / "config.json").write_text((tmp_path / "text-config" / "config.json").read_text())
    with pytest.raises(CheckpointError, match="vision"):
        dsjax.load_model(tmp_path / "extra")


def test_quantized_models_keep_the_encoder_float(model, tmp_path):
    q = quantize_model(model)
    assert q.vision.blocks[0].qkv.weight[...].dtype == jnp.float32
    save_model(q, tmp_path)
    assert_same_state(q, dsjax.load_model(tmp_path))


def test_synthetic_release_and_conversion_carry_the_encoder(tmp_path):
    cfg = ModelConfig.preset("tiny-vision")
    write_synthetic(tmp_path / "release", cfg)
    assert any(n.startswith("vision.") for n in _names(tmp_path / "release"))
    loaded = dsjax.load_model(tmp_path / "release")
    convert(tmp_path / "release", tmp_path / "orbax", progress=False)
    again = dsjax.load_model(tmp_path / "orbax")
    assert_same_state(loaded, again)
    w = np.asarray(again.vision.blocks[1].fc2.weight[...])
    assert w.std() > 0
