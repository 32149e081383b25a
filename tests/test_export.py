"""`dsjax export`: the exported steps, deserialized and called with a real tiny model's weights (a tiny-preset
checkpoint in DeepSeek's release format, FP8 and FP4 weights kept, fp32 activations) and a real cache, equal
the engine's own jitted steps; cuda and tpu artifacts are written (and deserialize) on this CPU machine; bad
input is refused before anything is traced, and the output folder is never half-written."""

import functools
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import dsjax
from dsjax.cli import main
from dsjax.config import ModelConfig
from dsjax.engine import steps
from dsjax.engine.engine import Engine
from dsjax.engine.sampling import Sampled, SamplingArrays, SamplingModes, SamplingParams
from dsjax.export import ALLOWED_CUSTOM_CALLS, MANIFEST, STEP_FILES, _write, export_steps, load_steps
from dsjax.model import DeepseekV4
from dsjax.quantize import V4_QUANT
from dsjax.run_config import RunConfig

SLOTS, MAX_LEN, CHUNK, ROWS = 4, 32, 8, 2  # ROWS: the cpu export's prefill rows
SIZES = ["--slots", str(SLOTS), "--max-len", str(MAX_LEN), "--chunk-size", str(CHUNK)]


@pytest.fixture(scope="module")
def tiny():
    return ModelConfig.preset("tiny")


@pytest.fixture(scope="module")
def model(release):
    """The tiny preset's random release-format checkpoint (conftest), loaded as a job loads one."""
    return dsjax.load_model(release, dtype=jnp.float32)


@pytest.fixture(scope="module")
def cpu_export(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "cpu"
    run = RunConfig(slots=SLOTS, max_len=MAX_LEN, chunk_size=CHUNK, weights="keep", dtype="float32")
    manifest = export_steps(tiny, "cpu", out, run, prefill_rows=ROWS, model_name="tiny")
    return out, manifest


def _assert_same(ours, ref, what):
    ours_l, ours_def = jax.tree.flatten(ours)
    ref_l, ref_def = jax.tree.flatten(ref)
    assert ours_def == ref_def, what
    for i, (a, b) in enumerate(zip(ours_l, ref_l)):
        assert a.dtype == b.dtype and a.shape == b.shape, (what, i)
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6, err_msg=f"{what}: leaf {i}")


def test_cpu_round_trip_equals_the_engines_steps(tiny, model, cpu_export):
    out, manifest = cpu_export
    assert sorted(os.listdir(out)) == sorted([MANIFEST, *STEP_FILES.values()])
    engine = Engine(model, RunConfig(slots=SLOTS, max_len=MAX_LEN, chunk_size=CHUNK))
    loaded = load_steps(out)
    assert loaded.manifest == json.loads((out / MANIFEST).read_text()) == manifest
    assert loaded.config() == model.cfg  # the preset, stored as the release stores it
    assert loaded.exported["decode"].platforms == ("cpu",) == loaded.exported["prefill"].platforms

    # The weights are inputs, not constants: each program is smaller than the weights it takes.
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(engine.params))
    assert all(d["bytes"] < weight_bytes / 4 for d in manifest["steps"].values())
    assert [e["path"] for e in manifest["params"]] == [
        jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(engine.params)[0]]

    # Two prefill chunks (slots 2 and 0 from position 0; then slot 1 from 0 and slot 2 going on from 8),
    # then three decode steps with slot 3 idle: past the window (8) and the CSA (4) and HCA (8) boundaries.
    rng = np.random.default_rng(0)
    greedy_and_sampled = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_k=50, top_p=0.9)]

    def tokens(*shape):
        return jnp.asarray(rng.integers(0, tiny.vocab_size, shape), jnp.int32)

    def ints(*v):
        return jnp.asarray(v, jnp.int32)

    def sampling(rows, first_seed):
        # every sampler mode, as the exported steps run them (they take no host-side modes)
        return SamplingArrays.of((greedy_and_sampled * rows)[:rows], range(first_seed, first_seed + rows),
                                 SamplingModes())

    script = [("prefill", (tokens(ROWS, CHUNK), ints(2, 0), ints(0, 0), ints(8, 6), sampling(ROWS, 0))),
              ("prefill", (tokens(ROWS, CHUNK), ints(1, 2), ints(0, 8), ints(8, 5), sampling(ROWS, 2)))]
    script += [("decode", (tokens(SLOTS), jnp.asarray([True, True, True, False]), sampling(SLOTS, 4 + 4 * i)))
               for i in range(3)]

    def run(prefill, decode, cache):
        records = [jax.device_get(cache)]
        for kind, args in script:
            cache, sampled = (prefill if kind == "prefill" else decode)(cache, *args)
            records.append(jax.device_get((cache, sampled)))
        return records

    ref = run(functools.partial(steps.prefill_program, engine.graphdef, engine.params),
              functools.partial(steps.decode_program, engine.graphdef, engine.params), engine.new_cache())
    got = run(functools.partial(loaded.prefill, engine.params), functools.partial(loaded.decode, engine.params),
              loaded.new_cache())
    for i, (r, g) in enumerate(zip(ref, got)):
        _assert_same(g, r, f"after step {i}: {script[i - 1][0] if i else 'new cache'}")
    assert isinstance(got[-1][1], Sampled)
    assert np.isfinite(got[-1][1].logprob).all()
    assert [np.asarray(c.lengths).tolist() for c, _ in got[1:]] == [
        [6, 0, 8, 0], [6, 8, 13, 0], [7, 9, 14, 0], [8, 10, 15, 0], [9, 11, 16, 0]]

    # The raw Exported takes leaves, arrays and a dict: what the manifest's inputs list, in order.
    last, active, last_sampling = script[-1][1]
    flat_in = [*loaded.flat_params(engine.params), *loaded.flat_cache(got[-1][0]), last, active,
               *[v for k, v in sorted(vars(last_sampling).items()) if k != "modes"]]
    spec = manifest["steps"]["decode"]["inputs"]
    assert [(list(x.shape), str(x.dtype)) for x in flat_in] == [(e["shape"], e["dtype"]) for e in spec]
    assert [e["name"] for e in spec[-4:]] == [f"sampling['{k}']" for k in ("seed", "temperature", "top_k", "top_p")]


