"""`dsjax bench`: configs, the roofline's byte and FLOP counts, the trace attribution, a run on the tiny
model through the CLI, its refusals; and `scripts/bench_hf.py` on CPU in the reference environment."""

import gzip
import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsjax import bench as B
from dsjax.cli import main
from dsjax.engine.engine import Engine
from dsjax.run_config import RunConfig
from tests.conftest import ROOT, reference_python

RATES = B.DeviceRates(1e12, 1e14)


@pytest.fixture(scope="module")
def tiny():
    return B.random_model(B.bench_config("tiny"))


def test_bench_config_cuts_layers_and_picks_storage():
    cfg = B.bench_config("v4-flash", 4, "keep")
    assert cfg.num_hidden_layers == 4 and len(cfg.layer_types) == len(cfg.mlp_layer_types) == 4
    assert cfg.quantization.expert_dtype == "fp4"
    assert B.bench_config("tiny").quantization is None
    with pytest.warns(DeprecationWarning, match="'fp8' is now spelled 'keep'"):
        assert B.bench_config("v4-flash", 4, "fp8") == cfg
    with pytest.raises(ValueError, match="between 1 and the preset's 4"):
        B.bench_config("tiny", 5)
    with pytest.raises(ValueError, match="weights must be one of"):
        B.bench_config("tiny", weights="int8")


def test_random_model_spreads_hash_routing(tiny):
    tables = [v.get_value() for p, v in nnx.to_flat_state(nnx.state(tiny)) if p[-1] == "tid2eid"]
    assert tables
    for t in tables:  # k distinct experts per token, many experts in use
        assert (t[..., 0] != t[..., 1]).all() and len(set(t.reshape(-1).tolist())) == tiny.cfg.n_routed_experts


@pytest.mark.parametrize("preset", ["tiny", "tiny-v4.1"])
def test_random_model_builds_straight_onto_a_mesh(preset):
    """With a mesh, each device computes only its share, placed as the rules say: the same weights, and the
    same shardings, as the model built on one device and then placed (what a model larger than a device needs)."""
    from dsjax.parallel.mesh import make_mesh
    from dsjax.parallel.shard import shard_model

    mesh = make_mesh("dp=2,ep=4")
    cfg = B.bench_config(preset, weights="keep")
    want = {p: v.get_value() for p, v in nnx.to_flat_state(nnx.state(shard_model(B.random_model(cfg, 3), mesh)))}
    got = {p: v.get_value() for p, v in nnx.to_flat_state(nnx.state(B.random_model(cfg, 3, mesh=mesh)))}
    assert got.keys() == want.keys()
    split = 0
    for p, x in got.items():
        assert x.sharding == want[p].sharding, p
        assert x.dtype == want[p].dtype and (np.asarray(x) == np.asarray(want[p])).all(), p
        split += x.sharding.shard_shape(x.shape) != x.shape
    assert split > 0


def test_touched_experts():
    cfg = B.bench_config("tiny")  # 2 of 8 experts per token
    assert B.touched_experts(cfg, 1) == pytest.approx(0.25)
    assert B.touched_experts(cfg, 2) == pytest.approx(1 - 0.75 ** 2)
    assert B.touched_experts(cfg, 10_000) == pytest.approx(1.0)


