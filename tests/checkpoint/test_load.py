"""load_model: bf16 loading, and clear errors (naming tensor and file) for broken checkpoints."""

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import dsjax
from dsjax.checkpoint.safetensors_io import CheckpointError
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