def test_the_loader_names_what_does_not_match(tiny, cpu_export):
    loaded = load_steps(cpu_export[0])

    def params(cfg, dtype):
        return nnx.split(nnx.eval_shape(lambda: DeepseekV4(cfg, rngs=nnx.Rngs(0), dtype=dtype)))[1]

    with pytest.raises(ValueError, match=r"params: 122 arrays given, the export takes 164 \(is it a model of the "
                                         "exported config, weight storage and dtype"):
        loaded.flat_params(params(tiny, jnp.float32))  # float weights: no scales
    with pytest.raises(ValueError, match=r"params\['embed_tokens'\]\['weight'\]\.value: the export takes "
                                         r"float32\[512, 64\], got bfloat16\[512, 64\]"):
        loaded.flat_params(params(tiny.replace(quantization=V4_QUANT), jnp.bfloat16))
    with pytest.raises(ValueError, match=r"decode: last_tokens must be int32\[4\], got float32\[4\]"):
        loaded.decode(params(tiny.replace(quantization=V4_QUANT), jnp.float32), loaded.new_cache(),
                      jnp.zeros(SLOTS, jnp.float32), jnp.ones(SLOTS, bool),
                      SamplingArrays.of([SamplingParams()] * SLOTS, range(SLOTS)))
    with pytest.raises(ValueError, match="holds no manifest.json: not a `dsjax export` folder"):
        load_steps(cpu_export[0].parent)


def test_an_export_written_before_keep_loads_with_its_weights_renamed(cpu_export, tmp_path):
    """Manifests before the one vocabulary of `RunConfig.WEIGHTS` say "fp8" for the storage now "keep"."""
    out, manifest = cpu_export
    old = tmp_path / "old"
    old.mkdir()
    for name in STEP_FILES.values():
        (old / name).write_bytes((out / name).read_bytes())
    (old / MANIFEST).write_text(json.dumps({**manifest, "weights": "fp8"}))
    assert manifest["weights"] == "keep" and load_steps(old).manifest == manifest


MESH8 = ["--mesh", "ep=8", "--slots", "8"]


@pytest.mark.parametrize("platform,preset,more", [("cuda", "tiny-kernels", []), ("tpu", "tiny-kernels", []),
                                                  ("cuda", "tiny-kernels", MESH8), ("tpu", "tiny-kernels", MESH8)])
