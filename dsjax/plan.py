"""`dsjax plan`: how much of each device a sharded model takes, from the compiled steps, with nothing
allocated.

The model is built abstractly (`abstract_model`), every parameter given the sharding the rules table
(`dsjax.parallel.rules.param_sharding`) gives it on the mesh, and the cache the layout the engine gives
it (`init_cache` shapes, `steps._cache_specs`). The engine's own decode step and prefill-chunk
step are lowered and compiled ahead of time on those abstract arrays under `jax.set_mesh(mesh)`, and
XLA's memory analysis of each compiled SPMD program (one device's program) gives the figures:

- weights: the bytes of each parameter's shard, summed (exact; the argument size XLA reports is the
  weights, the cache and the step's small inputs, checked to add up);
- cache: likewise for the cache arrays;
- temporaries: XLA's temp allocation, the larger of decode's and prefill's;
- other: step inputs and outputs that are neither weights nor the (donated, aliased) cache.

Fitting more sequences: per device, cache bytes are `slots_local · per_slot(max_len) + 4 · slots`
(the lengths, replicated), and `per_slot(L) = fixed + Σ_m row_bytes_m · ⌊L / m⌋` over the compress
rates m (the sliding-window rings, the partial-window buffers and the overlaps are the fixed part; the
compressed entries and the indexer's keys grow with ⌊L / m⌋). Both terms are read off the cache's
shapes, and checked against the cache at the planned size. What is left of the budget after weights,
temporaries and other bytes *at the planned slots and max_len* is filled with slots (`Plan.max_slots`,
`Plan.max_len_at_slots`). The temporaries grow with slots and max_len too (the prefill takes every slot
at once, and attention covers every cached entry), so those figures are estimates; `largest_fit`
compiles at other slot counts until the largest that fits by XLA's own figures is found.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import time

ONE_M = 1 << 20  # a 1M-token sequence: 1,048,576 tokens
WEIGHTS = ("fp8", "bf16")

_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9, "t": 1e12, "tb": 1e12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """`"141GB"` (10^9), `"80GiB"` (2^30), `"141e9"` or `"1.5TB"` → bytes; anything else raises ValueError."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = m and m.group(2).lower()
    if not m or unit not in _UNITS:
        raise ValueError(f"device memory {text!r}: expected a number of bytes with an optional unit "
                         f"(B, KB, MB, GB, TB: powers of 1000; KiB, MiB, GiB, TiB: powers of 1024), e.g. "
                         f"'141GB', '80GiB' or '141e9'")
    value = float(m.group(1)) * _UNITS[unit]
    if not math.isfinite(value) or value < 1:
        raise ValueError(f"device memory {text!r} must be at least one byte")
    return int(value)


def fmt_bytes(n: float) -> str:
    """Bytes as GB (10^9) with two decimals, or MB / KB for small amounts."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n:,.0f} B"


@dataclasses.dataclass(frozen=True)
class StepMemory:
    """XLA's memory analysis of one compiled step, per device (bytes), and how long it took to compile."""

    argument: int
    output: int
    alias: int
    temp: int
    generated_code: int
    compile_seconds: float

    @classmethod
    def of(cls, compiled, seconds: float) -> "StepMemory":
        ma = compiled.memory_analysis()
        if ma is None:
            raise RuntimeError("this backend gives no memory analysis of compiled programs")
        return cls(argument=int(ma.argument_size_in_bytes), output=int(ma.output_size_in_bytes),
                   alias=int(ma.alias_size_in_bytes), temp=int(ma.temp_size_in_bytes),
                   generated_code=int(ma.generated_code_size_in_bytes), compile_seconds=seconds)


