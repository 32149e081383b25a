"""The one table from logical axis names to mesh axes, and the logical axes of each parameter.

Parameters: only the routed experts are split so far (expert parallelism over `ep`); everything else
is replicated. Activations: the tokens entering the MoE are split over every data and expert device,
and so are the cache's slots (data-parallel attention).
Parallelism work adds tensor- and data-parallel rules here and nowhere else.
"""

from __future__ import annotations

import math

import jax
from jax.sharding import NamedSharding, PartitionSpec

# logical axis → mesh axis (None: replicated)
RULES: dict[str, str | tuple[str, ...] | None] = {
    "layers": None,  # the stacked-layer axis of a layer group
    "expert": "ep",  # routed experts
    "tokens": ("dp", "ep"),  # tokens entering the MoE: attention is data-parallel over every device
    "slots": ("dp", "ep"),  # the cache's sequences: each device keeps the cache of its own slots
}


def mesh_axes(mesh, logical: str) -> tuple[str, ...]:
    """The axes of `mesh` (of size > 1) that `logical` maps to."""
    axes = RULES.get(logical)
    axes = (axes,) if isinstance(axes, str) else axes or ()
    return tuple(a for a in axes if a in mesh.axis_names and mesh.shape[a] > 1)

_EXPERT_LEAVES = ("gate_up_proj", "down_proj", "gate_up_proj_scale_inv", "down_proj_scale_inv")


def slot_axes(mesh, num_slots: int) -> tuple[str, ...]:
    """The mesh axes the cache's slot axis splits over: those of the "slots" rule, as many (in order) as
    evenly divide `num_slots`; a slot count no axis divides stays replicated."""
    chosen: list[str] = []
    for a in mesh_axes(mesh, "slots"):
        if num_slots % (math.prod(mesh.shape[c] for c in chosen) * mesh.shape[a]) == 0:
            chosen.append(a)
    return tuple(chosen)


def logical_axes(path: tuple, ndim: int) -> tuple[str | None, ...]:
    """Logical names of the axes of the dsjax variable at state path `path`."""
    stacked = path[0] == "groups"
    lead = ("layers",) if stacked else ()
    if len(path) >= 2 and path[-2] == "experts" and path[-1] in _EXPERT_LEAVES:
        return lead + ("expert",) + (None,) * (ndim - len(lead) - 1)
    return lead + (None,) * (ndim - len(lead))


def param_sharding(mesh: jax.sharding.Mesh, path: tuple, ndim: int) -> NamedSharding:
    """Where the variable at `path` lives on `mesh`, by RULES."""
    spec = [mesh_axes(mesh, a) if a else () for a in logical_axes(path, ndim)]
    return NamedSharding(mesh, PartitionSpec(*[a[0] if len(a) == 1 else (a or None) for a in spec]))
