"""The `dsjax` command: one entry point, one sub-command per job."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys

from dsjax.compile_cache import compile_cache
from dsjax.config import ModelConfig
from dsjax.parallel import distributed
from dsjax.quant import KV_DTYPES
from dsjax.run_config import (DECODER_PREFILL, DTYPES, KERNELS, RENAMED_WEIGHTS, SPECULATIVE, WEIGHTS, RunConfig,
                              RunConfigError, auto_chunk_size)

# The run options (`RunConfig`'s fields) as flags, one name each whatever the sub-command: the flag, how
# argparse reads it (choices: the code's own tuples), and what it means.
_RUN_FLAGS = {
    "slots": ("--slots", dict(type=int, metavar="N"), "sequences in flight, the decode batch"),
    "max_len": ("--max-len", dict(type=int, metavar="TOKENS"),
                "tokens per sequence, prompt and generated: the cache's length"),
    "chunk_size": ("--chunk-size", dict(type=lambda t: _chunk_tokens(t), metavar="TOKENS|auto"),
                   "prompt tokens per prefill chunk; auto: on a GPU or TPU the largest power of two from 256 to 8192 "
                   "with at most 65,536 tokens in a prefill of every slot (one long prompt: 8192), on a CPU 256"),
    "dtype": ("--dtype", dict(choices=DTYPES), "activations, float weights and the cache's float parts"),
    "kv_dtype": ("--kv-dtype", dict(choices=KV_DTYPES),
                 "cache storage of K=V rows (default: --dtype). V4: fp8 and fp4 keep the rotary part in bf16 and "
                 "the indexer's keys in fp8 (docs/quantization.md); V4.1: fp4 packs rows as the release does (MXFP8 "
                 "window, NVFP4 entries, MXFP4 index keys), fp8 the same with MXFP8 entries (docs/v41.md)"),
    "weights": ("--weights", dict(choices=WEIGHTS),
                "keep: FP8 blocks and FP4 routed experts (a checkpoint's own storage; DeepSeek's release format "
                "for a preset) stay so on the device, dequantized layer by layer inside each step; bf16: float "
                "weights in --dtype, dequantized once at load"),
    "kernels": ("--kernels", dict(choices=KERNELS),
                "auto: the Pallas kernels on GPUs and TPUs, the pure-JAX references elsewhere; reference: the "
                "references everywhere; interpret: the GPU kernels in Pallas's interpreter, slow, for tests on "
                "a CPU"),
    "mesh": ("--mesh", dict(metavar="SPEC"),
             "a device mesh, e.g. 'ep=8' or 'dp=2,ep=4' (axes dp, ep, tp; sizes multiply to the device count); "
             "default: one device"),
    "decoder_prefill": ("--decoder-prefill", dict(choices=DECODER_PREFILL),
                        "DeepSeek-V4.1's prefill: exact (default) runs the decoder layers only on the prompt "
                        "positions that reach its end, bit for bit as full; replay is DeepInfer's approximate "
                        "bounded replay"),
    "speculative": ("--speculative", dict(choices=SPECULATIVE),
                    "off, or dspark: DeepSeek-V4.1's DSpark stages draft tokens that the target verifies in its step "
                    "(greedy: the same tokens as off; sampling: the same distribution); the summary gives the "
                    "acceptance"),
    "drafts": ("--drafts", dict(type=lambda t: _drafts(t), metavar="N|auto"),
               "with --speculative dspark, the drafts verified per request a step; auto (default): 0, 2 or all, chosen "
               "each step from the drafter's confidence and the step times measured at start"),
    "batch_invariant": ("--batch-invariant", dict(action="store_true"),
                        "prefill each request alone, so that a request's logits and tokens are bit for bit the same "
                        "whatever else is in the batch and whichever slot it takes (decode steps are already); costs "
                        "prefill throughput where many requests arrive at once (docs/generate.md)"),
}
_RUN_DEFAULTS = {f.name: f.default for f in dataclasses.fields(RunConfig)}
# For the commands that compile the engine's steps; those of V4.1's prefill and speculative decoding only where the
# scheduler runs (generate, bench).
_SCHEDULED = ("decoder_prefill", "speculative", "drafts", "batch_invariant")
_EVERY = tuple(f for f in _RUN_FLAGS if f not in _SCHEDULED)
# Spellings that still work until 0.2, each printing the one that replaces it.
_GOES_IN = "0.2"
_RENAMED_FLAGS = {"--max-batch": "--slots", "--batch": "--slots", "--chunk": "--chunk-size", "--context": "--max-len"}
_RENAMED_VALUES = {"--weights": RENAMED_WEIGHTS}


def _count_or_auto(what: str, auto):
    """An argparse type: a number of `what`, or "auto" (read as `auto`)."""
    def parse(text: str):
        if text == "auto":
            return auto
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number of {what} or 'auto', got {text!r}") from None
    return parse


# `--chunk-size`'s "auto" is resolved in `run_config`; `--drafts auto` is RunConfig's None (chosen each step).
_chunk_tokens = _count_or_auto("tokens", "auto")
_drafts = _count_or_auto("drafts", None)


def _deprecated(old: str, new: str) -> None:
    print(f"dsjax: {old} is deprecated, use {new} (it goes in {_GOES_IN})", file=sys.stderr, flush=True)


class _OldSpelling(argparse.Action):
    """A flag's old name: the value goes where the new flag's would, and stderr names the new flag."""

    def __call__(self, parser, namespace, values, option_string=None):
        _deprecated(option_string, _RENAMED_FLAGS[option_string])
        setattr(namespace, self.dest, values)


def _renamed_values(flag: str, parse=str):
    """An argparse type for `flag`: `parse`, then an old value is swapped for its new one (said on stderr)."""
    def convert(text: str):
        value = parse(text)
        new = _RENAMED_VALUES.get(flag, {}).get(value)
        if new is None:
            return value
        _deprecated(f"{flag} {value}", f"{flag} {new}")
        return new
    return convert


def add_run_args(p: argparse.ArgumentParser, fields: tuple[str, ...], *, defaults: dict | None = None,
                 required: tuple[str, ...] = (), several: tuple[str, ...] = (), helps: dict[str, str] | None = None,
                 old: tuple[str, ...] = ()) -> None:
    """Add the flags of the run options `fields` (RunConfig's names) to `p`: RunConfig's defaults unless
    `defaults` has the command's own; `required` ones must be given; `several` take one or more values;
    `helps` replaces a flag's description where the command means something more; `old` are renamed
    flags (`_RENAMED_FLAGS`) the command still accepts."""
    defaults, helps = defaults or {}, helps or {}
    for name in fields:
        flag, how, text = _RUN_FLAGS[name]
        how = {**how, "type": _renamed_values(flag, how.get("type", str))} if flag in _RENAMED_VALUES else how
        default = None if name in required else defaults.get(name, _RUN_DEFAULTS[name])
        if "dtype" not in fields:  # the command runs in RunConfig's dtype
            text = text.replace("--dtype", _RUN_DEFAULTS["dtype"])
        text = helps.get(name, text) + (f" (default {default})" if default is not None else "")
        nargs = {"nargs": "+"} if name in several else {}  # a switch (store_true) takes no nargs at all
        olds = [o for o in old if _RENAMED_FLAGS[o] == flag]
        # An old name with the new one in a group of either, so that giving both is refused.
        where = p.add_mutually_exclusive_group(required=name in required) if olds else p
        where.add_argument(flag, dest=name, default=default, **nargs, help=text,
                           **({"required": True} if name in required and not olds else {}), **how)
        for o in olds:
            where.add_argument(o, dest=name, action=_OldSpelling, **nargs, default=argparse.SUPPRESS,
                               help=argparse.SUPPRESS, **how)


def run_config(args: argparse.Namespace, **changes) -> RunConfig:
    """The RunConfig of the run flags in `args` (RunConfig's defaults for those the command has not) with
    `changes`; a bad value raises ValueError naming its flag."""
    values = {name: getattr(args, name) for name in _RUN_FLAGS if getattr(args, name, None) is not None}
    values = {**values, **changes}
    if values.get("chunk_size") == "auto":
        import jax

        given = {**_RUN_DEFAULTS, **values}
        values["chunk_size"] = auto_chunk_size(given["slots"], given["max_len"], jax.default_backend())
    try:
        return RunConfig(**values)
    except RunConfigError as e:  # its message starts with the field's name: say the flag's
        msg = str(e)
        for name, (flag, _, _) in _RUN_FLAGS.items():
            if msg.startswith(name + " "):
                msg = flag + msg[len(name):]
                break
        raise ValueError(msg) from None


def _model_source(parser: argparse.ArgumentParser) -> None:
    """`--preset NAME` or `--model FOLDER`, exactly one."""
    from dsjax.presets import PRESETS

    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", help=", ".join(sorted(PRESETS)))
    src.add_argument("--model", help="a Hugging Face model folder (its config.json is read)")


def _layers_arg(text: str) -> int | tuple[int, ...]:
    """`--layers`: a count, or a comma-separated list of layer indices."""
    try:
        return int(text) if "," not in text else tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a layer count or a list such as 0,1,20, got {text!r}") from None


def _load_config(args: argparse.Namespace):
    """The ModelConfig or V41Config of `--preset` or `--model`."""
    from dsjax.config_v41 import V41Config, is_v41, model_config
    from dsjax.presets import PRESETS

    if args.preset:
        if is_v41(PRESETS.get(args.preset, {})):
            return V41Config.preset(args.preset)
        return ModelConfig.preset(args.preset)
    return model_config(args.model)


def _info_v41(name: str, cfg) -> int:
    from dsjax.info import V41_COMPONENTS, v41_cache_bytes, v41_model_info

    info = v41_model_info(cfg)
    print(f"{name}: DeepSeek-V4.1, {cfg.num_hidden_layers} layers (encoder 0-{cfg.first_decoder_layer - 1}, "
          f"decoder {cfg.first_decoder_layer}-{cfg.num_hidden_layers - 1})")
    print(f"  backbone {info.backbone / 1e9:.2f}B parameters ({info.backbone:,}); Engram {info.engram / 1e9:.2f}B "
          f"(tables {info.by_component['engram_tables']:,}); DSpark {info.by_component['dspark'] / 1e9:.2f}B; "
          f"image encoder {info.by_component['vision'] / 1e9:.2f}B; total {info.total / 1e9:.2f}B")
    print(f"  active per decode token {info.active / 1e9:.2f}B; release storage {info.release_bytes / 2**30:.1f} GiB "
          "(FP8 32x32 blocks, FP4 experts, FP8 Engram tables)")
    for comp in V41_COMPONENTS:
        n = info.by_component[comp]
        print(f"  {comp:<19} {n:>18,}  {100 * n / info.total:5.1f}%")
    modes = [r.mode for r in cfg.layer_roles()]
    print("  layers: " + ", ".join(f"{m}×{modes.count(m)}" for m in ("sliding", "full", "reindex", "reuse")))
    for kv, label in (("fp4", "NVFP4 entries (release default)"), ("fp8", "MXFP8 entries")):
        c = v41_cache_bytes(cfg, kv)
        print(f"  cache, {label}: {c['global_per_token']:,.0f} B per token of context (entries "
              f"{c['entries_per_token']:,.0f}, index keys {c['index_keys_per_token']:,.0f}) + window rings "
              f"{c['windows_per_sequence'] / 2**20:,.2f} MiB per sequence (MXFP8); --kv-dtype {kv}")
    return 0


def _info(args: argparse.Namespace) -> int:
    from dsjax.cache import cache_bytes_per_token
    from dsjax.info import COMPONENTS, model_info

    cfg = _load_config(args)
    if getattr(cfg, "family", "v4") == "v4.1":
        return _info_v41(args.preset or args.model, cfg)
    context = run_config(args, max_len=args.max_len or cfg.max_position_embeddings).max_len
    info = model_info(cfg)
    name = args.preset or args.model
    print(f"{name}: {info.summary()}")
    for comp in COMPONENTS:
        n = info.by_component[comp]
        print(f"  {comp:<15} {n:>18,}  {100 * n / info.total:5.1f}%")
    kinds = ", ".join(f"{t}×{cfg.layer_types.count(t)}" for t in sorted(set(cfg.layer_types)))
    print(f"  layers: {cfg.num_hidden_layers} ({kinds})")
    print(f"  cache per token of context at {context:,} tokens (float parts bf16):")
    for kv in KV_DTYPES:
        per_type = cache_bytes_per_token(cfg, context, kv_dtype=kv)
        whole = sum(per_type[t] * cfg.layer_types.count(t) for t in per_type)
        print(f"    kv_dtype {kv:<8}  " + ", ".join(f"{t} {b:,.1f} B/layer" for t, b in per_type.items())
              + f"; whole model {whole / 1024:,.2f} KiB/token")
    return 0


def _bench(args: argparse.Namespace) -> int:
    import functools
    import json
    import tempfile

    import jax
    import jax.numpy as jnp

    from dsjax.bench import DeviceRates, bench, bench_config, format_report, measure_rates, random_model
    from dsjax.model import expert_code_layout, with_code_layout

    if args.model and args.layers:
        raise ValueError("--layers cuts a preset built with random weights; a --model folder runs whole")
    if args.prompt_len < 1 or args.gen_len < 2:
        raise ValueError(f"--prompt-len must be positive and --gen-len at least 2, got {args.prompt_len} and "
                         f"{args.gen_len}")
    for slots in args.slots:  # each size in turn is a run of its own
        run_config(args, slots=slots)
    run = run_config(args, slots=max(args.slots), max_len=args.prompt_len + args.gen_len)
    if (args.copy_tbps is None) != (args.matmul_tflops is None):
        raise ValueError("give both --copy-tbps and --matmul-tflops, or neither (then both are measured)")
    mesh = None
    if run.mesh:
        from dsjax.parallel.mesh import make_mesh

        mesh = make_mesh(run.mesh)
    if args.model:
        from dsjax.checkpoint.load import load_model

        model = load_model(args.model, jnp.bfloat16, weights=run.weights, mesh=mesh)
        name = args.model
    else:
        # straight onto the mesh: the whole model need not fit one device
        model = random_model(bench_config(args.preset, args.layers, run.weights, args.engram_rows), args.seed,
                             mesh=mesh)
        name = args.preset
    model = with_code_layout(model, expert_code_layout(run.kernels, jax.default_backend()))
    rates = (DeviceRates(args.copy_tbps * 1e12, args.matmul_tflops * 1e12) if args.copy_tbps
             else measure_rates())
    where = f"{mesh.size} × {mesh.devices.flat[0].device_kind}" if mesh is not None else jax.devices()[0].device_kind
    print(f"{name}: {model.cfg.num_hidden_layers} layers, {run.weights} weights on {where} "
          f"(copy {rates.copy_bytes_per_s / 1e12:.2f} TB/s, bf16 matmul {rates.matmul_flops_per_s / 1e12:.0f} "
          f"TFLOP/s)", flush=True)

    def emit(row):
        row = {"model": name, **row}
        print(format_report(row), flush=True)
        if args.json:  # appended at once, so that a run cut short keeps its rows
            with open(args.json, "a") as f:
                f.write(json.dumps(row) + "\n")

    measure = functools.partial(bench, model, args.slots, args.prompt_len, args.gen_len, run=run,
                                breakdown=not args.no_breakdown, rates=rates, seed=args.seed,
                                trace_dir=args.trace_dir, mesh=mesh, emit=emit)
    if args.no_breakdown or jax.default_backend() == "cpu" or jax.config.jax_compilation_cache_dir:
        measure()
        return 0
    # The per-part split compiles the decode step once more to read its kernels' names; with a
    # persistent cache (this run's own, removed after it) that second compile is a lookup.
    import shutil

    cache_dir = tempfile.mkdtemp(prefix="dsjax-bench-xla-")
    min_secs = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    try:
        measure()
    finally:
        jax.config.update("jax_compilation_cache_dir", None)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", min_secs)
        shutil.rmtree(cache_dir, ignore_errors=True)
    return 0


def _generate(args: argparse.Namespace) -> int:
    run = run_config(args)  # bad options fail before anything starts
    if args.demo and distributed.spec_from(args) is not None:
        raise ValueError("--demo runs on one process: drop --coordinator, --num-processes, --process-id and "
                         "--distributed (and unset JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID)")
    if args.demo or run.dtype == "float32":
        from dsjax.compile_cache import use_float32_gpu_flags

        use_float32_gpu_flags()  # before anything starts a jax backend
    distributed.initialize_from(args)  # before anything starts a jax backend
    from dsjax.batch.job import JobConfig, Terminated, format_summary, run_job, summary_path

    if args.demo:
        if args.model or args.input:
            raise ValueError("--demo runs the embedded model on its bundled requests: drop --model and --input")
        from dsjax.demo import run_demo

        s = run_demo(args.output, progress=not args.quiet, verbose=args.verbose)
        return 0 if s["requests_failed"] == 0 else 1
    missing = [flag for flag, v in (("--model", args.model), ("--input", args.input), ("--output", args.output))
               if not v]
    if missing:
        raise ValueError(f"{', '.join(missing)} required (or --demo)")
    cfg = JobConfig(model=args.model, input=args.input, output=args.output, run=run, seed=args.seed,
                    allow_remote_images=args.allow_remote_images, served_model_names=tuple(args.served_model_name),
                    prompt_format=args.prompt_format,
                    image_root=args.image_root, allow_changed_input=args.allow_changed_input,
                    thinking_budget=args.thinking_budget,
                    progress=not args.quiet, verbose=args.verbose)
    try:
        s = run_job(cfg)
    except KeyboardInterrupt as e:
        term = isinstance(e, Terminated)
        print(f"{'stopped by SIGTERM' if term else 'interrupted'}: finished records are in {args.output}; "
              "re-run the same command to resume", file=sys.stderr)
        return 143 if term else 130
    if distributed.process_index() != 0:  # process 0 writes the output and reports
        return 0
    print(format_summary(s) + f"; summary: {summary_path(args.output)}")
    return 0


def _convert(args: argparse.Namespace) -> int:
    from dsjax.checkpoint.convert import convert, to_hf
    from dsjax.parallel.mesh import parse_mesh

    run = run_config(args)
    if names := distributed.multi_process_env():  # one writer only
        raise ValueError(f"the environment asks for a multi-process run ({', '.join(names)} set), but convert "
                         "writes DST from one process: run it once, on one host, without them; every process "
                         "of a multi-process `dsjax generate --mesh ...` then reads only its own shards of DST")

    shard = int(args.shard_mb * 1e6) if args.shard_mb else None
    try:
        if args.to_hf:
            if args.weights != "keep" or args.mesh or args.verify:
                raise ValueError("--weights, --mesh and --verify apply to conversion into dsjax's layout, "
                                 "not to --to-hf")
            s = to_hf(args.src, args.dst, max_shard_bytes=shard, progress=not args.quiet)
        else:
            if shard:
                raise ValueError("--shard-mb sets the size of the safetensors shards --to-hf writes")
            ep = parse_mesh(run.mesh)["ep"] if run.mesh else 1
            s = convert(args.src, args.dst, weights=run.weights, ep=ep, verify=args.verify,
                        progress=not args.quiet)
    except KeyboardInterrupt:
        print(f"interrupted: {args.dst} was not created; re-run the same command to resume", file=sys.stderr)
        return 130
    print(f"{args.dst}: {s}")
    return 0


def _plan(args: argparse.Namespace) -> int:
    import math

    from dsjax.parallel.mesh import parse_mesh
    from dsjax.plan import largest_fit, parse_bytes, plan

    run = run_config(args)  # bad input fails before anything is compiled
    budget = parse_bytes(args.device_mem)
    _ensure_cpu_devices(math.prod(parse_mesh(run.mesh).values()))
    if args.layers is not None:
        from dsjax.bench import bench_config

        if args.model:
            raise ValueError("--layers cuts a preset; a --model folder is planned whole")
        cfg = bench_config(args.preset, args.layers, run.weights)
    else:
        cfg = _load_config(args)
    common = dict(device_mem=budget, model_name=args.preset or args.model)
    base = plan(cfg, run, **common)
    fit = None
    if not args.no_search:
        def log(msg):
            print(f"dsjax plan: {msg}", file=sys.stderr, flush=True)

        fit = largest_fit(base, lambda slots: plan(cfg, run.replace(slots=slots), **common), log=log)
    print(base.table(fit))
    return 0


def _export(args: argparse.Namespace) -> int:
    from dsjax.export import check_out_dir, export_steps

    run = run_config(args)  # bad input fails before anything is traced
    check_out_dir(args.out, args.force)
    cfg = ModelConfig.preset(args.preset) if args.preset else ModelConfig.from_hf(args.model)
    m = export_steps(cfg, args.platform, args.out, run, prefill_rows=args.prefill_rows, device_kind=args.device_kind,
                     model_name=args.preset or args.model, force=args.force)
    sizes = ", ".join(f"{name} {d['bytes'] / 1e6:,.2f} MB" for name, d in m["steps"].items())
    mesh = ",".join(f"{a}={n}" for a, n in (m["mesh"] or {}).items() if n > 1) or "one device"
    device = f" ({m['device_kind']})" if m["device_kind"] and m["platform"] != "cpu" else ""
    print(f"{args.out}: {m['model']} for {m['platform']}{device} on {mesh}, weights {m['weights']}, "
          f"dtype {m['dtype']}, kv {m['kv_dtype'] or m['dtype']}, {m['slots']} slots × {m['max_len']:,} tokens, prefill "
          f"{m['prefill_rows']} rows × {m['chunk_size']} tokens; {sizes}; {len(m['params'])} parameter and "
          f"{len(m['cache'])} cache arrays as inputs; {m['export_seconds']:.1f} s")
    return 0


def _ensure_cpu_devices(n: int) -> None:
    """Give the host CPU backend at least `n` devices, so a mesh of `n` can be planned without them.

    `jax_num_cpu_devices` (like XLA_FLAGS=--xla_force_host_platform_device_count) is read when JAX starts
    its CPU backend, on the first call that needs a device; importing jax does not start it. So this works
    whenever nothing in the process has touched a device yet, as in a `dsjax plan` command. It only ever
    raises the count XLA_FLAGS asks for; once a backend is up it changes nothing (`plan` then says if too
    few devices exist)."""
    import os
    import re

    import jax

    flag = re.search(r"--xla_force_host_platform_device_count=(\d+)", os.environ.get("XLA_FLAGS", ""))
    have = max(int(flag.group(1)) if flag else 1, jax.config.jax_num_cpu_devices)
    if n > have:
        try:
            jax.config.update("jax_num_cpu_devices", n)
        except RuntimeError:  # the backend has started already
            pass


def _int_at_least(least: int, below: int | None = None):
    """An argparse type: an integer >= `least` (and < `below`), so a bad value fails before any work."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < least or (below is not None and value >= below):
            bound = f"in [{least}, {below})" if below is not None else f"at least {least}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
        return value
    return parse


def add_generate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="Hugging Face model folder (config.json, safetensors, tokenizer.json)")
    p.add_argument("--input", help="requests, JSONL in the OpenAI Batch format")
    p.add_argument("--output", help="results JSONL (appended; re-running resumes it)")
    p.add_argument("--served-model-name", nargs="+", metavar="NAME", default=(),
                   help="the model names requests may give (default: the model folder's name and the recipe's "
                        "name for the checkpoint's version, e.g. DeepSeek-V4.1-Flash); requests naming another "
                        "get a model_not_found error record. The prompt format comes from the checkpoint")
    p.add_argument("--prompt-format", choices=["v4", "v4.1"],
                   help="the prompt encoding (default: the checkpoint's: v4.1 for a model that reads images, else "
                        "v4); for a checkpoint trained on the other format than its config says")
    add_run_args(p, (*_EVERY, *_SCHEDULED),
                 old=("--max-batch",), helps={
                     "mesh": "run sharded over the visible devices (of every process, in a multi-process run), "
                             "e.g. 'ep=8' or 'dp=2,ep=4': routed experts split over ep (expert parallelism); "
                             "sizes must multiply to the device count"})
    p.add_argument("--seed", type=_int_at_least(0, 2 ** 63), default=0,
                   help="job seed: requests that set no seed draw from it and their custom_id")
    p.add_argument("--allow-remote-images", action="store_true",
                   help="fetch image URLs of requests (public addresses only: private, loopback and link-local "
                        "ones are refused); without it a request with a remote image URL gets an error record. "
                        "Data URLs and local files (paths relative to the input file) need no flag")
    p.add_argument("--image-root", metavar="FOLDER",
                   help="read local image files from this folder (default: the input file's folder); paths that "
                        "lead outside it, through '..', absolute paths or symbolic links, are refused")
    p.add_argument("--allow-changed-input", action="store_true",
                   help="resume an output although the input changed since it was started (lines whose "
                        "custom_id already has a record are skipped); without it such a resume is refused")
    p.add_argument("--thinking-budget", type=int, metavar="TOKENS",
                   help="the most tokens a thinking part may take: then </think> is forced, so the answer (and an "
                        "output format) gets the rest of max_tokens; a Messages request's thinking.budget_tokens "
                        "overrides it (default: no limit but max_tokens)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    _verbose_arg(p)
    distributed.add_distributed_args(p)


def _shared_args() -> argparse.ArgumentParser:
    """The options every sub-command takes (as an argparse parent)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--no-compile-cache", action="store_true",
                   help="compile every program afresh and write nothing to the compile cache (default: load "
                        "programs compiled before from $DSJAX_CACHE_DIR, else $XDG_CACHE_HOME/dsjax or "
                        "~/.cache/dsjax, and add new ones there; docs/generate.md)")
    return p


def _verbose_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("-v", "--verbose", action="store_true",
                   help="also show the functions that took longest to compile (generate) and the libraries' "
                        "warnings logged through absl, such as tokamax's notes that a kernel shape has no tuned "
                        "configuration (it then uses its heuristics); by default only their errors")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dsjax", description="DeepSeek-V4 offline inference in JAX")
    sub = parser.add_subparsers(dest="command", required=True)
    shared = _shared_args()
    info = sub.add_parser("info", parents=[shared],
                          help="parameter counts and memory of a model, without loading it")
    _model_source(info)
    add_run_args(info, ("max_len",), defaults={"max_len": None}, old=("--context",), helps={
        "max_len": "the context length the cache report is for (default: the model's max_position_embeddings)"})
    info.set_defaults(func=_info)
    gen = sub.add_parser("generate", parents=[shared],
                         help="run a batch of API requests (OpenAI Batch JSONL) through a model")
    gen.add_argument("--demo", action="store_true", help="run the bundled requests through the embedded "
                     "model and print a few responses (--output optional)")
    add_generate_args(gen)
    gen.set_defaults(func=_generate)
    conv = sub.add_parser("convert", parents=[shared],
                          help="a DeepSeek-V4 or V4.1 safetensors checkpoint → dsjax's sharded Orbax layout "
                          "(or back with --to-hf)", description="Convert SRC (config.json, safetensors shards "
                          "of DeepSeek-V4 in any naming or of DeepSeek-V4.1 in the release's, index, tokenizer "
                          "files) into an Orbax checkpoint at DST laid out for dsjax. Streams with bounded memory; DST appears only "
                          "when complete; an interrupted run resumes when re-run with the same arguments. See "
                          "docs/convert.md.")
    conv.add_argument("src", help="checkpoint folder to read")
    conv.add_argument("dst", help="folder to create (must not exist)")
    add_run_args(conv, ("weights", "mesh"), helps={
        "weights": "keep: store FP8 weights, FP4 experts and their scales as they are; bf16: dequantize them "
                   "into bf16",
        "mesh": "the mesh the checkpoint is for, e.g. 'dp=2,ep=4': routed experts are stored in blocks that "
                "each expert-parallel device reads whole"})
    conv.add_argument("--verify", action="store_true",
                      help="before finishing, re-read every array and compare its sha256 with the source's")
    conv.add_argument("--to-hf", action="store_true",
                      help="the reverse: SRC is a converted checkpoint, DST gets safetensors shards with "
                      "DeepSeek's original names and an index")
    conv.add_argument("--shard-mb", type=float, help="--to-hf: shard size in MB (default 4096)")
    conv.add_argument("--quiet", action="store_true", help="no progress bar")
    conv.set_defaults(func=_convert)
    pl = sub.add_parser("plan", parents=[shared],
                        help="per-device memory of a model on a mesh, from the compiled steps",
                        description="Compile the decode and prefill-chunk steps ahead of time from abstract arrays "
                        "on a mesh (host CPU devices stand in for missing ones) and print per-device bytes of "
                        "weights, cache and temporaries from XLA's memory analysis against --device-mem, and the "
                        "most slots of --max-len tokens that fit. See docs/parallelism.md.")
    _model_source(pl)
    add_run_args(pl, _EVERY,
                 required=("slots", "max_len", "mesh"), helps={
                     "slots": "sequences in flight over the mesh (a multiple of the dp·ep devices)",
                     "mesh": "e.g. 'ep=8' or 'dp=2,ep=4' (axes dp, ep, tp); host CPU devices stand in for "
                             "missing ones"})
    pl.add_argument("--layers", type=_layers_arg, help="keep the preset's first N decoder layers, or for V4.1 the "
                    "release's layers listed (0,1,20,21): the slice `dsjax bench --layers` runs, to compare its peak "
                    "memory with the plan")
    pl.add_argument("--device-mem", default="141GB",
                    help="memory budget per device: '141GB' (10^9), '80GiB' (2^30) or bytes ('141e9'); "
                         "default 141GB (an H200)")
    pl.add_argument("--no-search", action="store_true",
                    help="skip compiling at other slot counts to find the largest that fits (the cache "
                         "formula's estimate is still printed)")
    pl.set_defaults(func=_plan)
    be = sub.add_parser("bench", parents=[shared],
                        help="prefill and decode throughput of the engine against the roofline",
                        description="Build the model with random weights (or load one), run the engine as "
                        "`generate` does (one prefill, then greedy decode steps without stop tokens) and report "
                        "prefill tokens/s, decode tokens/s per sequence and in all, the decode step and the whole "
                        "prefill split into attention, indexer scores, top-k, MoE and the rest (profiler trace, "
                        "GPUs; --no-breakdown skips it, which saves one more prefill), peak device memory, and "
                        "the roofline: the bytes and FLOPs the steps must move over the measured copy bandwidth "
                        "and matmul rate. See docs/benchmarks.md.")
    _model_source(be)
    be.add_argument("--layers", type=_layers_arg, help="keep the preset's first N decoder layers (to fit one device); "
                    "for V4.1 also a list of the release's layers kept in their roles, e.g. 0,1,2,3,20,21,24,25")
    be.add_argument("--engram-rows", type=int, help="V4.1: shrink each Engram table to about this many rows (the "
                    "lookups' cost does not depend on the table's size; the release's 384M rows take 98 GB each)")
    # Float weights by default, unlike plan's and export's: the measurements compare with float engines.
    add_run_args(be, ("slots", "chunk_size", "kv_dtype", "weights", "kernels", *_SCHEDULED, "mesh"),
                 defaults={"weights": "bf16"},
                 required=("slots",), several=("slots",), old=("--batch",), helps={
                     "slots": "sequences in flight; several sizes run in turn",
                     "mesh": "run on a device mesh, e.g. 'ep=8' (axes dp, ep, tp; sizes multiply to the device "
                             "count): --slots counts sequences over the whole mesh; --model loads each device's "
                             "slice only (a converted checkpoint), a preset is built on one device and then "
                             "placed"})
    be.add_argument("--prompt-len", type=int, required=True, help="prompt tokens per sequence")
    be.add_argument("--gen-len", type=int, required=True, help="generated tokens per sequence (at least 2)")
    be.add_argument("--copy-tbps", type=float, help="copy bandwidth in TB/s for the roofline (default: measured)")
    be.add_argument("--matmul-tflops", type=float, help="bf16 matmul rate in TFLOP/s (default: measured)")
    be.add_argument("--no-breakdown", action="store_true", help="skip the profiled per-part split")
    be.add_argument("--trace-dir", help="keep each breakdown's profiler trace here (batch<B>/, for Perfetto)")
    be.add_argument("--json", help="append one JSON row per batch size to this file")
    be.add_argument("--seed", type=int, default=0, help="weights and prompts")
    _verbose_arg(be)
    be.set_defaults(func=_bench)
    ex = sub.add_parser("export", parents=[shared],
                        help="the decode and prefill-chunk steps as serialized StableHLO for one platform",
                        description="Lower the engine's decode and prefill-chunk steps from abstract arrays (no "
                        "weights needed: the weights are inputs of the exported functions) for one platform and "
                        "write DIR/decode.stablehlo, DIR/prefill.stablehlo (jax.export serializations) and "
                        "DIR/manifest.json (config, sizes, dtypes, versions, the parameter and cache leaves and "
                        "each step's inputs and outputs). Load them with dsjax.export.load_steps(DIR).")
    _model_source(ex)
    ex.add_argument("--platform", required=True, metavar="{cpu,cuda,rocm,tpu}",
                    help="the platform the programs are for (one per export: the Pallas kernels differ)")
    ex.add_argument("--out", required=True, metavar="DIR",
                    help="folder to create (or an empty one); it appears only when complete")
    ex.add_argument("--force", action="store_true", help="replace DIR if it holds an earlier export")
    add_run_args(ex, _EVERY,
                 old=("--chunk",), helps={
                     "mesh": "export the SPMD program for a mesh, e.g. 'ep=8' (inputs laid out as `dsjax plan` "
                             "lays them out; no devices needed); default: one device"})
    ex.add_argument("--prefill-rows", type=int, help="rows of a prefill chunk (default: --slots)")
    ex.add_argument("--device-kind", help="the GPU or TPU the Pallas kernels are lowered for, as jax names it "
                    "(default: 'NVIDIA H200' for cuda, 'gfx942' for rocm, 'TPU v6 lite' for tpu)")
    ex.set_defaults(func=_export)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # What the command changes in jax and absl is undone after it, for callers that go on (tests, notebooks).
    with contextlib.ExitStack() as scope:
        _use_compile_cache(scope, not args.no_compile_cache)
        if hasattr(args, "verbose"):
            scope.enter_context(_absl_warnings(args.verbose))
        try:
            return args.func(args)
        except (ValueError, OSError, RuntimeError) as e:
            print(f"dsjax {args.command}: error: {e}", file=sys.stderr)
            return 2


def _use_compile_cache(scope: contextlib.ExitStack, wanted: bool) -> None:
    """dsjax's compile cache for the command, or (`--no-compile-cache`, or a folder that cannot be used:
    a read-only home, say) none at all, not even one JAX_COMPILATION_CACHE_DIR names."""
    if wanted:
        try:
            scope.enter_context(compile_cache())
            return
        except OSError as e:  # the command still runs, compiling everything
            print(f"dsjax: compile cache off: {e}", file=sys.stderr)
    scope.enter_context(compile_cache(enabled=False))


@contextlib.contextmanager
def _absl_warnings(shown: bool):
    """Hide absl's warnings, Python's and XLA's C++ ones, unless `shown` (`-v`). tokamax logs one for every
    kernel shape its tuning tables lack, hundreds in a job's start-up, although it then simply uses its
    heuristics (its `autotuning_cache_miss_fallback` default); XLA's GEMM autotuner logs its timer's
    notes on GPUs. Notices, not problems."""
    from absl import logging as absl_logging
    from jax._src.lib import utils as xla_utils

    before = absl_logging.get_verbosity()
    cpp_before = _cpp_log_level()
    # The GPU plugin logs through its own copy of absl, which reads TF_CPP_MIN_LOG_LEVEL once, when it
    # first logs: set for the command, before any backend starts, it quiets the plugin too.
    set_env = not shown and "TF_CPP_MIN_LOG_LEVEL" not in os.environ
    if set_env:
        os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
    if not shown:
        absl_logging.set_verbosity(absl_logging.ERROR)
        xla_utils.absl_set_min_log_level(max(cpp_before, 2))  # 2: errors and worse
    try:
        yield
    finally:
        absl_logging.set_verbosity(before)
        xla_utils.absl_set_min_log_level(cpp_before)
        if set_env:
            os.environ.pop("TF_CPP_MIN_LOG_LEVEL", None)


def _cpp_log_level() -> int:
    """XLA's C++ minimum log level as the process started with it (`TF_CPP_MIN_LOG_LEVEL`, else 0)."""
    try:
        return max(0, min(3, int(os.environ.get("TF_CPP_MIN_LOG_LEVEL", "0"))))
    except ValueError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