def test_accelerator_artifacts_are_written_here(platform, preset, more, tmp_path, capsys):
    """One-device cuda and tpu exports of the preset whose shapes the decode kernels tile, and exports for
    an 8-device expert-parallel mesh (which need no devices either: they are lowered on an abstract mesh)."""
    out = tmp_path / platform
    assert main(["export", "--preset", preset, "--platform", platform, "--out", str(out), *SIZES, *more]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(f"{out}: {preset} for {platform} (")
    m = json.loads((out / MANIFEST).read_text())
    slots, devices = (8, 8) if more else (4, 1)
    assert (m["platform"], m["slots"], m["max_len"], m["chunk_size"], m["prefill_rows"]) == (
        platform, slots, 32, 8, slots)
    assert (m["weights"], m["dtype"], m["kv_dtype"], m["devices"], m["jax_version"]) == (
        "keep", "bfloat16", None, devices, jax.__version__)
    assert ModelConfig.from_hf(m["config"]).quantization is not None  # keep: the release storage
    assert any(e["dtype"] == "float8_e4m3fn" for e in m["params"])
    loaded = load_steps(out)  # deserializes; these cannot run on this machine
    for name, e in loaded.exported.items():
        assert e.platforms == (platform,), name
        assert e.nr_devices == devices
        assert len(e.in_avals) == len(m["steps"][name]["inputs"]) == len(m["params"]) + len(m["cache"]) + (
            6 if name == "decode" else 8)
        allowed = {jax.export.DisabledSafetyCheck.custom_call(t) for t in ALLOWED_CUSTOM_CALLS[platform]}
        assert allowed <= set(e.disabled_safety_checks)
    if more:  # laid out as the rules say; k = 2 < ep = 8: tokens go to the experts by ragged all-to-all
        assert m["mesh"] == {"dp": 1, "ep": 8, "tp": 1}
        assert {e["sharding"] for e in m["cache"][1:]} == {"P(None, 'ep')"}
        assert "ragged_all_to_all" in loaded.exported["decode"].mlir_module()
    else:
        assert m["mesh"] is None and all("sharding" not in e for e in m["params"] + m["cache"])
    decode = loaded.exported["decode"].mlir_module()
    if platform == "cuda":  # the decode's Pallas kernels, lowered by Triton for the default H200
        assert m["device_kind"] == "NVIDIA H200"
        assert "__gpu$xla.gpu.triton" in decode
    kernels = ("dsjax_sparse_decode", "dsjax_index_scores") if platform == "cuda" else (
        "sparse_decode_tpu", "index_scores_tpu")
    for name in kernels:  # the decode runs through both kernels, on a mesh each device on its own slots
        assert name in decode, name
    prefill = loaded.exported["prefill"].mlir_module()  # and their chunks through the prefill kernel
    assert "dsjax_sparse_prefill" in prefill
    if platform == "tpu":  # the indexer's chunks through its TPU kernel too
        assert "index_scores_tpu" in prefill


@pytest.mark.parametrize("argv,message", [
    (["--preset", "nope"], "unknown preset 'nope'"),
    (["--platform", "gpu"], r"platform 'gpu' is not one of cpu, cuda, rocm, tpu \(NVIDIA GPUs: cuda"),
    (["--max-len", "0"], "max.len must be an integer of at least 2"),
    (["--prefill-rows", "5"], r"prefill_rows must be between 1 and slots \(4\)"),
    (["--mesh", "ep=3"], "ep=3 does not divide the model's 8 routed experts"),
    (["--mesh", "dp=3"], r"slots \(4\) must be a multiple of the 3 devices"),
])
def test_bad_input_is_refused_with_its_reason(argv, message, tmp_path, capsys):
    out = tmp_path / "out"
    args = {"--preset": "tiny", "--platform": "cpu", "--out": str(out), **dict(zip(SIZES[::2], SIZES[1::2]))}
    args.update(zip(argv[::2], argv[1::2]))
    assert main(["export", *[x for kv in args.items() for x in kv]]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dsjax export: error: ") and re.search(message, err), err
    assert os.listdir(tmp_path) == []  # nothing written, no temporary folder left


def test_an_occupied_output_folder_is_refused_unless_it_is_an_earlier_export_and_forced(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (tmp_path / "file").write_text("x")

    def run(folder, *more):
        return main(["export", "--preset", "tiny", "--platform", "cpu", "--out", str(folder), *SIZES, *more])

    assert run(out) == 2
    assert "exists and is not empty; pass --force" in capsys.readouterr().err
    assert run(out, "--force") == 2
    assert "holds no earlier export (no manifest.json)" in capsys.readouterr().err
    assert run(tmp_path / "file") == 2
    assert "exists and is not a folder" in capsys.readouterr().err
    assert os.listdir(out) == ["notes.txt"] and sorted(os.listdir(tmp_path)) == ["file", "out"]


def test_writing_is_all_or_nothing(tmp_path, monkeypatch):
    out = tmp_path / "sub" / "out"
    _write(out, {MANIFEST: b"{}", "a": b"1"}, force=False)  # parents made, the folder appears whole
    assert sorted(os.listdir(out)) == sorted([MANIFEST, "a"])
    with pytest.raises(ValueError, match="not empty"):
        _write(out, {MANIFEST: b"{}"}, force=False)
    _write(out, {MANIFEST: b"{ }", "b": b"2"}, force=True)  # an earlier export is replaced whole
    assert sorted(os.listdir(out)) == sorted([MANIFEST, "b"]) and (out / MANIFEST).read_bytes() == b"{ }"
    assert os.listdir(out.parent) == ["out"]

    calls = []

    def failing_fsync(fd):
        calls.append(fd)
        if len(calls) == 2:
            raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(OSError, match="disk full"):
        _write(out, {MANIFEST: b"new", "c": b"3"}, force=True)
    assert sorted(os.listdir(out)) == sorted([MANIFEST, "b"]) and (out / MANIFEST).read_bytes() == b"{ }"  # kept
    with pytest.raises(OSError, match="disk full"):
        calls.clear()
        _write(tmp_path / "fresh", {MANIFEST: b"new", "c": b"3"}, force=False)
    assert sorted(os.listdir(tmp_path)) == ["sub"] and os.listdir(out.parent) == ["out"]  # no leftovers
