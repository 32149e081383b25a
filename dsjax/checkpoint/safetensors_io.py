"""Lazy safetensors reading for every dtype a DeepSeek checkpoint holds.

safetensors' numpy loader cannot read FP8 (it looks for `numpy.float8_e4m3fn`), so the header is
parsed here and each tensor is a zero-copy view of a memory map, typed with ml_dtypes.
"""

from __future__ import annotations

import json
import os
import reprlib
import struct
from dataclasses import dataclass
from typing import Iterator

import ml_dtypes
import numpy as np

DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2, "F8_E8M0": ml_dtypes.float8_e8m0fnu,
}


SAFETENSORS_DTYPES = {np.dtype(v): k for k, v in DTYPES.items()}


class CheckpointError(ValueError):
    """A checkpoint folder or file that cannot be read as DeepSeek-V4 weights."""


@dataclass(frozen=True)
class TensorRef:
    name: str
    file: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def read_json(path: str, what: str) -> dict:
    """The JSON object in the file `path` (`what` it is, for messages), or a CheckpointError naming it."""
    try:
        with open(path, "rb") as f:
            value = json.loads(f.read())
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read the {what} ({e.strerror or e})") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: the {what} is not valid JSON (line {e.lineno}, column {e.colno}: "
                              f"{e.msg})") from None
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{path}: the {what} is not valid JSON (not UTF-8 text: {e.reason})") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: the {what} must be a JSON object, not a {type(value).__name__}")
    return value


def read_header(path: str) -> tuple[dict[str, TensorRef], int]:
    """The tensors of one .safetensors file and the byte offset where their data starts."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            first = f.read(8)
            if len(first) < 8:
                raise CheckpointError(f"{path}: not a safetensors file: it has {size} bytes, fewer than the "
                                      "8 that give the header's length")
            (n,) = struct.unpack("<Q", first)
            # Checked before reading: random bytes give lengths of exabytes.
            if n > size - 8:
                raise CheckpointError(f"{path}: not a safetensors file: its first 8 bytes give a header of "
                                      f"{n:,} bytes, but the file has {size:,}")
            header = json.loads(f.read(n))
    except OSError as e:
        raise CheckpointError(f"{path}: not a readable safetensors file ({e.strerror or e})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not a safetensors file: its header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: not a safetensors file: its header is a JSON {type(header).__name__}, "
                              "not an object")
    refs = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = _entry(path, name, info)
        refs[name] = TensorRef(name, path, info["dtype"], tuple(info["shape"]), begin, end)
    needed = 8 + n + max((r.end for r in refs.values()), default=0)
    if size < needed:
        short = sorted(r.name for r in refs.values() if 8 + n + r.end > size)
        raise CheckpointError(f"{path}: truncated: its header describes {needed:,} bytes but the file has "
                              f"{size:,}; {len(short)} tensor(s) cut off, e.g. {short[:3]}")
    return refs, 8 + n


def _is_count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _entry(path: str, name: str, info) -> tuple[int, int]:
    """The data offsets of header entry `name`, once its fields have the types the format gives them."""
    ok = (isinstance(info, dict) and isinstance(info.get("dtype"), str)
          and isinstance(info.get("shape"), list) and all(_is_count(d) for d in info["shape"])
          and isinstance(info.get("data_offsets"), list) and len(info["data_offsets"]) == 2
          and all(_is_count(o) for o in info["data_offsets"]))
    if not ok or info["data_offsets"][0] > info["data_offsets"][1]:
        raise CheckpointError(f"{path}: header entry {name!r} is not a tensor description: expected "
                              '{"dtype": str, "shape": [non-negative ints], "data_offsets": [begin, end]}, '
                              f"got {reprlib.repr(info)}")
    return tuple(info["data_offsets"])


def tensor_dtype(ref: TensorRef) -> np.dtype:
    """The numpy dtype of a header entry, checked against its byte size."""
    if ref.dtype not in DTYPES:
        raise CheckpointError(f"{ref.file}: tensor {ref.name} has unsupported dtype {ref.dtype}")
    dtype = np.dtype(DTYPES[ref.dtype])
    count = int(np.prod(ref.shape, dtype=np.int64))
    if ref.end - ref.begin != count * dtype.itemsize:
        raise CheckpointError(f"{ref.file}: tensor {ref.name} has {ref.end - ref.begin} bytes, "
                              f"expected {count * dtype.itemsize} for {ref.dtype}{list(ref.shape)}")
    return dtype


def read_tensor(ref: TensorRef, data_start: int) -> np.ndarray:
    """A zero-copy view of the tensor in a memory map of its file (unmapped when the view is dropped)."""
    dtype = tensor_dtype(ref)
    mm = np.memmap(ref.file, dtype=np.uint8, mode="r")
    return mm[data_start + ref.begin:data_start + ref.end].view(dtype).reshape(ref.shape)


def checkpoint_files(folder: str) -> list[str]:
    """The .safetensors files of a model folder: those the index names, or the single model file."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        weight_map = read_json(index, "safetensors index").get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index}: expected a \"weight_map\" object mapping tensor names to shard "
                                  f"files, got {reprlib.repr(weight_map)}")
        if not weight_map:
            raise CheckpointError(f"{index}: its weight_map is empty, so it names no shard files")
        files = sorted(set(weight_map.values()))
        missing = [x for x in files if not os.path.exists(os.path.join(folder, x))]
        if missing:
            raise CheckpointError(f"{index} names shard(s) that do not exist: {missing}")
        return [os.path.join(folder, x) for x in files]
    single = os.path.join(folder, "model.safetensors")
    if os.path.exists(single):
        return [single]
    files = sorted(x for x in os.listdir(folder) if x.endswith(".safetensors"))
    if not files:
        raise CheckpointError(f"{folder}: no model.safetensors, no index, and no *.safetensors files")
    return [os.path.join(folder, x) for x in files]


def iter_tensors(folder: str) -> Iterator[tuple[str, str, np.ndarray]]:
    """Yields (name, file, lazily mapped array) for every tensor of the checkpoint in `folder`."""
    seen: dict[str, str] = {}
    for path in checkpoint_files(folder):
        refs, start = read_header(path)
        for name, ref in refs.items():
            if name in seen:
                raise CheckpointError(f"tensor {name} appears in both {seen[name]} and {path}")
            seen[name] = path
            yield name, path, read_tensor(ref, start)
