"""A persistent compilation cache: each program is compiled once per machine, then loaded from disk.

Every `dsjax` command turns it on (unless given `--no-compile-cache`); a library user opts in with one
call, `dsjax.enable_compile_cache()`. The programs live in `<cache_dir()>/jax`: `$DSJAX_CACHE_DIR` if set,
else `$XDG_CACHE_HOME/dsjax`, else `~/.cache/dsjax`. Deleting the folder clears it.

What makes it safe to keep:

* A changed program never loads a stale one. jax keys each entry by a hash of the program itself (its
  StableHLO), the jaxlib version, the backend and its version, the XLA flags, the compile options and the
  kind of devices it runs on (`jax/_src/cache_key.py`), so a code change, another model config, another
  `--max-batch` or an upgrade only misses, and the new program is added beside the old ones.
* Several processes can share the folder at once (two jobs on one machine, the processes of a test run).
  The cache is bounded (`MAX_BYTES`, least recently used entries go first); with a bound, jax's LRUCache
  takes a `filelock` lock around every read and write, so no process reads an entry another is still
  writing. Without a bound it takes none.
* The engine's own programs are kept whole beside it, in `<cache_dir()>/programs` (`dsjax.engine.programs.program_store()`,
  `dsjax.engine.programs`), under a key of everything that decides them, so a warm run loads them without
  tracing or lowering them first (which jax's key needs).
* On GPUs, XLA keeps its per-fusion autotuning results in `<cache_dir()>/jax/xla_gpu_per_fusion_autotune_cache_dir`
  (jax's `jax_persistent_cache_enable_xla_caches` default, kept as it is): autotuning, too, runs once per
  machine rather than once per job.

Every program is cached, however quickly it compiled (jax's default skips those under a second): a job's
start-up is many small programs, and loading each costs less than compiling it.

jax trusts what it loads from the folder: anyone who can write to it can make dsjax run their code, so
point it only at a folder no one else may write to.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator

import filelock  # noqa: F401  (jax's LRUCache locks with it once a max size is set; fail here, not mid-job)
import jax
from jax.experimental.compilation_cache import compilation_cache as _jax_cache

MAX_BYTES = 16 * 2 ** 30  # 16 GiB: the bound that turns jax's locking on, and room for many jobs' programs

_OPTIONS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
            "jax_persistent_cache_min_entry_size_bytes", "jax_compilation_cache_max_size")
_JAX_DEFAULTS = (None, 1.0, 0, -1)  # jax 0.11's defaults for _OPTIONS: no persistent cache


def cache_dir() -> str:
    """dsjax's cache folder: `$DSJAX_CACHE_DIR`, else `$XDG_CACHE_HOME/dsjax`, else `~/.cache/dsjax`.

    An empty variable counts as unset; so does a relative XDG_CACHE_HOME (the XDG specification says to
    ignore one)."""
    own = os.environ.get("DSJAX_CACHE_DIR")
    if own:
        return os.path.abspath(os.path.expanduser(own))
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = xdg if xdg and os.path.isabs(xdg) else os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "dsjax")


def enable_compile_cache(path: str | None = None, *, max_bytes: int = MAX_BYTES) -> str:
    """Turn on jax's persistent compilation cache in `<path or cache_dir()>/jax` for this process and
    return that folder. Call it before the first compile that should be cached; calling it again with the
    same folder changes nothing, with another one moves the cache there.

    Raises OSError, naming the folder, if it cannot be created or written (a read-only home, a path
    through a regular file); the process is then left as it was."""
    folder = os.path.join(os.path.abspath(os.path.expanduser(path)) if path else cache_dir(), "jax")
    try:
        os.makedirs(folder, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".write-test-")  # a folder we may create files in
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise OSError(f"cannot use {folder} as the compile cache: {e.strerror or e}") from e
    _apply((folder, 0, -1, max_bytes))
    return folder


def disable_compile_cache() -> None:
    """Back to jax's defaults: no persistent cache (programs already loaded stay in memory)."""
    _apply(_JAX_DEFAULTS)


@contextlib.contextmanager
def compile_cache(path: str | None = None, *, enabled: bool = True) -> Iterator[str | None]:
    """`enable_compile_cache(path)` (or, if not `enabled`, `disable_compile_cache()`) for the duration of a
    `with` block, yielding the folder (None), then the settings from before it: a command run inside a
    longer process (a test, a notebook calling `dsjax.cli.main`) leaves that process's jax as it found it."""
    before = _current()
    try:
        yield enable_compile_cache(path) if enabled else disable_compile_cache()
    finally:
        _apply(before)


def _current() -> tuple:
    return tuple(getattr(jax.config, name) for name in _OPTIONS)


def _apply(values: tuple) -> None:
    if values == _current():
        return
    # jax opens its cache once, at the first compile after a folder is set, with the max size of that
    # moment (which decides whether it locks): forget the open one, so the next compile opens the new.
    _jax_cache.reset_cache()
    for name, value in zip(_OPTIONS, values):
        jax.config.update(name, value)


# Float32 models on GPUs (the embedded demo): XLA's GEMM autotuning and its Triton GEMM fusions cost most
# of their compile time and buy nothing at these sizes. Measured on an H200 (docs/benchmarks.md): the
# demo's prefill chunk compiled in 10 s with both off, against 60-70 s.
FLOAT32_GPU_FLAGS = ("--xla_gpu_autotune_level=0", "--xla_gpu_enable_triton_gemm=false")


def use_float32_gpu_flags() -> bool:
    """Add `FLOAT32_GPU_FLAGS` to `XLA_FLAGS` (those the user has not set either way), if jax has not
    started a backend yet (XLA reads the flags then) and may start a GPU one. Returns whether they apply.

    Where no GPU can be used (`JAX_PLATFORMS` names no GPU platform, or no GPU plugin is installed) they
    are left out: they would change nothing there but the compile cache's keys (the XLA flags are part of
    them), so the programs of a command would never match those the same work compiled in a Python
    process without the flags (a notebook, a test)."""
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized() or not may_use_a_gpu(jax.config.jax_platforms, _plugin_names()):
        return False
    flags = os.environ.get("XLA_FLAGS", "")
    extra = [f for f in FLOAT32_GPU_FLAGS if f.split("=")[0] not in flags]
    if extra:
        os.environ["XLA_FLAGS"] = " ".join([flags, *extra]).strip()
    return True


_GPU_PLATFORMS = ("cuda", "gpu", "rocm")


def may_use_a_gpu(platforms: str | None, plugins: list[str]) -> bool:
    """Whether jax, once started, may run on a GPU: `platforms` (`JAX_PLATFORMS`, comma-separated) names
    one, or, where it is empty, one of the installed `plugins` (names of jax plugin modules) is a GPU's."""
    if platforms and platforms.strip():
        return any(p.strip().lower() in _GPU_PLATFORMS for p in platforms.split(","))
    return any(gpu in name.lower() for name in plugins for gpu in ("cuda", "rocm"))


def _plugin_names() -> list[str]:
    """The jax plugins installed, found as jax finds them: `jax_plugins` modules and entry points."""
    import importlib.metadata
    import pkgutil

    names = [f"{ep.name} {ep.value}" for ep in importlib.metadata.entry_points(group="jax_plugins")]
    try:
        import jax_plugins

        names += [m.name for m in pkgutil.iter_modules(jax_plugins.__path__)]
    except ImportError:
        pass
    return names
