"""load_model: bf16 loading, and clear errors (naming tensor and file) for broken checkpoints."""

import json
import re
import shutil
import struct

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import dsjax
from dsjax.checkpoint.safetensors_io import CheckpointError
from dsjax.config import ConfigError, ModelConfig
from tests.helpers import assert_close


@pytest.fixture
def broken(reference, tmp_path):
    """A copy of the mixed case's single-file hybrid checkpoint whose tensors a test may edit."""
    folder = tmp_path / "ckpt"
    shutil.copytree(reference / "mixed" / "hybrid", folder)
    path = folder / "model.safetensors"

    def edit(fn):
        tensors = load_file(path)
        fn(tensors)
        save_file(tensors, path)
        return folder

    return edit


def test_unknown_tensor_is_named(broken):
    folder = broken(lambda t: t.__setitem__("model.layers.0.attn.surprise.weight", np.zeros(3, np.float32)))
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*surprise"):
        dsjax.load_model(folder)


def test_missing_tensor_is_named(broken):
    folder = broken(lambda t: t.pop("model.layers.2.attn.wq_b.weight"))
    with pytest.raises(CheckpointError, match=r"lacks 1 tensor.*model\.layers\.2\.self_attn\.q_b_proj\.weight"):
        dsjax.load_model(folder)


def test_missing_expert_is_named(broken):
    folder = broken(lambda t: t.pop("model.layers.3.ffn.experts.5.w3.weight"))
    with pytest.raises(CheckpointError, match=r"lacks 1 tensor\(s\): layers\.3\.ffn\.experts\.5\.w3\.weight$"):
        dsjax.load_model(folder)


def test_misshapen_tensor_is_named(broken):
    def shrink(t):
        t["model.layers.1.attn.wkv.weight"] = t["model.layers.1.attn.wkv.weight"][:-1]
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*attn\.wkv\.weight.*shape"):
        dsjax.load_model(broken(shrink))


def test_bad_hash_table_is_named(broken):
    def corrupt(t):
        t["model.layers.0.ffn.gate.tid2eid"] = t["model.layers.0.ffn.gate.tid2eid"] + 100
    with pytest.raises(CheckpointError, match="tid2eid"):
        dsjax.load_model(broken(corrupt))


def test_mtp_tensors_are_ignored(broken, reference):
    folder = broken(lambda t: t.__setitem__("mtp.0.attn.wq_a.weight", np.ones((2, 2), np.float32)))
    ids = np.load(reference / "mixed" / "input_ids_16.npy")
    logits = np.asarray(dsjax.load_model(folder)(jnp.asarray(ids)))
    assert_close(logits, np.load(reference / "mixed" / "logits_16.npy"), rtol=1e-4)


def test_missing_folder_and_config(tmp_path):
    with pytest.raises(CheckpointError, match="not a folder"):
        dsjax.load_model(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="config.json"):
        dsjax.load_model(tmp_path)


def test_bfloat16_load_keeps_reference_fp32_modules(load_case, reference):
    model = load_case("mixed", "hf", jnp.bfloat16)
    layer = model.layer(1)
    assert layer.self_attn.q_a_proj.weight[...].dtype == jnp.bfloat16
    assert layer.mlp.experts.gate_up_proj[...].dtype == jnp.bfloat16
    for v in (layer.attn_hc.fn, layer.self_attn.sinks, layer.self_attn.compressor.position_bias,
              layer.self_attn.q_a_norm.weight, layer.input_layernorm.weight, model.norm.weight,
              model.hc_head.hc_fn):
        assert v[...].dtype == jnp.float32


@pytest.mark.parametrize("case, t", [("mixed", 64), ("legacy", 48)])
def test_bfloat16_is_as_accurate_as_the_reference_bfloat16(load_case, reference, case, t):
    """bf16 routing/top-k decisions flip against fp32 in both implementations, so compare accuracy:
    our bf16 logits must sit no further from the fp32 reference than the reference's own bf16 run."""
    ids = np.load(reference / case / f"input_ids_{t}.npy")
    ref32 = np.load(reference / case / f"logits_{t}.npy")
    ref16 = np.load(reference / case / f"logits_bf16_{t}.npy")
    ours = np.asarray(load_case(case, "hf", jnp.bfloat16)(jnp.asarray(ids)))
    ours_err, ref_err = np.abs(ours - ref32).mean(), np.abs(ref16 - ref32).mean()
    assert ours_err <= 1.25 * ref_err, (ours_err, ref_err)
    assert np.median(np.abs(ours - ref16)) < 0.02 * np.abs(ref32).max()


def test_truncated_shard_is_named(broken):
    folder = broken(lambda t: None)
    path = folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:-1000])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: truncated.*cut off"):
        dsjax.load_model(folder)


def test_missing_shard_named_in_the_index_is_named(broken):
    folder = broken(lambda t: None)
    (folder / "model.safetensors").rename(folder / "model-00001-of-00002.safetensors")
    weight_map = {"embed.weight": "model-00001-of-00002.safetensors", "head.weight": "model-00002-of-00002.safetensors"}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match=r"names shard\(s\) that do not exist.*model-00002-of-00002"):
        dsjax.load_model(folder)


