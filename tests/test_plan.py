"""`dsjax plan`: per-device figures from the compiled steps add up, the fit search finds the edge, the
command prints its table, and bad input is refused before anything is compiled."""

import dataclasses
import math
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from dsjax.cache import init_cache
from dsjax.cli import main
from dsjax.config import ModelConfig
from dsjax.engine.sampling import MAX_LOGPROBS
from dsjax.model import DeepseekV4
from dsjax.plan import ONE_M, CacheModel, fmt_bytes, largest_fit, parse_bytes, plan, queued_prefill_inputs
from dsjax.quantize import V4_QUANT
from dsjax.run_config import RunConfig

# One compiled plan for the whole file; the CLI test asks for the same one (jax's in-process cache).
RUN = RunConfig(mesh="ep=8", max_len=64, slots=16, weights="keep", kv_dtype="fp4", chunk_size=8)
CLI = ["plan", "--preset", "tiny", "--mesh", "ep=8", "--max-len", "64", "--slots", "16", "--weights", "keep",
       "--kv-dtype", "fp4", "--chunk-size", "8"]
EXPERT_LEAVES = ("gate_up_proj", "down_proj", "gate_up_proj_scale_inv", "down_proj_scale_inv")


@pytest.fixture(scope="module")
def tiny():
    return ModelConfig.preset("tiny")


@pytest.fixture(scope="module")
def planned(tiny):
    return plan(tiny, RUN, device_mem="2MB", model_name="tiny")


def _nbytes(x) -> int:
    return math.prod(x.shape) * jnp.dtype(x.dtype).itemsize


def test_weights_are_the_expert_shards_plus_everything_else_whole(tiny, planned):
    # Counted from the model's shapes alone: with ep=8 (tp=1) only the routed experts are split, 8 ways.
    model = nnx.eval_shape(lambda: DeepseekV4(tiny.replace(quantization=V4_QUANT), rngs=nnx.Rngs(0),
                                              dtype=jnp.bfloat16))
    experts = rest = 0
    for path, var in nnx.to_flat_state(nnx.state(model)):
        n = _nbytes(var.get_value())
        if path[-2:-1] == ("experts",) and path[-1] in EXPERT_LEAVES:
            experts += n
        else:
            rest += n
    assert experts > 0 and rest > 0
    assert experts % 8 == 0
    assert planned.weights == rest + experts // 8
    assert any(str(dt) == "float8_e4m3fn" for dt in {v.get_value().dtype
                                                   for _, v in nnx.to_flat_state(nnx.state(model))})


def test_cache_is_what_the_engine_puts_on_each_device(tiny, planned):
    # An engine's real cache on the same mesh, measured shard by shard.
    from dsjax.engine.engine import Engine
    from dsjax.parallel.mesh import make_mesh

    # the engine reads only the model's structure to make its cache: an abstract model will do
    model = nnx.eval_shape(lambda: DeepseekV4(tiny, rngs=nnx.Rngs(0), dtype=jnp.bfloat16))
    engine = Engine(model, RUN)
    with jax.set_mesh(make_mesh(RUN.mesh)):
        cache = engine.new_cache()
    leaves = jax.tree.leaves(cache)
    on_device_0 = sum(s.data.nbytes for x in leaves for s in x.addressable_shards if s.device == jax.devices()[0])
    assert planned.cache == on_device_0
    # and from the shapes: lengths replicated, every group array's slot axis split 8 ways
    shapes = jax.eval_shape(lambda: init_cache(model, 16, 64, None, "fp4"))
    whole = sum(_nbytes(x) for x in jax.tree.leaves(shapes.groups))
    assert planned.cache == 16 * 4 + whole // 8


