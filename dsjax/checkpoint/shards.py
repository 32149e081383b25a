"""Writing safetensors checkpoints in shards: `ShardWriter` (tensors in memory, a shard at a time) and
`StreamingShards` (the layout planned first, data appended block by block)."""

from __future__ import annotations

import json
import os

import numpy as np
from safetensors.numpy import save_file

from dsjax.checkpoint.safetensors_io import SAFETENSORS_DTYPES


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


class ShardWriter:
    """Writes tensors into safetensors shards of at most `max_shard_bytes` (one tensor may exceed it),
    holding one shard in memory; `close()` names them `model-0000k-of-0000N` and writes the index."""

    def __init__(self, folder: str | os.PathLike, max_shard_bytes: int = 4 << 30):
        self.folder = os.fspath(folder)
        self.max_shard_bytes = max_shard_bytes
        self.parts: list[list[str]] = []
        self._pending: dict[str, np.ndarray] = {}
        self._size = 0
        os.makedirs(self.folder, exist_ok=True)

    def add(self, name: str, value: np.ndarray) -> None:
        if self._size and self._size + value.nbytes > self.max_shard_bytes:
            self._flush()
        self._pending[name] = value
        self._size += value.nbytes

    def _flush(self) -> None:
        path = self._part(len(self.parts))
        save_file(self._pending, path, metadata={"format": "pt"})
        os.chmod(path, 0o666 & ~_umask())  # safetensors creates files 0600 whatever the umask
        self.parts.append(list(self._pending))
        self._pending, self._size = {}, 0

    def _part(self, i: int) -> str:
        return os.path.join(self.folder, f".part-{i:05d}.safetensors")

    def close(self) -> dict[str, str]:
        """Finish the shards and the index; returns the weight map (tensor name → file)."""
        if self._pending or not self.parts:
            self._flush()
        weight_map = {}
        for i, names in enumerate(self.parts):
            fname = f"model-{i + 1:05d}-of-{len(self.parts):05d}.safetensors"
            os.replace(self._part(i), os.path.join(self.folder, fname))
            weight_map.update(dict.fromkeys(names, fname))
        with open(os.path.join(self.folder, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)
        return weight_map


class StreamingShards:
    """Safetensors shards whose tensors (names, dtypes, shapes, in order) are known before their data:
    each file's header is written when it is opened and the data appended as it arrives, a tensor whole
    or in consecutive row blocks, so only the block being written is in memory. Files are named
    `model-0000k-of-0000N` with an index once `close()` has checked every byte arrived."""

    def __init__(self, folder: str | os.PathLike, entries: list[tuple[str, np.dtype, tuple]],
                 max_shard_bytes: int = 4 << 30):
        self.folder = os.fspath(folder)
        os.makedirs(self.folder, exist_ok=True)
        self.shards: list[list[tuple[str, np.dtype, tuple, int]]] = [[]]
        size = 0
        for name, dtype, shape in entries:
            nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
            if size and size + nbytes > max_shard_bytes:
                self.shards.append([])
                size = 0
            self.shards[-1].append((name, np.dtype(dtype), tuple(shape), nbytes))
            size += nbytes
        self._order = [e for shard in self.shards for e in shard]
        self._shard_of = {e[0]: i for i, shard in enumerate(self.shards) for e in shard}
        self._next, self._left, self._file, self._shard = 0, 0, None, -1

    def _name(self, i: int) -> str:
        return f"model-{i + 1:05d}-of-{len(self.shards):05d}.safetensors"

    def _open(self, i: int) -> None:
        if self._file:
            self._file.close()
        header, offset = {}, 0
        for name, dtype, shape, nbytes in self.shards[i]:
            header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        header["__metadata__"] = {"format": "pt"}
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        self._file = open(os.path.join(self.folder, "." + self._name(i)), "wb")
        self._file.write(len(text).to_bytes(8, "little") + text)
        self._shard = i

    def write(self, name: str, data: np.ndarray) -> None:
        """Append `data`: the next tensor of the plan, or the next rows of the one being written."""
        if not self._left:
            if self._next == len(self._order) or self._order[self._next][0] != name:
                expected = self._order[self._next][0] if self._next < len(self._order) else "nothing"
                raise ValueError(f"expected tensor {expected!r} next, got {name!r}")
            _, dtype, shape, self._left = self._order[self._next]
            if self._shard_of[name] != self._shard:
                self._open(self._shard_of[name])
            self._dtype = dtype
            self._next += 1
        elif self._order[self._next - 1][0] != name:
            raise ValueError(f"tensor {self._order[self._next - 1][0]!r} is not complete; got {name!r}")
        if np.dtype(data.dtype) != self._dtype or data.nbytes > self._left:
            raise ValueError(f"{name}: got {data.dtype} {data.nbytes} bytes, expected {self._dtype} at most "
                             f"{self._left} more")
        self._file.write(memoryview(np.ascontiguousarray(data).reshape(-1).view(np.uint8)))
        self._left -= data.nbytes

    def close(self) -> dict[str, str]:
        if self._left or self._next != len(self._order):
            raise ValueError(f"{len(self._order) - self._next} tensor(s) not written")
        if self._file:
            self._file.close()
        weight_map = {}
        for i, shard in enumerate(self.shards):
            tmp = os.path.join(self.folder, "." + self._name(i))
            if not shard:  # an empty checkpoint still gets its one (empty) file
                self._open(i)
                self._file.close()
            os.chmod(tmp, 0o666 & ~_umask())
            os.replace(tmp, os.path.join(self.folder, self._name(i)))
            weight_map.update({e[0]: self._name(i) for e in shard})
        with open(os.path.join(self.folder, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)
        return weight_map
