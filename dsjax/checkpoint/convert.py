"""`convert`: a DeepSeek-V4 safetensors folder (any naming load_model accepts) or a DeepSeek-V4.1 release
folder → a dsjax Orbax checkpoint (layout in converted.py), and `to_hf`: the way back to original-name
safetensors shards. What differs between the two families (config, targets, placing a tensor, names) comes
from `family.py`.

The conversion first checks every header against the config (names, shapes, dtypes, scales, the index,
file sizes), so a bad checkpoint fails in seconds and before anything is written. It then streams:
tensors are read one at a time from memory maps, placed into arrays of the converted layout, and each
array is handed to an Orbax partial save as soon as it is complete; a journal next to the work folder
records what is saved, so a killed run re-run with the same arguments reads only what is still missing.
Everything happens in `DST.partial`; the result is renamed to DST only once complete (and verified,
with `verify=True`), so DST never exists half-written.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import shutil
import time
from dataclasses import dataclass, field
from typing import Callable

import ml_dtypes
import numpy as np
from orbax.checkpoint import v1 as ocp
from orbax.checkpoint._src.handlers.base_pytree_checkpoint_handler import PartialSaveReplacementError

from dsjax.checkpoint import converted as layout
from dsjax.checkpoint.family import Family, family_of
from dsjax.checkpoint.safetensors_io import (CheckpointError, TensorRef, checkpoint_files, read_header,
                                             read_json, read_tensor, tensor_dtype)
from dsjax.checkpoint.shards import StreamingShards
from dsjax.checkpoint.stored import check_scales_declared, pair_scales
from dsjax.checkpoint.targets import Target
from dsjax.run_config import WEIGHTS, check_choice

_BLOCK_BYTES = 256 << 20  # no array is larger: big tensors are stored in blocks of rows (experts)
_FLUSH_BYTES = 256 << 20  # finished arrays are saved together once they add up to this
_WEIGHT_FILES = ("model.safetensors.index.json", "config.json")


@dataclass(frozen=True)
class Item:
    """A source tensor, its scale if it has one, and the arrays of the converted layout it writes."""

    name: str
    ref: TensorRef
    start: int
    scale: tuple[TensorRef, int] | None
    pieces: tuple[str, ...]

    @property
    def nbytes(self) -> int:
        return self.ref.end - self.ref.begin + (self.scale[0].end - self.scale[0].begin if self.scale else 0)


@dataclass
class Plan:
    """Everything known before reading a byte of tensor data."""

    src: str
    family: Family
    raw_config: dict
    stored: object  # the config as the source declares it (ModelConfig, V41Config)
    cfg: object  # as converted (no quantization for weights="bf16")
    weights: str
    expert_block: int
    targets: dict[str, Target]
    items: list[Item]
    pieces: dict[str, layout.Piece]
    rows: dict[str, int]  # HF name → rows per block, for tensors stored in blocks along their first axis
    dropped: list[str] = field(default_factory=list)  # V4's MTP weights (unused, as by the reference)


class _Sink:
    """Stands in for an array while planning: has a shape and dtype, ignores writes."""

    def __init__(self, shape, dtype):
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)

    def __getitem__(self, key):
        return _Sink(np.broadcast_to(np.zeros((), bool), self.shape)[key].shape, self.dtype)

    def __setitem__(self, key, value):
        pass


class _Store:
    """The `dest` of `place()`: the arrays of the converted layout, allocated as tensors arrive. While
    planning (`plan` None) it decides the blocks and records each array's shape and dtype; converting,
    it allocates them as planned."""

    def __init__(self, expert_block: int, plan: Plan | None = None):
        self.expert_block, self.plan = expert_block, plan
        self.rows: dict[str, int] = {} if plan is None else plan.rows
        self.arrays: dict[str, np.ndarray | _Sink] = {}
        self.touched: set[str] = set()
        self.context = ("", "")  # (tensor, file) being placed, for error messages

    def __call__(self, t: Target, source_dtype):
        if self.plan is None and t.hf not in self.rows:
            if layout.is_expert(t.hf):
                self.rows[t.hf] = self.expert_block
            else:
                row_bytes = int(np.prod(t.shape[1:], dtype=np.int64)) * _stored_dtype(t, source_dtype).itemsize
                if t.shape and t.shape[0] * row_bytes > _BLOCK_BYTES:
                    self.rows[t.hf] = max(1, _BLOCK_BYTES // max(row_bytes, 1))
        if t.hf in self.rows:
            return _Blocks(self, t, source_dtype, self.rows[t.hf])
        return self.array(t.hf, t, t.shape, source_dtype)

    def array(self, key: str, t: Target, shape, source_dtype):
        self.touched.add(key)
        if key in self.arrays:
            a = self.arrays[key]
            if self.plan is None and a.dtype != _stored_dtype(t, source_dtype):
                name, file = self.context
                raise CheckpointError(f"{file}: tensor {name!r} is {source_dtype}, but other tensors of "
                                      f"{t.hf!r} are {a.dtype}")
            return a
        if self.plan is None:
            a = _Sink(shape, _stored_dtype(t, source_dtype))
        else:
            p = self.plan.pieces[key]
            a = np.empty(p.shape, p.dtype)
        self.arrays[key] = a
        return a


class _Blocks:
    """A tensor stored as blocks of `rows` along its first axis (for merged experts: experts per block):
    `[e]` is row e, `[...] = value` fills every block."""

    def __init__(self, store: _Store, t: Target, source_dtype, rows: int):
        self.store, self.t, self.source_dtype, self.rows = store, t, source_dtype, rows
        self.shape = t.shape

    def _block(self, first: int):
        shape = (min(self.rows, self.t.shape[0] - first),) + self.t.shape[1:]
        return self.store.array(layout.piece_key(self.t.hf, first), self.t, shape, self.source_dtype)

    def __getitem__(self, e: int):
        return self._block(e - e % self.rows)[e % self.rows]

    def __setitem__(self, key, value):
        if key is not Ellipsis:
            raise TypeError("a blocked tensor is written whole or one row (expert) at a time")
        for first in range(0, self.t.shape[0], self.rows):
            self._block(first)[...] = value[first:first + self.rows]


def _stored_dtype(t: Target, source_dtype) -> np.dtype:
    """Quantized storage as the config says; everything else as the source has it (lossless)."""
    return t.dtype if t.quantized or t.scale else np.dtype(source_dtype)


def _fake(ref: TensorRef) -> np.ndarray:
    """A zero-stride array with the tensor's dtype and shape: enough for every check `place()` makes
    from headers (ones are valid FP8 values and power-of-two scales; zero is a valid expert id)."""
    dtype = tensor_dtype(ref)
    one = np.zeros((), dtype) if dtype.kind in "iu" and ref.name.endswith("tid2eid") else np.ones((), dtype)
    return np.broadcast_to(one, ref.shape)


def _expert_block(cfg, targets: dict[str, Target], ep: int) -> int:
    e = cfg.n_routed_experts
    if e % ep:
        raise ValueError(f"the expert axis ({ep}) must divide n_routed_experts ({e})")
    per_expert = max((int(np.prod(t.shape[1:])) * t.dtype.itemsize for t in targets.values()
                      if layout.is_expert(t.hf)), default=1)
    local = e // ep
    return max(d for d in range(1, local + 1) if local % d == 0 and (d == 1 or d * per_expert <= _BLOCK_BYTES))


def plan(src: str | os.PathLike, weights: str = "keep", ep: int = 1) -> Plan:
    """Read and check the headers of the checkpoint in `src`; the arrays the conversion will write.

    Raises CheckpointError, naming the tensor and its file, for a missing, unexpected, mis-shaped or
    wrongly typed tensor, a shard the index names but the folder lacks, a truncated file, or a config
    that does not match the tensors."""
    check_choice("weights", weights, WEIGHTS)
    src = os.path.abspath(os.fspath(src))
    if not os.path.isdir(src):
        raise CheckpointError(f"{src} is not a folder")
    cfg_path = os.path.join(src, "config.json")
    family = None
    try:
        with open(cfg_path) as f:
            raw = json.load(f)
        family = family_of(raw)
        stored = family.config(raw)
    except FileNotFoundError:
        raise CheckpointError(f"{src} has no config.json") from None
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        what = family.name if family else "DeepSeek-V4"
        raise CheckpointError(f"{cfg_path}: not a {what} config ({type(e).__name__}: {e})") from None

    refs: dict[str, tuple[str, tuple[TensorRef, int]]] = {}
    for path in checkpoint_files(src):
        header, start = read_header(path)
        for name, ref in header.items():
            if name in refs:
                raise CheckpointError(f"tensor {name!r} appears in both {refs[name][0]} and {path}")
            refs[name] = (path, (ref, start))
    _check_index(src, refs)
    tensors, scales = pair_scales(refs)
    check_scales_declared(stored, scales, cfg_path)

    # Checks run against the stored (quantized) layout, where nothing is dequantized; weights="bf16"
    # then maps its arrays to their float form.
    keep_targets = family.targets(stored)
    block = _expert_block(stored, keep_targets, ep)
    store, filled, items, dropped = _Store(block), set(), [], []
    order = sorted(tensors, key=lambda n: (tensors[n][0], tensors[n][1][0].begin))
    for name in order:
        file, (ref, start) = tensors[name]
        scale = scales.get(name)
        fake_scale = (scale[0], scale[1], _fake(scale[2][0])) if scale else None
        store.touched, store.context = set(), (name, file)
        family.place(stored, stored, name, file, _fake(ref), fake_scale, keep_targets, store, filled)
        if not store.touched:
            dropped.append(name)
            continue
        items.append(Item(name, ref, start, scale[2] if scale else None, tuple(sorted(store.touched))))
    family.check_complete(src, stored, keep_targets, filled)
    pieces = {k: layout.Piece(k, *layout.split_key(k), a.shape, a.dtype) for k, a in store.arrays.items()}

    cfg, targets = stored, keep_targets
    if weights == "bf16" and stored.quantization is not None:
        cfg = stored.replace(quantization=None)
        targets = family.targets(cfg)
        # Scales go; weights kept beside the model (no target of either config) stay as stored.
        pieces = {k: _as_float(p, keep_targets[p.hf].quantized, targets) if p.hf in keep_targets else p
                  for k, p in pieces.items() if p.hf in targets or p.hf not in keep_targets}
        items = [Item(i.name, i.ref, i.start, i.scale, tuple(k for k in i.pieces if k in pieces)) for i in items]
    return Plan(src, family, raw, stored, cfg, weights, block, targets, items, pieces, store.rows, dropped)


def _as_float(p: layout.Piece, quantized: bool, targets: dict[str, Target]) -> layout.Piece:
    """An array of the stored layout as `weights="bf16"` writes it: quantized weights dequantized to bf16
    in dsjax's float orientation, in the same blocks."""
    t = targets[p.hf]
    shape = t.shape if p.first is None else (p.shape[0],) + t.shape[1:]
    return layout.Piece(p.key, p.hf, p.first, shape, np.dtype(ml_dtypes.bfloat16) if quantized else p.dtype)


