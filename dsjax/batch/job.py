"""`dsjax generate`: the offline batch job.

input.jsonl (OpenAI Batch) → deepseek-recipe (convert, encode) → scheduler (continuous batching) →
prefill/decode steps → sampler → recipe stream processor → output.jsonl (appended, flushed, resumable)
and a summary JSON next to it.

In a multi-process run (`dsjax.parallel.distributed`) every process runs this same job, in lockstep: the
same requests in the same order through the same steps. Before any work the processes check that their
inputs (sha256), settings, model config and tokenizer are the same, and process 0, the only one that
reads or writes the output, tells the others which input lines are already done.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
import os
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator, Sequence

import jax
import numpy as np
from flax import nnx
from tqdm import tqdm

from dsjax.batch.formats import asks_for_format
from dsjax.batch.images import ImageResolver, count_images
from dsjax.batch.jobfile import ErrorInfo, InputLine, JobError, check_readable, clip, read_lines
from dsjax.batch.recipe import PROMPT_FORMATS, Prepared, Recipe, default_served_names, prompt_format
from dsjax.batch.results import InputFingerprint, ResultsFile, check_output, error_record, success_record
from dsjax.config import ModelConfig
from dsjax.config_v41 import model_config
from dsjax.engine.acceptance import Acceptance
from dsjax.engine.compiles import CompileClock
from dsjax.engine.engine import Engine, Spliced
from dsjax.engine.generate import request_seed
from dsjax.engine.grammar import Matcher
from dsjax.engine.pixels import ImageError, decode_image
from dsjax.engine.programs import program_store
from dsjax.engine.scheduler import Request, StepTimer, run
from dsjax.engine.speculative import check_drafting
from dsjax.engine.slots import prefill_buckets, prefill_rows
from dsjax.engine.thinking_budget import ThinkingBudget
from dsjax.model import expert_code_layout, with_code_layout
from dsjax.parallel import distributed
from dsjax.run_config import RunConfig

# Requests whose images go through the encoder together (`_encode_images`).
IMAGE_REQUESTS = 8
# Threads preparing a window's requests: the recipe's image resolution (decode, resize, WebP) runs natively
# without Python's lock, about 0.3 s for a 1,000-token image, and would otherwise starve the GPU of requests.
PREPARE_THREADS = min(8, os.cpu_count() or 1)


@dataclasses.dataclass(frozen=True)
class JobConfig:
    """A batch job: the model folder, the input and output files, how the model is run (`run`) and the
    job's own options."""

    model: str
    input: str
    output: str
    # Slots, lengths, dtypes, weights, kernels and mesh: validated when made (RunConfigError). The job
    # runs at most the model's context: `max_len` above it is cut to `max_position_embeddings`.
    run: RunConfig = dataclasses.field(default_factory=RunConfig)
    seed: int = 0
    window: int = 256  # requests read ahead and ordered longest prompt first
    allow_remote_images: bool = False  # fetch remote image URLs (public addresses only); off: refused
    # The model names requests may give; empty: the checkpoint folder's name and the recipe's name for it.
    served_model_names: tuple[str, ...] = ()
    prompt_format: str | None = None  # "v4" or "v4.1"; None: the checkpoint's (batch.recipe.prompt_format)
    image_root: str | None = None  # where local image files may be read from; None: the input's folder
    allow_changed_input: bool = False  # resume an output that was started from a different input
    progress: bool = True  # the progress bar and one line per start-up phase (on stderr)
    verbose: bool = False  # also the functions that took longest to compile
    # The most tokens a thinking part may take before `</think>` is forced (a Messages request's
    # thinking.budget_tokens overrides it); None: no limit but max_tokens.
    thinking_budget: int | None = None


def _pending(path: str, is_done: Callable[[InputLine], bool]) -> tuple[int, int, bool, bool]:
    """(lines, lines still to answer, whether any of those holds an image, whether any asks for an output format):
    the progress bar's total, and what the programs compiled before the first request must cover."""
    total, pending, images, constrained = 0, 0, False, False
    for line in read_lines(path):
        total += 1
        if not is_done(line):
            pending += 1
            images = images or (not line.error and count_images(line.body) > 0)
            constrained = constrained or (not line.error and (asks_for_format(line.url, line.body)
                                                              or _asks_for_budget(line.url, line.body)))
    return total, pending, images, constrained


def _asks_for_budget(url: str, body) -> bool:
    """Whether a Messages request gives its thinking part a budget (the other protocols have none)."""
    thinking = body.get("thinking") if url == "/v1/messages" and isinstance(body, dict) else None
    return isinstance(thinking, dict) and thinking.get("budget_tokens") is not None