def test_roofline_counts_the_weights_and_cache_a_step_reads(tiny):
    cfg = tiny.cfg
    leaves = list(B._leaves(tiny))
    total = sum(n for _, _, n, _ in leaves)
    experts = sum(n for c, _, n, _ in leaves if c == "routed_experts")
    emb = sum(n for c, _, n, _ in leaves if c == "embedding")
    r1 = B.roofline(tiny, 1, 40, 8, RATES)
    assert r1["weight_bytes"] == total
    want = total - emb - experts + experts * 2 / 8 + emb / cfg.vocab_size
    assert r1["decode_weight_bytes"] == pytest.approx(want)
    assert r1["decode_cache_bytes"] > 0 and r1["context"] == 44
    r4 = B.roofline(tiny, 4, 40, 8, RATES)
    assert r4["decode_cache_bytes"] == pytest.approx(4 * r1["decode_cache_bytes"])
    assert r4["decode_step_flops"] == pytest.approx(4 * r1["decode_step_flops"])
    assert r4["decode_step_s"] == RATES.time(r4["decode_step_bytes"], r4["decode_step_flops"])
    # Longer prompts: more prefill FLOPs than tokens alone (causal attention grows with position).
    p1, p2 = B.roofline(tiny, 1, 32, 2, RATES), B.roofline(tiny, 1, 64, 2, RATES)
    assert p2["prefill_flops"] > 2 * p1["prefill_flops"]


def test_csa_cache_reads_count_only_the_picked_entries():
    cfg = B.bench_config("tiny")  # CSA: rate 4, top-4 picks
    from dsjax.config import CSA, HCA

    short = B._cache_read_bytes(cfg, CSA, 16, jnp.bfloat16, None)   # 4 entries: all picked
    long_ = B._cache_read_bytes(cfg, CSA, 160, jnp.bfloat16, None)  # 40 entries, 4 picked
    row = cfg.head_dim * 2
    index_row = cfg.index_head_dim * 2
    # From 16 to 160 tokens the CSA reads 36 more index keys and no more K=V entries.
    assert long_ - short == pytest.approx(36 * index_row)
    hca_short, hca_long = (B._cache_read_bytes(cfg, HCA, n, jnp.bfloat16, None) for n in (16, 160))
    assert hca_long - hca_short == pytest.approx((160 // 8 - 16 // 8) * row)


def _trace(tmp_path, events):
    d = tmp_path / "plugins" / "profile" / "run1"
    d.mkdir(parents=True)
    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}}]
    with gzip.open(d / "host.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": meta + events}, f)
    return str(tmp_path)


HLO = """
ENTRY %main {
  %fusion.3 = f32[8] fusion(%p), kind=kLoop, metadata={op_name="jit(_decode)/while/body/attention/indexer/dot_general" source_file="x"}
  %custom-call.7 = f32[8] custom-call(%a), custom_call_target="mosaic_gpu", metadata={op_name="jit(_decode)/while/body/moe/ragged_dot"}
  ROOT %loop_add_fusion.2 = f32[8] fusion(%q), kind=kLoop, metadata={op_name="jit(_decode)/while/body/attention/add"}
  %sort.1 = f32[8] sort(%r), metadata={op_name="jit(_decode)/sort"}
  %sort.5 = f32[8] sort(%r), metadata={op_name="jit(_decode)/while/body/attention/indexer/topk/sort"}
}
"""


def test_attribute_trace_maps_kernels_to_parts(tmp_path):
    ev = lambda kernel, dur, pid=1, **args: {"ph": "X", "pid": pid, "name": kernel, "dur": dur, "args": args}  # noqa: E731
    d = _trace(tmp_path, [
        ev("fusion_3", 10, hlo_op="fusion.3"),                    # by its instruction
        ev("ragged_dot_kernel", 40, hlo_op="custom-call.7"),      # a custom call
        ev("loop_add_fusion_2", 6, hlo_op="command_buffer_4"),    # inside a CUDA graph: by the kernel's name
        ev("cub_sort", 20, hlo_op="custom-call.99", name="jit(_decode)/sort"),  # by the scope path it carries
        ev("mystery", 4, hlo_op="command_buffer_9"),
        ev("sort_kernel", 8, hlo_op="sort.5"),                    # the indexer's top-k, inside the indexer
        ev("host_work", 1000, pid=2, hlo_op="fusion.3"),          # host events are not device time
    ])
    parts = B.attribute_trace(d, HLO, steps=2)
    assert parts["indexer"] == pytest.approx(5e-6) and parts["moe"] == pytest.approx(20e-6)
    assert parts["attention"] == pytest.approx(3e-6) and parts["rest"] == pytest.approx(10e-6)
    assert parts["unattributed"] == pytest.approx(2e-6) and parts["topk"] == pytest.approx(4e-6)
    assert parts["kernels_per_step"] == 3
    assert list(parts["top_kernels"])[0] == "moe: ragged_dot_kernel"
    assert B.attribute_trace(_trace(tmp_path / "cpu", [ev("x", 5, pid=2)]), HLO, 1) == {}
    assert B.attribute_trace(str(tmp_path / "none"), HLO, 1) == {}


