"""dsjax convert for DeepSeek-V4.1: a synthetic release checkpoint (nested config, FP8 32 × 32 blocks, FP4
experts, FP8 Engram tables, DSpark and image-encoder tensors, a tokenizer) → Orbax → loads as `load_v41` loads
the source, bit for bit; kept FP8/FP4 and dequantized-at-conversion give the same logits; --to-hf gives the
release tensors back byte for byte; an interrupted run resumes; bad input fails before DST exists."""

import json
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

import dsjax
import dsjax.checkpoint.convert as c
from dsjax.checkpoint import converted, names_v41
from dsjax.checkpoint.convert import convert, plan, to_hf
from dsjax.checkpoint.load_v41 import load_v41
from dsjax.checkpoint.safetensors_io import CheckpointError
from dsjax.checkpoint.synthetic import word_level_tokenizer, write_synthetic_v41
from dsjax.config_v41 import V41Config
from dsjax.layers.ngram_hash import default_token_map
from dsjax.model_v41 import DeepseekV41
from dsjax.presets import PRESETS, tiny_v41_vocabulary
from tests.checkpoint.test_convert import assert_absent, tensors
from tests.helpers import assert_close


def _config() -> V41Config:
    """tiny-v4.1 with one DSpark stage (FP8 and FP4 weights among them) and a one-block image encoder."""
    raw = json.loads(json.dumps(PRESETS["tiny-v4.1"]))
    raw["text_config"].update(num_nextn_predict_layers=1, dspark_target_layer_ids=[5, 6, 7], dspark_markov_rank=8,
                              dspark_n_routed_experts=4)
    raw["vision_config"].update(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=64,
                                patch_size=4, downsample_ratio=2)
    return V41Config.from_hf(raw)


CFG = _config()
# Small enough that the embedding, the head, an Engram table and DSpark's FP8 projection are stored in row blocks,
# and the experts in blocks of 4 (of 8).
BLOCK = 8192
E4M3, E8M0 = np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e8m0fnu)


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    folder = tmp_path_factory.mktemp("v41") / "src"
    write_synthetic_v41(folder, CFG, max_shard_bytes=300_000, seed=1,
                        tokenizer=word_level_tokenizer(tiny_v41_vocabulary()))
    return folder


@pytest.fixture(scope="module")
def keep(src):
    dst = src.parent / "keep"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(c, "_BLOCK_BYTES", BLOCK)
        summary = convert(src, dst, verify=True, progress=False)
    assert summary.verified and not summary.dropped
    return dst


@pytest.fixture(scope="module")
def bf16(src):
    dst = src.parent / "bf16"
    convert(src, dst, weights="bf16", ep=2, progress=False)
    return dst


@pytest.fixture(scope="module")
def from_src(src):
    return load_v41(str(src), str(src / "config.json"))


@pytest.fixture(scope="module")
def kept(keep):
    return dsjax.load_model(keep)


@pytest.fixture(scope="module")
def dense(bf16):
    return dsjax.load_model(bf16)


def _flat(model) -> dict[str, np.ndarray]:
    return {".".join(str(p) for p in path): np.asarray(var.get_value())
            for path, var in nnx.to_flat_state(nnx.state(model, nnx.Variable))}


def assert_same_model(got, want) -> None:
    """Every variable (the Engram token map's tables included) and every kept weight: dtype, shape, bytes."""
    assert isinstance(got, DeepseekV41) and got.cfg == want.cfg
    a, b = _flat(got), _flat(want)
    assert a.keys() == b.keys()
    for key in a:
        assert (a[key].dtype, a[key].shape) == (b[key].dtype, b[key].shape), key
        assert a[key].tobytes() == b[key].tobytes(), key
    assert got.kept_weights.names() == want.kept_weights.names()
    for name in want.kept_weights.names():
        x, y = got.kept_weights.arrays[name], want.kept_weights.arrays[name]
        assert (x.dtype, x.shape) == (y.dtype, y.shape) and x.tobytes() == y.tobytes(), name


def test_keep_round_trip_loads_as_the_source_does(src, keep, kept, from_src):
    assert sorted(p.name for p in keep.iterdir()) == ["config.json", converted.MANIFEST, converted.PARAMS,
                                                      "tokenizer.json"]
    assert json.loads((keep / "config.json").read_text()) == json.loads((src / "config.json").read_text())
    pieces = json.loads((keep / converted.MANIFEST).read_text())["pieces"]
    assert [k for k in pieces if k.startswith("layers.0.ffn.experts.gate_up_proj.")] == [
        "layers.0.ffn.experts.gate_up_proj.0", "layers.0.ffn.experts.gate_up_proj.4"]
    assert pieces["layers.0.ffn.experts.gate_up_proj.0"]["dtype"] == "int8"
    assert pieces["layers.1.engram.table_scale"]["dtype"] == "uint8"
    assert len([k for k in pieces if k.startswith("layers.3.engram.table.")]) > 1  # row blocks
    assert len([k for k in pieces if k.startswith("mtp.0.main_proj.weight.")]) > 1  # DSpark's FP8, in blocks
    assert pieces["mtp.0.main_proj.weight_scale_inv"]["dtype"] == "uint8"  # a variable, like the layers' FP8
    assert_same_model(kept, from_src)
    assert len(kept.kept_weights) == 0 and len(kept.mtp) == 1
    assert _flat(kept)["vision.blocks.0.attn.wqkv.weight"].shape == (96, 32)  # the encoder runs: a variable
    assert _flat(kept)["mtp.0.ffn.experts.down_proj"].dtype == np.int8
    # The token map comes from the tokenizer copied along, not the default of a folder without one.
    assert not np.array_equal(np.asarray(kept.ngram_hash.token_map[...]),
                              default_token_map(CFG.vocab_size, CFG.engram_compressed_vocab_size))


