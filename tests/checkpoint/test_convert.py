"""dsjax convert: release shards → Orbax → back byte for byte; resumable, atomic, and strict about bad input."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

import dsjax
from dsjax.checkpoint import converted
from dsjax.checkpoint.convert import convert, plan, to_hf, verify_against_source
from dsjax.checkpoint.safetensors_io import CheckpointError, iter_tensors
from dsjax.checkpoint.save import save_model
from dsjax.cli import main
from dsjax.config import ModelConfig, QuantConfig
from dsjax.quantize import quantize_model
from tests.helpers import assert_same_state

ROOT = Path(__file__).resolve().parents[2]
IDS = jnp.asarray([[5, 17, 300, 2, 41, 99, 7, 260, 3, 11, 480, 64]])


def tensors(folder) -> dict[str, np.ndarray]:
    return {name: np.array(value) for name, _, value in iter_tensors(str(folder))}


def assert_absent(dst: Path) -> None:
    assert not dst.exists(), f"{dst} exists"
    assert not Path(str(dst) + ".partial").exists(), f"{dst}.partial was left behind"


def test_release_round_trip_is_byte_identical_and_loads_to_the_same_logits(release, tmp_path):
    dst, back = tmp_path / "orbax", tmp_path / "back"
    summary = convert(release, dst, verify=True, progress=False)
    assert summary.verified and summary.bytes_read > 0 and summary.mb_per_s > 0
    assert sorted(os.listdir(dst)) == ["config.json", converted.MANIFEST, converted.PARAMS, "tokenizer_config.json"]
    to_hf(dst, back, max_shard_bytes=60_000, progress=False)
    ours, theirs = tensors(back), tensors(release)
    assert ours.keys() == theirs.keys()
    for name in theirs:
        assert ours[name].dtype == theirs[name].dtype and ours[name].shape == theirs[name].shape, name
        assert ours[name].tobytes() == theirs[name].tobytes(), name
    index = json.loads((back / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index) == set(theirs) and len(set(index.values())) > 1
    assert json.loads((back / "config.json").read_text()) == json.loads((release / "config.json").read_text())
    assert (back / "tokenizer_config.json").exists()

    from_src, from_orbax = dsjax.load_model(release), dsjax.load_model(dst)
    assert_same_state(from_src, from_orbax)
    np.testing.assert_array_equal(np.asarray(from_orbax(IDS)), np.asarray(from_src(IDS)))


def test_small_blocks_split_every_large_tensor_and_still_round_trip(release, tmp_path, monkeypatch):
    """With 4 KB blocks the embedding, head and most weights are stored in row blocks and the experts one
    per block; loading, --verify and --to-hf put the rows back together."""
    import dsjax.checkpoint.convert as c

    monkeypatch.setattr(c, "_BLOCK_BYTES", 4096)
    convert(release, tmp_path / "o", verify=True, progress=False)
    man = json.loads((tmp_path / "o" / converted.MANIFEST).read_text())
    embed = sorted((k for k in man["pieces"] if k.startswith("model.embed_tokens.weight.")),
                   key=lambda k: int(k.rsplit(".", 1)[1]))
    cfg = ModelConfig.preset("tiny")
    assert len(embed) > 1 and sum(man["pieces"][k]["shape"][0] for k in embed) == cfg.vocab_size
    assert all(np.prod(v["shape"]) * np.dtype(getattr(ml_dtypes, v["dtype"], v["dtype"])).itemsize <= 4096
               or v["shape"][0] == 1 for v in man["pieces"].values())
    to_hf(tmp_path / "o", tmp_path / "back", progress=False)
    ours, theirs = tensors(tmp_path / "back"), tensors(release)
    assert ours.keys() == theirs.keys() and all(ours[n].tobytes() == theirs[n].tobytes() for n in ours)
    assert_same_state(dsjax.load_model(release), dsjax.load_model(tmp_path / "o"))


def test_experts_are_stored_in_blocks_of_dsjax_orientation(release, tmp_path):
    convert(release, tmp_path / "o", ep=4, progress=False)
    man = json.loads((tmp_path / "o" / converted.MANIFEST).read_text())
    cfg = ModelConfig.preset("tiny")
    e, h, i = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
    assert man["expert_block"] == e // 4
    blocks = [k for k in man["pieces"] if k.startswith("model.layers.1.mlp.experts.gate_up_proj.")]
    assert blocks == [f"model.layers.1.mlp.experts.gate_up_proj.{f}" for f in range(0, e, e // 4)]
    # FP4 gate_up: [experts, 2I rows (w1 | w3), H/2 bytes], as dsjax keeps it
    assert man["pieces"][blocks[0]] == {**man["pieces"][blocks[0]], "shape": [e // 4, 2 * i, h // 2],
                                        "dtype": "int8"}


def test_hf_named_float_checkpoint_converts_losslessly(tmp_path):
    model = dsjax.DeepseekV4(ModelConfig.preset("tiny"), rngs=nnx.Rngs(7), dtype=jnp.float32)
    save_model(model, tmp_path / "hf", max_shard_bytes=50_000)
    convert(tmp_path / "hf", tmp_path / "orbax", progress=False)
    again = dsjax.load_model(tmp_path / "orbax")
    assert_same_state(model, again)
    man = json.loads((tmp_path / "orbax" / converted.MANIFEST).read_text())
    cfg = model.cfg
    key = "model.layers.0.mlp.experts.down_proj.0"
    assert man["pieces"][key]["shape"] == [cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size]
    assert man["pieces"][key]["dtype"] == "float32"  # the source's precision, not narrowed
    to_hf(tmp_path / "orbax", tmp_path / "back", progress=False)
    save_model(model, tmp_path / "original", naming="original")
    ours, theirs = tensors(tmp_path / "back"), tensors(tmp_path / "original")
    assert ours.keys() == theirs.keys()
    assert all(ours[n].tobytes() == theirs[n].tobytes() for n in ours)


def test_hf_named_fp8_experts_with_float_scales(tmp_path):
    quant = QuantConfig(weight_block_size=(16, 16), scale_fmt="float", expert_dtype="fp8")
    model = quantize_model(dsjax.DeepseekV4(ModelConfig.preset("tiny"), rngs=nnx.Rngs(2), dtype=jnp.bfloat16),
                           quant)
    save_model(model, tmp_path / "hf", max_shard_bytes=40_000)
    convert(tmp_path / "hf", tmp_path / "orbax", ep=2, verify=True, progress=False)
    assert_same_state(dsjax.load_model(tmp_path / "hf", dtype=jnp.bfloat16),
                      dsjax.load_model(tmp_path / "orbax", dtype=jnp.bfloat16))


def test_bf16_weights_are_dequantized_once(release, tmp_path):
    convert(release, tmp_path / "bf16", weights="bf16", progress=False)
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert "quantization_config" not in config
    man = json.loads((tmp_path / "bf16" / converted.MANIFEST).read_text())
    assert not any(k.endswith("_scale_inv") or "_scale_inv." in k for k in man["pieces"])
    assert man["pieces"]["model.layers.0.self_attn.q_b_proj.weight"]["dtype"] == "bfloat16"
    assert_same_state(dsjax.load_model(release, dtype=jnp.bfloat16, weights="bf16"),
                      dsjax.load_model(tmp_path / "bf16", dtype=jnp.bfloat16))


_KILLER = """
import os, signal, sys
import dsjax.checkpoint.convert as c
save, n, when = c._partial_save, [0], sys.argv[3]
def killing(*a):
    n[0] += 1
    if n[0] == int(sys.argv[4]) and when == "before":
        os.kill(os.getpid(), signal.SIGKILL)
    save(*a)
    if n[0] == int(sys.argv[4]) and when == "after":  # saved, but not yet journaled
        os.kill(os.getpid(), signal.SIGKILL)
