"""`dsjax export`: the engine's prefill-chunk and decode steps as serialized StableHLO for one platform,
and the loader that calls them again.

`export_steps` builds the model abstractly (no weights are read or allocated, so a 500B preset exports on
a CPU machine) through the same machinery as `dsjax plan` (`dsjax.engine.aot.abstract_steps`), traces the
engine's own steps with their sampler (`dsjax.engine.steps.prefill_step` and `decode_step`) for
`RunConfig.slots` sequences of `max_len` tokens and prefill chunks of `prefill_rows` × `chunk_size` tokens,
lowers them for one platform with `jax.export.export` and writes into DIR:

- `prefill.stablehlo`, `decode.stablehlo`: `Exported.serialize()` of each step;
- `manifest.json`: the preset or model, its config (`ModelConfig.to_hf()`, with the weight storage
  chosen), the platform, dtypes, sizes, versions, the parameter and cache leaves (key path, shape,
  dtype, in the order `jax.tree.leaves` gives them) and each step's calling convention (`inputs` and
  `outputs`: one entry per array, in the order of the StableHLO function's arguments and results).

The weights are arguments of both functions, never constants. Every input and output is a list, a dict
or an array, so the artifacts need no pytree registrations to deserialize:

    decode(params, cache, last_tokens[S] i32, active[S] bool, sampling)
        → (cache, sampled)
    prefill(params, cache, tokens[N, C] i32, slots[N] i32, start[N] i32, n_valid[N] i32, sampling)
        → (cache, sampled)

where `params` is `jax.tree.leaves(params)` of the model's `nnx.split(model)[1]`, `cache` is
`jax.tree.leaves(cache)` of a `dsjax.cache.Cache` (from `init_cache` or `Engine.new_cache`), `sampling`
is `{"temperature": f32[n], "top_k": i32[n], "top_p": f32[n], "seed": u32[n]}` (one row per slot for
decode, per prefill row for prefill: `SamplingArrays`' fields) and `sampled` is
`{"token", "logprob", "top_ids", "top_logprobs"}` (`Sampled`'s fields). The returned cache leaves replace
the given ones (the manifest's `aliases`: donate them). The steps mean what the engine's do: decode feeds
each active slot its last token and samples the next; prefill writes `n_valid` tokens of each row
starting at `start` into slot `slots[i]` (distinct slots; rows with n_valid 0 ride along unchanged).

Loading (here, with a real model and cache):

    import dsjax, jax.numpy as jnp
    from flax import nnx
    from dsjax.engine.sampling import SamplingArrays, SamplingParams
    from dsjax.export import load_steps

    steps = load_steps("DIR")                       # deserializes both, checks the files' hashes
    # the exported model, weights stored as exported: --weights keep keeps a release checkpoint's FP8/FP4
    # (load_model's default weights="keep"), --weights bf16 wants float weights (weights="bf16"), in --dtype
    model = dsjax.load_model("path/to/checkpoint", dtype=jnp.bfloat16)
    graphdef, params = nnx.split(model)
    cache = steps.new_cache()                       # or dsjax.Engine(model, RunConfig(...)).new_cache()
    sampling = SamplingArrays.of([SamplingParams(temperature=0.0)] * n, seeds)   # n = rows of the step
    cache, sampled = steps.prefill(params, cache, tokens, slots, start, n_valid, sampling)
    cache, sampled = steps.decode(params, cache, last_tokens, active, sampling)

`steps.prefill` / `steps.decode` take pytrees (any whose leaves have the manifest's key paths: an nnx
State, a `Cache`, a `SamplingArrays` or a dict of its fields), check every leaf's path, shape and dtype
against the manifest (a mismatch raises ValueError naming the leaf), call the deserialized function
with the cache donated, and return a `Cache` and a `Sampled`, as the engine's steps do. The raw
`jax.export.Exported` objects are `steps.exported["decode"]` and `["prefill"]`:
`exported.call(steps.flat_params(params), steps.flat_cache(cache), *inputs, sampling_dict)`; flattened,
the dicts' entries come in sorted key order (the manifest's `inputs` and `outputs` list every array).

Where the artifacts run: on the exported platform only, with the jax/jaxlib the manifest names (Pallas
Triton calls carry Triton IR, which has no stability promise across versions); GPU kernels are lowered
for `device_kind` (an abstract device: this host needs none). A `--mesh` export is the SPMD program for
that mesh's device count: place every input as the manifest's `sharding` entries say
(`exported.in_shardings_jax(mesh)` gives them for a concrete mesh of the same axes) before calling it;
`new_cache` makes a one-device cache.

One platform per artifact: the model picks Pallas kernels with `jax.lax.platform_dependent`, and a
program holding Pallas calls cannot be lowered for several platforms at once. The custom calls each
platform's programs may hold beyond jax's list of stable ones are in `ALLOWED_CUSTOM_CALLS`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import time
import uuid
from pathlib import Path

from dsjax.kernels.devices import core_count
from dsjax.run_config import RENAMED_WEIGHTS, RunConfig

FORMAT = "dsjax-export/1"
PLATFORMS = ("cpu", "cuda", "rocm", "tpu")
STEP_FILES = {"prefill": "prefill.stablehlo", "decode": "decode.stablehlo"}
MANIFEST = "manifest.json"
ARGS = {"decode": ("params", "cache", "last_tokens", "active", "sampling"),
        "prefill": ("params", "cache", "tokens", "slots", "start", "n_valid", "sampling")}

# Custom calls a platform's programs may hold beyond jax's stable list (which has `tpu_custom_call`, the
# Pallas Mosaic TPU kernels, and `mosaic_gpu_v2` already): Pallas's Triton kernels on GPUs (Triton IR
# carries no stability promise: the artifact needs the jaxlib that wrote it, which the manifest names),
# and XLA's ragged all-to-all (expert-parallel dispatch on GPUs and TPUs), which lowers as a custom call.
ALLOWED_CUSTOM_CALLS = {
    "cpu": (),
    "cuda": ("__gpu$xla.gpu.triton", "ragged_all_to_all"),
    "rocm": ("__gpu$xla.gpu.triton", "ragged_all_to_all"),
    "tpu": ("ragged_all_to_all",),
}


# The accelerator each platform's programs are lowered for by default (`device_kind`, as jax's devices
# name it): Pallas kernels are generated for one GPU or TPU generation (Triton's lowering reads the GPU's
# compute capability, Mosaic the TPU's version and cores), and this host need not have one. The kinds
# jax's Pallas lowerings recognise; `num_cores` (streaming multiprocessors, TensorCores per chip) from
# `kernels.devices` for the kinds it lists.
DEVICE_KINDS = {"cpu": "cpu", "cuda": "NVIDIA H200", "rocm": "gfx942", "tpu": "TPU v6 lite"}


def abstract_device(platform: str, device_kind: str | None = None):
    """The `jax.sharding.AbstractDevice` that `platform`'s programs are lowered for: `device_kind` (default
    `DEVICE_KINDS[platform]`) with its core count (`kernels.devices.core_count`: None if unlisted)."""
    import jax

    kind = device_kind or DEVICE_KINDS[_platform(platform)]
    return jax.sharding.AbstractDevice(device_kind=kind, num_cores=core_count(kind),
                                       platform={"cuda": "gpu", "rocm": "gpu"}.get(platform, platform))


def disabled_checks(platform: str) -> list:
    """The `jax.export.DisabledSafetyCheck`s that let `platform`'s programs hold its custom calls."""
    import jax

    return [jax.export.DisabledSafetyCheck.custom_call(t) for t in ALLOWED_CUSTOM_CALLS[_platform(platform)]]