def test_attribute_trace_gives_collectives_their_own_part_and_averages_devices(tmp_path):
    """Two GPUs in the trace (a mesh): each part is the mean over them; collectives (by instruction or as
    NCCL kernels) are counted apart from the scope they run in."""
    def ev(kernel, dur, pid, **args):
        return {"ph": "X", "pid": pid, "name": kernel, "dur": dur, "args": args}

    d = tmp_path / "plugins" / "profile" / "run1"
    d.mkdir(parents=True)
    meta = [{"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}}
            for pid, name in ((1, "/device:GPU:0"), (3, "/device:GPU:1"), (2, "/host:CPU"))]
    events = [ev("ragged_dot_kernel", 40, 1, hlo_op="custom-call.7"),   # moe on both devices
              ev("ragged_dot_kernel", 20, 3, hlo_op="custom-call.7"),
              ev("ncclDevKernel_AllToAll", 8, 1, hlo_op="all-to-all.2"),  # collectives, by instruction or name
              ev("ncclDevKernel_SendRecv", 4, 3),
              ev("all_gather_fusion", 2, 3, hlo_op="all-gather-start.1")]
    with gzip.open(d / "host.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": meta + events}, f)
    parts = B.attribute_trace(str(tmp_path), HLO, steps=1)
    assert parts["devices"] == 2
    assert parts["moe"] == pytest.approx(30e-6) and parts["collectives"] == pytest.approx(7e-6)
    assert parts["kernels_per_step"] == 2.5