def test_xla_arguments_are_weights_cache_and_the_step_inputs(planned):
    s, n, c, k = RUN.slots, RUN.slots, RUN.chunk_size, MAX_LOGPROBS
    sampling = 4 + 4 + 4 + 4  # temperature, top_k, top_p, seed per row
    assert planned.decode.argument == planned.weights + planned.cache + s * (4 + 1 + sampling)
    assert planned.prefill.argument == planned.weights + planned.cache + n * (c * 4 + 3 * 4 + sampling)
    # the cache is donated: the new cache is written over the old, everything else is small
    for step in (planned.decode, planned.prefill):
        assert step.alias == planned.cache
        assert step.output - step.alias < 1000 * n + 8 * n * k
        assert step.temp > 0
    assert planned.temp == max(planned.decode.temp, planned.prefill.temp)
    assert planned.total == planned.weights + planned.cache + planned.temp + planned.other
    assert planned.fits == (planned.total <= 2_000_000)


def test_other_holds_a_longest_prompts_queued_chunk_inputs(planned):
    """`Engine.prefill` puts every chunk's inputs on the device before the first chunk has run: the later
    chunks' wait there, each buffer in 256-byte units."""
    n, c = planned.prefill_rows, RUN.chunk_size
    per_chunk = 256 * -(-4 * n * c // 256) + 2 * 256 * -(-4 * n // 256) + 256 * -(-n // 256)
    assert planned.queued_inputs == (-(-RUN.max_len // c) - 1) * per_chunk > 0
    steps = max(planned.small_inputs[name] + s.output - s.alias
                for name, s in (("decode", planned.decode), ("prefill", planned.prefill)))
    assert planned.other == planned.queued_inputs + steps
    # the 1M-token prompt of docs/benchmarks.md's run, one row in 8,192-token chunks: 127 chunks queued
    assert queued_prefill_inputs(1, 8192, 1_048_002) == 127 * (32_768 + 256 + 256 + 256)
    assert queued_prefill_inputs(4, 64, 64) == 0


def test_a_run_without_a_mesh_is_planned_on_one_device(tiny):
    """`run.mesh` None: one device holds everything (weights whole, the cache's slots unsplit)."""
    one = plan(tiny, RUN.replace(mesh=None, slots=2), device_mem="1GB")
    assert one.devices == 1 and one.mesh == {"dp": 1, "ep": 1, "tp": 1} and one.cache_model.slot_shards == 1
    assert one.weights_format == "keep" and one.kv_dtype == "fp4"
    assert one.cache == one.cache_model.bytes(2, RUN.max_len)
    assert "mesh one device (1 × cpu), 2 slots × 64 tokens" in one.table()


def test_cache_formula_matches_the_cache_at_every_length(tiny, planned):
    cm = planned.cache_model
    assert cm.slot_shards == 8
    assert [m for m, _ in cm.per_entry] == [tiny.compress_rate_csa, tiny.compress_rate_hca]
    model = nnx.eval_shape(lambda: DeepseekV4(tiny, rngs=nnx.Rngs(0), dtype=jnp.bfloat16))
    for slots, length in ((8, 1), (8, 63), (16, 64), (24, 65), (8, 100), (16, 1000)):
        shapes = jax.eval_shape(lambda s=slots, n=length: init_cache(model, s, n, None, "fp4"))
        want = slots * 4 + sum(_nbytes(x) for x in jax.tree.leaves(shapes.groups)) // 8
        assert cm.bytes(slots, length) == want, (slots, length)


def test_the_reported_maximum_fits_and_one_slot_shard_more_does_not(planned):
    cm, k, free = planned.cache_model, planned.cache_model.slot_shards, planned.free_for_cache
    most = planned.max_slots()
    assert most % k == 0
    assert cm.bytes(most, planned.max_len) <= free < cm.bytes(most + k, planned.max_len)
    longest = planned.max_len_at_slots()
    assert cm.bytes(planned.slots, longest) <= free < cm.bytes(planned.slots, longest + 1)
    # monotone: longer sequences or less memory never fit more
    fits = [cm.max_slots(free, n) for n in (16, 64, 256, 1024, 4096)]
    assert fits == sorted(fits, reverse=True)
    assert [cm.max_slots(f, 64) for f in (0, 10_000, 100_000, 1_000_000)] == sorted(
        cm.max_slots(f, 64) for f in (0, 10_000, 100_000, 1_000_000))
    per_device, over_mesh = planned.sequences_1m()
    assert over_mesh == cm.max_slots(free, ONE_M) and per_device == over_mesh / k


def test_cache_model_arithmetic():
    cm = CacheModel(slot_shards=4, fixed=1000, per_entry=((4, 10), (128, 3)))
    assert cm.per_slot(0) == 1000 and cm.per_slot(7) == 1010 and cm.per_slot(256) == 1000 + 640 + 6
    assert cm.bytes(8, 256) == 2 * 1646 + 32
    assert cm.max_slots(2 * 1646 + 32, 256) == 8 and cm.max_slots(2 * 1646 + 31, 256) == 4
    assert cm.max_slots(100, 256) == 0
    assert cm.max_len(cm.bytes(8, 1000), 8) == 1003  # ⌊1003/4⌋ = 250 = ⌊1000/4⌋, ⌊1004/4⌋ adds an entry
    assert cm.max_len(10, 8) == 0
    assert CacheModel(slot_shards=1, fixed=5, per_entry=()).max_len(100, 1) == -1  # nothing grows


def _synthetic(base, temp_of):
    """Plans whose temporaries are `temp_of(slots)`: the search logic without compiling."""
    calls = []

    def replan(slots):
        calls.append(slots)
        return dataclasses.replace(base, slots=slots, cache=base.cache_model.bytes(slots, base.max_len),
                                   decode=dataclasses.replace(base.decode, temp=0),
                                   prefill=dataclasses.replace(base.prefill, temp=temp_of(slots)))
    return replan, calls


@pytest.mark.parametrize("temp_of", [lambda s: 50_000, lambda s: 20_000 + 3_000 * s,
                                     lambda s: 10_000 + 40 * s * s, lambda s: 900_000 + 10 * s ** 3,
                                     lambda s: 1_000 * s + s // 64 * 20_000])
@pytest.mark.parametrize("start", [8, 64, 4096])
def test_search_finds_the_edge_by_compiled_figures(planned, temp_of, start):
    budget = planned.weights + 300_000
    base0 = dataclasses.replace(planned, device_mem=budget)
    replan, calls = _synthetic(base0, temp_of)
    base = replan(start)
    fit = largest_fit(base, replan)
    k = base.cache_model.slot_shards
    brute = max([s for s in range(k, 20_000, k) if replan(s).fits], default=0)
    assert fit.max_slots == brute
    if brute:
        assert fit.fitting.fits and fit.fitting.slots == brute
    assert not fit.over.fits and fit.over.slots == brute + k
    assert len(fit.probes) <= 10
    report = base.table(fit)
    assert (f"compiled: {brute} slots fit" if brute else f"compiled: not even {k} slots fit") in report
    assert f"{brute + k} do not" in report or not brute


def test_cli_prints_the_table(planned, capsys):
    assert main(CLI + ["--device-mem", "2MB", "--no-search"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("tiny: weights keep, kv fp4, mesh ep=8 (8 × cpu), 16 slots × 64 tokens")
    for label in ("weights", "cache", "temporaries", "other", "total"):
        assert label in out
    assert f"{planned.weights / 1e3:,.2f} KB" in out
    assert ("fits" if planned.fits else "DOES NOT FIT") in out
    assert f"largest fit at 64 tokens: {planned.max_slots()} slots" in out
    assert "1,048,576-token sequences: 0 per device, 0 over the mesh" in out
    assert out.rstrip().endswith("a loose upper bound of an accelerator's (docs/parallelism.md); weights and cache "
                                 "are exact")


def test_cli_plans_a_preset_cut_to_its_first_layers(planned, capsys):
    """`--layers N` plans the slice `dsjax bench --layers N` runs: fewer weights than the whole preset."""
    assert main(CLI + ["--layers", "1", "--device-mem", "2MB", "--no-search"]) == 0
    out = capsys.readouterr().out
    weights = re.search(r"^  weights +([\d,.]+) KB", out, re.M)
    assert weights and 0 < float(weights.group(1).replace(",", "")) * 1e3 < planned.weights


@pytest.mark.parametrize("argv,message", [
    (["--layers", "0,1"], "--layers takes a count for a V4 preset"),
    (["--layers", "99"], "--layers must be between 1 and"),
    (["--device-mem", "141XB"], "device memory '141XB'"),
    (["--preset", "nope"], "unknown preset 'nope'"),
    (["--mesh", "dp=9"], "needs 9 devices"),
    (["--mesh", "ep=3"], "ep=3 does not divide the model's 8 routed experts"),
    (["--slots", "12"], r"slots \(12\) must be a multiple of the 8 devices"),
    (["--mesh", "ep=two"], "AXIS=SIZE"),
    (["--max-len", "0"], "max.len must be an integer of at least 2"),
])
def test_bad_input_is_refused_with_its_reason(argv, message, capsys):
    # Backends up, as they are in the whole suite: otherwise `dsjax plan` would still give the CPU as
    # many devices as the mesh asks, and "dp=9" would get past the device count (this test alone did).
    jax.devices()
    args = list(CLI)
    for i in range(0, len(argv), 2):
        if argv[i] in args:
            args[args.index(argv[i]) + 1] = argv[i + 1]
        else:
            args += argv[i:i + 2]
    assert main(args + ["--no-search"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dsjax plan: error: ")
    assert re.search(message, err), err


@pytest.mark.parametrize("text,value", [("141GB", 141 * 10**9), ("80GiB", 80 * 2**30), ("141e9", 141 * 10**9),
                                        ("1.5 TB", 15 * 10**11), ("512MiB", 2**29), ("1000", 1000)])
def test_byte_sizes(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["141XB", "", "GB", "-5GB", "0", "1e400", "12 G B"])
def test_bad_byte_sizes(text):
    with pytest.raises(ValueError, match="device memory"):
        parse_bytes(text)


def test_the_command_gives_the_cpu_backend_enough_devices():
    # In a fresh process (no backend started yet): raised to the mesh's size, never lowered.
    code = ("from dsjax.cli import _ensure_cpu_devices; import jax; _ensure_cpu_devices({n}); "
            "print(len(jax.devices('cpu')))")
    for flags, n, want in (("", 4, 4), ("--xla_force_host_platform_device_count=8", 4, 8)):
        env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
        out = subprocess.run([sys.executable, "-c", code.format(n=n)], env=env, capture_output=True, text=True,
                             check=True).stdout
        assert out.split()[-1] == str(want)


# DeepSeek-V4.1: the same plan, its release's storage (32x32 FP8 blocks, FP4 experts, FP8 Engram tables).
RUN41 = RUN.replace(slots=8)


@pytest.fixture(scope="module")
def tiny41():
    from dsjax.config_v41 import V41Config

    return V41Config.preset("tiny-v4.1")


@pytest.fixture(scope="module")
def planned41(tiny41):
    return plan(tiny41, RUN41, device_mem="8MB", model_name="tiny-v4.1")


def _on_device_0(tree) -> int:
    return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards
               if s.device == jax.devices()[0])


def test_v41_weights_are_what_a_model_placed_on_the_mesh_holds_on_each_device(tiny41, planned41):
    """A real V4.1 model in the release's storage, placed by the rules table, measured shard by shard: the
    plan's weights are device 0's. The routed experts and the Engram tables are split 8 ways."""
    from dsjax.bench import random_model
    from dsjax.engine.aot import stored_config
    from dsjax.parallel.mesh import make_mesh
    from dsjax.parallel.shard import shard_model

    cfg = stored_config(tiny41, "keep")
    assert cfg.quantization.weight_block_size == (32, 32) and cfg.quantization.expert_dtype == "fp4"
    model = shard_model(random_model(cfg), make_mesh(RUN41.mesh))
    state = nnx.state(model, nnx.Variable)
    assert planned41.weights == _on_device_0(state)
    split = {path: var.get_value() for path, var in nnx.to_flat_state(state)
             if path[-1] == "table" or (path[-2:-1] == ("experts",) and path[-1] in EXPERT_LEAVES)}
    assert any(p[-1] == "table" for p in split) and any(p[-1] == "gate_up_proj" for p in split)
    assert any(str(x.dtype) == "float8_e4m3fn" for p, x in split.items() if p[-1] == "table")
    for path, x in split.items():
        if path[:1] == ("layers",):  # the backbone's (a table's scales, one per 32 values of a row, are one column here)
            assert _on_device_0(x) * 8 == _nbytes(x), path


def test_v41_cache_is_what_the_engine_puts_on_each_device(tiny41, planned41):
    from dsjax.engine.engine import Engine
    from dsjax.model_v41 import DeepseekV41
    from dsjax.parallel.mesh import make_mesh

    model = nnx.eval_shape(lambda: DeepseekV41(tiny41, rngs=nnx.Rngs(0), dtype=jnp.bfloat16))
    engine = Engine(model, RUN41)
    with jax.set_mesh(make_mesh(RUN41.mesh)):
        cache = engine.new_cache()
    assert cache.history is not None  # Engram's n-gram history: per slot, split with the slots
    assert planned41.cache == _on_device_0(cache)
    cm = planned41.cache_model
    assert cm.slot_shards == 8 and [m for m, _ in cm.per_entry] == sorted(
        {r.ratio for r in tiny41.layer_roles() if r.mode == "full"})
    for slots, length in ((8, 1), (8, 63), (16, 64), (24, 65), (8, 100), (16, 1000)):
        shapes = jax.eval_shape(lambda s=slots, n=length: init_cache(model, s, n, None, "fp4"))
        want = slots * 4 + sum(_nbytes(x) for x in jax.tree.leaves((shapes.groups, shapes.history))) // 8
        assert cm.bytes(slots, length) == want, (slots, length)


def test_v41_cli_plans_a_preset_and_a_slice_of_its_layers(planned41, capsys):
    argv = ["plan", "--preset", "tiny-v4.1", "--mesh", "ep=8", "--max-len", "64", "--slots", "8", "--weights", "keep",
            "--kv-dtype", "fp4", "--chunk-size", "8", "--device-mem", "8MB", "--no-search"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("tiny-v4.1: weights keep, kv fp4, mesh ep=8 (8 × cpu), 8 slots × 64 tokens")
    assert f"{fmt_bytes(planned41.weights)}" in out and f"{fmt_bytes(planned41.total)}" in out
    # the release's layers 0, 1, 2, 4 (2 and 4 both Full, so each keeps its role): fewer weights
    assert main(argv + ["--layers", "0,1,2,4"]) == 0
    weights = re.search(r"^  weights +([\d,.]+) (KB|MB)", capsys.readouterr().out, re.M)
    assert weights and 0 < float(weights.group(1).replace(",", "")) * {"KB": 1e3, "MB": 1e6}[weights.group(2)] \
        < planned41.weights


def test_v41_step_inputs_count_the_weights_a_step_does_not_read():
    """XLA leaves weights a step never reads out of its arguments (the image encoder: neither step embeds
    images; in the release also DSpark); the plan still counts them, as the device holds them, and takes the
    steps' own inputs from their shapes."""
    from dsjax.config_v41 import V41Config
    from dsjax.engine.aot import stored_config
    from dsjax.model_v41 import DeepseekV41

    cfg = V41Config.preset("tiny-v4.1-vision")
    p = plan(cfg, RUN41, device_mem="8MB")
    s, n, c = RUN41.slots, RUN41.slots, RUN41.chunk_size
    sampling = 4 + 4 + 4 + 4
    assert p.small_inputs == {"decode": s * (4 + 1 + sampling), "prefill": n * (c * 4 + 3 * 4 + sampling)}
    model = nnx.eval_shape(lambda: DeepseekV41(stored_config(cfg, "keep"), rngs=nnx.Rngs(0), dtype=jnp.bfloat16))
    unused = sum(_nbytes(v.get_value()) for path, v in nnx.to_flat_state(nnx.state(model, nnx.Variable))
                 if path[0] in ("vision", "aligner", "image_start", "image_newline", "image_end", "mtp"))
    for name, step in (("decode", p.decode), ("prefill", p.prefill)):
        unread = p.weights + p.cache + p.small_inputs[name] - step.argument
        assert 0 < unread <= unused, (name, unread, unused)
    assert p.other >= p.queued_inputs