def _platform(platform: str) -> str:
    if platform not in PLATFORMS:
        hint = " (NVIDIA GPUs: cuda; AMD GPUs: rocm)" if str(platform).lower() in ("gpu", "nvidia", "amd") else ""
        raise ValueError(f"platform {platform!r} is not one of {', '.join(PLATFORMS)}{hint}")
    return platform


def check_out_dir(out: str | os.PathLike, force: bool = False) -> Path:
    """`out` as a Path, if an export may be written there: it does not exist, or is an empty folder, or
    (with `force`) is an earlier export (it holds a manifest.json). Anything else raises ValueError."""
    out = Path(out)
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise ValueError(f"output {str(out)!r} exists and is not a folder (or is a symbolic link)")
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise ValueError(f"output folder {str(out)!r} exists and is not empty; pass --force (force=True) to "
                             "replace an earlier export, or choose another folder")
        if not (out / MANIFEST).is_file():
            raise ValueError(f"output folder {str(out)!r} is not empty and holds no earlier export (no "
                             f"{MANIFEST}); --force replaces only an earlier export: choose another folder")
    return out


def export_steps(cfg, platform: str, out: str | os.PathLike, run: RunConfig, *, prefill_rows: int | None = None,
                 device_kind: str | None = None, model_name: str | None = None, force: bool = False) -> dict:
    """Export the engine's prefill-chunk and decode steps of a `cfg` model run as `run` says for `platform`
    into the folder `out` (see the module docstring) and return the manifest.

    `run.weights` "keep" stores the weights as DeepSeek's release does (FP8 blocks, FP4 routed experts, or
    the config's own quantization), "bf16" as floats in `run.dtype` (also the activations' and the cache's
    float dtype); `run.kv_dtype` (None: `run.dtype`) stores the cache's K=V rows. `prefill_rows` (default:
    `run.slots`) is the prefill chunk's row count. `run.mesh` (e.g. "ep=8") exports the SPMD program for
    that mesh, every input laid out as `dsjax plan` lays it out (on an abstract mesh: no devices needed);
    None exports the one-device program. `device_kind` names the GPU or TPU the Pallas kernels are lowered
    for (default `DEVICE_KINDS[platform]`). `out` must not exist, be an empty folder, or with `force` an
    earlier export; it appears complete or not at all (written into a temporary folder beside it, then
    renamed). Bad input raises ValueError before anything is traced."""
    import jax
    import jax.numpy as jnp

    from dsjax.engine import steps
    from dsjax.engine.aot import abstract_steps

    platform = _platform(platform)
    out = check_out_dir(out, force)
    t0 = time.perf_counter()
    # One CPU device needs no abstract device: the program is then lowered exactly as an engine's is.
    device = None if platform == "cpu" and run.mesh is None else abstract_device(platform, device_kind)
    a = abstract_steps(cfg, run, prefill_rows=prefill_rows, abstract_device=device)
    params_leaves, params_def = jax.tree.flatten(a.params)
    cache_leaves, cache_def = jax.tree.flatten(a.cache)
    blobs, described = {}, {}
    with a.context():
        for name, step, args in (("prefill", steps.prefill_step, a.prefill_args),
                                 ("decode", steps.decode_step, a.decode_args)):
            flat_args = (params_leaves, cache_leaves, *args[3:-1], _fields(args[-1]))
            fn = _flat_step(step, a.graphdef, params_def, cache_def)
            exported = jax.export.export(fn, platforms=[platform], disabled_checks=disabled_checks(platform))(
                *flat_args)
            blobs[name] = bytes(exported.serialize())
            described[name] = _describe(name, exported, flat_args, blobs[name])

    manifest = {
        "format": FORMAT,
        "model": model_name,
        "platform": platform,
        "weights": run.weights,
        "dtype": run.dtype,
        "kv_dtype": run.kv_dtype,
        "cache_dtype": str(jnp.dtype(a.model.dtype)),  # the engine's: the model's float dtype
        "slots": run.slots,
        "max_len": run.max_len,
        "chunk_size": run.chunk_size,
        "prefill_rows": a.prefill_rows,
        "mesh": None if a.mesh is None else {k: int(v) for k, v in a.mesh.shape.items()},
        "devices": 1 if a.mesh is None else int(a.mesh.size),
        "device_kind": None if device is None else device.device_kind,
        "config": a.cfg.to_hf(),
        "jax_version": jax.__version__,
        "jaxlib_version": _jaxlib_version(),
        "dsjax_version": _dsjax_version(),
        "allowed_custom_calls": list(ALLOWED_CUSTOM_CALLS[platform]),
        "params": _leaves(a.params),
        "cache": _leaves(a.cache),
        "steps": described,
        "export_seconds": round(time.perf_counter() - t0, 3),
    }
    manifest["kernels"] = a.run.kernels
    _write(out, {**{STEP_FILES[n]: blobs[n] for n in blobs},
                 MANIFEST: (json.dumps(manifest, indent=1) + "\n").encode()}, force)
    return manifest