def test_bf16_round_trip_loads_as_the_source_dequantized(src, keep, bf16, dense):
    """Dequantized once at conversion into bf16: exact, since an e4m3 or e2m1 code times a power of two has
    at most 4 significant bits; so equal bit for bit to `load_v41(weights="bf16")`'s fp32 values, and to the
    keep conversion dequantized at load."""
    config = json.loads((bf16 / "config.json").read_text())
    assert "quantization_config" not in config and "quantization_config" not in config["text_config"]
    pieces = json.loads((bf16 / converted.MANIFEST).read_text())["pieces"]
    assert not [k for k in pieces if "_scale" in k and not names_v41.is_kept(k)]  # *_scale_inv, table_scale
    assert pieces["layers.0.attn.q_a_proj.weight"]["dtype"] == "bfloat16"
    assert pieces["layers.1.engram.table"]["dtype"] == "bfloat16"
    assert pieces["mtp.0.main_proj.weight"]["dtype"] == "bfloat16"
    # ep=2: blocks of whole expert-parallel shares, dsjax's float orientation [E, H, 2I]
    assert [k for k in pieces if k.startswith("layers.5.ffn.experts.gate_up_proj.")] == [
        "layers.5.ffn.experts.gate_up_proj.0", "layers.5.ffn.experts.gate_up_proj.4"]
    assert pieces["layers.5.ffn.experts.gate_up_proj.4"]["shape"] == [4, CFG.hidden_size, 2 * CFG.moe_intermediate_size]
    want = load_v41(str(src), str(src / "config.json"), weights="bf16")
    assert_same_model(dense, want)
    assert_same_model(dsjax.load_model(keep, weights="bf16"), want)


def test_kept_storage_and_dequantized_weights_give_the_same_logits(kept, dense):
    """The FP8/FP4 storage is dequantized inside each step to the same fp32 values the bf16 conversion holds
    (exact, see above), and on the CPU the rest of the program is the same XLA: the logits are equal. A GPU
    may run the FP4 experts through a kernel of their own, summing in another order: there, within
    test_load_v41's tolerance for the same comparison (1e-5 of the largest logit). Eager, not jitted: the
    second model reuses the first one's compiled ops (two jit compiles take 30 s here)."""
    ids = jnp.asarray(np.random.default_rng(0).integers(3, 250, (2, 12)), jnp.int32)
    assert _flat(kept)["layers.0.attn.q_a_proj.weight"].dtype == E4M3
    assert _flat(dense)["layers.0.attn.q_a_proj.weight"].dtype == np.float32
    want = np.asarray(dense.forward(ids))
    assert np.isfinite(want).all() and np.abs(want).max() > 0
    got = np.asarray(kept.forward(ids))
    if jax.default_backend() == "cpu":
        np.testing.assert_array_equal(got, want)
    else:
        assert_close(got, want, rtol=1e-5, what="FP8/FP4 kept against dequantized at conversion")