def _phase_printer(on: bool) -> Callable[[str], None]:
    """One line per start-up phase on stderr, above the progress bar, or nothing."""
    def say(line: str) -> None:
        if on:
            tqdm.write(f"dsjax generate: {line}", file=sys.stderr)
    return say


def summary_path(output: str) -> str:
    return os.path.splitext(output)[0] + ".summary.json"


@dataclasses.dataclass(frozen=True)
class _Setup:
    """What the checks before any work found: the recipe, the run options the engine takes (`max_len` cut
    to the model's context), the mesh."""

    recipe: Recipe
    run: RunConfig
    mesh: Any


class Terminated(KeyboardInterrupt):
    """The job was stopped by SIGTERM (how Slurm, Docker and Kubernetes stop jobs), handled as Ctrl-C is."""


class _Stopper:
    """SIGINT and SIGTERM while a job runs. A signal raises at once (KeyboardInterrupt, Terminated) and is
    remembered: one that Python swallowed where it cannot raise (in a garbage-collector callback) still
    stops the job at its next `check`. While the job finishes (closing the output, writing the summary)
    signals are only remembered, so a second one cannot lose the summary."""

    def __init__(self):
        self.signal: str | None = None
        self.finishing = False
        self._previous = {}

    def _raise(self):
        raise Terminated() if self.signal == "SIGTERM" else KeyboardInterrupt()

    def _handle(self, signum, frame):
        if self.signal is None:
            self.signal = signal.Signals(signum).name
        if not self.finishing:
            self._raise()

    def check(self) -> None:
        if self.signal is not None and not self.finishing:
            self._raise()

    def __enter__(self) -> "_Stopper":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def run_job(cfg: JobConfig) -> dict[str, Any]:
    """Run (or resume) the job; returns the summary, also written to `summary_path(cfg.output)`.

    Raises JobError before any work when the input, output, model folder or settings cannot be used;
    per-request problems become error records. Ctrl-C or SIGTERM stops after writing what is finished
    (KeyboardInterrupt propagates once the summary is written; its `signal` says which). In a
    multi-process run every process calls this with the same settings; only process 0 writes the
    output and the summary (the others return it).
    """
    main = distributed.process_index() == 0  # the process that reads and writes the output
    with _Stopper() as stopper:
        return _run_job(cfg, main, stopper)