def test_prefill_chunks_fill_the_cache_as_the_engine_does(tiny):
    """The prefill breakdown's own run of the prefill program (a profiler trace needs it compiled without
    CUDA graphs) writes the cache and logits the engine's prefill writes."""
    import numpy as np

    from dsjax.engine.sampling import SamplingArrays, SamplingParams

    engine = Engine(tiny, RunConfig(slots=3, max_len=40, chunk_size=8))
    prompts = np.random.default_rng(0).integers(0, tiny.cfg.vocab_size, (2, 21)).astype(np.int32)
    compiled = engine.lower_prefill(engine.new_cache(), 2).compile()
    cache, logits = B.prefill_chunks(engine, compiled, engine.new_cache(), prompts)
    sampling = SamplingArrays.of([SamplingParams(temperature=0.0)] * 3, [0] * 3)
    want_cache, sampled = engine.prefill(engine.new_cache(), [list(p) for p in prompts], [0, 1], sampling)
    assert np.asarray(cache.lengths).tolist() == np.asarray(want_cache.lengths).tolist() == [21, 21, 0]
    assert np.asarray(jnp.argmax(logits[:2], -1)).tolist() == np.asarray(sampled.token[:2]).tolist()
    for got, want in zip(jax.tree.leaves(cache), jax.tree.leaves(want_cache)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert B.prefill_breakdown(engine, 2, 21) == {}  # CPU traces have no device kernels


def test_run_bench_refuses_recompilation(tiny, monkeypatch):
    """A measured run that compiled anything is an error (the runs themselves are stubbed here: the
    CLI test runs them for real). The engine has a slot per sequence, each of exactly its tokens."""
    runs = []
    monkeypatch.setattr(B, "_timed_run", lambda engine, requests, acceptance=None: runs.append(
        (len(requests), engine.run)) or (1.0, 1.0, 1))
    calls = iter(range(100))
    monkeypatch.setattr(Engine, "compilations", staticmethod(lambda: next(calls)))
    with pytest.raises(RuntimeError, match="more programs after warm-up"):
        B.run_bench(tiny, 2, 12, 4, run=RunConfig(slots=5, max_len=100, chunk_size=8), rates=RATES, breakdown=False)
    engine_run = RunConfig(slots=2, max_len=16, chunk_size=8)
    assert runs == [(2, engine_run), (2, engine_run)]  # the warm-up, then the measured run
    monkeypatch.setattr(Engine, "compilations", staticmethod(lambda: 7))
    assert B.run_bench(tiny, 2, 12, 4, run=RunConfig(chunk_size=8), breakdown=False)["compilations_after_warmup"] == 0


def test_cli_runs_and_appends_rows(tmp_path, capsys):
    out = tmp_path / "rows.jsonl"
    args = ["bench", "--preset", "tiny", "--layers", "2", "--slots", "2", "--prompt-len", "12", "--gen-len", "4",
            "--chunk-size", "8", "--copy-tbps", "1", "--matmul-tflops", "100", "--json", str(out)]
    assert main(args) == 0
    main(args[:-2])  # a second run without --json appends nothing (its steps are compiled already)
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["model"] == "tiny" and row["batch"] == 2 and row["decode_steps"] == 3 and row["layers"] == 2
    assert row["decode_tokens_per_s"] == pytest.approx(2 * row["decode_tokens_per_s_per_seq"])
    assert row["prefill_tokens_per_s"] == pytest.approx(24 / row["prefill_s"])
    assert 0 < row["decode_of_roofline"] and row["roofline_decode_step_s"] > 0
    assert row["compilations_after_warmup"] == 0
    assert row["decode_parts_s"] == {}  # CPU traces have no device kernels
    text = capsys.readouterr().out
    assert "roofline decode" in text and "no device kernels" in text


def test_cli_runs_on_a_mesh(tmp_path, capsys):
    """`--mesh` places the model on all 8 test devices and runs the engine under it: sequences over the
    whole mesh, peak memory per device (None on CPU), no roofline past one device."""
    out = tmp_path / "rows.jsonl"
    assert main(["bench", "--preset", "tiny", "--layers", "2", "--slots", "8", "--prompt-len", "12", "--gen-len", "3",
                 "--chunk-size", "8", "--copy-tbps", "1", "--matmul-tflops", "100", "--mesh", "dp=2,ep=4",
                 "--json", str(out)]) == 0
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["mesh"] == {"dp": 2, "ep": 4, "tp": 1} and row["batch"] == 8 and row["decode_steps"] == 2
    assert row["peak_memory_bytes_per_device"] == [None] * 8 and "roofline_decode_step_s" not in row
    assert row["compilations_after_warmup"] == 0
    assert "8 × cpu" in capsys.readouterr().out.lower()


@pytest.mark.parametrize("args,message", [
    (["--model", "x", "--layers", "2", "--slots", "1", "--prompt-len", "4", "--gen-len", "2"], "--layers cuts a preset"),
    (["--preset", "tiny", "--slots", "1", "--prompt-len", "4", "--gen-len", "1"], "--gen-len at least 2"),
    (["--preset", "tiny", "--slots", "0", "--prompt-len", "4", "--gen-len", "2"],
     "--slots must be an integer of at least 1, got 0"),
    (["--preset", "tiny", "--slots", "1", "--prompt-len", "4", "--gen-len", "2", "--copy-tbps", "4"],
     "give both --copy-tbps and --matmul-tflops"),
    (["--preset", "tiny", "--layers", "9", "--slots", "1", "--prompt-len", "4", "--gen-len", "2", "--copy-tbps", "1",
      "--matmul-tflops", "1"], "between 1 and the preset's 4"),
    (["--preset", "tiny", "--slots", "1", "--prompt-len", "4", "--gen-len", "2", "--mesh", "ep=3"], "needs 3 devices"),
    (["--preset", "tiny", "--slots", "1", "--prompt-len", "4", "--gen-len", "2", "--mesh", "xp=8"], "expected comma"),
])
def test_cli_refuses_bad_input(args, message, capsys):
    assert main(["bench", *args]) == 2
    assert message in capsys.readouterr().err


def test_bench_hf_runs_the_reference_on_cpu(tmp_path):
    """The HF script's own logic (build, random routing, prefill, decode through the cache) on the tiny
    config in the reference's environment; the GPU run is the benchmark itself."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(B.bench_config("tiny").to_hf()))
    out = tmp_path / "hf.jsonl"
    proc = subprocess.run([reference_python(), str(ROOT / "scripts" / "bench_hf.py"), "--config-json", str(cfg),
                           "--device", "cpu", "--batch", "2", "--prompt-len", "9", "--gen-len", "4", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    row = json.loads(out.read_text())
    assert row["impl"] == "hf" and row["batch"] == 2 and row["decode_tokens_per_s"] > 0
    assert row["decode_tokens_per_s"] == pytest.approx(2 * row["decode_tokens_per_s_per_seq"])
    refused = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_hf.py"), "--batch", "1",
                              "--prompt-len", "4", "--gen-len", "1"], capture_output=True, text=True)
    assert refused.returncode == 2 and "--gen-len at least 2" in refused.stderr


def test_cli_benches_a_release_format_and_a_converted_checkpoint(tmp_path, capsys):
    """`--model` takes a checkpoint as DeepSeek ships it (FP8 blocks, FP4 experts, original names) and the
    Orbax folder `dsjax convert` makes of it: the same model, so the same decode step count and layers."""
    from dsjax.checkpoint.save import save_model
    from dsjax.model import DeepseekV4
    from dsjax.quantize import quantize_model

    release = tmp_path / "release"
    save_model(quantize_model(DeepseekV4(B.bench_config("tiny"), rngs=nnx.Rngs(0))), release, naming="original")
    converted = tmp_path / "converted"
    assert main(["convert", str(release), str(converted), "--quiet"]) == 0, capsys.readouterr().err
    rows = []
    for folder in (release, converted):
        out = tmp_path / f"{folder.name}.jsonl"
        assert main(["bench", "--model", str(folder), "--weights", "keep", "--slots", "2", "--prompt-len", "12",
                     "--gen-len", "3", "--chunk-size", "8", "--copy-tbps", "1", "--matmul-tflops", "100",
                     "--json", str(out)]) == 0, capsys.readouterr().err
        (row,) = [json.loads(line) for line in out.read_text().splitlines()]
        rows.append(row)
    assert [r["model"] for r in rows] == [str(release), str(converted)]
    assert all(r["weights"] == "keep" and r["decode_steps"] == 2 and r["compilations_after_warmup"] == 0 for r in rows)
    assert rows[0]["layers"] == rows[1]["layers"] == B.bench_config("tiny").num_hidden_layers


def test_v41_slice_keeps_each_layers_role():
    """A slice of the release's layers (Engram 1, Full 2 and 20, Reuse 3, 21 and 25, Reindex 24 inside 20's
    candidates) renumbered, each in its role; a slice that drops a layer's KV source is refused."""
    cfg = B.bench_config("v4.1-flash", (0, 1, 2, 3, 20, 21, 24, 25), "keep", engram_rows=1 << 20)
    modes = [(r.ratio, r.mode, r.kv_source, r.uses_candidates, r.candidate_source, r.engram) for r in cfg.layer_roles()]
    assert modes == [(0, "sliding", None, False, False, None), (0, "sliding", None, False, False, 0),
                     (2, "full", 2, False, False, None), (2, "reuse", 2, False, False, None),
                     (1, "full", 4, False, True, None), (1, "reuse", 4, False, False, None),
                     (1, "reindex", 4, True, False, None), (1, "reuse", 4, False, False, None)]
    assert cfg.first_decoder_layer == 4 and cfg.quantization.weight_block_size == (32, 32)
    # The table shrinks (primes above 2^20 / 24), the hashing keeps its form: 24 buckets summing to the rows.
    assert (1 << 20) <= cfg.engram_num_embeddings[0] < (1 << 20) * 1.01
    with pytest.raises(ValueError, match="needs a preceding KV source"):
        B.bench_config("v4.1-flash", (0, 1, 3, 20), "keep")
    with pytest.raises(ValueError, match="takes a count for a V4 preset"):
        B.bench_config("tiny", (0, 1))


