"""Ahead-of-time tracing: the engine's steps with abstract arguments (nothing allocated), laid out on a
mesh as the engine lays them out, for `dsjax plan` to compile and measure and `dsjax export` to
serialize. A model of any size traces on a machine without its devices: the model is abstract, and an
`abstract_device` lowers for an accelerator this host does not have."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings

import jax
import jax.numpy as jnp
from flax import nnx

from dsjax.cache import init_cache
from dsjax.config import ModelConfig
from dsjax.config_v41 import V41Config
from dsjax.engine.sampling import SamplingArrays
from dsjax.engine.steps import cache_specs
from dsjax.model import abstract_state as abstract_state_v4
from dsjax.model import with_kernels
from dsjax.model_v41 import abstract_state as abstract_state_v41
from dsjax.parallel.mesh import AXES, make_mesh, parse_mesh
from dsjax.parallel.rules import mesh_axes
from dsjax.parallel.shard import abstract_on_mesh
from dsjax.quantize import V4_QUANT, V41_QUANT
from dsjax.run_config import WEIGHTS, RunConfig, check_choice


def stored_config(cfg: ModelConfig | V41Config, weights: str) -> ModelConfig | V41Config:
    """`cfg` with the weight storage `weights` (`run_config.WEIGHTS`) names: "keep" keeps a config's
    quantization, or gives a float one its family's release format (FP8 blocks of 128x128 for V4, 32x32
    for V4.1; FP4 routed experts); "bf16" drops it."""
    check_choice("weights", weights, WEIGHTS)
    if weights != "keep":
        return cfg.replace(quantization=None)
    return cfg.replace(quantization=cfg.quantization or (V41_QUANT if cfg.family == "v4.1" else V4_QUANT))


def abstract_state(cfg: ModelConfig | V41Config, dtype=jnp.bfloat16):
    """(graphdef, flat state of ShapeDtypeStructs) of a DeepSeek-V4 or V4.1 `cfg` model, nothing allocated."""
    return (abstract_state_v41 if cfg.family == "v4.1" else abstract_state_v4)(cfg, dtype)


def mesh_devices(n: int) -> list:
    """`n` devices to trace on: the default backend's if it has enough; on a GPU host with fewer, `n`
    compile-only GPUs like its own (`compile_only_gpus`), so that the program compiled is the GPUs' one;
    otherwise the host's CPU devices (as many as `jax_num_cpu_devices` or XLA_FLAGS made; see
    `dsjax.cli._ensure_cpu_devices`)."""
    devices = jax.devices()
    if len(devices) < n and devices[0].platform == "gpu":
        try:
            return compile_only_gpus(n)
        except Exception as e:  # the plugin may not offer topologies: the host's CPU still compiles the plan
            warnings.warn(f"could not describe {n} GPUs like this host's to compile for ({e}); compiling for "
                          "the host's CPU devices instead, whose temporaries are a loose upper bound", stacklevel=2)
    if len(devices) < n:
        devices = jax.devices("cpu")
    if len(devices) < n:
        raise ValueError(f"the mesh needs {n} devices; only {len(devices)} are available (set "
                         f"XLA_FLAGS=--xla_force_host_platform_device_count={n}, or plan from `dsjax plan`, "
                         "which does so)")
    return devices[:n]


def compile_only_gpus(n: int) -> list:
    """`n` compile-only devices (nothing runs on them) of one host, described like this host's first GPU:
    XLA compiles the SPMD program for them, with the GPU's own kernels and collectives. Raises where the
    GPU plugin cannot describe such a topology."""
    from jax.experimental import topologies

    return list(topologies.get_topology_desc(platform="cuda", topology=f"1x1x{n}").devices)[:n]


@dataclasses.dataclass(frozen=True)
class AbstractSteps:
    """The engine's decode and prefill-chunk steps with abstract arguments (`jax.ShapeDtypeStruct`s, nothing
    allocated): `decode_args` and `prefill_args` are what `steps.decode_program` and `steps.prefill_program`
    take, from the static graphdef on; with a mesh they carry the shardings the rules and the engine give
    them. Lower them (`.lower`, `jax.export.export`) inside `context()`."""

    cfg: ModelConfig | V41Config  # with the weight storage `run.weights` applied
    run: RunConfig
    mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None  # None: one device, no shardings (as an engine runs)
    abstract_device: jax.sharding.AbstractDevice | None  # lowered for; None: this host's devices
    slot_shards: int  # devices the cache's slot axis is split over (1 without a mesh)
    model: nnx.Module  # the abstract model
    decode_args: tuple  # (graphdef, params, cache, last_tokens [S], active [S], sampling [S])
    prefill_args: tuple  # (graphdef, params, cache, tokens [N, C], slots [N], start [N], n_valid [N], sampling [N])

    @property
    def graphdef(self):
        return self.decode_args[0]

    @property
    def params(self):
        return self.decode_args[1]

    @property
    def cache(self):
        return self.decode_args[2]

    @property
    def prefill_rows(self) -> int:
        return self.prefill_args[3].shape[0]

    def context(self):
        """`jax.set_mesh(mesh)` for a concrete mesh; `jax.sharding.use_abstract_mesh` for an abstract one, or
        (without a mesh) for a mesh of no axes on the abstract device; otherwise nothing."""
        if isinstance(self.mesh, jax.sharding.Mesh):
            return jax.set_mesh(self.mesh)
        if self.mesh is not None:
            return jax.sharding.use_abstract_mesh(self.mesh)
        if self.abstract_device is not None:
            return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (),
                                                                            abstract_device=self.abstract_device))
        return contextlib.nullcontext()

    def cache_shapes(self, n_slots: int, length: int):
        """The abstract cache (no shardings) of `n_slots` sequences of `length` tokens."""
        return jax.eval_shape(lambda: init_cache(self.model, n_slots, length, kv_dtype=self.run.kv_dtype))


def abstract_steps(cfg: ModelConfig | V41Config, run: RunConfig, *, prefill_rows: int | None = None, devices=None,
                   abstract_device: jax.sharding.AbstractDevice | None = None) -> AbstractSteps:
    """The engine's steps for `cfg` (its weights stored as `run.weights` says) with abstract arguments:
    `run.slots` sequences of `run.max_len` tokens, prefill chunks of `prefill_rows` (default: every slot)
    rows × `run.chunk_size` tokens, activations and the cache's float arrays in `run.dtype`, its K=V rows
    in `run.kv_dtype`. `run.mesh` ("ep=8") places every parameter as the rules table does and the cache as
    the engine does, on `devices` (default: `mesh_devices`); None gives the one-device steps, no mesh.
    `abstract_device` (the accelerator to lower for, which Pallas kernels need when this host has none)
    makes the mesh an AbstractMesh of that device, no devices needed, and `context()` sets it (a mesh of no
    axes without `run.mesh`). Sizes that do not fit the model or the mesh raise ValueError naming them."""
    slots = run.slots
    prefill_rows = slots if prefill_rows is None else prefill_rows
    if not isinstance(prefill_rows, int) or not 1 <= prefill_rows <= slots:
        raise ValueError(f"prefill_rows must be between 1 and slots ({slots}), got {prefill_rows}")
    mesh = None
    shards = 1
    if run.mesh is not None:
        sizes = parse_mesh(run.mesh)
        if sizes["ep"] > 1 and cfg.n_routed_experts % sizes["ep"]:
            raise ValueError(f"mesh {run.mesh!r}: ep={sizes['ep']} does not divide the model's "
                             f"{cfg.n_routed_experts} routed experts")
        if abstract_device is None:
            mesh = make_mesh(sizes, mesh_devices(math.prod(sizes.values())) if devices is None else devices)
        else:
            mesh = jax.sharding.AbstractMesh(tuple(sizes[a] for a in AXES), AXES,
                                             axis_types=(jax.sharding.AxisType.Auto,) * len(AXES),
                                             abstract_device=abstract_device)
        shards = math.prod(mesh.shape[a] for a in mesh_axes(mesh, "slots"))
        if slots % shards:
            raise ValueError(f"slots ({slots}) must be a multiple of the {shards} devices the cache's slots "
                             f"are split over (the mesh's {'·'.join(mesh_axes(mesh, 'slots'))} axes), or the "
                             "cache would be replicated")
    cfg = stored_config(cfg, run.weights)

    graphdef, flat = abstract_state(cfg, run.jnp_dtype)
    model = with_kernels(nnx.merge(graphdef, nnx.from_flat_state(flat)), run.kernels)
    graphdef, params = nnx.split(model)
    if mesh is None:
        def small(shape, dt):
            return jax.ShapeDtypeStruct(shape, dt)
    else:
        params = abstract_on_mesh(params, mesh)
        rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

        def small(shape, dt):
            return jax.ShapeDtypeStruct(shape, dt, sharding=rep)

    def sampling(n):
        return SamplingArrays(temperature=small((n,), jnp.float32), top_k=small((n,), jnp.int32),
                              top_p=small((n,), jnp.float32), seed=small((n,), jnp.uint32))

    out = AbstractSteps(cfg=cfg, run=run, mesh=mesh, abstract_device=abstract_device, slot_shards=shards,
                        model=model, decode_args=(), prefill_args=())
    cache = out.cache_shapes(slots, run.max_len)
    if mesh is not None:
        with out.context():
            specs = cache_specs(cache)  # the engine's own layout of its cache
        cache = jax.tree.map(lambda x, p: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                               sharding=jax.sharding.NamedSharding(mesh, p)),
                             cache, specs)
    n, c = prefill_rows, run.chunk_size
    decode_args = (graphdef, params, cache, small((slots,), jnp.int32), small((slots,), jnp.bool_),
                   sampling(slots))
    prefill_args = (graphdef, params, cache, small((n, c), jnp.int32), small((n,), jnp.int32),
                    small((n,), jnp.int32), small((n,), jnp.int32), sampling(n))
    return dataclasses.replace(out, decode_args=decode_args, prefill_args=prefill_args)
