"""A converted checkpoint: dsjax's Orbax layout, and loading it straight onto the devices.

    DST/config.json, tokenizer files     from the source (no quantization_config after `--weights bf16`)
    DST/dsjax_checkpoint.json            format, conversion options, every array's shape, dtype, sha256
    DST/params/                          one Orbax checkpoint (OCDBT, zarr3, uncompressed)

The Orbax tree is dsjax's parameter tree with the layers unstacked: a leaf per tensor, keyed by its HF
name for DeepSeek-V4 (`model.layers.3.self_attn.q_a_proj.weight`, `…weight_scale_inv`) and by its dsjax
path for DeepSeek-V4.1 (`layers.3.attn.q_a_proj.weight`, `layers.1.engram.table_scale`; the weights it
keeps beside the model under their release names, `mtp.0.attn.wq_a.weight`). The merged routed experts
are split into blocks of consecutive experts keyed by the first one (`model.layers.3.mlp.experts.gate_up_proj.0`,
`….gate_up_proj.64`), so that no array is ever larger than a block and an expert-parallel device reads
only its blocks. Arrays keep the dtypes the source stored (bf16, fp32, FP8 e4m3, FP4 as int8, ue8m0
scales as uint8, int64 hash tables); only float experts change orientation, to dsjax's [E, in, out].
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from orbax.checkpoint import v1 as ocp

from dsjax.checkpoint.targets import abstract_model
from dsjax.checkpoint.names import TRANSPOSED_LEAVES
from dsjax.checkpoint.names_v41 import MERGED_EXPERTS
from dsjax.checkpoint.safetensors_io import CheckpointError, read_json
from dsjax.config import ModelConfig
from dsjax.model import DeepseekV4

MANIFEST = "dsjax_checkpoint.json"
PARAMS = "params"
FORMAT = "dsjax-orbax"
VERSION = 1


@dataclass(frozen=True)
class Piece:
    """One array of a converted checkpoint: HF tensor `hf`, or experts [first, first + n) of it."""

    key: str
    hf: str
    first: int | None
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


_EXPERTS = tuple(x + s for x in TRANSPOSED_LEAVES for s in ("", "_scale_inv")) + MERGED_EXPERTS


def is_expert(hf: str) -> bool:
    """A merged routed-expert tensor (V4 or V4.1) or its scales: stored in blocks of experts."""
    return hf.endswith(_EXPERTS)


def piece_key(hf: str, first: int | None) -> str:
    return hf if first is None else f"{hf}.{first}"


def split_key(key: str) -> tuple[str, int | None]:
    """(HF name, first row of the block or None); no HF name ends in a number, block keys do."""
    head, _, tail = key.rpartition(".")
    return (head, int(tail)) if tail.isdigit() else (key, None)


def unit_of(key: str) -> int:
    """The layer a piece belongs to; -1 for embedding, head, final norms and kept weights."""
    parts = key.split(".")
    if parts[:2] == ["model", "layers"]:
        return int(parts[2])
    return int(parts[1]) if parts[0] == "layers" else -1


def nest(flat: dict[str, object]) -> dict:
    """{'a.b.c': x} → {'a': {'b': {'c': x}}}: the Orbax tree of a set of pieces."""
    tree: dict = {}
    for key, value in flat.items():
        node = tree
        *path, leaf = key.split(".")
        for p in path:
            node = node.setdefault(p, {})
        node[leaf] = value
    return tree


def flatten(tree: dict, prefix: str = "") -> dict[str, object]:
    out = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        out.update(flatten(v, key + ".") if isinstance(v, dict) else {key: v})
    return out


def dtype_of(name: str) -> np.dtype:
    return np.dtype(jnp.dtype(name))


def read_manifest(folder: str) -> dict:
    path = os.path.join(folder, MANIFEST)
    man = read_json(path, "dsjax manifest")
    if man.get("format") != FORMAT or man.get("version") != VERSION:
        raise CheckpointError(f"{path}: format {man.get('format')!r} version {man.get('version')!r}; this dsjax "
                              f"reads {FORMAT!r} version {VERSION}")
    return man


def pieces_of(man: dict) -> dict[str, Piece]:
    out = {}
    for key, info in man["pieces"].items():
        hf, first = split_key(key)
        out[key] = Piece(key, hf, first, tuple(info["shape"]), dtype_of(info["dtype"]))
    return out


def is_converted(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, MANIFEST))


def read_pieces(params: str, pieces: list[Piece], sharding=None) -> dict[str, np.ndarray | jax.Array]:
    """Read some pieces of the Orbax checkpoint at `params`: numpy arrays on the host (sharding None),
    else jax arrays placed by `sharding(piece)`. Integer pieces always come back as numpy (jax would
    truncate int64)."""
    abstract = {}
    for p in pieces:
        if sharding is None or p.dtype.kind in "iu":
            # np.empty only reserves address space; Orbax reads the shape and dtype from it.
            abstract[p.key] = np.empty(p.shape, p.dtype)
        else:
            abstract[p.key] = jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=sharding(p))
    ctx = ocp.Context()
    ctx.pytree.loading.partial_load = True
    with ctx:
        return flatten(ocp.load(os.path.abspath(params), nest(abstract)))  # Orbax refuses relative paths


def load_converted(folder: str, dtype=jnp.float32, weights: str = "keep", mesh=None) -> DeepseekV4:
    """A DeepseekV4 from a converted checkpoint, placed on `mesh` by `dsjax.parallel.rules` (None: the
    first device); see `fill`."""
    from dsjax.quantize import dequantize_model

    man = read_manifest(folder)
    stored = ModelConfig.from_hf(os.path.join(folder, "config.json"))  # errors name the file
    if weights == "bf16" and stored.quantization is not None:
        return dequantize_model(load_converted(folder, dtype, "keep", mesh), dtype)
    graphdef, flat, targets = abstract_model(stored, dtype)
    fill(folder, pieces_of(man), flat, targets, mesh)
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def fill(folder: str, pieces: dict[str, Piece], flat: list, targets: dict, mesh=None) -> None:
    """Set the variables of `flat` (an abstract state) that `targets` name from the converted checkpoint's
    `pieces`, which must cover them exactly. Arrays are read a few at a time, layer by layer, and each
    device receives only its slice of each, written into its own buffer: the host never holds more than a
    batch of arrays, no device more than its share, and a process reads only the arrays its devices need."""
    variables = dict(flat)
    _check_covers(folder, targets, pieces)
    params = os.path.join(folder, PARAMS)

    placed: dict[tuple, _Placed] = {}

    def placement(path) -> _Placed:
        if path not in placed:
            sds = variables[path].get_value()
            if mesh is None:
                sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
            else:
                from dsjax.parallel.rules import param_sharding

                sharding = param_sharding(mesh, path, variables[path])
            placed[path] = _Placed(tuple(sds.shape), np.dtype(sds.dtype), sharding)
        return placed[path]

    units: dict[int, list[Piece]] = {}
    for p in pieces.values():
        t = targets[p.hf]
        if placement(t.path).wants(_region(t, p)):
            units.setdefault(unit_of(p.key), []).append(p)
    for unit in sorted(units):
        for batch in batches(sorted(units[unit], key=lambda p: p.key)):
            for key, value in read_pieces(params, batch).items():
                t = targets[pieces[key].hf]
                placement(t.path).put(_region(t, pieces[key]), value)
    for path, pl in placed.items():
        variables[path].set_value(pl.array())


def read_whole(folder: str, pieces: list[Piece]) -> dict[str, np.ndarray]:
    """Host arrays of the tensors `pieces` hold (row blocks joined), by name."""
    params = os.path.join(folder, PARAMS)
    parts: dict[str, list[tuple[int, np.ndarray]]] = {}
    for batch in batches(sorted(pieces, key=lambda p: p.key)):
        for key, value in read_pieces(params, batch).items():
            hf, first = split_key(key)
            parts.setdefault(hf, []).append((first, value))
    out = {}
    for hf, blocks in parts.items():
        if len(blocks) == 1 and blocks[0][0] is None:
            out[hf] = blocks[0][1]
            continue
        blocks.sort(key=lambda b: -1 if b[0] is None else b[0])
        at = 0
        for first, value in blocks:
            if first != at:
                raise CheckpointError(f"{folder}: array {hf!r} lacks or repeats rows from {at}")
            at += value.shape[0]
        out[hf] = np.concatenate([v for _, v in blocks])
    return out


_READ_BYTES = 256 << 20


def batches(pieces: list[Piece], max_bytes: int = _READ_BYTES):
    """`pieces` in their order, in batches of at most `max_bytes` (or one larger piece): one Orbax read each."""
    batch, size = [], 0
    for p in pieces:
        if batch and size + p.nbytes > max_bytes:
            yield batch
            batch, size = [], 0
        batch.append(p)
        size += p.nbytes
    if batch:
        yield batch


def _region(t, p: Piece) -> tuple[tuple[int, int], ...]:
    """The [lo, hi) ranges the piece covers in the (stacked) variable."""
    rows = [(0, n) for n in t.shape]
    if p.first is not None:
        rows[0] = (p.first, p.first + p.shape[0])
    return (((t.repeat, t.repeat + 1),) if t.repeat is not None else ()) + tuple(rows)


class _Placed:
    """One variable being assembled: a buffer per addressable device holding that device's slice."""

    def __init__(self, shape: tuple, dtype: np.dtype, sharding):
        self.shape, self.dtype, self.sharding = shape, dtype, sharding
        self.slices = {d: tuple(s.indices(n)[:2] for s, n in zip(idx, shape))
                       for d, idx in sharding.addressable_devices_indices_map(shape).items()}
        self.buffers: dict = {}

    def _overlap(self, mine, region):
        both = [(max(a, c), min(b, d)) for (a, b), (c, d) in zip(mine, region)]
        return None if any(lo >= hi for lo, hi in both) else both

    def wants(self, region) -> bool:
        return any(self._overlap(mine, region) for mine in self.slices.values())

    def put(self, region, value: np.ndarray) -> None:
        value = value.reshape(tuple(hi - lo for lo, hi in region))  # adds the stacked axis
        for d, mine in self.slices.items():
            both = self._overlap(mine, region)
            if both is None:
                continue
            part = value[tuple(slice(lo - r, hi - r) for (lo, hi), (r, _) in zip(both, region))]
            if d not in self.buffers:
                self.buffers[d] = jnp.zeros(tuple(b - a for a, b in mine), self.dtype, device=d)
            start = tuple(jnp.int32(lo - m) for (lo, _), (m, _) in zip(both, mine))
            self.buffers[d] = _insert(self.buffers[d], jax.device_put(part.astype(self.dtype), d), start)

    def array(self) -> jax.Array:
        return jax.make_array_from_single_device_arrays(self.shape, self.sharding,
                                                        [self.buffers[d] for d in self.slices])