def _run_job(cfg: JobConfig, main: bool, stopper: _Stopper) -> dict[str, Any]:
    from dsjax.checkpoint.load import load_model

    results: ResultsFile | _NoOutput = _NoOutput()
    setup = error = None
    t_start = time.perf_counter()
    try:
        setup = _check(cfg, writes=main)
        if main:
            results = ResultsFile(cfg.output, cfg.input, allow_changed_input=cfg.allow_changed_input)
    except JobError as e:
        error = e
    tokenizer = os.path.join(cfg.model, "tokenizer.json")
    if distributed.process_count() == 1:
        if error:
            raise error
        is_done = results.is_done
    else:
        try:
            _agree(cfg, tokenizer, error)
            is_done = _done_on_process_0(cfg, results)
        except BaseException:
            results.close()
            raise
    stats = {"ok": 0, "failed": 0, "skipped_done": 0, "prompt_tokens": 0, "generated_tokens": 0}
    phase = {"load": 0.0, "load_end": 0.0, "precompile": 0.0, "loop": 0.0, "loop_compile": 0.0, "loop_programs": 0,
             "programs_loaded": 0, "load_programs": 0.0}
    stopped_by = None
    acceptance = None  # speculative decoding's counts, with an engine that drafts
    say = _phase_printer(cfg.progress and main)
    with CompileClock() as clock:
        timer = StepTimer(clock)
        try:
            total, pending, with_images, constrained = _pending(cfg.input, is_done)
            if not pending:  # nothing to do: no model to load
                stats["skipped_done"] = total
                results.open()
            else:
                t = time.perf_counter()
                model = load_model(cfg.model, dtype=cfg.run.jnp_dtype, weights=cfg.run.weights, mesh=setup.mesh,
                                   drafter=cfg.run.speculative != "off")  # DSpark's stages only where they draft
                model = with_code_layout(model, expert_code_layout(cfg.run.kernels, jax.default_backend()))
                phase["load"] = time.perf_counter() - t
                phase["load_end"] = time.perf_counter() - t_start
                weight_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model)))
                say(f"loaded {weight_bytes / 1e9:,.2f} GB of weights in {phase['load']:.1f} s")
                stopper.check()
                with jax.set_mesh(setup.mesh) if setup.mesh is not None else contextlib.nullcontext():
                    engine = Engine(model, setup.run, programs=program_store())
                    acceptance = Acceptance(model.cfg.dspark_block_size) if engine.drafting else None
                    stopper.check()
                    results.open()
                    bar = tqdm(total=total, disable=not (cfg.progress and main), unit="req", dynamic_ncols=True)
                    programs_before = [None]  # the executables built when the generation began
                    # When the work began (perf_counter, wall): after the programs were prepared and the widths timed
                    # (`compile_all`). Preparing them is not all jax's compile spans (loading whole programs,
                    # eval_shape, timing), so the generation's time is counted from there, not from the loop's start
                    # less the spans.
                    work_start = [time.perf_counter(), time.time()]

                    def compile_all(first: int, later: int) -> None:
                        """Every program the job can need, before the first request (in parallel): none is
                        compiled mid-job. `first` requests are ready to start; at most `later` follow."""
                        if not first and not later:  # no request will run
                            return
                        slots = cfg.run.slots
                        reachable = set(prefill_buckets(slots, later)) if later else set()
                        # The first window's bucket now; the others a prefill may take later in the
                        # background (on one process: processes must run the same programs in step).
                        now = {prefill_rows(min(first, slots), slots) if first else max(reachable)}
                        background = reachable - now if distributed.process_count() == 1 else set()
                        now |= reachable - background
                        if cfg.run.batch_invariant:  # one request per prefill
                            now, background = {prefill_rows(1, slots)}, set()
                        t, built, hits = time.perf_counter(), clock.programs, clock.cache_hits
                        n = engine.precompile(images=with_images and model.vision is not None, buckets=sorted(now),
                                              later=sorted(background),
                                              masked=(constrained or cfg.thinking_budget is not None)
                                              and not engine.drafting)
                        phase["precompile"] = time.perf_counter() - t
                        programs_before[0] = clock.programs  # what follows is the generation's
                        loaded = engine.programs_loaded
                        phase["programs_loaded"], phase["load_programs"] = loaded, engine.load_seconds
                        pending = len(engine.pending_buckets())
                        say(f"compiled {n - pending} programs in {phase['precompile']:.1f} s ({loaded} loaded whole, "
                            f"{clock.cache_hits - hits} of {clock.programs - built} executables from the compile cache)"
                            + (f"; {pending} more prefill size{'s' * (pending > 1)} compiling alongside the work"
                               if pending else ""))
                        if cfg.verbose:
                            for name, secs in clock.slowest():
                                say("  " + name + ": " + ", ".join(f"{k} {v:.2f} s" for k, v in secs.items()))
                        if len(engine.widths) > 1:  # the drafts a step verifies are chosen from these
                            # (`precompile` measured them before its background compiles started)
                            seconds = engine.width_seconds
                            if seconds is None:
                                seconds = engine.measure_widths()
                            phase["measure_widths"] = engine.measure_seconds
                            phase["width_seconds"] = [round(float(x), 6) for x in seconds]
                            say("verification step at widths " + ", ".join(
                                f"{w}: {1e3 * seconds[w - 1]:.1f} ms" for w in engine.widths)
                                + f" ({phase['measure_widths']:.1f} s to measure or read)")
                        work_start[:] = [time.perf_counter(), time.time()]

                    try:
                        def working() -> float:  # seconds of the work so far, less jax's compiling in it
                            return time.perf_counter() - work_start[0] - clock.seconds(since=work_start[1])

                        _run(cfg, engine, setup.recipe, results, is_done, stats, timer, bar, working, stopper.check,
                             compile_all, pending, acceptance)
                    finally:
                        engine.close()
                        bar.close()
                        phase["loop"] = time.perf_counter() - work_start[0]
                        phase["loop_compile"] = clock.seconds(since=work_start[1])
                        phase["loop_programs"] = 0 if programs_before[0] is None else clock.programs - programs_before[0]
        except KeyboardInterrupt as e:
            stopped_by = stopper.signal or ("SIGTERM" if isinstance(e, Terminated) else "SIGINT")
        finally:
            stopper.finishing = True
            results.close()
    stopped_by = stopped_by or stopper.signal
    wall = time.perf_counter() - t_start
    generation = max(phase["loop"] - phase["loop_compile"], 0.0)
    summary = {
        "requests_ok": stats["ok"], "requests_failed": stats["failed"],
        "requests_already_done": stats["skipped_done"],
        "prompt_tokens": stats["prompt_tokens"], "generated_tokens": stats["generated_tokens"],
        "wall_seconds": round(wall, 3),
        # Start-up apart from work: loading the weights, jax preparing programs (in the loop too, where
        # a step first runs), and the generation loop without that.
        "load_seconds": round(phase["load"], 3),
        # jax's spans, and the seconds loading whole programs from dsjax's store (no span of jax's covers them)
        "compile_seconds": round(clock.seconds() + phase["load_programs"], 3),
        "precompile_seconds": round(phase["precompile"], 3),  # wall time of compiling before the first request
        "programs_compiled": clock.programs,  # executables jax built or loaded from its cache
        "programs_from_cache": clock.cache_hits,
        "programs_loaded": phase["programs_loaded"],  # the engine's programs, loaded whole from dsjax's store
        # Built inside the generation loop: only image encoders, one per new image size bucket.
        "programs_compiled_during_generation": phase["loop_programs"],
        # Prefill sizes the first requests did not need, built in a background thread alongside the work
        # (a prefill meanwhile takes a larger size that is ready); not in the seconds above or below.
        "programs_compiled_in_background": clock.background_programs,
        "background_compile_seconds": round(clock.background_seconds(), 3),
        "generation_seconds": round(generation, 3),
        # When the first response was written, from the job's start, and from the end of loading weights.
        "first_result_seconds": _since(stats.get("first_result_at"), t_start),
        "first_result_after_load_seconds": _since(stats.get("first_result_at"), t_start + phase["load_end"]),
        "prompt_tokens_per_second": round(stats["prompt_tokens"] / generation, 2) if generation else 0.0,
        "generated_tokens_per_second": round(stats["generated_tokens"] / generation, 2) if generation else 0.0,
        "engine_step_seconds": round(timer.seconds, 3),  # compiling not included
        # --speculative dspark: the verification steps' widths' measured times, and what they kept
        "speculative": None if acceptance is None else {
            "width_seconds": phase.get("width_seconds"), "measure_seconds": round(phase.get("measure_widths", 0.0), 3),
            **acceptance.summary()},
        # Time in the generation loop spent outside the jitted steps: recipe, scheduling, output.
        "host_overhead_ms_per_generated_token": round(1e3 * max(phase["loop"] - phase["loop_compile"] - timer.seconds,
                                                                0.0) / max(stats["generated_tokens"], 1), 3),
        "interrupted": stopped_by is not None,
        "signal": stopped_by,
        "repaired_torn_bytes": results.repaired_bytes,
        "input_changed": results.input_changed,
        "served_model_names": list(setup.recipe.served_names),
        "prompt_format": setup.recipe.prompt_format,
        "output_path": os.path.abspath(cfg.output),
        "config": dataclasses.asdict(cfg),
    }
    if distributed.process_count() > 1:
        summary["processes"] = distributed.process_count()
    if main:
        _write_summary(summary_path(cfg.output), summary)
    if stopped_by == "SIGTERM":
        raise Terminated()
    if stopped_by:
        raise KeyboardInterrupt
    return summary


