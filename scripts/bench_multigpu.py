"""Expert parallelism on several GPUs of one host, end to end (issue 11): a synthetic checkpoint in
DeepSeek's release format, converted for `ep` devices, loaded one slice per device, decoding through
the engine on the mesh, against `dsjax plan`'s memory prediction and the measured collective bandwidth.

    python scripts/bench_multigpu.py WORKDIR [--ep N] [--preset v4-flash] [--layers 2] [--experts E]
        [--per-device 64 128 256] [--prompt-len 4096] [--gen-len 16] [--json rows.jsonl]
        [--job-mix 150:2000 3000:400 20000:90 180000:10 --job-slots 64 --job-max-len 262400]

`--layers` is a count of the first layers (V4), the release's layer indices (V4.1: 0,1,2,20,21) or `all`
(the whole model, V4.1's DSpark and image encoder too). The checkpoint and its conversion must both fit
WORKDIR's disk: the script says so before writing when they do not (the whole V4.1-Flash takes 475 GiB each).

Steps, each kept in WORKDIR and skipped when its result is there (a run cut short resumes, also row
by row: a sequence count already measured with the same settings is not measured again):
1. `src/`: the synthetic checkpoint (`scripts/make_synthetic_checkpoint.py`; FP8 blocks, FP4 experts);
2. `converted/`: `dsjax convert --mesh ep=N` (expert blocks aligned to the expert axis);
3. with `--job-mix`: `dsjax generate` of a job of mixed prompt lengths (`scripts/make_requests.py --mix`) on
   the mesh, in a process of its own before this one loads the model: its start-up (load, compile) and its
   prompt and generated tokens per second, from the job's summary (`job/summary`);
4. for each sequence count: `dsjax plan`'s per-device bytes, then `dsjax bench --mesh ep=N` on the
   converted checkpoint (decode throughput, peak memory of every device, the decode step by part with
   the collectives apart, on GPUs);
5. the collectives' bandwidth on this mesh, measured alone (an all-to-all and an all-gather of 256 MiB
   per device), against the bytes the MoE's exchange moves per step (`scripts/comm_bytes.py`);
6. with `--check-sequences N`: greedy tokens of N random prompts on the mesh against the same
   checkpoint loaded whole onto the first device (it must fit there), kept in `WORKDIR/tokens.json`.
   Where a sequence parts, the one-device run's margin between its first and second choice at that
   step tells a rounding tie (near 0) from a wrong result.

The last lines are a table: per sequence count, tokens/s, ms per step, the collectives' ms per step and
the bandwidth they reached, measured peak against planned bytes per device. Runs on CPU devices too
(`XLA_FLAGS=--xla_force_host_platform_device_count=N`), without the per-part split.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
from make_requests import mix_entry  # noqa: E402


def collective_rates(mesh, bytes_per_device: int = 256 << 20) -> dict[str, float]:
    """Bytes each device sends per second in an all-to-all and in an all-gather over all of `mesh`'s
    devices (bf16 buffers of `bytes_per_device`; best of a few runs)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from dsjax.bench import _best_seconds

    n = mesh.size
    axes = tuple(mesh.axis_names)
    rows = max(n, bytes_per_device // (2 * 1024) // n * n)  # rows of 1024 bf16, a multiple of n
    x = jax.device_put(jnp.ones((n * rows, 1024), jnp.bfloat16), NamedSharding(mesh, P(axes)))
    a2a = jax.jit(jax.shard_map(lambda b: jax.lax.all_to_all(b, axes, 0, 0, tiled=True), mesh=mesh,
                                in_specs=P(axes), out_specs=P(axes)))
    gather = jax.jit(jax.shard_map(lambda b: jax.lax.all_gather(b[: rows // n], axes, tiled=True), mesh=mesh,
                                   in_specs=P(axes), out_specs=P(axes)))
    piece = rows * 1024 * 2
    return {"all_to_all": piece * (n - 1) / n / _best_seconds(a2a, x),  # keeps 1/n of its buffer
            "all_gather": piece / n * (n - 1) / _best_seconds(gather, x)}  # sends its 1/n piece to n − 1


def exchange_bytes(cfg, ep: int, tokens_per_device: int) -> dict[str, float]:
    """Bytes one device sends per decode step in the MoE's exchange, both designs (every layer has a
    routed MoE): `comm_bytes.layer_bytes` times the layers."""
    sys.path.insert(0, _HERE)
    from comm_bytes import layer_bytes

    return {k: v * cfg.num_hidden_layers for k, v in layer_bytes(cfg, ep, tokens_per_device).items()}


def check_tokens(model, mesh, one_device, n: int, prompt_len: int, gen_len: int, seed: int = 0) -> dict:
    """Greedy tokens of `n` random `prompt_len`-token prompts, `gen_len` each, from `model` on `mesh` and
    from `one_device` (the same weights on one device): how many sequences and tokens agree, where each
    differing sequence parts and the one-device margin (nats) between its top two choices there, and the
    largest difference of a chosen token's log-probability before any parting."""
    import jax
    import numpy as np

    from dsjax.engine.generate import generate
    from dsjax.engine.sampling import SamplingParams
    from dsjax.run_config import RunConfig

    prompts = np.random.default_rng(seed).integers(0, model.cfg.vocab_size, (n, prompt_len)).tolist()
    greedy = SamplingParams(temperature=0.0, max_tokens=gen_len, stop_token_ids=[], logprobs=2)
    slots = RunConfig(slots=n, max_len=prompt_len + gen_len, chunk_size=64)
    runs = {}
    for name, m, where in (("mesh", model, jax.set_mesh(mesh)), ("one_device", one_device, contextlib.nullcontext())):
        t = time.perf_counter()
        with where:
            runs[name] = generate(m, prompts, greedy, run=slots)
        print(f"[tokens: {name}] {time.perf_counter() - t:.1f} s", flush=True)
    partings, same, lp_diff = [], 0, 0.0
    for i, (a, b) in enumerate(zip(runs["mesh"], runs["one_device"])):
        common = next((t for t, (x, y) in enumerate(zip(a.tokens, b.tokens)) if x != y), len(a.tokens))
        same += common
        lp_diff = max([lp_diff] + [abs(x.logprob - y.logprob) for x, y in zip(a.logprobs[:common], b.logprobs)])
        if common < len(a.tokens):
            top = b.logprobs[common].top
            partings.append({"sequence": i, "step": common, "margin": top[0][1] - top[1][1]})
    return {"sequences": n, "prompt_len": prompt_len, "gen_len": gen_len, "seed": seed,
            "equal_sequences": n - len(partings), "equal_tokens": same, "tokens": n * gen_len,
            "partings": partings, "max_logprob_diff": lp_diff}


def _done_rows(path: str, *, ep: int, **same) -> dict[int, dict]:
    """Rows already measured in `path` for this run (same model, lengths, cache dtype and mesh), by
    sequences per device; the last of repeated ones. A torn last line (a run killed mid-write) is ignored."""
    rows: dict[int, dict] = {}
    if not os.path.exists(path):
        return rows
    with open(path) as f:
        for line in f:
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            if all(r.get(k) == v for k, v in same.items()) and (r.get("mesh") or {}).get("ep") == ep:
                rows[r["per_device"]] = r
    return rows


def _append_row(path: str, row: dict) -> None:
    """Append `row` as one JSON line, on a line of its own after a torn last line."""
    torn = False
    if os.path.exists(path) and os.path.getsize(path):
        with open(path, "rb") as f:
            f.seek(-1, os.SEEK_END)
            torn = f.read(1) != b"\n"
    with open(path, "a") as f:
        f.write(("\n" if torn else "") + json.dumps(row) + "\n")


def checkpoint_bytes(preset: str, layers, experts: int | None = None, engram_rows: int | None = None) -> int:
    """Bytes of the synthetic checkpoint of `preset` cut to `layers` (None: whole) with `experts` routed experts
    (None: the preset's) and Engram tables of about `engram_rows` rows (V4.1 slices), in the release's storage:
    the stored model's arrays, from their shapes."""
    import math

    import jax

    from dsjax.bench import bench_config
    from dsjax.engine.aot import abstract_state

    cfg = bench_config(preset, layers, "keep", engram_rows)
    _, flat = abstract_state(cfg if experts is None else cfg.replace(n_routed_experts=experts))
    return sum(math.prod(v.get_value().shape) * jax.numpy.dtype(v.get_value().dtype).itemsize for _, v in flat)


def parse_layers(text: str):
    """`--layers`: "all" → None, "2" → 2, "0,1,20" → (0, 1, 20)."""
    if text == "all":
        return None
    try:
        return int(text) if "," not in text else tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a count, layer indices such as 0,1,20, or all; got {text!r}") \
            from None


def run_job(workdir: str, model: str, ep: int, args) -> dict:
    """`dsjax generate` of a job of mixed lengths on the `ep` mesh, in a process of its own; its summary."""
    import subprocess

    from dsjax.batch.job import summary_path

    job = os.path.join(workdir, "job")
    os.makedirs(job, exist_ok=True)
    requests, output = os.path.join(job, "requests.jsonl"), os.path.join(job, "output.jsonl")
    if not os.path.exists(requests):
        from make_requests import main as make_requests

        if make_requests([requests + ".partial", "--model", "synthetic", "--max-tokens", str(args.job_max_tokens),
                          "--mix", *(f"{w}:{c}" for w, c in args.job_mix)]) != 0:
            raise SystemExit(2)
        os.replace(requests + ".partial", requests)
    summary = summary_path(output)
    if os.path.exists(summary):
        with open(summary) as f:
            done = json.load(f)
        if done.get("requests_already_done", 0) == 0 and done.get("requests_ok", 0) + done.get(
                "requests_failed", 0) == sum(c for _, c in args.job_mix):
            print("[job] already there, skipped", flush=True)
            return done
    command = [sys.executable, "-m", "dsjax.cli", "generate", "--input", requests, "--model", model, "--output",
               output, "--served-model-name", "synthetic", "--mesh", f"ep={ep}", "--weights", "keep", "--slots",
               str(args.job_slots), "--max-len", str(args.job_max_len), "--quiet"] + (
                   ["--kv-dtype", args.kv_dtype] if args.kv_dtype else [])
    print("[job] " + " ".join(command), flush=True)
    subprocess.run(command, check=True)
    with open(summary) as f:
        return json.load(f)


def _step(name: str, done: bool, fn):
    t = time.perf_counter()
    if done:
        print(f"[{name}] already there, skipped", flush=True)
        return
    fn()
    print(f"[{name}] {time.perf_counter() - t:.1f} s", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workdir", help="folder for the checkpoints and results (created; reused when re-run)")
    ap.add_argument("--ep", type=int, help="devices on the expert axis (default: every device)")
    ap.add_argument("--preset", default="v4-flash")
    ap.add_argument("--layers", type=parse_layers, default=2,
                    help="the slice: a count of first layers (V4), layer indices (V4.1: 0,1,2,20,21), or all "
                         "(default 2)")
    ap.add_argument("--experts", type=int, help="routed experts (default: the preset's)")
    ap.add_argument("--engram-rows", type=int, help="V4.1 slices: each Engram table about this many rows (default: "
                    "the release's 384M, 183 GiB the two)")
    ap.add_argument("--per-device", type=int, nargs="+", default=[64, 128, 256], help="sequences per device")
    ap.add_argument("--prompt-len", type=int, default=4096)
    ap.add_argument("--gen-len", type=int, default=16)
    ap.add_argument("--chunk-size", type=int, default=256)
    ap.add_argument("--kv-dtype", choices=["bfloat16", "fp8", "fp4"])
    ap.add_argument("--no-breakdown", action="store_true", help="skip the profiled per-part split")
    ap.add_argument("--collective-mib", type=float, default=256,
                    help="buffer per device for timing the collectives alone (default 256 MiB)")
    ap.add_argument("--job-mix", nargs="+", type=mix_entry, metavar="WORDS:COUNT",
                    help="also run `dsjax generate` on a job of COUNT requests of about WORDS words per pair "
                         "(`make_requests.py --mix`; about one token a word with DeepSeek's tokenizer)")
    ap.add_argument("--job-slots", type=int, default=64, help="the job's --slots (default 64)")
    ap.add_argument("--job-max-len", type=int, default=262400,
                    help="the job's --max-len: the longest prompt and its answer (default 262,400)")
    ap.add_argument("--job-max-tokens", type=int, default=256, help="each request's max_tokens (default 256)")
    ap.add_argument("--json", help="append one JSON row per sequence count (default WORKDIR/rows.jsonl)")
    ap.add_argument("--check-sequences", type=int, default=0, metavar="N",
                    help="also compare greedy tokens of N random prompts (a multiple of the mesh's devices) "
                         "on the mesh and on one device, which must hold the whole checkpoint (default: off)")
    ap.add_argument("--check-prompt-len", type=int, default=64)
    ap.add_argument("--check-gen-len", type=int, default=32)
    ap.add_argument("--check-dtype", choices=["bfloat16", "float32"], default="bfloat16",
                    help="activations of the token check (float32 loads the mesh's model again)")
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from dsjax.bench import bench, format_report
    from dsjax.checkpoint.convert import convert
    from dsjax.checkpoint.load import load_model
    from dsjax.config_v41 import model_config
    from dsjax.parallel.mesh import make_mesh
    from dsjax.plan import fmt_bytes, plan
    from dsjax.run_config import RunConfig

    sys.path.insert(0, _HERE)
    from make_synthetic_checkpoint import main as make_synthetic

    try:
        ep = args.ep or jax.device_count()
        if ep != jax.device_count():
            raise ValueError(f"--ep {ep}: the mesh takes every device, and there are {jax.device_count()}")
        bad = [f"--{k} {v}" for k, v in (("prompt-len", args.prompt_len), ("chunk-size", args.chunk_size),
                                           *(("per-device", n) for n in args.per_device)) if v < 1]
        if bad or args.gen_len < 2:
            raise ValueError(f"must be positive (and --gen-len at least 2): {', '.join(bad) or args.gen_len}")
        if args.check_sequences < 0 or args.check_sequences % ep:
            raise ValueError(f"--check-sequences {args.check_sequences}: must be a multiple of the {ep} devices "
                             "(every device holds as many sequences)")
        if args.check_sequences and min(args.check_prompt_len, args.check_gen_len) < 1:
            raise ValueError("--check-prompt-len and --check-gen-len must be positive")
        if args.job_mix and min(args.job_slots, args.job_max_len) < 2:
            raise ValueError("--job-slots and --job-max-len must be at least 2")
        mesh = make_mesh(f"ep={ep}")
        src, dst = os.path.join(args.workdir, "src"), os.path.join(args.workdir, "converted")
        need = checkpoint_bytes(args.preset, args.layers, args.experts, args.engram_rows) * sum(not os.path.exists(d) for d in (src, dst))
        free = _free_bytes(args.workdir)
        if need > free:
            raise ValueError(f"the checkpoint and its conversion need {need / 2**30:,.1f} GiB more; "
                             f"{args.workdir} has {free / 2**30:,.1f} GiB free: take fewer --layers")
    except ValueError as e:
        print(f"bench_multigpu: error: {e}", file=sys.stderr)
        return 2
    os.makedirs(args.workdir, exist_ok=True)
    out = args.json or os.path.join(args.workdir, "rows.jsonl")
    layers = [] if args.layers is None else ["--layers", str(args.layers) if isinstance(args.layers, int)
                                             else ",".join(map(str, args.layers))]
    synth = ["--preset", args.preset, *layers] + (["--experts", str(args.experts)] if args.experts else []) + (
        ["--engram-rows", str(args.engram_rows)] if args.engram_rows else [])

    def make():
        import shutil

        for stale in (src, src + ".partial"):  # an interrupted earlier write: start it again
            if os.path.exists(stale):
                shutil.rmtree(stale)
        if make_synthetic([src + ".partial", *synth]) != 0:
            raise SystemExit(2)
        os.rename(src + ".partial", src)

    _step("synthetic checkpoint", os.path.exists(os.path.join(src, "config.json")), make)
    _step(f"convert for ep={ep}", os.path.exists(dst), lambda: convert(src, dst, ep=ep, progress=False))
    cfg = model_config(dst)
    job = None
    if args.job_mix:
        t = time.perf_counter()
        job = run_job(args.workdir, dst, ep, args)
        print(f"[job] {time.perf_counter() - t:.1f} s", flush=True)
    model = load_model(dst, jnp.bfloat16, weights="keep", mesh=mesh)
    run = RunConfig(max_len=args.prompt_len + args.gen_len, chunk_size=args.chunk_size, kv_dtype=args.kv_dtype,
                    weights="keep", mesh=f"ep={ep}")
    rates = collective_rates(mesh, int(args.collective_mib * 2**20))
    print(f"{args.preset}, {cfg.num_hidden_layers} layers, {cfg.n_routed_experts} experts on {ep} × "
          f"{jax.devices()[0].device_kind}: all-to-all {rates['all_to_all'] / 1e9:.1f} GB/s, all-gather "
          f"{rates['all_gather'] / 1e9:.1f} GB/s sent per device", flush=True)
    model_name = f"{args.preset} ({cfg.num_hidden_layers} layers, {cfg.n_routed_experts} experts)"
    done = _done_rows(out, model=model_name, prompt_len=args.prompt_len, gen_len=args.gen_len,
                      kv_dtype=args.kv_dtype or "bfloat16", chunk_size=args.chunk_size, ep=ep)
    rows = []
    for per in args.per_device:
        if per in done:
            print(f"[{per} per device] already in {out}, skipped", flush=True)
            rows.append(done[per])
            continue
        predicted = plan(cfg, run.replace(slots=per * ep))
        (row,) = bench(model, [per * ep], args.prompt_len, args.gen_len, run=run, breakdown=not args.no_breakdown,
                       mesh=mesh, emit=lambda r: None)
        sent = exchange_bytes(cfg, ep, per)
        parts = row.get("decode_parts_s") or {}
        row |= {"model": model_name, "per_device": per, "chunk_size": args.chunk_size,
                "planned_bytes_per_device": predicted.total, "planned_weights": predicted.weights,
                "planned_cache": predicted.cache, "planned_temp": predicted.temp,
                "exchange_bytes_per_step": sent, "collective_rates": rates}
        if parts.get("collectives"):
            row["collectives_GBps"] = {k: v / parts["collectives"] / 1e9 for k, v in sent.items()}
        print(format_report(row), flush=True)
        print(f"  planned {fmt_bytes(predicted.total)} per device (weights {fmt_bytes(predicted.weights)}, cache "
              f"{fmt_bytes(predicted.cache)}, temporaries {fmt_bytes(predicted.temp)})", flush=True)
        _append_row(out, row)
        rows.append(row)

    check = None
    if args.check_sequences:
        check_path = os.path.join(args.workdir, "tokens.json")
        settings = {"model": model_name, "ep": ep, "sequences": args.check_sequences, "dtype": args.check_dtype,
                    "prompt_len": args.check_prompt_len, "gen_len": args.check_gen_len}
        if os.path.exists(check_path):
            with open(check_path) as f:
                check = json.load(f)
            if {k: check.get(k) for k in settings} != settings:
                check = None
        if check is None:
            import gc

            gc.collect()  # the benchmark's engines and their caches
            dtype = getattr(jnp, args.check_dtype)
            on_mesh = model if dtype is jnp.bfloat16 else load_model(dst, dtype, weights="keep", mesh=mesh)
            one = load_model(dst, dtype, weights="keep")
            check = settings | check_tokens(on_mesh, mesh, one, args.check_sequences, args.check_prompt_len,
                                            args.check_gen_len)
            del one, on_mesh
            with open(check_path + ".partial", "w") as f:
                json.dump(check, f, indent=1)
            os.replace(check_path + ".partial", check_path)
        else:
            print(f"[tokens] already in {check_path}, skipped", flush=True)

    print("\nper device | tok/s | ms/step | collectives ms/step | exchange GB/s (gathered / ragged) | peak / planned")
    for r in rows:
        coll = (r.get("decode_parts_s") or {}).get("collectives")
        rate = r.get("collectives_GBps")
        peak = r["peak_memory_bytes"]
        print(f"{r['per_device']:>10} | {r['decode_tokens_per_s']:,.0f} | {r['decode_step_s'] * 1e3:.2f} | "
              f"{'n/a' if coll is None else f'{coll * 1e3:.2f}'} | "
              f"{'n/a' if not rate else f'{rate['gathered']:.1f} / {rate['ragged_mean']:.1f}'} | "
              f"{'n/a' if peak is None else fmt_bytes(peak)} / {fmt_bytes(r['planned_bytes_per_device'])}")
    if job:
        print(f"job: {job['requests_ok']} ok, {job['requests_failed']} failed; {job['prompt_tokens']:,} prompt and "
              f"{job['generated_tokens']:,} generated tokens; load {job['load_seconds']:.1f} s, compile "
              f"{job['compile_seconds']:.1f} s, generation {job['generation_seconds']:.1f} s at "
              f"{job['prompt_tokens_per_second']:,.0f} prompt and {job['generated_tokens_per_second']:,.0f} "
              "generated tok/s")
    if check:
        parts = ", ".join(f"#{p['sequence']} at step {p['step']} (one-device margin {p['margin']:.3g} nats)"
                          for p in check["partings"])
        print(f"greedy tokens, mesh against one device: {check['equal_sequences']}/{check['sequences']} sequences "
              f"and {check['equal_tokens']}/{check['tokens']} tokens equal; chosen-token logprobs within "
              f"{check['max_logprob_diff']:.3g} nats before any parting" + (f"; parted: {parts}" if parts else ""))
    return 0


def _free_bytes(folder: str) -> int:
    """Free bytes on the disk `folder` is (or will be) on."""
    import shutil

    while not os.path.exists(folder):
        folder = os.path.dirname(os.path.abspath(folder))
    return shutil.disk_usage(folder).free


if __name__ == "__main__":
    sys.exit(main())
