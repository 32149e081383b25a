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


def test_streaming_shards_take_tensors_whole_or_in_row_blocks(tmp_path):
    import pytest
    from safetensors.numpy import load_file

    from dsjax.checkpoint.shards import StreamingShards

    a = np.arange(24, dtype=np.float32).reshape(6, 4)
    b = np.arange(10, dtype=np.int64)
    c = np.ones((3, 2), dtype=np.uint8)
    w = StreamingShards(tmp_path, [("a", a.dtype, a.shape), ("b", b.dtype, b.shape), ("c", c.dtype, c.shape)],
                        max_shard_bytes=100)
    with pytest.raises(ValueError, match="expected tensor 'a' next, got 'b'"):
        w.write("b", b)
    w.write("a", a[:4])
    with pytest.raises(ValueError, match="'a' is not complete; got 'b'"):
        w.write("b", b)
    w.write("a", a[4:])
    w.write("b", b)
    with pytest.raises(ValueError, match="1 tensor"):
        w.close()
    w.write("c", c)
    weight_map = w.close()
    assert weight_map == {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors",
                          "c": "model-00002-of-00002.safetensors"}
    first, second = load_file(tmp_path / weight_map["a"]), load_file(tmp_path / weight_map["b"])
    np.testing.assert_array_equal(first["a"], a)
    np.testing.assert_array_equal(second["b"], b)
    np.testing.assert_array_equal(second["c"], c)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert index == weight_map and not list(tmp_path.glob(".*"))
