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
import time
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from dsjax.batch.images import ImageResolver
from dsjax.batch.jobfile import ErrorInfo, InputLine, JobError, check_readable, read_lines
from dsjax.batch.recipe import Prepared, Recipe
from dsjax.batch.results import ResultsFile, error_record, success_record
from dsjax.engine.generate import request_seed
from dsjax.engine.scheduler import Request, StepTimer, run
from dsjax.engine.steps import Engine, Spliced
from dsjax.layers.vision import ImageError, decode_image
from dsjax.parallel import distributed
from dsjax.quant import KV_DTYPES

_DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}


@dataclasses.dataclass(frozen=True)
class JobConfig:
    model: str
    input: str
    output: str
    max_batch: int = 8
    max_len: int = 4096
    chunk_size: int = 256
    dtype: str = "bfloat16"
    weights: str = "keep"  # FP8/FP4 checkpoints: "keep" them so on the device, or "bf16": dequantize at load
    kv_dtype: str | None = None  # cache rows: None (= dtype), "bfloat16", "fp8" or "fp4"
    seed: int = 0
    mesh: str | None = None  # e.g. "dp=2,ep=4": routed experts split over ep (dsjax.parallel)
    window: int = 256  # requests read ahead and ordered longest prompt first
    allow_remote_images: bool = False  # fetch remote image URLs (public addresses only); off: refused
    progress: bool = True


def summary_path(output: str) -> str:
    return os.path.splitext(output)[0] + ".summary.json"


def _count_lines(path: str) -> int:
    with open(path, "rb") as f:
        return sum(1 for raw in f if raw.strip())


def run_job(cfg: JobConfig) -> dict[str, Any]:
    """Run (or resume) the job; returns the summary, also written to `summary_path(cfg.output)`.

    Raises JobError before any work when the input, output or model cannot be used; per-request
    problems become error records. Ctrl-C stops after writing what is finished (KeyboardInterrupt
    propagates once the summary is written). In a multi-process run every process calls this with the
    same settings; only process 0 writes the output and the summary (the others return it).
    """
    from dsjax.checkpoint.load import load_model

    main = distributed.process_index() == 0  # the process that reads and writes the output
    tokenizer = os.path.join(cfg.model, "tokenizer.json")
    results: ResultsFile | _NoOutput = _NoOutput()
    mesh = error = None
    try:
        mesh = _check(cfg, tokenizer)
        if main:
            results = ResultsFile(cfg.output)
    except JobError as e:
        error = e
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
    t_start = time.perf_counter()
    stats = {"ok": 0, "failed": 0, "skipped_done": 0, "prompt_tokens": 0, "generated_tokens": 0}
    timer = StepTimer()
    interrupted = False
    try:
        model = load_model(cfg.model, dtype=_DTYPES[cfg.dtype], weights=cfg.weights, mesh=mesh)
        context = min(cfg.max_len, model.cfg.max_position_embeddings)
        recipe = Recipe(tokenizer, context, model.cfg.eos_token_id, vision=model.cfg.vision,
                        images=ImageResolver(allow_remote=cfg.allow_remote_images),
                        image_root=os.path.dirname(os.path.abspath(cfg.input)))
        with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
            engine = Engine(model, num_slots=cfg.max_batch, max_len=context,
                            chunk_size=min(cfg.chunk_size, context), kv_dtype=cfg.kv_dtype)
            total = _count_lines(cfg.input)
            bar = tqdm(total=total, disable=not (cfg.progress and main), unit="req", dynamic_ncols=True)
            t_loop = time.perf_counter()
            try:
                _run(cfg, engine, recipe, results, is_done, stats, timer, bar, t_start)
            finally:
                bar.close()
                stats["loop_seconds"] = time.perf_counter() - t_loop
    except KeyboardInterrupt:
        interrupted = True
    finally:
        results.close()
    wall = time.perf_counter() - t_start
    summary = {
        "requests_ok": stats["ok"], "requests_failed": stats["failed"],
        "requests_already_done": stats["skipped_done"],
        "prompt_tokens": stats["prompt_tokens"], "generated_tokens": stats["generated_tokens"],
        "wall_seconds": round(wall, 3),
        "prompt_tokens_per_second": round(stats["prompt_tokens"] / wall, 2) if wall else 0.0,
        "generated_tokens_per_second": round(stats["generated_tokens"] / wall, 2) if wall else 0.0,
        "engine_step_seconds": round(timer.seconds, 3),
        # Time in the generation loop spent outside the jitted steps: recipe, scheduling, output.
        "host_overhead_ms_per_generated_token": round(1e3 * (stats.get("loop_seconds", 0.0) - timer.seconds)
                                                      / max(stats["generated_tokens"], 1), 3),
        "interrupted": interrupted,
        "repaired_torn_bytes": results.repaired_bytes,
        "config": dataclasses.asdict(cfg),
    }
    if distributed.process_count() > 1:
        summary["processes"] = distributed.process_count()
    if main:
        with open(summary_path(cfg.output), "w") as f:
            json.dump(summary, f, indent=1)
    if interrupted:
        raise KeyboardInterrupt
    return summary