def test_to_hf_gives_the_release_tensors_back(src, keep, from_src, tmp_path):
    back = tmp_path / "back"
    to_hf(keep, back, max_shard_bytes=100_000, progress=False)
    ours, theirs = tensors(back), tensors(src)
    assert ours.keys() == theirs.keys()
    for name in theirs:
        assert (ours[name].dtype, ours[name].shape) == (theirs[name].dtype, theirs[name].shape), name
        assert ours[name].tobytes() == theirs[name].tobytes(), name
    assert ours["layers.1.engram.embed.scale"].dtype == E8M0
    assert ours["layers.0.ffn.experts.7.w1.weight"].dtype == np.int8
    index = json.loads((back / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index) == set(theirs) and len(set(index.values())) > 1
    assert json.loads((back / "config.json").read_text()) == json.loads((src / "config.json").read_text())
    assert (back / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
    assert_same_model(dsjax.load_model(back), from_src)


def test_an_interrupted_conversion_resumes(src, keep, tmp_path, monkeypatch):
    """Stopped (as by Ctrl-C) in the third partial save (one per source shard): DST does not exist; the
    re-run reads only the shards not saved yet and writes the same arrays as the uninterrupted conversion."""
    monkeypatch.setattr(c, "_BLOCK_BYTES", BLOCK)
    save, calls = c._partial_save, [0]

    def interrupted(*args):
        calls[0] += 1
        if calls[0] == 3:
            raise KeyboardInterrupt
        save(*args)

    monkeypatch.setattr(c, "_partial_save", interrupted)
    dst = tmp_path / "dst"
    with pytest.raises(KeyboardInterrupt):
        convert(src, dst, progress=False)
    assert not dst.exists() and (tmp_path / "dst.partial" / "journal.jsonl").stat().st_size > 0
    monkeypatch.setattr(c, "_partial_save", save)
    summary = convert(src, dst, progress=False)
    assert summary.resumed_arrays > 0 and summary.bytes_read < sum(i.nbytes for i in plan(src).items)
    assert (json.loads((dst / converted.MANIFEST).read_text())["pieces"]
            == json.loads((keep / converted.MANIFEST).read_text())["pieces"])
    assert not (tmp_path / "dst.partial").exists()


def _broken(src, tmp_path, edit):
    """A copy of `src` with its tensors edited (in one file, index removed)."""
    folder = tmp_path / "broken"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(src / name, folder / name)
    ts = tensors(src)
    edit(ts)
    save_file(ts, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop("layers.2.attn.compressor.wgate.weight"),
     r"lacks 1 tensor\(s\): layers\.2\.attn\.compressor\.wgate\.weight$"),
    (lambda t: [t.pop(f"layers.6.ffn.experts.7.w3.{k}") for k in ("weight", "scale")],
     r"lacks 2 tensor\(s\): layers\.6\.ffn\.experts\.\*, layers\.6\.ffn\.experts\.\*$"),
    (lambda t: t.update({"layers.3.engram.embed.weight": t["layers.3.engram.embed.weight"][:-1]}),
     r"model\.safetensors: tensor 'layers\.3\.engram\.embed\.weight' has shape \[551, 16\], expected \[552, 16\]"),
    (lambda t: t.update({"layers.0.attn.wq_a.scale": t["layers.0.attn.wq_a.scale"][:, :1]}),
     r"tensor 'layers\.0\.attn\.wq_a\.scale' has shape \[1, 1\], expected \[1, 2\]"),
    (lambda t: t.update({"layers.4.ffn.experts.0.w2.weight": t["layers.4.ffn.experts.0.w2.weight"].view(np.uint8)
                         .astype(ml_dtypes.bfloat16)}),
     r"tensor 'layers\.4\.ffn\.experts\.0\.w2\.weight' is bfloat16, but the quantization_config makes it FP4"),
    (lambda t: t.update({"layers.2.attn.compressor.ape": np.zeros((2, 64), np.float32)}),
     r"unexpected tensor 'layers\.2\.attn\.compressor\.ape'; it belongs to no DeepSeek-V4\.1 parameter"),
], ids=["missing", "missing expert", "engram rows", "scale shape", "expert dtype", "unexpected"])
def test_bad_input_is_named_before_anything_is_written(src, tmp_path, edit, message):
    folder = _broken(src, tmp_path, edit)
    with pytest.raises(CheckpointError, match=message):
        convert(folder, tmp_path / "dst", progress=False)
    assert_absent(tmp_path / "dst")


def test_unsupported_options_are_refused(src, keep, tmp_path):
    with pytest.raises(ValueError, match=r"the expert axis \(3\) must divide n_routed_experts \(8\)"):
        convert(src, tmp_path / "dst", ep=3, progress=False)
    assert_absent(tmp_path / "dst")


@pytest.mark.parametrize("folder", ["keep", "src"])
def test_loads_onto_a_mesh_each_device_holding_its_share(request, folder, kept):
    """Onto dp=2,ep=4 (the converted folder read straight onto the devices, the release folder placed after
    loading): the experts split over ep, an Engram table's row values over all 8 devices (its one scale a row
    stays whole),
    every variable the one-device model's, and the forward's logits those of one device."""
    model = dsjax.load_model(request.getfixturevalue(folder), mesh="dp=2,ep=4")
    experts = model.layers[4].ffn.experts.gate_up_proj[...]
    assert experts.sharding.spec[0] == "ep" and experts.addressable_shards[0].data.shape[0] == 2
    engram = next(layer.engram for layer in model.layers if layer.engram is not None)
    table, scale = engram.table[...], engram.table_scale[...]
    assert table.sharding.spec == jax.sharding.PartitionSpec(None, ("dp", "ep"))
    assert table.addressable_shards[0].data.shape == (table.shape[0], table.shape[1] // 8)
    assert scale.shape[1] == 1 and scale.sharding.spec == jax.sharding.PartitionSpec(None, None)  # 16 values: 1 scale
    a, b = _flat(model), _flat(kept)
    assert a.keys() == b.keys() and all(a[k].tobytes() == b[k].tobytes() for k in a)
    if folder == "keep":  # the same variables either way: one forward on the mesh is enough
        ids = jnp.asarray(np.random.default_rng(0).integers(3, 250, (2, 12)), jnp.int32)
        with jax.set_mesh(experts.sharding.mesh):
            got = np.asarray(jax.jit(lambda m, x: m.forward(x))(model, ids))
        assert_close(got, np.asarray(kept.forward(ids)), rtol=1e-5, what="on the mesh against one device")