def _since(t: float | None, start: float) -> float | None:
    return None if t is None else round(t - start, 3)


def format_summary(s: dict[str, Any]) -> str:
    """The job's closing line: counts, then start-up apart from the generation loop's throughput."""
    cached = f", {s['programs_from_cache']} from the cache" if s["programs_from_cache"] else ""
    if s.get("programs_loaded"):
        cached += f"; {s['programs_loaded']} loaded whole"
    return (f"{s['requests_ok']} ok, {s['requests_failed']} failed, {s['requests_already_done']} already done; "
            f"{s['prompt_tokens']:,} prompt and {s['generated_tokens']:,} generated tokens in {s['wall_seconds']:.1f} s: "
            f"load {s['load_seconds']:.1f} s, compile {s['compile_seconds']:.1f} s ({s['programs_compiled']} "
            f"programs{cached}), generation {s['generation_seconds']:.1f} s at "
            f"{s['prompt_tokens_per_second']:,.1f} prompt and {s['generated_tokens_per_second']:,.1f} generated tok/s"
            + _format_speculative(s.get("speculative")))


def _format_speculative(spec: dict | None) -> str:
    """The closing line's part on speculative decoding: what a request got per target step, and each draft's
    acceptance."""
    if not spec or not spec.get("target_steps"):
        return ""
    rates = "/".join("-" if r is None else f"{100 * r:.0f}%" for r in spec["acceptance_by_position"])
    return (f"; DSpark: {spec['mean_accepted_length']:.2f} tokens per request per target step "
            f"({spec['tokens_per_target_step']:.2f} per step), drafts accepted {rates}")


