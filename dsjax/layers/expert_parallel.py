"""Expert parallelism: routed experts split over the mesh's expert axis, tokens brought to them.

Inside `jax.shard_map` each device holds E/ep experts (and, with tensor parallelism, 1/tp of their FFN
width) and 1/(dp·ep) of the tokens. Two dropless designs move the tokens, chosen per backend with
`jax.lax.platform_dependent`:

- GPU/TPU, `ragged_dispatch`: each device sends every (token, expert) pair to the device holding that
  expert with `jax.lax.ragged_all_to_all`, the receivers run their pairs through the grouped matmuls,
  and a second ragged all-to-all returns the outputs to the owners, who weight and sum them.
- XLA:CPU (no ragged all-to-all there), `gathered_dispatch`: the tokens of an ep group are all-gathered
  with their routing, each device runs the pairs routed to its own experts, and the partial sums are
  reduce-scattered back to the tokens' owners.

Both equal the single-device model up to the order of the final sums. docs/parallelism.md compares the
bytes each moves.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from dsjax.layers.experts import EXPERT_LEAVES, RoutedExperts, grouped_mlp, matmul_experts
from dsjax.parallel.rules import declared_axes, mesh_axes, spec_of
from dsjax.stacked import StackedSlice, as_array



def expert_axis(mesh) -> str | None:
    """The mesh axis the routed experts are split over, or None (one device, or no expert axis)."""
    axes = mesh_axes(mesh, "expert")
    return axes[0] if axes else None


class _Local:
    """What one device knows inside the shard_map: its axis names, its experts and the FFN slice."""

    def __init__(self, experts: RoutedExperts, ep: str, n_dev: int, tp: str | None, e_local: int):
        self.experts, self.ep, self.n_dev, self.tp, self.e_local = experts, ep, n_dev, tp, e_local

    def first_expert(self) -> jax.Array:
        return jax.lax.axis_index(self.ep) * self.e_local

    def mlp(self, x_nh, weights_nk, idx_nk, gate_up, down, scales) -> jax.Array:
        """`grouped_mlp` over this device's experts (and FFN slice: summed over tp by the caller)."""
        e, cfg = self.experts, self.experts.cfg
        gate_up_scale, down_scale = scales or (None, None)
        return grouped_mlp(x_nh, weights_nk, idx_nk,
                           matmul_experts(gate_up, gate_up_scale, e.storage, cfg, e.code_layout),
                           matmul_experts(down, down_scale, e.storage, cfg, e.code_layout), cfg,
                           first_expert=self.first_expert(), tp_axis=self.tp, kernels=e.kernels)


def gathered_dispatch(local: _Local, x_nh, weights_nk, idx_nk, gate_up, down, scales) -> jax.Array:
    """All-gather the ep group's tokens, run this device's pairs, reduce-scatter the partial sums."""
    ep = local.ep
    x_all, w_all, idx_all = (jax.lax.all_gather(a, ep, axis=0, tiled=True) for a in (x_nh, weights_nk, idx_nk))
    y_all = local.mlp(x_all, w_all, idx_all, gate_up, down, scales)
    y = jax.lax.psum_scatter(y_all, ep, scatter_dimension=0, tiled=True)
    return jax.lax.psum(y, local.tp) if local.tp else y