def _check_index(src: str, refs: dict) -> None:
    index = os.path.join(src, "model.safetensors.index.json")
    if not os.path.exists(index):
        return
    try:
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index}: not a safetensors index ({type(e).__name__}: {e})") from None
    for name, fname in weight_map.items():
        where = refs.get(name)
        if where is None or os.path.basename(where[0]) != fname:
            raise CheckpointError(f"{index} puts tensor {name!r} in {fname}, but "
                                  + ("no shard holds it" if where is None else f"it is in {where[0]}"))
    for name, (path, _) in refs.items():
        if name not in weight_map:
            raise CheckpointError(f"{path}: tensor {name!r} is not in {index}")


def _complete(plan: Plan, key: str, filled: set) -> bool:
    hf, first = layout.split_key(key)
    if first is None or hf in filled:
        return hf in filled
    leaf = hf.removesuffix("_scale_inv")
    parts = ("w2",) if leaf.endswith("down_proj") else ("w1", "w3")
    return all((hf, e, p) in filled for e in range(first, first + plan.expert_block) for p in parts)


def stream(plan: Plan, on_array: Callable[[str, np.ndarray], None], skip: set[str] = frozenset(),
           on_bytes: Callable[[int], None] = lambda n: None, on_file: Callable[[str], None] = lambda f: None):
    """Read the source tensors that feed arrays not in `skip` and call `on_array(key, array)` as each
    array of the converted layout is complete; `on_file(path)` after the last tensor of each file."""
    store, filled = _Store(plan.expert_block, plan), set()
    for i, item in enumerate(plan.items):
        if item.pieces and not all(k in skip for k in item.pieces):
            value = read_tensor(item.ref, item.start)
            scale = (item.scale[0].name, item.scale[0].file, read_tensor(*item.scale)) if item.scale else None
            store.touched, store.context = set(), (item.name, item.ref.file)
            plan.family.place(plan.stored, plan.cfg, item.name, item.ref.file, value, scale, plan.targets, store,
                              filled)
            del value, scale  # drop the memory maps: their pages stop counting once unmapped
            for key in sorted(store.touched):
                if key in store.arrays and _complete(plan, key, filled):
                    on_array(key, store.arrays.pop(key))
            on_bytes(item.nbytes)
        if i + 1 == len(plan.items) or plan.items[i + 1].ref.file != item.ref.file:
            on_file(item.ref.file)
    if store.arrays:  # cannot happen after check_complete; guards against a planning bug
        raise AssertionError(f"arrays never completed: {sorted(store.arrays)[:5]}")


