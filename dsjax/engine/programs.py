"""Compiled programs kept on disk and loaded again without tracing or lowering them.

jax's persistent cache keys a program by its lowered HLO, so a warm run still traces and lowers every
program to find it: seconds per program for a large model (31 s of a 4-layer V4-Flash job's 32 s of
warm start-up on an H200). `ProgramStore` keys a program instead by everything that decides it,
without building it:

* the program's name and variant, the model's structure (its graph, config) and the engine's shapes;
* the tree, shapes, dtypes and shardings (devices included) of every input;
* the source of the whole `dsjax` package, the versions of jax, jaxlib and its plugins, flax, tokamax,
  ml_dtypes and numpy, jax's configuration (caching options aside), `XLA_FLAGS`, the platform version
  and the devices.

A change to any of these misses, and the program is compiled (through jax's cache) and stored anew. Only
a program XLA compiled in this process is stored (`compile_for_store`): one jax loaded from its own cache
does not serialize again faithfully (on XLA:CPU its functions go missing when it is loaded once more).
Entries are written whole (a temporary file, then a rename), so processes can share the folder; an
entry that cannot be read is removed and compiled again. The store is bounded by `MAX_BYTES`, least
recently used entries going first. Like jax's cache, it trusts what it loads (entries are pickles of
serialized executables): point it only at a folder no one else may write to.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
import pickle
import tempfile
import threading
from typing import Any

import jax
from jax.experimental import serialize_executable

MAX_BYTES = 8 * 2 ** 30
_SUFFIX = ".program"
_VALUE_SUFFIX = ".json"
_PACKAGES = ("jax", "jaxlib", "flax", "tokamax", "ml_dtypes", "numpy")


class ProgramStore:
    """Serialized executables in `folder`, by `key`."""

    def __init__(self, folder: str, max_bytes: int = MAX_BYTES):
        os.makedirs(folder, exist_ok=True)
        self.folder = folder
        self.max_bytes = max_bytes

    def key(self, *parts: Any) -> str:
        """The entry name for a program decided by `parts` (strings, numbers, `describe`d inputs) in this
        process's environment (`environment()`)."""
        h = hashlib.sha256(environment().encode())
        for p in parts:
            h.update(b"\0" + repr(p).encode())
        return h.hexdigest()

    def load(self, key: str) -> jax.stages.Compiled | None:
        """The program stored under `key`, loaded onto the devices, or None."""
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                blob, in_tree, out_tree, device_ids = pickle.load(f)
            by_id = {d.id: d for d in jax.devices()}
            compiled = serialize_executable.deserialize_and_load(
                blob, in_tree, out_tree, execution_devices=[by_id[i] for i in device_ids])
        except FileNotFoundError:
            return None
        except Exception:  # a damaged or foreign entry: compile again, and replace it
            _remove(path)
            return None
        os.utime(path)  # recently used
        return compiled

    def save(self, key: str, compiled: jax.stages.Compiled) -> bool:
        """Store `compiled` under `key`; False if it cannot be serialized (host callbacks, say) or written.
        A full store first drops its least recently used entries."""
        try:
            # The devices it runs on, in the order it was compiled for (loading it onto all would not do).
            sharding = jax.tree.leaves((compiled.input_shardings, compiled.output_shardings))[0]
            devices = [d.id for d in sharding._device_assignment]
            entry = pickle.dumps((*serialize_executable.serialize(compiled), devices),
                                 protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:
            return False
        try:
            fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=".tmp-")
            with os.fdopen(fd, "wb") as f:
                f.write(entry)
            os.replace(tmp, self._path(key))
        except OSError:
            _remove(locals().get("tmp", ""))
            return False
        self._evict()
        return True

    def load_value(self, key: str):
        """The JSON value stored under `key` (`save_value`), or None."""
        try:
            with open(self._path(key, _VALUE_SUFFIX)) as f:
                return json.load(f)
        except FileNotFoundError:
            return None
        except (OSError, ValueError):  # damaged: measured again, and replaced
            _remove(self._path(key, _VALUE_SUFFIX))
            return None

    def save_value(self, key: str, value) -> bool:
        """Store a small JSON value (a measurement that goes with the programs) under `key`; False if it cannot be
        written."""
        try:
            fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=".tmp-")
            with os.fdopen(fd, "w") as f:
                json.dump(value, f)
            os.replace(tmp, self._path(key, _VALUE_SUFFIX))
        except OSError:
            _remove(locals().get("tmp", ""))
            return False
        return True

    def _path(self, key: str, suffix: str = _SUFFIX) -> str:
        return os.path.join(self.folder, key + suffix)

    def _evict(self) -> None:
        entries = []
        for name in os.listdir(self.folder):
            if name.endswith(_SUFFIX):
                try:
                    st = os.stat(os.path.join(self.folder, name))
                except FileNotFoundError:  # another process evicted it
                    continue
                entries.append((st.st_mtime, st.st_size, name))
        total = sum(size for _, size, _ in entries)
        for _, size, name in sorted(entries):
            if total <= self.max_bytes:
                break
            _remove(os.path.join(self.folder, name))
            total -= size