def _write_summary(path: str, summary: dict[str, Any]) -> None:
    """Write the summary whole or not at all (a stop mid-write leaves the previous one)."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(summary, f, indent=1)
    os.replace(tmp, path)


def _check(cfg: JobConfig, writes: bool = True) -> _Setup:
    """Raise JobError if the job cannot run: every setting, the input, the paths it will write (if it
    `writes`: process 0 of a multi-process run), the model's config and tokenizer, all before any weight
    is read."""
    if not isinstance(cfg.run, RunConfig):  # its own options were checked when it was made
        raise JobError(f"run must be a RunConfig, got {type(cfg.run).__name__}")
    if isinstance(cfg.window, bool) or not isinstance(cfg.window, int) or cfg.window < 1:
        raise JobError(f"window must be an integer of at least 1, got {cfg.window!r}")
    if isinstance(cfg.seed, bool) or not isinstance(cfg.seed, int) or not 0 <= cfg.seed < 2 ** 63:
        raise JobError(f"seed must be an integer in [0, 2^63), got {cfg.seed!r}")
    budget = cfg.thinking_budget
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 0):
        raise JobError(f"thinking_budget must be an integer >= 0 (or None: no limit), got {budget!r}")
    if budget is not None and cfg.run.speculative != "off":
        raise JobError(f"a thinking budget does not combine with --speculative {cfg.run.speculative} yet (its forced "
                       "end of thinking is a token mask, which the drafts' steps do not take)")
    names = cfg.served_model_names
    if isinstance(names, str) or any(not isinstance(n, str) or not n.strip() for n in names):
        raise JobError(f"served model names must be non-empty strings, got {names!r}")
    mesh = None
    if cfg.run.mesh:
        from dsjax.parallel.mesh import make_mesh

        try:
            mesh = make_mesh(cfg.run.mesh)
        except ValueError as e:
            raise JobError(str(e)) from None
    elif distributed.process_count() > 1:
        raise JobError(f"a run of {distributed.process_count()} processes needs --mesh over all their "
                       f"{jax.device_count()} devices (e.g. 'ep={jax.device_count()}'): without one each "
                       "process would run the whole job alone")
    check_readable(cfg.input)
    if cfg.image_root is not None and not os.path.isdir(cfg.image_root):
        raise JobError(f"image root {cfg.image_root!r} is not a folder")
    if writes:
        check_output(cfg.output, cfg.input)
        _check_writable(summary_path(cfg.output), cfg.input, "summary", cfg.output)
    if not os.path.isdir(cfg.model):
        raise JobError(f"model folder {cfg.model!r} does not exist or is not a folder")
    try:
        model_cfg = model_config(cfg.model)
    except FileNotFoundError:
        raise JobError(f"{cfg.model!r} has no config.json: a model folder holds config.json, the weights and "
                       "tokenizer.json") from None
    except (ValueError, OSError) as e:
        raise JobError(str(e)) from None
    tokenizer = os.path.join(cfg.model, "tokenizer.json")
    if not os.path.isfile(tokenizer):
        raise JobError(f"{cfg.model!r} has no tokenizer.json: the job encodes prompts with the model's tokenizer")
    if cfg.run.speculative != "off":
        try:
            check_drafting(model_cfg, cfg.run.drafts)
        except ValueError as e:
            raise JobError(str(e)) from None
    context = min(cfg.run.max_len, model_cfg.max_position_embeddings)
    sized = cfg.run.replace(max_len=context, chunk_size=min(cfg.run.chunk_size, context))
    _check_cache_fits(model_cfg, sized, mesh)
    fmt = cfg.prompt_format or prompt_format(model_cfg)
    if fmt not in PROMPT_FORMATS:
        raise JobError(f"prompt_format must be one of {sorted(PROMPT_FORMATS)} (or None: the checkpoint's), got {fmt!r}")
    if model_cfg.vision is not None and fmt != "v4.1":
        raise JobError("a model that reads images needs the v4.1 prompt format (V4's renders no images)")
    image_root = cfg.image_root or os.path.dirname(os.path.abspath(cfg.input))
    try:
        no_formats = None
        if cfg.run.speculative != "off":
            no_formats = (f"constrained decoding does not combine with --speculative {cfg.run.speculative} yet; "
                          "run such requests in a job with --speculative off")
        recipe = Recipe(tokenizer, context, model_cfg.eos_token_id, prompt_format=fmt,
                        served_names=names or default_served_names(cfg.model, fmt), vision=model_cfg.vision,
                        images=ImageResolver(allow_remote=cfg.allow_remote_images), image_root=image_root,
                        vocab_size=model_cfg.vocab_size, no_formats=no_formats, thinking_budget=cfg.thinking_budget)
    except ValueError as e:
        raise JobError(str(e)) from None
    return _Setup(recipe, sized, mesh)


def _check_cache_fits(model_cfg: ModelConfig, run: RunConfig, mesh) -> None:
    """Refuse a cache larger than all the devices' memory together (which would be found only when it is
    allocated, by the out-of-memory killer on a CPU); `dsjax plan` tells what fits more closely."""
    from dsjax.cache import cache_bytes_per_token

    context = run.max_len
    if getattr(model_cfg, "family", "v4") == "v4.1":
        from dsjax.cache import v41_layer_cache

        one = [jax.eval_shape(lambda r=r: v41_layer_cache(model_cfg, r, 1, context, run.jnp_dtype, run.kv_dtype))
               for r in model_cfg.layer_roles()]
        need = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(one)) * run.slots
    else:
        per_type = cache_bytes_per_token(model_cfg, context, run.jnp_dtype, run.kv_dtype)
        need = sum(b * model_cfg.layer_types.count(t) for t, b in per_type.items()) * context * run.slots
    devices = list(mesh.devices.flat) if mesh is not None else jax.local_devices()[:1]
    if devices[0].platform == "cpu":  # host devices share the machine's memory
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    else:
        limits = [(d.memory_stats() or {}).get("bytes_limit") for d in devices]
        if not all(limits):
            return
        have = sum(limits)
    if need > have:
        raise JobError(f"the cache of --slots {run.slots} sequences of {context:,} tokens needs "
                       f"{need / 1e9:,.1f} GB, more than the {have / 1e9:,.1f} GB the devices have: lower "
                       "--slots or --max-len (`dsjax plan` estimates what fits)")


def _summary_owner(data: bytes) -> str | None:
    """The output a summary was written for, where it says."""
    try:
        owner = json.loads(data).get("output_path")
    except (ValueError, AttributeError):
        return None
    return owner if isinstance(owner, str) else None


def _check_writable(path: str, input_path: str, what: str, output: str) -> None:
    """That `path` can be written at the end of the job, found out now (creating nothing that stays)."""
    if os.path.exists(path) and os.path.exists(input_path) and os.path.samefile(path, input_path):
        raise JobError(f"the {what} {path!r} would overwrite the input: choose another --output")
    try:
        if os.path.exists(path):
            if not os.path.isfile(path):
                raise JobError(f"the {what} {path!r} is not a regular file")
            with open(path, "r+b") as f:
                owner = _summary_owner(f.read(1 << 20))
            if owner and os.path.exists(owner) and os.path.realpath(owner) != os.path.realpath(output):
                raise JobError(f"the {what} {path!r} is that of another output, {owner!r} (both name it: their "
                               "names differ only in their extension); choose another --output")
        else:
            with open(path, "xb"):
                pass
            os.unlink(path)
    except OSError as e:
        raise JobError(f"cannot write the {what} {path!r}: {e.strerror or e}") from None


class _NoOutput:
    """The output of a process other than 0 in a multi-process run: it writes nothing."""

    repaired_bytes = 0
    input_changed = False

    def open(self) -> None:
        pass

    def write(self, record: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


def _sha256(path: str) -> bytes:
    return bytes.fromhex(InputFingerprint.of(path).sha256)


def _settings_digest(cfg: JobConfig, tokenizer: str) -> bytes:
    """What every process must share besides the input: the settings that shape the steps and the
    request stream (not the paths, which may differ between hosts), the model's config.json and the
    tokenizer."""
    h = hashlib.sha256()
    settings = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("model", "input", "output",
                                                                             "image_root", "progress", "verbose")}
    h.update(json.dumps(settings, sort_keys=True).encode())
    for path in (os.path.join(cfg.model, "config.json"), tokenizer):
        h.update(_sha256(path) if os.path.isfile(path) else b"-" * 32)
    return h.digest()


def _agree(cfg: JobConfig, tokenizer: str, error: JobError | None) -> None:
    """Multi-process: every process checks its own input and model folder; then all compare, and all raise
    the same way if any process failed or differs from process 0 (so none is left waiting for the
    others in a collective)."""
    ok, digests = b"\0", b"\0" * 64
    if error is None:
        try:
            ok, digests = b"\1", _sha256(cfg.input) + _settings_digest(cfg, tokenizer)
        except OSError as e:
            error = JobError(f"cannot read {e.filename!r}: {e.strerror}")
    rows = distributed.allgather_bytes(ok + digests, 65)
    me = distributed.process_index()
    failed = [i for i, r in enumerate(rows) if r[:1] != b"\1"]
    if error is not None:
        raise JobError(f"process {me}: {error}")
    if failed:
        raise JobError(f"{distributed.describe(failed)} could not start the job (see the error there)")
    differs = [i for i, r in enumerate(rows) if r[1:33] != rows[0][1:33]]
    if differs:
        raise JobError(f"the input of {distributed.describe(differs)} differs from process 0's (sha256 "
                       + ", ".join(f"{i}: {rows[i][1:33].hex()[:16]}…" for i in [0, *differs])
                       + "): every process must read the same requests")
    differs = [i for i, r in enumerate(rows) if r[33:] != rows[0][33:]]
    if differs:
        raise JobError(f"the settings, model config.json or tokenizer.json of {distributed.describe(differs)} "
                       "differ from process 0's: every process must run the same job")


def _done_on_process_0(cfg: JobConfig, results) -> Callable[[InputLine], bool]:
    """Multi-process: which input lines process 0's output already holds, sent to every process (a bit
    per line number), so that all skip the same lines whatever their own view of the output folder."""
    mask = np.zeros(0, bool)
    if isinstance(results, ResultsFile):
        done = [line.line_no for line in read_lines(cfg.input) if results.is_done(line)]
        mask = np.zeros(max(done, default=-1) + 1, bool)
        mask[done] = True
    bits = np.unpackbits(np.frombuffer(distributed.broadcast_bytes(np.packbits(mask).tobytes()), np.uint8))
    done_lines = frozenset(np.flatnonzero(bits).tolist())
    return lambda line: line.line_no in done_lines


def _run(cfg, engine, recipe, results, is_done, stats, timer, bar, working: Callable[[], float],
         check_stop: Callable[[], None], compile_all: Callable[[int, int], None], pending: int,
         acceptance: Acceptance | None = None) -> None:
    """The generation loop. The first window of requests is read and prepared before `compile_all(first,
    later)` is told how many requests are ready (`first`) and how many more may come (`later`): the
    prefill programs it compiles are those row counts can take. Images are encoded as the scheduler takes
    their requests, `IMAGE_REQUESTS` at a time, not a window at a time: the first results do not wait for
    a whole window's images, and no more embeddings are held than the requests in flight need."""
    preps: dict[int, Prepared] = {}  # requests handed to the scheduler and not finished yet
    matchers: dict[int, Matcher | ThinkingBudget] = {}  # of those with an output format or a thinking budget
    streams = {}
    next_index = itertools.count()
    cancelled: set[int] = set()

    def fail(line: InputLine, error: ErrorInfo) -> None:
        results.write(error_record(line, error))
        stats["failed"] += 1
        bar.update(1)

    read = [0]  # lines not done before, read so far

    def prepared(pool: ThreadPoolExecutor, lines: list[InputLine]) -> list[Prepared]:
        """The window's requests prepared in parallel, their errors written in input order."""
        futures = [None if line.error else pool.submit(recipe.prepare, line) for line in lines]
        window: list[Prepared] = []
        for line, future in zip(lines, futures):
            check_stop()
            prep = line.error if future is None else future.result()
            if isinstance(prep, ErrorInfo):
                fail(line, prep)
            else:
                window.append(prep)
        return window

    def windows() -> Iterator[list[Prepared]]:
        pool = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="dsjax-prepare")
        try:
            lines: list[InputLine] = []
            for line in read_lines(cfg.input):
                check_stop()
                if is_done(line):
                    stats["skipped_done"] += 1
                    bar.update(1)
                    continue
                read[0] += 1
                lines.append(line)
                if len(lines) >= cfg.window:
                    yield prepared(pool, lines)
                    lines = []
            yield prepared(pool, lines)
        finally:  # a stopped job does not wait for a window's preparation
            pool.shutdown(wait=False, cancel_futures=True)

    def requests() -> Iterator[Request]:
        batches = windows()
        first = next(batches)
        # `first` counts requests whose images may yet fail to decode: an upper bound is what compile_all needs.
        compile_all(len(first), len(first) - min(len(first), cfg.run.slots) + pending - read[0])
        yield from order(first)
        for batch in batches:
            yield from order(batch)

    def order(window: list[Prepared]) -> Iterator[Request]:
        # Longest prompts first keeps slots busy; no result depends on the order.
        ranked = sorted(window, key=lambda p: -len(p.prompt))
        for first in range(0, len(ranked), IMAGE_REQUESTS):
            group = ranked[first:first + IMAGE_REQUESTS]
            yield from admit(group, _encode_images(engine, group))

    def admit(group: list[Prepared], encoded: list) -> Iterator[Request]:
        for prep, spliced in zip(group, encoded):
            if isinstance(spliced, ImageError):
                fail(prep.line, ErrorInfo("invalid_image", f"an image of the request could not be encoded: "
                                                           f"{spliced}"))
                continue
            index = next(next_index)
            preps[index] = prep
            seed = prep.sampling.seed
            if seed is None:  # stable per custom_id: a request's draw does not depend on where it sits
                digest = hashlib.sha256(prep.line.custom_id.encode("utf-8", "surrogatepass")).digest()
                seed = request_seed(cfg.seed, int.from_bytes(digest[:8]))
            matcher = recipe.grammars.matcher(prep.constraint) if prep.constraint is not None else None
            if prep.thinking_budget is not None:
                matcher = ThinkingBudget(recipe.thinking_end_id, prep.thinking_budget, matcher)
            if matcher is not None:
                matchers[index] = matcher
            yield Request(index, tuple(prep.prompt), prep.sampling, seed, frozenset(prep.sampling.stop_token_ids),
                          spliced, matcher)

    for ev in run(engine, requests(), cancelled, timer, acceptance):
        check_stop()
        prep = preps[ev.index]
        stream = streams.get(ev.index)
        if stream is None:
            stream = streams[ev.index] = recipe.stream(prep)
            stats["prompt_tokens"] += len(prep.prompt)
        stats["generated_tokens"] += 1
        reason = ev.finish_reason
        # The EOS that ends a request is not part of its text (the recipe would decode its spelling).
        ends_on_eos = reason == "stop" and ev.token in prep.sampling.stop_token_ids
        try:
            if not ends_on_eos and stream.token(ev.token, ev.logprob, ev.top) and reason is None:
                cancelled.add(ev.index)  # the processor saw a stop sequence
                reason = "stop"
            body = stream.finish(reason) if reason else None
        except RuntimeError as e:
            cancelled.add(ev.index)
            del streams[ev.index], preps[ev.index]
            matchers.pop(ev.index, None)
            fail(prep.line, ErrorInfo("output_processing_failed", f"the response could not be built: {e}"))
            continue
        matcher = matchers.pop(ev.index, None) if reason else None
        if matcher is not None and matcher.error is not None:
            del streams[ev.index], preps[ev.index]
            fail(prep.line, ErrorInfo("output_processing_failed", "constrained decoding failed, so the output may "
                                                                  f"not match its format: {clip(matcher.error)}"))
            continue
        if reason:
            results.write(success_record(prep.line, body))
            stats["ok"] += 1
            stats.setdefault("first_result_at", time.perf_counter())
            del streams[ev.index], preps[ev.index]
            bar.update(1)
            elapsed = max(working(), 1e-9)
            bar.set_postfix(prompt_tok_s=f"{stats['prompt_tokens'] / elapsed:.0f}",
                            gen_tok_s=f"{stats['generated_tokens'] / elapsed:.0f}", refresh=False)


