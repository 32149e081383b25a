"""Time one routed-expert MoE layer split over the visible accelerators, for both dispatch designs.

Experts at the preset's sizes (bf16, random), as many as the devices hold (`--experts`, default the
preset's, scaled down if they do not fit), random top-k routing. Prints milliseconds per layer call.

    python scripts/bench_dispatch.py --preset v4-flash --tokens 1 64 256 1024
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="v4-flash")
    p.add_argument("--experts", type=int, help="routed experts (default: the preset's)")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 256, 1024])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from dsjax.config import ModelConfig
    from dsjax.layers.experts import RoutedExperts
    from dsjax.layers.expert_parallel import routed_experts_parallel
    from dsjax.parallel.mesh import make_mesh
    from dsjax.parallel.rules import param_sharding

    n_dev = len(jax.devices())
    cfg = ModelConfig.preset(args.preset)
    if args.experts:
        cfg = cfg.replace(n_routed_experts=args.experts)
    mesh = make_mesh(f"ep={n_dev}")
    abstract = nnx.eval_shape(lambda: RoutedExperts(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16))
    graphdef, state = nnx.split(abstract)
    flat = list(nnx.to_flat_state(state))
    for i, (path, var) in enumerate(flat):
        sds = var.get_value()
        make = jax.jit(lambda key, shape=sds.shape: (0.02 * jax.random.normal(key, shape)).astype(jnp.bfloat16),
                       out_shardings=param_sharding(mesh, path, var))
        var.set_value(make(jax.random.key(i)))
    state = nnx.from_flat_state(flat)
    tokens = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("ep"))
    rng = np.random.default_rng(0)
    rows = []
    for n in args.tokens:
        total = n * n_dev
        idx = np.argsort(rng.random((total, cfg.n_routed_experts)), axis=-1)[:, :cfg.num_experts_per_tok]
        x = jax.device_put(jnp.asarray(rng.normal(size=(total, cfg.hidden_size)), jnp.bfloat16), tokens)
        w = jax.device_put(jnp.asarray(rng.random(idx.shape), jnp.float32), tokens)
        idx = jax.device_put(jnp.asarray(idx, jnp.int32), tokens)
        results = {}
        for design in ("gathered", "ragged"):
            f = jax.jit(lambda s, x, w, i, design=design: routed_experts_parallel(
                nnx.merge(graphdef, s), x, w, i, mesh, design))
            with jax.set_mesh(mesh):
                y = f(state, x, w, idx).block_until_ready()
                t0 = time.perf_counter()
                for _ in range(args.iters):
                    y = f(state, x, w, idx)
                y.block_until_ready()
            results[design] = ((time.perf_counter() - t0) / args.iters * 1e3, np.asarray(y, np.float32))
        diff = float(np.max(np.abs(results["gathered"][1] - results["ragged"][1])))
        rows.append({"tokens_per_device": n, "gathered_ms": results["gathered"][0],
                     "ragged_ms": results["ragged"][0], "max_abs_diff": diff})
    print(f"{jax.devices()[0].device_kind} x{n_dev}, ep={n_dev}, {cfg.n_routed_experts} experts "
          f"(H={cfg.hidden_size}, I={cfg.moe_intermediate_size}, k={cfg.num_experts_per_tok}), bf16")
    print(f"{'tokens/dev':>10} {'all-gather ms':>14} {'ragged a2a ms':>14} {'max |diff|':>11}")
    for r in rows:
        print(f"{r['tokens_per_device']:>10} {r['gathered_ms']:>14.3f} {r['ragged_ms']:>14.3f} {r['max_abs_diff']:>11.3g}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