def compile_for_store(lowered: jax.stages.Lowered) -> tuple[jax.stages.Compiled, bool]:
    """`lowered.compile()`, and whether it may be stored: XLA compiled it here and now, rather than jax
    loading it from its persistent cache or handing back one it holds in memory (which may have come from
    that cache)."""
    _listen()
    before = (getattr(_seen, "compiles", 0), getattr(_seen, "hits", 0))
    compiled = lowered.compile()
    return compiled, (getattr(_seen, "compiles", 0), getattr(_seen, "hits", 0)) == (before[0] + 1, before[1])


# jax reports, in the thread that compiles, a span for each program it compiles or loads from its
# persistent cache, and an event for each such load (nothing for one it holds in memory): counted per thread.
_seen = threading.local()
_listening = threading.Event()
_COMPILED = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT = "/jax/compilation_cache/cache_hits"


def _listen() -> None:
    if not _listening.is_set():
        _listening.set()
        jax.monitoring.register_event_listener(_count_hit)
        jax.monitoring.register_event_time_span_listener(_count_compile)


def _count_hit(event: str, **_) -> None:
    if event == _CACHE_HIT:
        _seen.hits = getattr(_seen, "hits", 0) + 1


def _count_compile(event: str, *_, **__) -> None:
    if event == _COMPILED:
        _seen.compiles = getattr(_seen, "compiles", 0) + 1


def describe(tree: Any) -> str:
    """The inputs' tree, shapes, dtypes, weak types and shardings (with their devices' ids), as text: what
    a compiled program requires of the arguments it is called with."""
    leaves, treedef = jax.tree.flatten(tree)
    parts = [str(treedef)]
    for x in leaves:
        sharding = getattr(x, "sharding", None)
        if sharding is None:
            where = "-"
        elif hasattr(sharding, "mesh") and hasattr(sharding.mesh, "devices"):
            where = f"{sharding!r}@{[d.id for d in sharding.mesh.devices.flat]}"
        else:
            where = f"{sharding!r}@{sorted(d.id for d in sharding.device_set)}"
        parts.append(f"{getattr(x, 'shape', ())}:{getattr(x, 'dtype', type(x).__name__)}:"
                     f"{getattr(x, 'weak_type', False)}:{where}")
    return "|".join(parts)


def environment() -> str:
    """Everything outside a program's own inputs that decides what it compiles to, as text."""
    config = sorted((k, repr(v)) for k, v in jax.config.values.items() if "cache" not in k)
    devices = [(d.id, d.platform, d.device_kind, d.process_index) for d in jax.devices()]
    backend = jax.devices()[0].client
    return repr((_source_digest(), _versions(), config, os.environ.get("XLA_FLAGS", ""),
                 backend.platform, backend.platform_version, devices, jax.process_index()))


@functools.cache
def _source_digest() -> str:
    """A hash of every source file of the `dsjax` package (what this process imported is what it ran)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    h = hashlib.sha256()
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                h.update(os.path.relpath(path, root).encode() + b"\0")
                with open(path, "rb") as f:
                    h.update(f.read())
    return h.hexdigest()


@functools.cache
def _versions() -> tuple:
    found = {}
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("-", "_")
        if name in _PACKAGES or name.startswith(("jax_cuda", "jax_rocm", "libtpu")):
            found[name] = dist.version
    return tuple(sorted(found.items()))


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def program_store() -> ProgramStore | None:
    """The store of whole compiled programs that goes with the compile cache in force: `programs` beside
    its `jax` folder, when `enable_compile_cache` set it (None when the cache is off, or is a folder jax
    was pointed at otherwise)."""
    folder = jax.config.jax_compilation_cache_dir
    if not folder or os.path.basename(os.path.normpath(folder)) != "jax":
        return None
    try:
        return ProgramStore(os.path.join(os.path.dirname(os.path.normpath(folder)), "programs"))
    except OSError:  # cannot be created: programs are then compiled (through jax's cache) every run
        return None