def _flat_step(step, graphdef, params_def, cache_def):
    """`step` (`steps.decode_step` or `steps.prefill_step`) over leaves: (params leaves, cache leaves, *inputs,
    sampling dict) → (cache leaves, sampled dict). Lists and dicts only: jax.export serializes their tree
    structure without registrations (an nnx State's or a Cache's would need them)."""
    import jax

    from dsjax.engine.sampling import SamplingArrays

    def flat(params, cache, *rest):
        *inputs, sampling = rest
        new_cache, sampled = step(graphdef, jax.tree.unflatten(params_def, params),
                                  jax.tree.unflatten(cache_def, cache), *inputs, SamplingArrays(**sampling))
        leaves, new_def = jax.tree.flatten(new_cache)
        if new_def != cache_def:
            raise AssertionError(f"the step returned a cache of another structure: {new_def} != {cache_def}")
        return leaves, _fields(sampled)

    flat.__name__ = flat.__qualname__ = {"decode_step": "decode", "prefill_step": "prefill_chunk"}[step.__name__]
    return jax.jit(flat)


def _fields(dc) -> dict:
    """A dataclass's array fields as a dict (not `dataclasses.asdict`, which copies its values). Static
    fields are left out: an exported step takes `SamplingArrays`' default modes, which serve any rows."""
    return {f.name: getattr(dc, f.name) for f in dataclasses.fields(dc) if not f.metadata.get("static")}