_insert = jax.jit(lambda buf, value, start: jax.lax.dynamic_update_slice(buf, value, start), donate_argnums=0)


def _check_covers(folder: str, targets: dict, pieces: dict[str, Piece]) -> None:
    """Every target is in the checkpoint exactly once (whole, or in blocks that tile its first axis), with
    its shape, and nothing else is."""
    spans: dict[str, list[tuple[int, int]]] = {}
    for p in pieces.values():
        if p.hf not in targets:
            raise CheckpointError(f"{folder}: array {p.key!r} belongs to no parameter of its config")
        t = targets[p.hf]
        want = t.shape if p.first is None else (p.shape[0],) + t.shape[1:]
        if p.shape != want:
            raise CheckpointError(f"{folder}: array {p.key!r} has shape {list(p.shape)}, expected {list(want)}")
        first = 0 if p.first is None else p.first
        spans.setdefault(p.hf, []).append((first, first + (1 if p.first is None and not t.shape else
                                                            t.shape[0] if p.first is None else p.shape[0])))
    bad = []
    for hf, t in targets.items():
        rows, at = sorted(spans.get(hf, [])), 0
        for lo, hi in rows:
            at = hi if lo == at else -1
        if at != (t.shape[0] if t.shape else 1):
            bad.append(hf)
    if bad:
        raise CheckpointError(f"{folder}: converted checkpoint lacks or repeats parts of {len(bad)} array(s): "
                              f"{sorted(bad)[:8]}")
