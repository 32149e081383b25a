"""`dsjax plan`: how much of each device a sharded model takes, from the compiled steps, with nothing
allocated.

The model is built abstractly (`dsjax.engine.aot.abstract_steps`), every parameter given the sharding
the rules table (`dsjax.parallel.rules.param_sharding`) gives it on the mesh, and the cache the layout
the engine gives it (`init_cache` shapes, `engine.steps.cache_specs`). The engine's own decode step and
prefill-chunk step are lowered and compiled ahead of time on those abstract arrays under
`jax.set_mesh(mesh)`, and XLA's memory analysis of each compiled SPMD program (one device's program)
gives the figures:

- weights: the bytes of each parameter's shard, summed (exact; the argument size XLA reports is the
  weights, the cache and the step's small inputs, checked to add up);
- cache: likewise for the cache arrays;
- temporaries: XLA's temp allocation, the larger of decode's and prefill's;
- other: step inputs and outputs that are neither weights nor the (donated, aliased) cache, and the
  inputs of a longest prompt's later chunks: the engine dispatches every chunk of a prefill at once, so
  those (tokens, starts, lengths, ends; each allocation rounded up to 256 bytes, the GPU allocator's unit)
  wait on the device while the first chunks run (`queued_prefill_inputs`).

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
import math
import re
import time

import jax

from dsjax.config import SLIDING, ModelConfig
from dsjax.config_v41 import V41Config
from dsjax.engine import steps
from dsjax.engine.aot import abstract_steps
from dsjax.parallel.mesh import parse_mesh
from dsjax.run_config import RunConfig

ONE_M = 1 << 20  # a 1M-token sequence: 1,048,576 tokens

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
    weights_format: str  # run_config.WEIGHTS: "keep" or "bf16"
    kv_dtype: str  # RunConfig.kv_dtype, or its dtype where that is None
    device_mem: int
    weights: int
    cache: int
    decode: StepMemory
    prefill: StepMemory
    cache_model: CacheModel
    small_inputs: dict  # step → bytes of its arguments that are neither weights nor cache
    queued_inputs: int  # the later chunks' inputs of a max_len prompt (`queued_prefill_inputs`)

    @property
    def temp(self) -> int:
        return max(self.decode.temp, self.prefill.temp)

    @property
    def other(self) -> int:
        """Step inputs and outputs besides weights and cache (tokens, sampling rows, sampled tokens), and
        the inputs of a longest prompt's chunks queued behind the running one."""
        return self.queued_inputs + max(self.small_inputs[name] + s.output - s.alias
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
            f"  other         {fmt_bytes(self.other):>13}   (step inputs and outputs; "
            f"{fmt_bytes(self.queued_inputs)} of them a longest prompt's queued chunks)",
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
        if self.device_kind == "cpu":
            lines.append("compiled for this host's CPU: attention, the indexer and the experts run their pure-JAX "
                         "references, so the temporaries are XLA:CPU's, a loose upper bound of an accelerator's "
                         "(docs/parallelism.md); weights and cache are exact")
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


def plan(cfg: ModelConfig | V41Config, run: RunConfig, *, device_mem: int | str = "141GB", prefill_rows: int | None = None,
         model_name: str | None = None, devices=None) -> Plan:
    """Compile the engine's decode and prefill-chunk steps for `cfg` run as `run` says (its weights stored as
    `run.weights` names, on the mesh `run.mesh`; None: one device) from abstract arrays and return the
    per-device memory within `device_mem`. `prefill_rows` (default: every slot, the scheduler's largest
    prefill) rows of `run.chunk_size` tokens go through a prefill chunk. `devices` (default: the backend's,
    or the host's CPU devices: `aot.mesh_devices`) hold the mesh."""
    budget = parse_bytes(device_mem) if isinstance(device_mem, str) else int(device_mem)
    if run.mesh is None:  # one device, still a mesh: every figure below reads the arrays' shardings
        run = run.replace(mesh="dp=1")
    sizes = parse_mesh(run.mesh)
    a = abstract_steps(cfg, run, prefill_rows=prefill_rows, devices=devices)
    mem = {}
    platform = a.mesh.devices.flat[0].platform  # plan always runs on a mesh (dp=1 above where none is given)
    # XLA:GPU's autotuner runs candidate kernels on real buffers: a plan past the device's memory (the
    # slot search probes those) would fail allocating them, and the analysis does not need the timings.
    options = {"xla_gpu_autotune_level": 0} if platform in ("gpu", "cuda", "rocm") else None
    with a.context():
        for name, fn, args in (("decode", steps.decode_program, a.decode_args),
                               ("prefill", steps.prefill_program, a.prefill_args)):
            t0 = time.perf_counter()
            compiled = fn.lower(*args).compile(compiler_options=options)
            mem[name] = StepMemory.of(compiled, time.perf_counter() - t0)
            del compiled

    weights_bytes = sharded_bytes(jax.tree.leaves(a.params))
    cache_bytes = sharded_bytes(jax.tree.leaves(a.cache))
    # The steps' own inputs, from their shapes: XLA's argument bytes leave out weights a step never reads
    # (V4.1's DSpark and image encoder in decode and prefill), which the device holds all the same.
    small_inputs = {name: sharded_bytes(jax.tree.leaves(args[3:]))
                    for name, args in (("decode", a.decode_args), ("prefill", a.prefill_args))}
    cmodel = cache_model(lambda length: a.cache_shapes(1, length), a.cfg, a.slot_shards)
    if cmodel.bytes(run.slots, run.max_len) != cache_bytes:
        raise AssertionError(f"cache model gives {cmodel.bytes(run.slots, run.max_len)} bytes per device, the "
                             f"sharded cache {cache_bytes}")
    return Plan(model=model_name or "model", mesh=sizes, devices=a.mesh.devices.size,
                device_kind=_kind(a.mesh.devices.flat[0]), slots=run.slots, max_len=run.max_len,
                chunk_size=run.chunk_size, prefill_rows=a.prefill_rows, weights_format=run.weights,
                kv_dtype=run.kv_dtype or run.dtype, device_mem=budget, weights=weights_bytes, cache=cache_bytes,
                decode=mem["decode"], prefill=mem["prefill"], cache_model=cmodel, small_inputs=small_inputs,
                queued_inputs=queued_prefill_inputs(a.prefill_rows, run.chunk_size, run.max_len))


ALLOCATION_UNIT = 256  # bytes: XLA's GPU allocator rounds every buffer up to this


def queued_prefill_inputs(rows: int, chunk: int, max_len: int) -> int:
    """Bytes of the inputs (tokens `[rows, chunk]` int32; starts and valid lengths `[rows]` int32; ends
    `[rows]` bool) of all but the first chunk of a `max_len` prompt, which `Engine.prefill` puts on the
    device ahead of the steps that read them."""
    unit = lambda n: -(-n // ALLOCATION_UNIT) * ALLOCATION_UNIT  # noqa: E731
    per_chunk = unit(4 * rows * chunk) + 2 * unit(4 * rows) + unit(rows)
    return (-(-max_len // chunk) - 1) * per_chunk


def sharded_bytes(leaves) -> int:
    """Bytes one device holds of abstract arrays with shardings (the largest shard, which is every
    shard: the rules split only evenly)."""
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in leaves)


def compress_rates(cfg: ModelConfig | V41Config) -> set[int]:
    """The compress rates of the layers that store compressed entries: V4's compressed layer types, V4.1's
    KV-source (Full) layers."""
    if cfg.family == "v4.1":
        return {role.ratio for role in cfg.layer_roles() if role.mode == "full"}
    return {cfg.compress_rate(t) for t in set(cfg.layer_types) if t != SLIDING}


def cache_model(one_slot, cfg: ModelConfig | V41Config, slot_shards: int) -> CacheModel:
    """The cache's bytes per slot as `fixed + Σ_m per_entry[m] · ⌊L / m⌋`, from `one_slot(L)` (the abstract
    cache of one slot of L tokens): at L = 0 only the fixed part is there; at L = m each rate below m
    has added ⌊m / m'⌋ entries and rate m its first."""
    def slot_bytes(length):
        cache = one_slot(length)
        return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves((cache.groups, cache.history)))

    rates = sorted(compress_rates(cfg))
    fixed = slot_bytes(0)
    per_entry: list[tuple[int, int]] = []
    for m in rates:
        grown = slot_bytes(m) - fixed - sum(b * (m // r) for r, b in per_entry)
        per_entry.append((m, grown))
    return CacheModel(slot_shards=slot_shards, fixed=fixed, per_entry=tuple(per_entry))



def _kind(device) -> str:
    """What the table calls a device: "cpu", or an accelerator's kind ("NVIDIA H200")."""
    return device.platform if device.platform == "cpu" else device.device_kind