def test_v41_roofline_counts_truncated_prefill():
    """The V4.1 roofline: decode reads the dense weights, the touched experts and 2·24 Engram rows per token;
    exact truncation runs the decoder layers on `decoder_keep` prompt positions, full prefill on all."""
    from dsjax.model_v41 import decoder_keep

    model = B.random_model(B.bench_config("tiny-v4.1"))
    exact = B.roofline_v41(model, 1, 200, 8, RATES, "exact")
    full = B.roofline_v41(model, 1, 200, 8, RATES, "full")
    assert decoder_keep(model.cfg) < 200
    assert exact["prefill_flops"] < full["prefill_flops"]
    assert exact["decode_step_bytes"] == full["decode_step_bytes"] > exact["decode_cache_bytes"] > 0
    short_exact = B.roofline_v41(model, 1, 20, 8, RATES, "exact")  # shorter than the decoder's reach
    assert short_exact["prefill_flops"] == B.roofline_v41(model, 1, 20, 8, RATES, "full")["prefill_flops"]


def test_cli_benches_a_v41_preset(tmp_path):
    out = tmp_path / "rows.jsonl"
    assert main(["bench", "--preset", "tiny-v4.1", "--slots", "2", "--prompt-len", "40", "--gen-len", "4",
                 "--chunk-size", "16", "--weights", "keep", "--kv-dtype", "fp4", "--copy-tbps", "1",
                 "--matmul-tflops", "100", "--no-breakdown", "--json", str(out)]) == 0  # CPUs: no parts (V4's test)
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["weights"] == "keep" and row["layers"] == 8 and row["compilations_after_warmup"] == 0
    assert row["kv_dtype"] == "fp4"  # the release's packed cache, through the engine's donated steps
    assert row["roofline_decode_step_s"] > 0