def _encode_images(engine: Engine, preps: Sequence[Prepared]) -> list[Spliced | ImageError | None]:
    """Per request, the embeddings of its images at their expanded placeholders (None without images, the
    ImageError of an image that cannot be decoded). The images of all the requests go through the encoder
    together (`Engine.encode_images`); encoded just before the requests enter the scheduler, so a window
    of requests does not hold them all."""
    out: list[Spliced | ImageError | None] = [None] * len(preps)
    pixels, owners = [], []
    for k, prep in enumerate(preps):
        try:
            decoded = [decode_image(span.data, engine.cfg.vision) for span in prep.images]
        except ImageError as e:
            out[k] = e
            continue
        pixels += decoded
        owners += [k] * len(decoded)
    embeds = engine.encode_images(pixels) if pixels else []
    for k, prep in enumerate(preps):
        if not prep.images or out[k] is not None:
            continue
        mine = [e for e, owner in zip(embeds, owners) if owner == k]
        for span, e in zip(prep.images, mine):
            if e.shape[0] != span.length:
                # The recipe's count and the encoder's layout disagree: a dsjax bug, not the image's fault.
                raise RuntimeError(f"the encoder made {e.shape[0]} embeddings for an image the recipe counts as "
                                   f"{span.length} tokens")
        positions = np.concatenate([np.arange(s.start, s.start + s.length) for s in prep.images])
        out[k] = Spliced(positions, np.concatenate(mine))
    return out