def sha256(a: np.ndarray) -> str:
    return hashlib.sha256(memoryview(np.ascontiguousarray(a).reshape(-1).view(np.uint8))).hexdigest()


class _Saver:
    """Saves finished arrays into the Orbax partial-save session and journals each one."""

    def __init__(self, params: str, journal: str, done: dict[str, dict]):
        self.params, self.journal, self.done = params, journal, done
        self.ready: dict[str, np.ndarray] = {}
        self.bytes = 0

    def add(self, key: str, value: np.ndarray) -> None:
        if key in self.done:
            return
        self.ready[key] = value
        self.bytes += value.nbytes
        if self.bytes >= _FLUSH_BYTES:
            self.flush()

    def flush(self, _file: str | None = None) -> None:
        if not self.ready:
            return
        try:
            _partial_save(self.params, self.ready)
        except PartialSaveReplacementError:
            # A run killed between a save and its journal line: save what the session still lacks.
            for key, value in self.ready.items():
                try:
                    _partial_save(self.params, {key: value})
                except PartialSaveReplacementError:
                    pass
        with open(self.journal, "a") as f:
            for key, value in self.ready.items():
                info = {"key": key, "shape": list(value.shape), "dtype": value.dtype.name, "sha256": sha256(value)}
                f.write(json.dumps(info) + "\n")
                self.done[key] = info
            f.flush()
            os.fsync(f.fileno())
        self.ready, self.bytes = {}, 0