def test_v41_roofline_reads_the_caches_storage():
    """Decode's cache bytes in the cache's storage: tiny-v4.1 at 204 tokens of context reads per layer 8 window
    rows, per ratio-2 layer (Full, Reindex) 8 picked entries and, for both, 102 index keys; per ratio-1 layer
    (Full, Reuse, Reindex, Reuse) 8 picked entries and, for Full and Reindex, 204 keys. Packed ("fp4"): rows of
    66 (MXFP8 window, 64 channels), 36 (NVFP4 entry) and 17 bytes (MXFP4 key, 32 channels); bf16: 2 B a channel."""
    model = B.random_model(B.bench_config("tiny-v4.1"))
    fp4 = B.roofline_v41(model, 1, 200, 8, RATES, kv_dtype="fp4")["decode_cache_bytes"]
    bf16 = B.roofline_v41(model, 1, 200, 8, RATES, kv_dtype="bfloat16")["decode_cache_bytes"]
    assert fp4 == 8 * 8 * 66 + 2 * 8 * 36 + 2 * 102 * 17 + 4 * 8 * 36 + 2 * 204 * 17
    assert bf16 == 8 * 8 * 128 + 2 * 8 * 128 + 2 * 102 * 64 + 4 * 8 * 128 + 2 * 204 * 64