c._partial_save = killing
c.convert(sys.argv[1], sys.argv[2], progress=False)
"""


@pytest.mark.parametrize("when,at", [("after", 3), ("before", 5)])
def test_killed_conversion_resumes_to_the_same_checkpoint(release, tmp_path, when, at):
    whole = tmp_path / "whole"
    convert(release, whole, progress=False)
    dst = tmp_path / "killed"
    run = subprocess.run([sys.executable, "-c", _KILLER, str(release), str(dst), when, str(at)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == -9, run.stderr[-2000:]
    assert not dst.exists() and Path(f"{dst}.partial").is_dir()
    summary = convert(release, dst, progress=False)
    assert summary.resumed_arrays > 0 and summary.bytes_read < convert_bytes(release)
    a = json.loads((whole / converted.MANIFEST).read_text())
    b = json.loads((dst / converted.MANIFEST).read_text())
    assert a["pieces"] == b["pieces"]
    pieces = list(converted.pieces_of(a).values())
    left = converted.read_pieces(str(whole / converted.PARAMS), pieces)
    right = converted.read_pieces(str(dst / converted.PARAMS), pieces)
    assert all(left[k].tobytes() == right[k].tobytes() for k in left)
    assert not Path(f"{dst}.partial").exists()


def convert_bytes(folder) -> int:
    return sum(i.nbytes for i in plan(folder).items)


def test_a_partial_conversion_with_other_options_is_not_resumed(release, tmp_path):
    dst = tmp_path / "d"
    run = subprocess.run([sys.executable, "-c", _KILLER, str(release), str(dst), "after", "2"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == -9
    with pytest.raises(CheckpointError, match="unfinished conversion.*other options"):
        convert(release, dst, weights="bf16", progress=False)
    assert not dst.exists()


def _edit(release: Path, tmp_path: Path, fn) -> Path:
    """A copy of the release checkpoint whose tensors fn(tensors, folder, weight_map) changes; tensors it
    adds go into the shard of `layers.0.attn.wq_a.weight`."""
    src = tmp_path / "broken"
    shutil.copytree(release, src)
    index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    ts = tensors(src)
    fn(ts, src, index)
    shards: dict[str, dict] = {}
    for name, value in ts.items():
        shards.setdefault(index.get(name, index["layers.0.attn.wq_a.weight"]), {})[name] = value
    for shard, part in shards.items():
        save_file(part, src / shard, metadata={"format": "pt"})
    return src


def _set_index(src: Path, index: dict) -> None:
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))


def _add_unexpected(ts, src, index):
    ts["layers.0.attn.surprise.weight"] = np.zeros(3, np.float32)
    _set_index(src, {**index, "layers.0.attn.surprise.weight": index["layers.0.attn.wq_a.weight"]})


def _drop(ts, src, index):
    del ts["layers.0.attn.wq_a.weight"], ts["layers.0.attn.wq_a.scale"]
    _set_index(src, {k: v for k, v in index.items() if not k.startswith("layers.0.attn.wq_a.")})


def _misshape(ts, src, index):
    ts["layers.0.attn_norm.weight"] = ts["layers.0.attn_norm.weight"][:-1]


def _bf16_for_fp8(ts, src, index):
    ts["layers.0.attn.wq_a.weight"] = ts["layers.0.attn.wq_a.weight"].astype(ml_dtypes.bfloat16)


def _int_for_float(ts, src, index):
    ts["layers.0.attn_norm.weight"] = ts["layers.0.attn_norm.weight"].astype(np.int32)


def _misindexed(ts, src, index):
    other = sorted(set(index.values()) - {index["layers.0.attn.wq_a.weight"]})[0]
    _set_index(src, {**index, "layers.0.attn.wq_a.weight": other})


def _bad_hash_table(ts, src, index):
    ts["layers.0.ffn.gate.tid2eid"] = ts["layers.0.ffn.gate.tid2eid"] + 1000


@pytest.mark.parametrize("edit,message", [
    (_drop, r"lacks 2 tensor.*model\.layers\.0\.self_attn\.q_a_proj\.weight \(layers\.0\.attn\.wq_a\.weight\)"
            r".*q_a_proj\.weight_scale_inv \(layers\.0\.attn\.wq_a\.scale\)"),
    (_add_unexpected, r"model-\d+-of-\d+\.safetensors: unexpected tensor 'layers\.0\.attn\.surprise\.weight'"),
    (_misshape, r"model-\d+-of-\d+\.safetensors: tensor 'layers\.0\.attn_norm\.weight' has shape \[63\]"),
    (_bf16_for_fp8, r"model-\d+-of-\d+\.safetensors: tensor 'layers\.0\.attn\.wq_a\.weight' is bfloat16.*FP8"),
    (_int_for_float, r"model-\d+-of-\d+\.safetensors: tensor 'layers\.0\.attn_norm\.weight' is int32.*float"),
    (_misindexed, r"index\.json puts tensor 'layers\.0\.attn\.wq_a\.weight' in model-\d+.*but it is in"),
    (_bad_hash_table, r"model-\d+-of-\d+\.safetensors: tensor 'layers\.0\.ffn\.gate\.tid2eid' routes to expert"),
])
def test_bad_tensors_are_named_and_nothing_is_left(release, tmp_path, edit, message):
    src = _edit(release, tmp_path, edit)
    with pytest.raises(CheckpointError, match=message):
        convert(src, tmp_path / "dst", progress=False)
    assert_absent(tmp_path / "dst")


def _unlink_shard(src: Path) -> str:
    shard = sorted(src.glob("model-*.safetensors"))[3]
    shard.unlink()
    return rf"names shard\(s\) that do not exist.*{shard.name}"


def _truncate_shard(src: Path) -> str:
    shard = sorted(src.glob("model-*.safetensors"))[5]
    os.truncate(shard, shard.stat().st_size - 100)
    return rf"{shard.name}: truncated.*cut off"


def _mismatch_config(src: Path) -> str:
    config = json.loads((src / "config.json").read_text())
    config["moe_intermediate_size"] *= 2
    (src / "config.json").write_text(json.dumps(config))
    return (r"model-\d+-of-\d+\.safetensors: tensor 'layers\.0\.ffn\.shared_experts\.w1\.weight' has shape "
            r"\[32, 64\], expected \[64, 64\]")


@pytest.mark.parametrize("breaker", [_unlink_shard, _truncate_shard, _mismatch_config])
def test_broken_folders_are_named_and_nothing_is_left(release, tmp_path, breaker):
    """A shard the index names but the folder lacks, a truncated shard, a config that does not fit."""
    src = tmp_path / "src"
    shutil.copytree(release, src)
    message = breaker(src)
    with pytest.raises(CheckpointError, match=message):
        convert(src, tmp_path / "dst", progress=False)
    assert_absent(tmp_path / "dst")


def test_verify_catches_a_corrupted_array(release, tmp_path):
    dst = tmp_path / "dst"
    convert(release, dst, progress=False)
    files = [p for p in (dst / converted.PARAMS).rglob("*") if p.is_file() and p.parent.name == "d"]
    biggest = max(files, key=lambda p: p.stat().st_size)
    data = bytearray(biggest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    biggest.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="differs from the source"):
        verify_against_source(str(dst), plan(release), progress=False)


def test_cli_converts_refuses_to_overwrite_and_goes_back(release, tmp_path, capsys):
    dst = tmp_path / "dst"
    assert main(["convert", str(release), str(dst), "--mesh", "ep=2"]) == 0
    captured = capsys.readouterr()
    assert "arrays" in captured.out and "MB/s" in captured.out and "peak RSS" in captured.out
    bar = captured.err.replace("\r", "\n").strip().splitlines()[-1]  # bytes done of total, rate, time left
    assert bar.startswith("convert: 100%") and "B/s]" in bar and "<00:00" in bar
    assert main(["convert", str(release), str(dst), "--quiet"]) == 2
    assert "exists" in capsys.readouterr().err
    assert main(["convert", str(dst), str(tmp_path / "back"), "--to-hf", "--quiet", "--shard-mb", "0.05"]) == 0
    assert tensors(tmp_path / "back").keys() == tensors(release).keys()
    assert main(["convert", str(dst), str(tmp_path / "x"), "--to-hf", "--weights", "bf16"]) == 2
    assert "not to --to-hf" in capsys.readouterr().err
    assert main(["convert", str(release), str(tmp_path / "y"), "--mesh", "ep=3"]) == 2
    assert "must divide n_routed_experts" in capsys.readouterr().err
    assert main(["convert", str(release), str(tmp_path / "z"), "--mesh", "ep=2,pp=2"]) == 2
    assert "AXIS=SIZE" in capsys.readouterr().err
    assert_absent(tmp_path / "y")


_MEMORY = """
import json, resource, sys
import dsjax.checkpoint.convert as c
from dsjax.checkpoint.synthetic import write_synthetic
from dsjax.config import ModelConfig
c._BLOCK_BYTES = c._FLUSH_BYTES = 4 << 20
small = ModelConfig.preset("tiny")
big = small.replace(hidden_size=512, moe_intermediate_size=1024, n_routed_experts=64)
write_synthetic(sys.argv[1] + "/small", small, max_shard_bytes=1 << 20)
write_synthetic(sys.argv[1] + "/big", big, max_shard_bytes=16 << 20)
rss = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
c.convert(sys.argv[1] + "/small", sys.argv[1] + "/small.orbax", progress=False)  # warms everything up
warm = rss()
s = c.convert(sys.argv[1] + "/big", sys.argv[1] + "/big.orbax", progress=False)
print(json.dumps({"warm": warm, "peak": rss(), "total": s.bytes_read}))
"""


def test_memory_does_not_grow_with_the_checkpoint(tmp_path):
    """Converting ~220 MB with 4 MB blocks and batches: peak RSS grows by a fraction of that (the
    ~8 GB measurement against the largest-shard + 2 GB bound is in docs/convert.md)."""
    run = subprocess.run([sys.executable, "-c", _MEMORY, str(tmp_path)], cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    m = json.loads(run.stdout.strip().splitlines()[-1])
    assert m["total"] > 200e6
    print(m)
    assert m["peak"] - m["warm"] < 0.25 * m["total"], m


def test_a_journal_line_cut_by_a_kill_is_dropped_before_appending(tmp_path):
    from dsjax.checkpoint.convert import _read_journal

    path = tmp_path / "journal.jsonl"
    path.write_text('{"key": "a", "sha256": "1"}\n{"key": "b", "sha256": "2"}\n{"key": "c", "sh')
    assert list(_read_journal(str(path))) == ["a", "b"]
    assert path.read_text() == '{"key": "a", "sha256": "1"}\n{"key": "b", "sha256": "2"}\n'