def _check(cfg: JobConfig, tokenizer: str):
    """Raise JobError if the job cannot run; its mesh (or None)."""
    if cfg.dtype not in _DTYPES:
        raise JobError(f"dtype must be one of {sorted(_DTYPES)}, got {cfg.dtype!r}")
    if cfg.weights not in ("keep", "bf16"):
        raise JobError(f"weights must be 'keep' or 'bf16', got {cfg.weights!r}")
    if cfg.kv_dtype not in (None, *KV_DTYPES):
        raise JobError(f"kv_dtype must be one of {KV_DTYPES}, got {cfg.kv_dtype!r}")
    if cfg.max_batch < 1 or cfg.max_len < 2 or cfg.chunk_size < 1:
        raise JobError("max_batch and chunk_size must be >= 1 and max_len >= 2")
    mesh = None
    if cfg.mesh:
        from dsjax.parallel.mesh import make_mesh

        try:
            mesh = make_mesh(cfg.mesh)
        except ValueError as e:
            raise JobError(str(e)) from None
    elif distributed.process_count() > 1:
        raise JobError(f"a run of {distributed.process_count()} processes needs --mesh over all their "
                       f"{jax.device_count()} devices (e.g. 'ep={jax.device_count()}'): without one each "
                       "process would run the whole job alone")
    check_readable(cfg.input)
    if not os.path.isfile(tokenizer):
        raise JobError(f"{cfg.model!r} has no tokenizer.json: the job encodes prompts with the model's tokenizer")
    return mesh


class _NoOutput:
    """The output of a process other than 0 in a multi-process run: it writes nothing."""

    repaired_bytes = 0

    def write(self, record: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


def _sha256(path: str) -> bytes:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.digest()


def _settings_digest(cfg: JobConfig, tokenizer: str) -> bytes:
    """What every process must share besides the input: the settings that shape the steps and the
    request stream (not the paths, which may differ between hosts), the model's config.json and the
    tokenizer."""
    h = hashlib.sha256()
    settings = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("model", "input", "output",
                                                                             "progress")}
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


def _run(cfg, engine, recipe, results, is_done, stats, timer, bar, t_start) -> None:
    preps: dict[int, Prepared] = {}  # requests handed to the scheduler and not finished yet
    streams = {}
    next_index = itertools.count()
    cancelled: set[int] = set()

    def fail(line: InputLine, error: ErrorInfo) -> None:
        results.write(error_record(line, error))
        stats["failed"] += 1
        bar.update(1)

    def requests() -> Iterator[Request]:
        window: list[Prepared] = []
        for line in read_lines(cfg.input):
            if is_done(line):
                stats["skipped_done"] += 1
                bar.update(1)
                continue
            if line.error:
                fail(line, line.error)
                continue
            prep = recipe.prepare(line)
            if isinstance(prep, ErrorInfo):
                fail(line, prep)
                continue
            window.append(prep)
            if len(window) >= cfg.window:
                yield from order(window)
                window = []
        yield from order(window)

    def order(window: list[Prepared]) -> Iterator[Request]:
        # Longest prompts first keeps slots busy; no result depends on the order.
        for prep in sorted(window, key=lambda p: -len(p.prompt)):
            try:
                spliced = _encode_images(engine, prep)
            except ImageError as e:
                fail(prep.line, ErrorInfo("invalid_image", f"an image of the request could not be encoded: {e}"))
                continue
            index = next(next_index)
            preps[index] = prep
            seed = prep.sampling.seed
            if seed is None:  # stable per custom_id: a request's draw does not depend on where it sits
                digest = hashlib.sha256(prep.line.custom_id.encode()).digest()
                seed = request_seed(cfg.seed, int.from_bytes(digest[:8]))
            yield Request(index, tuple(prep.prompt), prep.sampling, seed, frozenset(prep.sampling.stop_token_ids),
                          spliced)

    for ev in run(engine, requests(), cancelled, timer):
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
            fail(prep.line, ErrorInfo("output_processing_failed", f"the response could not be built: {e}"))
            continue
        if reason:
            results.write(success_record(prep.line, body))
            stats["ok"] += 1
            del streams[ev.index], preps[ev.index]
            bar.update(1)
            elapsed = time.perf_counter() - t_start
            bar.set_postfix(prompt_tok_s=f"{stats['prompt_tokens'] / elapsed:.0f}",
                            gen_tok_s=f"{stats['generated_tokens'] / elapsed:.0f}", refresh=False)


def _encode_images(engine: Engine, prep: Prepared) -> Spliced | None:
    """The embeddings of a request's images at their expanded placeholders (None without images); encoded
    just before the request enters the scheduler, so a window of requests does not hold them all."""
    if not prep.images:
        return None
    embeds = []
    for span in prep.images:
        e = engine.encode_image(decode_image(span.data, engine.cfg.vision))
        if e.shape[0] != span.length:
            # The recipe's count and the encoder's layout disagree: a dsjax bug, not the image's fault.
            raise RuntimeError(f"the encoder made {e.shape[0]} embeddings for an image the recipe counts as "
                               f"{span.length} tokens")
        embeds.append(e)
    positions = np.concatenate([np.arange(s.start, s.start + s.length) for s in prep.images])
    return Spliced(positions, np.concatenate(embeds))