@dataclasses.dataclass(frozen=True)
class CacheModel:
    """Per-device cache bytes as a function of (slots, max_len), read off the cache's shapes:
    `slots / slot_shards · (fixed + Σ_m per_entry[m] · ⌊max_len / m⌋) + 4 · slots`."""

    slot_shards: int  # devices the slot axis is split over (dp·ep); the cache is replicated over the rest
    fixed: int  # bytes per slot that do not depend on max_len
    per_entry: tuple[tuple[int, int], ...]  # (compress rate m, bytes per slot per ⌊max_len / m⌋)
    lengths_itemsize: int = 4

    def per_slot(self, max_len: int) -> int:
        return self.fixed + sum(b * (max_len // m) for m, b in self.per_entry)

    def bytes(self, slots: int, max_len: int) -> int:
        """Cache bytes on one device for `slots` sequences (a multiple of slot_shards) of `max_len`."""
        return slots // self.slot_shards * self.per_slot(max_len) + self.lengths_itemsize * slots

    def max_slots(self, free: int, max_len: int) -> int:
        """The most slots (a multiple of slot_shards) whose cache takes at most `free` bytes per device."""
        per_shard_step = self.per_slot(max_len) + self.lengths_itemsize * self.slot_shards
        return max(0, free // per_shard_step) * self.slot_shards

    def max_len(self, free: int, slots: int) -> int:
        """The longest max_len at which `slots` sequences' cache takes at most `free` bytes per device
        (0 if not even the fixed part fits)."""
        if self.bytes(slots, 0) > free:
            return 0
        lo, hi = 0, 1
        while self.bytes(slots, hi) <= free:
            lo, hi = hi, hi * 2
            if not self.per_entry:
                return -1  # unbounded: nothing grows with max_len
        while hi - lo > 1:  # bytes(slots, ·) is nondecreasing: lo fits, hi does not
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.bytes(slots, mid) <= free else (lo, mid)
        return lo


@dataclasses.dataclass(frozen=True)
class Plan:
    """Per-device memory of a model on a mesh; every figure in bytes, per device."""

    model: str
    mesh: dict
    devices: int
    device_kind: str
    slots: int
    max_len: int
    chunk_size: int
    prefill_rows: int
    weights_format: str
    kv_dtype: str
    device_mem: int
    weights: int
    cache: int
    decode: StepMemory
    prefill: StepMemory
    cache_model: CacheModel
    small_inputs: dict  # step → bytes of its arguments that are neither weights nor cache

    @property
    def temp(self) -> int:
        return max(self.decode.temp, self.prefill.temp)

    @property
    def other(self) -> int:
        """Step inputs and outputs besides weights and cache (tokens, sampling rows, sampled tokens)."""
        return max(self.small_inputs[name] + s.output - s.alias
                   for name, s in (("decode", self.decode), ("prefill", self.prefill)))

    @property
    def total(self) -> int:
        return self.weights + self.cache + self.temp + self.other

    @property
    def fits(self) -> bool:
        return self.total <= self.device_mem

    @property
    def free_for_cache(self) -> int:
        """Budget left for the cache once weights, temporaries and other bytes (as planned) are in."""
        return self.device_mem - self.weights - self.temp - self.other

    def max_slots(self, max_len: int | None = None) -> int:
        """Most slots (over the mesh) of `max_len` (default: the planned) tokens that fit the budget."""
        return self.cache_model.max_slots(self.free_for_cache, self.max_len if max_len is None else max_len)

    def max_len_at_slots(self) -> int:
        """Longest max_len at the planned slot count that fits the budget."""
        return self.cache_model.max_len(self.free_for_cache, self.slots)

    def sequences_1m(self) -> tuple[float, int]:
        """1,048,576-token sequences: (per device, over the mesh). A device holds slots/slot_shards of them."""
        total = self.max_slots(ONE_M)
        return total / self.cache_model.slot_shards, total

    def table(self, fit: "Fit | None" = None) -> str:
        """A short readable report (with the compiled search for the largest fit, if given)."""
        mesh = ",".join(f"{a}={n}" for a, n in self.mesh.items() if n > 1) or "one device"
        lines = [
            f"{self.model}: weights {self.weights_format}, kv {self.kv_dtype}, mesh {mesh} "
            f"({self.devices} × {self.device_kind}), {self.slots} slots × {self.max_len:,} tokens, "
            f"prefill {self.prefill_rows} rows × {self.chunk_size}-token chunks",
            "per device:",
            f"  weights       {fmt_bytes(self.weights):>13}",
            f"  cache         {fmt_bytes(self.cache):>13}   ({fmt_bytes(self.cache_model.per_slot(self.max_len))}"
            f" per slot, {self.slots // self.cache_model.slot_shards} slots per device)",
            f"  temporaries   {fmt_bytes(self.temp):>13}   (decode {fmt_bytes(self.decode.temp)}, "
            f"prefill {fmt_bytes(self.prefill.temp)})",
            f"  other         {fmt_bytes(self.other):>13}   (step inputs and outputs)",
            f"  total         {fmt_bytes(self.total):>13}   of {fmt_bytes(self.device_mem)}: "
            + ("fits" if self.fits else "DOES NOT FIT") + f" ({100 * self.total / self.device_mem:.1f}%)",
        ]
        k = self.cache_model.slot_shards
        most = self.max_slots()
        lines.append(f"largest fit at {self.max_len:,} tokens: {most} slots ({most // k} per device) "
                     "by the cache formula, temporaries as planned")
        if fit is not None:
            over = (f"{fit.over.slots} do not ({fmt_bytes(fit.over.total)})" if fit.over is not None
                    else "the search stopped at its limit")
            if fit.fitting is None:
                got = f"not even {k} slots fit ({fmt_bytes(fit.over.total)})"
            else:
                got = f"{fit.max_slots} slots fit ({fmt_bytes(fit.fitting.total)}); {over}"
            lines.append(f"  compiled: {got}  [{len(fit.probes)} plans compiled]")
        longest = self.max_len_at_slots()
        lines.append(f"longest max_len at {self.slots} slots: "
                     + ("unbounded" if longest < 0 else f"{longest:,} tokens")
                     + " by the cache formula, temporaries as planned")
        if fit is not None and self.max_len == ONE_M:
            per_dev, over_mesh, how = fit.max_slots / k, fit.max_slots, "compiled"
        else:
            (per_dev, over_mesh), how = self.sequences_1m(), "cache formula, temporaries as planned"
        lines += [
            f"1,048,576-token sequences: {per_dev:g} per device, {over_mesh} over the mesh ({how})",
            f"compile: decode {self.decode.compile_seconds:.1f} s, prefill {self.prefill.compile_seconds:.1f} s",
        ]
        return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class Fit:
    """The most slots of `max_len` tokens that fit the budget, found by compiling: `fitting` (at
    `max_slots`) fits by XLA's figures and `over` (one slot shard more) does not. Either may be None:
    `fitting` when not even one slot per slot shard fits, `over` when the search reached its limit."""

    max_slots: int
    fitting: Plan | None
    over: Plan | None
    probes: tuple[tuple[int, int, bool], ...]  # (slots, total bytes per device, fits), in the order compiled


def largest_fit(base: Plan, replan, limit: int = 1 << 16, log=None) -> Fit:
    """Search the slot count (multiples of the slot shards, at most `limit`) for the largest that fits,
    `replan(slots)` compiling the plan at that count.

    While only counts that fit are known, the next guess is the newest plan's cache formula (its
    temporaries held) but at most 4 times its count, since the temporaries grow with the slots (the
    prefill takes them all at once). While only counts that do not fit are known, it is the newest
    plan's cache formula. Once both are known, it is where the straight line through their totals meets
    the budget, or half the gap when one side has moved twice running, and never past what the fitting
    plan's own temporaries leave room for. Stops when the two are one slot shard apart. Assumes that
    more slots never take fewer bytes."""
    k = base.cache_model.slot_shards
    known = {base.slots: base}
    order = [base.slots]

    def probe(slots):
        if slots not in known:
            if log:
                log(f"compiling at {slots} slots")
            known[slots] = replan(slots)
            order.append(slots)
        return known[slots]

    lo, hi = (base, None) if base.fits else (None, base)  # the most slots known to fit, the fewest not
    guess = min(base.max_slots(), 4 * base.slots) if base.fits else base.max_slots()
    last_side, streak, cap = None, 0, max(limit // k, 1) * k
    while True:
        lo_s = lo.slots if lo is not None else 0
        if (hi is not None and hi.slots - lo_s <= k) or (hi is None and lo_s >= cap):
            break
        if lo is not None:  # lo's own temporaries already leave no room past this
            guess = min(guess, lo.max_slots())
        guess = min(max(guess, lo_s + k), hi.slots - k if hi is not None else cap)
        p = probe(guess)
        side = "lo" if p.fits else "hi"
        streak = streak + 1 if side == last_side else 1
        last_side = side
        if p.fits:
            lo = p
        else:
            hi = p
        if hi is None:  # only fitting counts so far: the cache formula, but at most 4 times as many
            guess = min(p.max_slots(), 4 * p.slots)
        elif lo is None:  # only counts that do not fit: the cache formula from the newest
            guess = p.max_slots()
        elif streak >= 2:  # one end keeps moving: halve the gap (geometrically while it is wide)
            mid = math.isqrt(lo.slots * hi.slots) if hi.slots > 4 * lo.slots else (lo.slots + hi.slots) // 2
            guess = mid // k * k
        else:  # where the line through the two totals meets the budget
            slope = (hi.total - lo.total) / (hi.slots - lo.slots)
            guess = lo.slots + int((base.device_mem - lo.total) / slope) // k * k
    return Fit(max_slots=lo.slots if lo is not None else 0, fitting=lo, over=hi,
               probes=tuple((s, known[s].total, known[s].fits) for s in order))


def model_config(weights: str, cfg):
    """`cfg` with the weight storage `weights` names: "fp8" keeps a config's quantization, or gives a
    float one DeepSeek's release format (FP8 blocks, FP4 routed experts); "bf16" drops it."""
    from dsjax.quantize import V4_QUANT

    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {WEIGHTS}, got {weights!r}")
    return cfg.replace(quantization=(cfg.quantization or V4_QUANT) if weights == "fp8" else None)


def mesh_devices(n: int):
    """`n` devices to plan on: the default backend's if it has enough, otherwise the host's CPU devices
    (as many as `jax_num_cpu_devices` or XLA_FLAGS made; see `dsjax.cli._plan`)."""
    import jax

    devices = jax.devices()
    if len(devices) < n:
        devices = jax.devices("cpu")
    if len(devices) < n:
        raise ValueError(f"the mesh needs {n} devices; only {len(devices)} are available (set "
                         f"XLA_FLAGS=--xla_force_host_platform_device_count={n}, or plan from `dsjax plan`, "
                         "which does so)")
    return devices[:n]


@dataclasses.dataclass(frozen=True)
class AbstractSteps:
    """The engine's decode and prefill-chunk steps with abstract arguments (`jax.ShapeDtypeStruct`s, nothing
    allocated): `decode_args` and `prefill_args` are what `steps.decode_program` and `steps.prefill_program` take,
    from the static graphdef on; with a mesh they carry the shardings the rules and the engine give them.
    Lower them (`.lower`, `jax.export.export`) inside `context()`. Shared by `dsjax plan` and `dsjax export`."""

    cfg: object  # the ModelConfig, with the weight storage applied
    mesh: object  # a jax Mesh or AbstractMesh, or None: one device, no shardings (as an engine runs)
    abstract_device: object  # the jax.sharding.AbstractDevice lowered for, or None: this host's devices
    slot_shards: int  # devices the cache's slot axis is split over (1 without a mesh)
    model: object  # the abstract model
    engine: object  # an Engine over it (its dtypes and sizes)
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

    def context(self):
        """`jax.set_mesh(mesh)` for a concrete mesh; `jax.sharding.use_abstract_mesh` for an abstract one, or
        (without a mesh) for a mesh of no axes on the abstract device; otherwise nothing."""
        import contextlib

        import jax

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
        import jax

        from dsjax.cache import init_cache

        e = self.engine
        return jax.eval_shape(functools.partial(init_cache, self.model, n_slots, length, e.cache_dtype,
                                                e.kv_dtype))


def abstract_steps(cfg, mesh_spec, max_len: int, slots: int, weights: str = "fp8", kv_dtype: str | None = "bfloat16",
                   chunk_size: int = 256, prefill_rows: int | None = None, dtype=None,
                   devices=None, abstract_device=None) -> AbstractSteps:
    """The engine's steps for `cfg` (its weights stored as `weights` says) with abstract arguments: `slots`
    sequences of `max_len` tokens, prefill chunks of `prefill_rows` (default: every slot) rows × `chunk_size`
    tokens, activations in `dtype` (default bfloat16), the cache's K=V rows in `kv_dtype` (None: `dtype`).
    `mesh_spec` ("ep=8", or {axis: size}) places every parameter as the rules table does and the cache as
    the engine does, on `devices` (default: `mesh_devices`); None gives the one-device steps, no mesh.
    `abstract_device` (a `jax.sharding.AbstractDevice`: the accelerator to lower for, which Pallas kernels
    need when this host has none) makes the mesh an AbstractMesh of that device, no devices needed, and
    `context()` sets it (a mesh of no axes without `mesh_spec`). Bad sizes raise ValueError naming them."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from dsjax.checkpoint.load import abstract_model
    from dsjax.engine import steps
    from dsjax.engine.sampling import SamplingArrays
    from dsjax.parallel.mesh import AXES, make_mesh, parse_mesh
    from dsjax.parallel.rules import mesh_axes
    from dsjax.parallel.shard import abstract_on_mesh
    from dsjax.quant import KV_DTYPES

    dtype = dtype or jnp.bfloat16
    if kv_dtype not in (None, *KV_DTYPES):
        raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, got {kv_dtype!r}")
    for name, v in (("max_len", max_len), ("slots", slots), ("chunk_size", chunk_size)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    prefill_rows = slots if prefill_rows is None else prefill_rows
    if not isinstance(prefill_rows, int) or not 1 <= prefill_rows <= slots:
        raise ValueError(f"prefill_rows must be between 1 and slots ({slots}), got {prefill_rows}")
    mesh = None
    shards = 1
    if mesh_spec is not None:
        sizes = parse_mesh(mesh_spec) if isinstance(mesh_spec, str) else {**dict.fromkeys(AXES, 1), **mesh_spec}
        if sizes["ep"] > 1 and cfg.n_routed_experts % sizes["ep"]:
            raise ValueError(f"mesh {mesh_spec!r}: ep={sizes['ep']} does not divide the model's "
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
    cfg = model_config(weights, cfg)

    graphdef, flat, _ = abstract_model(cfg, dtype)
    model = nnx.merge(graphdef, nnx.from_flat_state(flat))
    engine = steps.Engine(model, slots, max_len, chunk_size, kv_dtype=kv_dtype)
    if mesh is None:
        params = engine.params

        def small(shape, dt):
            return jax.ShapeDtypeStruct(shape, dt)
    else:
        params = abstract_on_mesh(engine.params, mesh)
        rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

        def small(shape, dt):
            return jax.ShapeDtypeStruct(shape, dt, sharding=rep)

    def sampling(n):
        return SamplingArrays(temperature=small((n,), jnp.float32), top_k=small((n,), jnp.int32),
                              top_p=small((n,), jnp.float32), seed=small((n,), jnp.uint32))

    out = AbstractSteps(cfg=cfg, mesh=mesh, abstract_device=abstract_device, slot_shards=shards, model=model,
                        engine=engine, decode_args=(), prefill_args=())
    cache = out.cache_shapes(slots, max_len)
    if mesh is not None:
        with out.context():
            specs = steps._cache_specs(cache)  # the engine's own layout of its cache
        cache = jax.tree.map(lambda x, p: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                               sharding=jax.sharding.NamedSharding(mesh, p)),
                             cache, specs)
    n, c = prefill_rows, chunk_size
    decode_args = (graphdef, params, cache, small((slots,), jnp.int32), small((slots,), jnp.bool_),
                   sampling(slots))
    prefill_args = (graphdef, params, cache, small((n, c), jnp.int32), small((n,), jnp.int32),
                    small((n,), jnp.int32), small((n,), jnp.int32), sampling(n))
    return dataclasses.replace(out, decode_args=decode_args, prefill_args=prefill_args)


def plan(cfg, mesh_spec: str, max_len: int, slots: int, weights: str = "fp8", kv_dtype: str = "bfloat16",
         chunk_size: int = 256, device_mem: int | str = "141GB", prefill_rows: int | None = None,
         dtype=None, model_name: str | None = None, devices=None) -> Plan:
    """Compile the engine's decode and prefill-chunk steps for `cfg` on the mesh `mesh_spec` from abstract
    arrays and return the per-device memory. `prefill_rows` (default: every slot, the scheduler's
    largest prefill) rows of `chunk_size` tokens go through a prefill chunk."""
    import jax

    from dsjax.engine import steps
    from dsjax.parallel.mesh import parse_mesh
    from dsjax.quant import KV_DTYPES

    budget = parse_bytes(device_mem) if isinstance(device_mem, str) else int(device_mem)
    sizes = parse_mesh(mesh_spec) if isinstance(mesh_spec, str) else dict(mesh_spec)
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, got {kv_dtype!r}")
    a = abstract_steps(cfg, sizes, max_len, slots, weights=weights, kv_dtype=kv_dtype, chunk_size=chunk_size,
                       prefill_rows=prefill_rows, dtype=dtype, devices=devices)
    mem = {}
    with a.context():
        for name, fn, args in (("decode", steps.decode_program, a.decode_args),
                               ("prefill", steps.prefill_program, a.prefill_args)):
            t0 = time.perf_counter()
            compiled = fn.lower(*args).compile()
            mem[name] = StepMemory.of(compiled, time.perf_counter() - t0)
            del compiled

    weights_bytes = sharded_bytes(jax.tree.leaves(a.params))
    cache_bytes = sharded_bytes(jax.tree.leaves(a.cache))
    small_inputs = {name: mem[name].argument - weights_bytes - cache_bytes for name in mem}
    cmodel = cache_model(lambda length: a.cache_shapes(1, length), a.cfg, a.slot_shards)
    if cmodel.bytes(slots, max_len) != cache_bytes:
        raise AssertionError(f"cache model gives {cmodel.bytes(slots, max_len)} bytes per device, the sharded "
                             f"cache {cache_bytes}")
    return Plan(model=model_name or "model", mesh=sizes, devices=a.mesh.devices.size,
                device_kind=a.mesh.devices.flat[0].platform, slots=slots, max_len=max_len, chunk_size=chunk_size,
                prefill_rows=a.prefill_args[3].shape[0], weights_format=weights, kv_dtype=kv_dtype,
                device_mem=budget, weights=weights_bytes, cache=cache_bytes, decode=mem["decode"],
                prefill=mem["prefill"], cache_model=cmodel, small_inputs=small_inputs)


def sharded_bytes(leaves) -> int:
    """Bytes one device holds of abstract arrays with shardings (the largest shard, which is every
    shard: the rules split only evenly)."""
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in leaves)


def cache_model(one_slot, cfg, slot_shards: int) -> CacheModel:
    """The cache's bytes per slot as `fixed + Σ_m per_entry[m] · ⌊L / m⌋`, from `one_slot(L)` (the abstract
    cache of one slot of L tokens): at L = 0 only the fixed part is there; at L = m each rate below m
    has added ⌊m / m'⌋ entries and rate m its first."""
    import jax

    from dsjax.config import SLIDING

    def slot_bytes(length):
        return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(one_slot(length).groups))

    rates = sorted({cfg.compress_rate(t) for t in set(cfg.layer_types) if t != SLIDING})
    fixed = slot_bytes(0)
    per_entry: list[tuple[int, int]] = []
    for m in rates:
        grown = slot_bytes(m) - fixed - sum(b * (m // r) for r, b in per_entry)
        per_entry.append((m, grown))
    return CacheModel(slot_shards=slot_shards, fixed=fixed, per_entry=tuple(per_entry))

