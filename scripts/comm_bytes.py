"""Bytes each device sends per MoE layer and per decode step, for both expert-parallel designs.

The all-gather design (`gathered_dispatch`) is lowered for N CPU devices at the preset's sizes and its
collectives are read from the HLO. The ragged all-to-all design moves as many rows as
leave each device, which depends on the routing: it is counted on random top-k routing (every expert
equally likely, as the router's balancing bias aims for), the mean and the busiest device.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python scripts/comm_bytes.py --preset v4-flash \
        --ep 8 --tokens 1 64 256 1024 4096
"""

from __future__ import annotations

import argparse
import os
import re
import sys

import numpy as np


def collective_bytes(hlo: str, group: int) -> dict[str, int]:
    """Bytes one device sends in each kind of collective of a compiled SPMD module (ring algorithms:
    an all-gather or reduce-scatter over P devices moves (P−1)/P of the whole array through each)."""
    sizes = {"f32": 4, "bf16": 2, "s32": 4, "u32": 4, "f16": 2, "s8": 1, "u8": 1}
    out: dict[str, int] = {}
    for m in re.finditer(r"= (\w+)\[([\d,]*)\]\{[^}]*\} (all-gather|reduce-scatter|all-reduce)(?:-start)?\(", hlo):
        dtype, dims, kind = m.groups()
        n = int(np.prod([int(d) for d in dims.split(",") if d])) * sizes[dtype]
        whole = n * group if kind == "reduce-scatter" else n  # a reduce-scatter's result is one piece
        moved = whole * (group - 1) // group * (2 if kind == "all-reduce" else 1)
        out[kind] = out.get(kind, 0) + moved
    return out


def gathered_hlo(cfg, ep: int, tokens_per_device: int, dtype) -> str:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from dsjax.layers.experts import RoutedExperts
    from dsjax.layers.expert_parallel import routed_experts_parallel
    from dsjax.parallel.mesh import make_mesh
    from dsjax.parallel.shard import abstract_on_mesh

    mesh = make_mesh(f"ep={ep}", devices=jax.devices()[:ep])
    abstract = nnx.eval_shape(lambda: RoutedExperts(cfg, rngs=nnx.Rngs(0), dtype=dtype))
    graphdef, state = nnx.split(abstract)
    state = abstract_on_mesh(state, mesh)
    n, k = tokens_per_device * ep, cfg.num_experts_per_tok
    tokens = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("ep"))
    args = (jax.ShapeDtypeStruct((n, cfg.hidden_size), dtype, sharding=tokens),
            jax.ShapeDtypeStruct((n, k), jnp.float32, sharding=tokens),
            jax.ShapeDtypeStruct((n, k), jnp.int32, sharding=tokens))

    def layer(state, x, w, idx):
        return routed_experts_parallel(nnx.merge(graphdef, state), x, w, idx, mesh, design="gathered")

    with jax.set_mesh(mesh):
        # Before XLA's optimisations: XLA:CPU would widen bf16 collectives to f32, which GPUs do not.
        return jax.jit(layer).lower(state, *args).as_text(dialect="hlo")


def ragged_rows(cfg, ep: int, tokens_per_device: int, seed: int = 0) -> tuple[float, int]:
    """(mean, max) over devices of the (token, expert) pairs that leave a device on random top-k routing."""
    rng = np.random.default_rng(seed)
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    idx = np.argsort(rng.random((ep, tokens_per_device, e)), axis=-1)[..., :k]  # k distinct experts per token
    dest = idx // (e // ep)
    leaving = (dest != np.arange(ep)[:, None, None]).sum(axis=(1, 2))
    return float(leaving.mean()), int(leaving.max())


def layer_bytes(cfg, ep: int, tokens_per_device: int, dtype=None) -> dict[str, float]:
    """Bytes one device sends per MoE layer in each design: "gathered" (from its lowered collectives),
    "ragged_mean" and "ragged_max" (over devices, on random top-k routing)."""
    import jax.numpy as jnp

    if ep == 1:  # one device holds every expert: nothing is exchanged
        return {"gathered": 0.0, "ragged_mean": 0.0, "ragged_max": 0.0}
    act = 2  # bf16 activations
    gathered = sum(collective_bytes(gathered_hlo(cfg, ep, tokens_per_device, dtype or jnp.bfloat16), ep).values())
    mean_rows, max_rows = ragged_rows(cfg, ep, tokens_per_device)
    per_row = cfg.hidden_size * act + 4  # dispatch: the row and its expert id
    back = cfg.hidden_size * act  # combine: the expert's output row
    return {"gathered": gathered, "ragged_mean": mean_rows * (per_row + back) + ep * 4,  # + the send counts
            "ragged_max": max_rows * (per_row + back) + ep * 4}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="v4-flash")
    p.add_argument("--ep", type=int, default=8)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 256, 1024, 4096])
    args = p.parse_args(argv)
    if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={args.ep}").strip()
    import jax.numpy as jnp

    from dsjax.config import ModelConfig

    cfg = ModelConfig.preset(args.preset)
    h, k = cfg.hidden_size, cfg.num_experts_per_tok
    moe_layers = cfg.num_hidden_layers  # every V4 layer has a routed MoE (hash or top-k)
    print(f"{args.preset}: H={h}, k={k}, E={cfg.n_routed_experts}, ep={args.ep}, bf16 activations, "
          f"{moe_layers} MoE layers; bytes sent per device")
    print(f"{'tokens/dev':>10} | {'all-gather design / layer':>26} | {'ragged a2a / layer (mean, max)':>31} | "
          f"{'ratio':>5} | {'per decode step: gather':>23} | {'ragged (mean)':>13}")
    for n in args.tokens:
        sent = layer_bytes(cfg, args.ep, n, jnp.bfloat16)
        gathered, ragged_mean, ragged_max = sent["gathered"], sent["ragged_mean"], sent["ragged_max"]
        print(f"{n:>10} | {gathered:>26,} | {ragged_mean:>18,.0f} {ragged_max:>12,} | "
              f"{ragged_mean / gathered:>5.2f} | {gathered * moe_layers / 1e6:>20.2f} MB | "
              f"{ragged_mean * moe_layers / 1e6:>10.2f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