def _spec(x, sharding: bool = True) -> dict:
    """Shape and dtype, and the partition spec of an input laid out on a mesh."""
    import jax

    out = {"shape": [int(d) for d in x.shape], "dtype": str(x.dtype)}
    s = getattr(x, "sharding", None) if sharding else None
    if isinstance(s, jax.sharding.NamedSharding) and s.mesh.axis_names:
        out["sharding"] = str(s.spec)
    return out


def _leaves(tree) -> list[dict]:
    import jax

    return [{"path": jax.tree_util.keystr(path), **_spec(x)}
            for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _named(names, tree, sharding: bool = True) -> list[dict]:
    """One entry per leaf of the tuple `tree` of arguments (or results) named `names`, in flat order."""
    import jax

    return [{"name": names[path[0].idx] + jax.tree_util.keystr(path[1:]), **_spec(x, sharding)}
            for path, x in jax.tree_util.tree_flatten_with_path(tuple(tree))[0]]


def _describe(name: str, exported, flat_args, blob: bytes) -> dict:
    import jax

    n_params, n_cache = len(flat_args[0]), len(flat_args[1])
    if jax.tree.structure(tuple(flat_args)) != exported.in_tree.children()[0]:
        raise AssertionError(f"{name}: the exported inputs are not the arguments given")
    outs = jax.tree.unflatten(exported.out_tree, exported.out_avals)
    desc = {
        "file": STEP_FILES[name],
        "bytes": len(blob),
        "sha256": hashlib.sha256(blob).hexdigest(),
        "function": f"dsjax.engine.steps.{'decode_step' if name == 'decode' else 'prefill_step'}",
        "args": list(ARGS[name]),
        "results": ["cache", "sampled"],
        "in_tree": str(exported.in_tree),
        "out_tree": str(exported.out_tree),
        "inputs": _named(ARGS[name], flat_args),
        "outputs": _named(("cache", "sampled"), outs, sharding=False),
        # input i is donated into output j: the new cache is written over the old
        "aliases": [[n_params + i, i] for i in range(n_cache)],
        "nr_devices": exported.nr_devices,
        "platforms": list(exported.platforms),
        "calling_convention_version": exported.calling_convention_version,
    }
    kept = tuple(exported.module_kept_var_idx)
    if kept != tuple(range(len(exported.in_avals))):  # arguments the StableHLO function does not take
        desc["module_kept_var_idx"] = list(kept)
    return desc


def _jaxlib_version() -> str:
    import jaxlib

    return jaxlib.__version__


def _dsjax_version() -> str | None:
    from importlib import metadata

    try:
        return metadata.version("dsjax")
    except metadata.PackageNotFoundError:
        return None


def _write(out: Path, files: dict[str, bytes], force: bool) -> None:
    """Write `files` into a new folder beside `out` and rename it to `out` (replacing an empty folder or,
    with `force`, an earlier export), so that `out` is never seen half-written."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp = out.parent / f".{out.name}.partial-{tag}"
    old = out.parent / f".{out.name}.replaced-{tag}"
    os.mkdir(tmp)
    try:
        for name, data in files.items():
            with open(tmp / name, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        check_out_dir(out, force)  # again: something may have appeared there while exporting
        if out.is_dir():
            if any(out.iterdir()):
                os.rename(out, old)
            else:
                out.rmdir()
        try:
            os.rename(tmp, out)
        except BaseException:
            if old.exists():
                os.rename(old, out)
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)


@dataclasses.dataclass
class LoadedSteps:
    """Deserialized steps of an export folder (`load_steps`): `manifest`, `exported` ({"decode",
    "prefill"} → `jax.export.Exported`), and `decode` / `prefill` that call them on pytrees."""

    manifest: dict
    exported: dict
    _calls: dict = dataclasses.field(default_factory=dict, repr=False)

    @property
    def platform(self) -> str:
        return self.manifest["platform"]

    def config(self):
        """The exported model's ModelConfig (with its weight storage)."""
        from dsjax.config import ModelConfig

        return ModelConfig.from_hf(self.manifest["config"])

    def abstract_model(self):
        """The exported model with ShapeDtypeStructs for weights (nothing allocated)."""
        import jax.numpy as jnp
        from flax import nnx

        from dsjax.checkpoint.targets import abstract_model
        from dsjax.model import with_kernels

        graphdef, flat, _ = abstract_model(self.config(), jnp.dtype(self.manifest["dtype"]))
        return with_kernels(nnx.merge(graphdef, nnx.from_flat_state(flat)), self.manifest.get("kernels", "auto"))

    def new_cache(self):
        """An empty cache of the exported slots, max_len and dtypes, on the default device (one-device
        exports; for a mesh export, lay it out as the manifest's cache shardings say)."""
        import jax.numpy as jnp

        from dsjax.cache import init_cache

        m = self.manifest
        return init_cache(self.abstract_model(), m["slots"], m["max_len"], jnp.dtype(m["cache_dtype"]),
                          m["kv_dtype"])

    def flat_params(self, params) -> list:
        """The leaves of `params` (e.g. `nnx.split(model)[1]`), checked against the manifest."""
        return _check_leaves("params", params, self.manifest["params"])

    def flat_cache(self, cache) -> list:
        """The leaves of `cache` (a `dsjax.cache.Cache`), checked against the manifest."""
        return _check_leaves("cache", cache, self.manifest["cache"])

    def decode(self, params, cache, last_tokens, active, sampling):
        """The exported decode step: (new Cache, Sampled); `cache`'s buffers are donated."""
        return self._run("decode", params, cache, (last_tokens, active), sampling)

    def prefill(self, params, cache, tokens, slots, start, n_valid, sampling):
        """The exported prefill-chunk step: (new Cache, Sampled); `cache`'s buffers are donated."""
        return self._run("prefill", params, cache, (tokens, slots, start, n_valid), sampling)

    def _run(self, name, params, cache, inputs, sampling):
        import jax
        import jax.numpy as jnp

        from dsjax.engine.sampling import Sampled

        if name not in self._calls:
            self._calls[name] = jax.jit(self.exported[name].call, donate_argnums=1)
        spec = self.manifest["steps"][name]["inputs"]
        n_params, n_cache = len(self.manifest["params"]), len(self.manifest["cache"])
        given = dict(zip(ARGS[name][2:-1], inputs))
        small = []
        for entry in spec[n_params + n_cache:n_params + n_cache + len(given)]:
            x = jnp.asarray(given[entry["name"]])
            if list(x.shape) != entry["shape"] or str(x.dtype) != entry["dtype"]:
                raise ValueError(f"{name}: {entry['name']} must be {entry['dtype']}{entry['shape']}, got "
                                 f"{x.dtype}{list(x.shape)}")
            small.append(x)
        fields = sampling if isinstance(sampling, dict) else _fields(sampling)
        _, cache_def = jax.tree.flatten(cache)
        new_cache, sampled = self._calls[name](self.flat_params(params), self.flat_cache(cache), *small,
                                               {k: jnp.asarray(v) for k, v in fields.items()})
        return jax.tree.unflatten(cache_def, new_cache), Sampled(**sampled)


def _check_leaves(what: str, tree, expected: list[dict]) -> list:
    import jax

    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    if len(flat) != len(expected):
        raise ValueError(f"{what}: {len(flat)} arrays given, the export takes {len(expected)} (is it a "
                         "model of the exported config, weight storage and dtype?)")
    out = []
    for (path, x), want in zip(flat, expected):
        key = jax.tree_util.keystr(path)
        if key != want["path"]:
            raise ValueError(f"{what}: array {len(out)} is {key}, the export takes {want['path']} there")
        if list(x.shape) != want["shape"] or str(x.dtype) != want["dtype"]:
            raise ValueError(f"{what}{key}: the export takes {want['dtype']}{want['shape']}, got "
                             f"{x.dtype}{list(x.shape)}")
        out.append(x)
    return out


def load_steps(folder: str | os.PathLike, verify: bool = True) -> LoadedSteps:
    """Read an export folder: its manifest (an older one's `weights` "fp8" read as "keep") and both steps
    deserialized (`jax.export.deserialize`); with `verify`, each file's sha256 is checked against the
    manifest's. Raises ValueError on a folder that is not an export, one of another format version, or a
    file that does not match its manifest."""
    import jax

    folder = Path(folder)
    path = folder / MANIFEST
    if not path.is_file():
        raise ValueError(f"{str(folder)!r} holds no {MANIFEST}: not a `dsjax export` folder")
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{path}: format {manifest.get('format')!r}, this dsjax reads {FORMAT!r}")
    # An export written before "keep" named the same storage "fp8".
    if manifest.get("weights") in RENAMED_WEIGHTS:
        manifest["weights"] = RENAMED_WEIGHTS[manifest["weights"]]
    exported = {}
    for name, desc in manifest["steps"].items():
        blob = (folder / desc["file"]).read_bytes()
        if verify and hashlib.sha256(blob).hexdigest() != desc["sha256"]:
            raise ValueError(f"{folder / desc['file']}: its sha256 does not match the manifest's")
        exported[name] = jax.export.deserialize(bytearray(blob))
    return LoadedSteps(manifest=manifest, exported=exported)
