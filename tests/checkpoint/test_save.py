"""save_model writes HF module names or the original DeepSeek names; load_model reads both back to the same model."""

import json

import jax.numpy as jnp
import numpy as np

import dsjax
from dsjax.checkpoint.save import save_model


def test_round_trip_of_a_reference_model(load_case, reference, tmp_path):
    model = load_case("legacy")
    save_model(model, tmp_path, max_shard_bytes=100_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) > 1
    ours = set(index)
    theirs = set(json.loads((reference / "legacy" / "hf" / "model.safetensors.index.json").read_text())["weight_map"])
    assert ours == theirs  # the same tensor names transformers writes with save_original_format=False
    again = dsjax.load_model(tmp_path)
    ids = jnp.asarray(np.load(reference / "legacy" / "input_ids_23.npy"))
    np.testing.assert_array_equal(np.asarray(again(ids)), np.asarray(model(ids)))


def test_original_naming_matches_the_release_names_and_round_trips(load_case, reference, tmp_path):
    """The names are those the harness's original-name checkpoint holds (which transformers reloads
    to identical logits), per-expert tensors included; reading them back gives the same model."""
    model = load_case("legacy")
    save_model(model, tmp_path, max_shard_bytes=100_000, naming="original")
    ours = set(json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"])
    theirs = set(json.loads((reference / "legacy" / "original" / "model.safetensors.index.json")
                            .read_text())["weight_map"])
    assert ours == theirs
    assert any(".ffn.experts.0.w3.weight" in n for n in ours) and not any(n.startswith("model.") for n in ours)
    again = dsjax.load_model(tmp_path)
    ids = jnp.asarray(np.load(reference / "legacy" / "input_ids_23.npy"))
    np.testing.assert_array_equal(np.asarray(again(ids)), np.asarray(model(ids)))


def test_unknown_naming_is_refused(load_case, tmp_path):
    import pytest

    with pytest.raises(ValueError, match="naming must be"):
        save_model(load_case("legacy"), tmp_path, naming="megatron")