def _orbax_context() -> ocp.Context:
    ctx = ocp.Context()
    ctx.array.saving.use_compression = False  # FP8/FP4 weights do not compress; zstd only costs time
    return ctx


def _partial_save(params: str, arrays: dict[str, np.ndarray]) -> None:
    with _orbax_context():
        ocp.partial.save(params, layout.nest(arrays))


def _read_journal(path: str) -> dict[str, dict]:
    """The arrays a previous run saved. A last line cut by a kill is cut off the file too, so that new
    lines start clean; its array is saved again or found in the Orbax session."""
    done, good = {}, 0
    if os.path.exists(path):
        with open(path, "rb") as f:
            for line in f:
                try:
                    info = json.loads(line)
                except (json.JSONDecodeError, UnicodeDecodeError):
                    break
                if not line.endswith(b"\n"):
                    break
                done[info["key"]] = info
                good += len(line)
        os.truncate(path, good)
    return done


def _fingerprint(plan: Plan, ep: int) -> dict:
    files = sorted({i.ref.file for i in plan.items} | {os.path.join(plan.src, "config.json")})
    return {"src": plan.src, "weights": plan.weights, "ep": ep, "expert_block": plan.expert_block,
            "files": [[os.path.basename(f), os.path.getsize(f), os.stat(f).st_mtime_ns] for f in files]}


def _extra_files(src: str) -> list[str]:
    """Tokenizer and other small files that travel with the weights."""
    return sorted(f for f in os.listdir(src) if os.path.isfile(os.path.join(src, f))
                  and not f.endswith(".safetensors") and f not in _WEIGHT_FILES)


@dataclass
class Summary:
    arrays: int
    bytes_read: int
    bytes_written: int
    seconds: float
    resumed_arrays: int
    dropped: list[str]
    peak_rss_bytes: int
    verified: bool

    @property
    def mb_per_s(self) -> float:
        return self.bytes_read / 1e6 / max(self.seconds, 1e-9)

    def __str__(self) -> str:
        resumed = f", {self.resumed_arrays} already saved by an earlier run" if self.resumed_arrays else ""
        dropped = f"; dropped {len(self.dropped)} MTP tensor(s)" if self.dropped else ""
        return (f"{self.arrays} arrays{resumed}; read {self.bytes_read / 1e9:.2f} GB in {self.seconds:.1f} s "
                f"({self.mb_per_s:.0f} MB/s); checkpoint {self.bytes_written / 1e9:.2f} GB; peak RSS "
                f"{self.peak_rss_bytes / 1e9:.2f} GB{dropped}" + ("; verified against the source" if self.verified
                                                                  else ""))


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _progress(total: int, desc: str, enabled: bool, initial: int = 0):
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, unit="B", unit_scale=True, unit_divisor=1024, desc=desc,
                disable=not enabled, smoothing=0.1, dynamic_ncols=True)


