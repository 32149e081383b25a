"""`scripts/bench_kernels.py`'s device-timed path: the `variants` mode runs each kernel twice and names
it; the `ncu` mode pairs ncu's kernel durations with those names."""

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_kernels.py"
spec = importlib.util.spec_from_file_location("bench_kernels", SCRIPT)
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)

HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",'
          '"Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')


def ncu_row(i, value, unit):
    return (f'"{i}","1","python3","host","dsjax_sparse_decode","1","14","(256, 1, 1)","(64, 2, 1)","0","9.0",'
            f'"Command line profiler metrics","gpu__time_duration.sum","{unit}","{value}"')


def test_variants_then_ncu_give_each_kernels_own_time(tmp_path, capsys):
    variants = ['{"op": "attention", "kv": "fp8", "batch": 1, "context": 2048, "block_k": 32}',
                '{"op": "indexer", "kv": "fp8", "batch": 1, "context": 2048, "tiles": 2}',
                '{"op": "attention", "kv": "bfloat16", "batch": 1, "context": 512, "kernel": "mosaic"}']
    assert bench.main(["variants", "--interpret", "--copy-tbps", "4", "--variant", *variants]) == 0
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("VARIANT ")]
    assert [json.loads(line[8:])["variant"] for line in printed] == [json.loads(v) for v in variants]
    # ncu prints its CSV after the program's own output; the first launch of each variant compiles.
    log = tmp_path / "ncu.log"
    log.write_text("\n".join(printed + [HEADER, ncu_row(0, "99,000", "ns"), ncu_row(1, "50,000", "ns"),
                                        ncu_row(2, "1.5", "ms"), ncu_row(3, "20", "us"), ncu_row(4, "9", "us"),
                                        ncu_row(5, "8", "us")]) + "\n")
    out = tmp_path / "rows.jsonl"
    bench.main(["ncu", "--ncu-log", str(log), "--copy-tbps", "4", "--json", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["kernel_us"] for r in rows] == pytest.approx([50.0, 20.0, 8.0])
    first = json.loads(printed[0][8:])
    assert rows[0]["of_copy"] == pytest.approx(first["bytes"] / 50e-6 / 4e12)
    assert rows[0]["block_k"] == 32 and rows[1]["op"] == "indexer" and rows[1]["tiles"] == 2
    assert rows[2]["kernel"] == "mosaic"


def test_ncu_refuses_a_log_whose_launches_do_not_pair_with_the_variants(tmp_path):
    log = tmp_path / "ncu.log"
    log.write_text("\n".join(['VARIANT {"variant": {"op": "indexer"}, "bytes": 1, "flops": 1}', HEADER,
                              ncu_row(0, "5", "us")]) + "\n")
    with pytest.raises(SystemExit, match="1 kernel launches for 1 variants"):
        bench.main(["ncu", "--ncu-log", str(log), "--copy-tbps", "4"])
    (tmp_path / "empty.log").write_text("no profiler here\n")
    with pytest.raises(SystemExit, match="no ncu CSV rows"):
        bench.main(["ncu", "--ncu-log", str(tmp_path / "empty.log"), "--copy-tbps", "4"])


def test_timed_refuses_a_difference_lost_in_jitter(monkeypatch):
    """Every call timed alike (a clock that advances 1 s per reading): many calls are no slower than few,
    so there is no per-call time to give; `timed` says so instead of returning a near-zero one."""
    from types import SimpleNamespace

    import jax.numpy as jnp

    # The script's own clock only: jax's calls to time.perf_counter, if any, keep the real one.
    clock = iter(range(10_000))
    monkeypatch.setattr(bench, "time", SimpleNamespace(perf_counter=lambda: float(next(clock))))
    with pytest.raises(RuntimeError, match="timing did not resolve: 3 calls took 1000.000 ms, 1 took 1000.000 ms"):
        bench.timed(lambda x: x + 1, lambda i: (jnp.full(4, float(i)),), few=1, many=3, repeats=2)
    steps = iter([0.0, 1.0] * 2 + [0.0, 3.0] * 2)  # 1 s for one call, 3 s for three: 1 s each
    monkeypatch.setattr(bench, "time", SimpleNamespace(perf_counter=lambda: next(steps)))
    assert bench.timed(lambda x: x + 1, lambda i: (jnp.full(4, float(i)),), few=1, many=3, repeats=2) == 1.0


def test_v41_cases_hold_the_release_storage():
    """`attention --preset v4.1-flash --kv-dtype fp4` times the op over an MXFP8 window and NVFP4 entries (a
    decoder layer: an entry per token, 512 picks at most), counting each table's own record bytes; the
    indexer over MXFP4 key records. (The ops over records: tests/kernels.)"""
    import numpy as np

    from dsjax.cache import read_rows
    from dsjax.config import CSA
    from dsjax.config_v41 import V41Config

    cfg = V41Config.preset("v4.1-flash")
    entries, make_set, n_bytes, _ = bench.attention_case(cfg, 1, 300, "fp4", CSA)
    q, window, wlen, sinks, extra = make_set(0)
    assert (entries.fmt, entries.data.shape, window.fmt, window.data.shape) == ("nvfp4", (1, 300, 288), "mxfp8",
                                                                                (1, 128, 528))
    assert n_bytes == 128 * 528 + 300 * 288 + 2 * 64 * 512 * 2 + 4 * 300
    assert extra["idx_bk"].shape == (1, 300) and q.shape == (1, 64, 512)
    for rows in (window, entries):  # finite values, scales near 1
        values = np.asarray(read_rows(rows, np.float32))
        assert np.isfinite(values).all() and 0 < np.abs(values).max() < 2 ** 12
    keys, _, _, _ = bench.indexer_case(cfg, 1, 300, "fp4")
    assert (keys.fmt, keys.data.shape) == ("mxfp4", (1, 300, 68))
    with pytest.raises(ValueError, match="all pick their entries"):
        bench.attention_case(cfg, 1, 300, "fp4", bench.HCA)
