"""save_model writes HF module names that load_model reads back to the same model."""

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
