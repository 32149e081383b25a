"""The cost of speculative decoding's verification against a plain decode step, on a DeepSeek-V4.1 slice with random
weights: the target over every slot's emitted token and k drafts (width k + 1), the cache taken back past the
rejected ones (`DeepseekV41.rewind`, here to the first token: the step's worst case), for k = 0 … 5, against one
token a slot without the record. From the ratio, the acceptance a step must reach to pay: a step of width w is worth
it when it emits more than t(w) / t(1) tokens in expectation.

    python scripts/bench_speculative.py --preset v4.1-flash --layers 0,1,2,3,20,21,24,25 --engram-rows 4194304 \
        --weights keep --kv-dtype fp4 --slots 32 128 --context 4096 [--drafter] --json OUT.jsonl

`--drafter` also times DSpark's own step (the preset's three stages, fed by the slice's last three layers): the
drafts of every slot's next block, and the context keys of a verified block written.

Each (slots, width) compiles its own program; the cache holds zeros with every slot's length set to `--context`
(the kernels' reads and the indexer's top-k depend on the lengths, not the values). Times: the median of 20 calls
after 3 warm-up calls, each call's result waited for.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from dsjax.bench import bench_config, random_model
from dsjax.cache import init_cache
from dsjax.config_v41 import V41Config
from dsjax.engine import speculative
from dsjax.engine.sampling import SamplingArrays, SamplingParams


def _step(model, tokens, cache, record: bool):
    b, c = tokens.shape
    start = cache.lengths
    n_valid = jnp.full((b,), c, jnp.int32)
    if not record:
        hidden, cache = model.extend(tokens, cache, start, n_valid)
        return model.logits(hidden), cache
    rec: dict = {}
    hidden, cache = model.extend(tokens, cache, start, n_valid, record=rec)
    logits = model.logits(hidden)
    cache = model.rewind(cache, rec, tokens, start, n_valid, jnp.ones((b,), jnp.int32))
    return logits, dataclasses.replace(cache, lengths=start)  # the next call verifies at the same place


def measure(model, slots: int, context: int, widths, kv_dtype, emit) -> None:
    cfg = model.cfg
    cache = init_cache(model, slots, context + max(widths) + 1, kv_dtype=kv_dtype)
    cache = dataclasses.replace(cache, lengths=jnp.full((slots,), context, jnp.int32))
    plain = None
    for w in widths:
        record = w > 1
        step = jax.jit(lambda m, t, c, record=record: _step(m, t, c, record), donate_argnums=2)
        tokens = jnp.asarray(np.random.default_rng(w).integers(3, cfg.vocab_size, (slots, w)), jnp.int32)
        t0 = time.perf_counter()
        logits, cache = step(model, tokens, cache)
        jax.block_until_ready(logits)
        compile_s = time.perf_counter() - t0
        if not record:
            cache = dataclasses.replace(cache, lengths=jnp.full((slots,), context, jnp.int32))
        times = []
        for i in range(23):
            t0 = time.perf_counter()
            logits, cache = step(model, tokens, cache)
            jax.block_until_ready(logits)
            times.append(time.perf_counter() - t0)
            if not record:
                cache = dataclasses.replace(cache, lengths=jnp.full((slots,), context, jnp.int32))
        ms = float(np.median(times[3:])) * 1e3
        plain = ms if w == 1 else plain
        row = {"slots": slots, "context": context, "width": w, "drafts": w - 1, "step_ms": ms,
               "of_plain": ms / plain if plain else None, "compile_s": compile_s, "kv_dtype": kv_dtype,
               "device": jax.devices()[0].device_kind}
        emit(row)


def with_drafter(sliced, preset: str):
    """The slice with the preset's DSpark stages, their target features from the slice's last three layers (the
    release's are its last three, 37–39): what the drafter's own step costs is the stages', whatever feeds them."""
    full = V41Config.preset(preset)
    if not full.num_nextn_predict_layers:
        raise SystemExit(f"--drafter: the {preset} preset has no DSpark stages")
    n = sliced.num_hidden_layers
    return sliced.replace(num_nextn_predict_layers=full.num_nextn_predict_layers,
                          compress_ratios=sliced.compress_ratios + (0,) * full.num_nextn_predict_layers,
                          dspark_target_layer_ids=tuple(range(n - len(full.dspark_target_layer_ids), n)))


def measure_drafter(model, slots: int, context: int, emit) -> None:
    """The drafter's step on every slot: the next block's drafts after a token at `context`, its context the
    window of keys before it (`speculative.propose`, greedy), and the context keys of one verified block written
    (`speculative.write_context`, 6 positions)."""
    cfg = model.cfg
    state = speculative.new_state(model, slots)
    token = jnp.full((slots,), 5, jnp.int32)
    position = jnp.full((slots,), context, jnp.int32)
    params = SamplingArrays.of([SamplingParams(temperature=0.0)] * slots, [0] * slots)
    features = jnp.zeros((slots, 6, len(cfg.dspark_target_layer_ids) * cfg.hidden_size), model.dtype)
    parts = {"propose": (jax.jit(speculative.propose), (model, state.rings, token, position, params)),
             "write_context": (jax.jit(speculative.write_context),
                               (model, state.rings, features, position, jnp.full((slots,), 6, jnp.int32)))}
    for name, (fn, args) in parts.items():
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        compile_s = time.perf_counter() - t0
        times = []
        for _ in range(23):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times.append(time.perf_counter() - t0)
        emit({"slots": slots, "context": context, "part": name, "step_ms": float(np.median(times[3:])) * 1e3,
              "compile_s": compile_s, "device": jax.devices()[0].device_kind})


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="v4.1-flash")
    p.add_argument("--layers", default="0,1,2,3,20,21,24,25")
    p.add_argument("--engram-rows", type=int, default=4194304)
    p.add_argument("--weights", default="keep")
    p.add_argument("--kv-dtype", default="fp4")
    p.add_argument("--slots", type=int, nargs="+", default=[32])
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--widths", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6])
    p.add_argument("--drafter", action="store_true",
                   help="also time DSpark's own step (the preset's stages on the slice's last three layers)")
    p.add_argument("--json")
    args = p.parse_args(argv)
    if args.widths[0] != 1:
        raise SystemExit("--widths must start with 1 (the plain decode step the others are compared with)")
    layers = [int(x) for x in args.layers.split(",")]
    cfg = bench_config(args.preset, layers, args.weights, args.engram_rows)
    model = random_model(with_drafter(cfg, args.preset) if args.drafter else cfg, 0)
    kv = None if args.kv_dtype == "bfloat16" else args.kv_dtype

    def emit(row):
        row = {"preset": args.preset, "layers": args.layers, "weights": args.weights, **row}
        if "part" in row:
            print(f"slots {row['slots']:4d} drafter {row['part']}: {row['step_ms']:8.3f} ms, compile "
                  f"{row['compile_s']:.1f} s", flush=True)
        else:
            print(f"slots {row['slots']:4d} width {row['width']} ({row['drafts']} drafts): {row['step_ms']:8.3f} ms "
                  f"({row['of_plain'] or 1:.2f}x plain), compile {row['compile_s']:.1f} s", flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(row) + "\n")

    for slots in args.slots:
        measure(model, slots, args.context, args.widths, kv, emit)
        if args.drafter:
            measure_drafter(model, slots, args.context, emit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