@pytest.fixture
def model_folder(tmp_path):
    """A folder with the tiny preset's config.json and the files a test gives it (bytes or text)."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(ModelConfig.preset("tiny").to_hf()))

    def make(**files):
        for name, data in files.items():
            path = folder / name.replace("__", ".")
            path.write_bytes(data) if isinstance(data, bytes) else path.write_text(data)
        return folder

    return make


def _safetensors(header: bytes, data: bytes = b"") -> bytes:
    return struct.pack("<Q", len(header)) + header + data


@pytest.mark.parametrize("data, message", [
    (np.random.default_rng(0).bytes(4096), "not a safetensors file: its first 8 bytes give a header of .* bytes, "
                                           "but the file has 4,096"),
    (struct.pack("<Q", 1000) + b"{}", "not a safetensors file: its first 8 bytes give a header of 1,000 bytes, "
                                      "but the file has 10"),
    (b"abc", "not a safetensors file: it has 3 bytes, fewer than the 8"),
    (_safetensors(b"hello"), "not a safetensors file: its header is not valid JSON"),
    (_safetensors(b"[]"), "not a safetensors file: its header is a JSON list, not an object"),
    (_safetensors(b'{"a": {"dtype": "F32", "shape": [2]}}', bytes(8)), "header entry 'a' is not a tensor description"),
    (_safetensors(b'{"a": {"dtype": "F32", "shape": [-1, -2], "data_offsets": [0, 8]}}', bytes(8)),
     "header entry 'a' is not a tensor description"),
    (_safetensors(b'{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 800]}}', bytes(8)),
     "truncated: its header describes"),
], ids=["random bytes", "header past the end", "3 bytes", "header not JSON", "header not an object",
        "entry without offsets", "negative shape", "data past the end"])
def test_garbage_safetensors_files_are_named(model_folder, data, message):
    folder = model_folder(model__safetensors=data)
    with pytest.raises(CheckpointError, match=f"^{re.escape(str(folder / 'model.safetensors'))}: {message}"):
        dsjax.load_model(folder)


@pytest.mark.parametrize("index, message", [
    ("{not json", r"the safetensors index is not valid JSON \(line 1, column 2: Expecting property name"),
    ("[]", "the safetensors index must be a JSON object, not a list"),
    ('{"metadata": {}}', 'expected a "weight_map" object mapping tensor names to shard files, got None'),
    ('{"weight_map": {"embed.weight": 5}}', 'expected a "weight_map" object .* got {\'embed.weight\': 5}'),
    ('{"weight_map": {}}', "its weight_map is empty, so it names no shard files"),
    ('{"weight_map": {"embed.weight": "model-00001-of-00001.safetensors"}}',
     r" names shard\(s\) that do not exist: \['model-00001-of-00001.safetensors'\]"),
], ids=["not JSON", "an array", "no weight_map", "shard not a string", "empty weight_map", "missing shard"])
def test_broken_indexes_are_named(model_folder, index, message):
    folder = model_folder(model__safetensors__index__json=index)
    with pytest.raises(CheckpointError, match=f"^{re.escape(str(folder / 'model.safetensors.index.json'))}:? "
                                              f"?{message}"):
        dsjax.load_model(folder)


def test_a_shard_named_by_the_index_that_is_garbage_is_named(model_folder):
    folder = model_folder(model__safetensors__index__json='{"weight_map": {"embed.weight": "a.safetensors"}}',
                          a__safetensors=b"\x00" * 4)
    with pytest.raises(CheckpointError, match=r"a\.safetensors: not a safetensors file"):
        dsjax.load_model(folder)


def test_a_folder_without_weights_is_named(model_folder):
    folder = model_folder()
    with pytest.raises(CheckpointError, match=f"^{re.escape(str(folder))}: no model.safetensors, no index, and no "
                                              r"\*\.safetensors files$"):
        dsjax.load_model(folder)


@pytest.mark.parametrize("text, message", [
    ("hello", r"is not valid JSON \(line 1, column 1: Expecting value\)"),
    ('{"hidden_size": 64', r"is not valid JSON \(line 1, column 19: Expecting ',' delimiter\)"),
    ("[]", "must hold a JSON object, got an array"),
    (json.dumps({**ModelConfig.preset("tiny").to_hf(), "hidden_size": "big"}),
     ": hidden_size must be a positive integer, got 'big'"),
], ids=["hello", "truncated", "an array", "a bad field"])
def test_a_bad_config_json_is_named_by_load_model(model_folder, text, message):
    folder = model_folder(config__json=text)
    with pytest.raises(ConfigError, match=f"^{re.escape(str(folder / 'config.json'))} ?{message}$"):
        dsjax.load_model(folder)


def test_a_folder_that_is_a_file_and_a_config_that_is_a_folder(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"model\.safetensors is not a folder"):
        dsjax.load_model(tmp_path / "model.safetensors")
    (tmp_path / "config.json").mkdir()
    with pytest.raises(CheckpointError, match=r"config\.json is a folder, not a file"):
        dsjax.load_model(tmp_path)


def test_an_unreadable_converted_manifest_is_named(model_folder):
    folder = model_folder(dsjax_checkpoint__json="{")
    with pytest.raises(CheckpointError, match=r"dsjax_checkpoint\.json: the dsjax manifest is not valid JSON"):
        dsjax.load_model(folder)