def convert(src: str | os.PathLike, dst: str | os.PathLike, weights: str = "keep", ep: int = 1,
            verify: bool = False, progress: bool = True) -> Summary:
    """Convert the checkpoint in `src` into a dsjax Orbax checkpoint at `dst` (see converted.py).

    `weights="bf16"` dequantizes FP8/FP4 weights into bf16; `ep` aligns the expert blocks to an expert
    axis of that size. Works in `dst.partial` and renames it to `dst` when complete; a run interrupted in
    any way resumes when re-run with the same arguments. `verify` re-reads every array of the result and
    compares its sha256 with the same array rebuilt from `src` before the rename.
    """
    t0 = time.time()
    dst = os.path.abspath(os.fspath(dst))
    if os.path.exists(dst):
        raise FileExistsError(f"{dst} exists; remove it or choose another destination")
    the_plan = plan(src, weights, ep)
    work = dst + ".partial"
    params = os.path.join(work, layout.PARAMS)
    fingerprint = _fingerprint(the_plan, ep)
    args_path = os.path.join(work, "conversion.json")
    if os.path.exists(work):
        try:
            with open(args_path) as f:
                previous = json.load(f)
        except (OSError, json.JSONDecodeError):
            previous = None
        if previous != fingerprint:
            raise CheckpointError(f"{work} holds an unfinished conversion of another source or with other "
                                  "options (or the source changed since); remove it, or re-run with the "
                                  "arguments it was started with")
    else:
        os.makedirs(work)
        with open(args_path + ".tmp", "w") as f:
            json.dump(fingerprint, f, indent=1)
        os.replace(args_path + ".tmp", args_path)

    journal = os.path.join(work, "journal.jsonl")
    done = _read_journal(journal)
    resumed = sum(k in done for k in the_plan.pieces)
    total = sum(i.nbytes for i in the_plan.items if i.pieces)
    todo = sum(i.nbytes for i in the_plan.items if i.pieces and not all(k in done for k in i.pieces))
    saver = _Saver(params, journal, done)
    bar = _progress(total, "convert", progress, initial=total - todo)
    try:
        if not os.path.isdir(params):
            stream(the_plan, saver.add, skip=set(done), on_bytes=bar.update,
                   on_file=saver.flush)
            saver.flush()
            missing = sorted(set(the_plan.pieces) - set(done))
            if missing:
                raise AssertionError(f"arrays never saved: {missing[:5]}")
            with _orbax_context():
                ocp.partial.finalize(params)
    except CheckpointError:
        bar.close()
        shutil.rmtree(work, ignore_errors=True)  # bad data: nothing to resume
        raise
    bar.close()

    for name in _extra_files(the_plan.src):
        shutil.copy2(os.path.join(the_plan.src, name), os.path.join(work, name))
    config = json.loads(json.dumps(the_plan.raw_config))
    if the_plan.cfg.quantization is None:
        for level in (config, config.get("text_config")):  # V4.1 may declare it in either
            if isinstance(level, dict):
                level.pop("quantization_config", None)
    with open(os.path.join(work, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    manifest = {"format": layout.FORMAT, "version": layout.VERSION, "weights": weights,
                "expert_block": the_plan.expert_block, "ep": ep, "source": the_plan.src,
                "dropped": the_plan.dropped,
                "pieces": {k: {x: done[k][x] for x in ("shape", "dtype", "sha256")} for k in sorted(the_plan.pieces)}}
    with open(os.path.join(work, layout.MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1)
    if verify:
        verify_against_source(work, the_plan, progress)
    for name in ("journal.jsonl", "conversion.json"):
        os.remove(os.path.join(work, name))
    os.rename(work, dst)
    written = sum(p.nbytes for p in the_plan.pieces.values())
    return Summary(len(the_plan.pieces), todo, written, time.time() - t0, resumed, the_plan.dropped, _peak_rss(),
                   verify)


def verify_against_source(folder: str, the_plan: Plan, progress: bool = True) -> None:
    """Rebuild every array of the converted checkpoint in `folder` from the source and compare its sha256
    with the manifest's, then read every array back from the Orbax checkpoint and compare again (two
    passes, so that memory holds one batch of arrays at a time)."""
    man = layout.read_manifest(folder)
    listed = man["pieces"]
    missing = sorted(set(the_plan.pieces) - set(listed))
    if missing:
        raise CheckpointError(f"{folder}: the manifest lacks {len(missing)} array(s), e.g. {missing[:3]}")
    bar = _progress(sum(i.nbytes for i in the_plan.items if i.pieces) + sum(p.nbytes for p in the_plan.pieces.values()),
                    "verify", progress)

    def check_source(key: str, expected: np.ndarray) -> None:
        if sha256(expected) != listed[key]["sha256"]:
            raise CheckpointError(f"{folder}: array {key!r} as rebuilt from {the_plan.src} differs from the "
                                  "one the conversion recorded")

    stream(the_plan, check_source, on_bytes=bar.update)
    pieces = layout.pieces_of(man)
    params = os.path.join(folder, layout.PARAMS)
    for batch in layout.batches([pieces[key] for key in sorted(the_plan.pieces)], _FLUSH_BYTES):
        values = layout.read_pieces(params, batch)
        for p in batch:
            got = sha256(values.pop(p.key))
            if got != listed[p.key]["sha256"]:
                raise CheckpointError(f"{folder}: array {p.key!r} differs from the source (sha256 {got[:12]} "
                                      f"read back, {listed[p.key]['sha256'][:12]} from the source)")
            bar.update(p.nbytes)
    bar.close()


def to_hf(src: str | os.PathLike, dst: str | os.PathLike, max_shard_bytes: int | None = None,
          progress: bool = True) -> Summary:
    """Write the converted checkpoint `src` back as safetensors shards with DeepSeek's original names
    (+ index, config, tokenizer files) at `dst`. Every file's header is known before any data is read,
    so the arrays stream through one at a time; the result is staged in `dst.partial`."""
    t0 = time.time()
    src, dst = os.path.abspath(os.fspath(src)), os.path.abspath(os.fspath(dst))
    if os.path.exists(dst):
        raise FileExistsError(f"{dst} exists; remove it or choose another destination")
    if not layout.is_converted(src):
        raise CheckpointError(f"{src} is not a converted dsjax checkpoint (no {layout.MANIFEST})")
    man = layout.read_manifest(src)
    raw = read_json(os.path.join(src, "config.json"), "config")
    family = family_of(raw)
    cfg = family.config(raw)
    pieces = layout.pieces_of(man)
    order = sorted(pieces.values(), key=lambda p: (layout.unit_of(p.key) == -1, layout.unit_of(p.key), p.hf,
                                                   p.first or 0))  # layers, then embedding, norm and head

    def originals(p: layout.Piece, value: np.ndarray):
        """(original name, data) for one array: the per-expert tensors of an expert block; else the
        tensor, or the rows of it that a block holds (the writer appends them)."""
        yield from family.originals(cfg, p.hf, value, p.first if layout.is_expert(p.hf) else 0)

    full_rows = {}
    for p in pieces.values():
        if p.first is not None and not layout.is_expert(p.hf):
            full_rows[p.hf] = max(full_rows.get(p.hf, 0), p.first + p.shape[0])
    entries = []
    for p in order:
        if p.first is not None and not layout.is_expert(p.hf):
            if p.first == 0:
                fake = np.broadcast_to(np.zeros((), p.dtype), (full_rows[p.hf],) + p.shape[1:])
                entries += [(n, v.dtype, v.shape) for n, v in originals(p, fake)]
            continue
        fake = np.broadcast_to(np.zeros((), p.dtype), p.shape)
        entries += [(n, v.dtype, v.shape) for n, v in originals(p, fake)]

    work = dst + ".partial"
    shutil.rmtree(work, ignore_errors=True)
    writer = StreamingShards(work, entries, max_shard_bytes or 4 << 30)
    params = os.path.join(src, layout.PARAMS)
    total = sum(p.nbytes for p in pieces.values())
    bar = _progress(total, "to-hf", progress)
    for batch in layout.batches(order, _FLUSH_BYTES):
        values = layout.read_pieces(params, batch)
        for p in batch:
            for name, v in originals(p, np.asarray(values.pop(p.key))):
                writer.write(name, v)
            bar.update(p.nbytes)
    writer.close()
    bar.close()
    for name in _extra_files(src):
        if name != layout.MANIFEST:
            shutil.copy2(os.path.join(src, name), os.path.join(work, name))
    shutil.copy2(os.path.join(src, "config.json"), os.path.join(work, "config.json"))
    os.rename(work, dst)
    return Summary(len(pieces), total, total, time.time() - t0, 0, [], _peak_rss(), False)