def ragged_dispatch(local: _Local, x_nh, weights_nk, idx_nk, gate_up, down, scales,
                    exchange: Callable = jax.lax.ragged_all_to_all) -> jax.Array:
    """Send each (token, expert) pair to its expert's device and the result back, by ragged all-to-all.

    Pairs leave sorted by expert, so those for device d are one contiguous run; device d stacks the
    runs it receives in sender order. Its receive buffer holds the worst case (every pair of the group
    routed to it: ep·n·k rows), which keeps shapes static and nothing dropped. `exchange` is
    `jax.lax.ragged_all_to_all` (tests give an equivalent built from dense collectives for XLA:CPU).
    """
    ep, e_local = local.ep, local.e_local
    n, k = idx_nk.shape
    n_dev = local.n_dev
    me = jax.lax.axis_index(ep)
    pairs = n * k
    order = jnp.argsort(idx_nk.reshape(-1), stable=True)
    expert_p = jnp.take(idx_nk.reshape(-1), order)
    x_ph = jnp.take(x_nh, order // k, axis=0)

    send = jnp.bincount(expert_p // e_local, length=n_dev).astype(jnp.int32)  # pairs for each device
    sent_by = jax.lax.all_gather(send, ep)  # [sender, receiver]
    in_offsets = jnp.cumsum(send) - send
    # where my run lands on each receiver: after the runs of the senders before me
    out_offsets = (jnp.cumsum(sent_by, axis=0) - sent_by)[me]
    recv = sent_by[:, me]
    buffer_rows = n_dev * pairs
    x_rh = exchange(x_ph, jnp.zeros((buffer_rows, x_ph.shape[1]), x_ph.dtype), in_offsets, send, out_offsets,
                    recv, axis_name=ep)
    expert_r = exchange(expert_p, jnp.full((buffer_rows,), -1, expert_p.dtype), in_offsets, send, out_offsets,
                        recv, axis_name=ep)  # rows past the received runs keep -1: no expert, output 0
    y_rh = local.mlp(x_rh, jnp.ones((buffer_rows, 1), x_nh.dtype), expert_r[:, None], gate_up, down, scales)
    if local.tp:
        y_rh = jax.lax.psum(y_rh, local.tp)
    # Back: my received runs sit one after another in sender order; each returns to where it came from.
    recv_offsets = jnp.cumsum(recv) - recv
    back_offsets = (jnp.cumsum(sent_by, axis=1) - sent_by)[:, me]
    y_ph = exchange(y_rh, jnp.zeros((pairs, y_rh.shape[1]), y_rh.dtype), recv_offsets, recv, back_offsets, send,
                    axis_name=ep)
    y_ph = y_ph * jnp.take(weights_nk.reshape(-1), order)[:, None].astype(y_ph.dtype)
    return jnp.sum(jnp.zeros_like(y_ph).at[order].set(y_ph).reshape(n, k, -1), axis=1)


def routed_experts_parallel(experts: RoutedExperts, x_nh: jax.Array, weights_nk: jax.Array,
                            idx_nk: jax.Array, mesh, design: str | None = None,
                            exchange: Callable = jax.lax.ragged_all_to_all) -> jax.Array:
    """`experts(x_nh, weights_nk, idx_nk)` with the experts split over `mesh`'s expert axis (and their FFN
    width over its tensor axis). `design` forces "ragged" or "gathered". By default: the all-gather
    design when k ≥ ep (it then moves fewer bytes: ragged/gathered = k/ep) and on CPU; otherwise the
    backend picks with `platform_dependent` (ragged all-to-all on GPU and TPU)."""
    ep = expert_axis(mesh)
    cfg = experts.cfg
    if cfg.n_routed_experts % mesh.shape[ep]:
        raise ValueError(f"the expert axis ({mesh.shape[ep]}) must divide n_routed_experts ({cfg.n_routed_experts})")
    tokens = mesh_axes(mesh, "tokens")
    e_local = cfg.n_routed_experts // mesh.shape[ep]
    n = x_nh.shape[0]
    pad = -n % math.prod(mesh.shape[a] for a in tokens)
    if pad:  # padding rows carry weight 0 to expert 0: they add nothing and are cut off below
        x_nh = jnp.pad(x_nh, ((0, pad), (0, 0)))
        weights_nk = jnp.pad(weights_nk, ((0, pad), (0, 0)))
        idx_nk = jnp.pad(idx_nk, ((0, pad), (0, 0)))

    arrays, specs = [], []
    scales = tuple(f"{leaf}_scale_inv" for leaf in EXPERT_LEAVES) if experts.storage is not None else ()
    names = EXPERT_LEAVES + scales
    for name in names:
        var = getattr(experts, name)
        arrays.append(var[...])
        specs.append(spec_of(mesh, declared_axes(var), var.shape))
    tp = _ffn_axis(mesh, specs, experts)
    # A layer group's scan hands quantized experts over as StackedSlices of the whole stack. The stack
    # enters the shard_map as it is (each device's experts of every layer) with the layer index beside it,
    # so that the expert kernel reads the layer in place; cutting it out here copied it every step.
    in_place = all(isinstance(a, StackedSlice) for a in arrays) and len({id(a.index) for a in arrays}) == 1
    if in_place:
        index = arrays[0].index
        specs = [P(None, *s) for s in specs]
        arrays = [a.stack for a in arrays]
    else:
        arrays = [as_array(a) for a in arrays]
    local = _Local(experts, ep, mesh.shape[ep], tp, e_local)

    if design is None and cfg.num_experts_per_tok >= mesh.shape[ep]:
        design = "gathered"
    if design not in (None, "gathered", "ragged"):
        raise ValueError(f"design must be 'gathered' or 'ragged', got {design!r}")

    def run(x, w, idx, *weights):
        if in_place:
            layer = weights[0]
            weights = tuple(StackedSlice(a, layer) for a in weights[1:])
        gate_up, down, *scales = weights
        args = (local, x, w, idx, gate_up, down, tuple(scales))
        if design == "gathered":
            return gathered_dispatch(*args)
        if design == "ragged":
            return ragged_dispatch(*args, exchange=exchange)
        return jax.lax.platform_dependent(*args[1:], cpu=lambda *a: gathered_dispatch(local, *a),
                                          default=lambda *a: ragged_dispatch(local, *a, exchange=exchange))

    token_spec = P(tokens)
    # check_vma off: the expert kernels' Pallas calls declare no varying axes for their outputs, and the
    # check would refuse them (they then ran the reference, which dequantizes every local expert).
    extra, extra_specs = ((index,), (P(),)) if in_place else ((), ())
    y = jax.shard_map(run, mesh=mesh, in_specs=(token_spec,) * 3 + extra_specs + tuple(specs), out_specs=token_spec,
                      check_vma=False)(x_nh, weights_nk, idx_nk, *extra, *arrays)
    return y[:n]


def _ffn_axis(mesh, specs: list[P], experts: RoutedExperts) -> str | None:
    """The tensor axis the experts' FFN width is split over, if the rules split it in every expert array
    (weights and scales alike); a split of some but not all would leave scales that do not match."""
    tp = mesh_axes(mesh, "ffn")
    if not tp:
        return None
    split = [tp[0] in jax.tree.leaves(tuple(s)) for s in specs]
    if all(split):
        return tp[0]
    if any(split):
        raise ValueError(f"tensor parallelism over {tp[0]}={mesh.shape[tp[0]]} splits some of the routed "
                         f"experts' arrays but not all (moe_intermediate_size {experts.cfg.moe_intermediate_size}"
                         f" and its scale blocks must all divide): use a smaller tp, or none")
    return None
