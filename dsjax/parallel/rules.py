"""The one table from logical axis names to mesh axes.

Modules declare what their variables' axes mean, as `axes=` metadata on the variable (`nnx.Param(w,
axes=("heads", None))`); a variable without it is small and replicated. Stacked layer groups add a
leading "layers" axis. Nothing outside this file names a mesh axis for a parameter or a cache array.

Parameters: routed experts split over `ep`; query heads (and what carries them: the sinks, the grouped
output projection) and the expert FFN width split over `tp`; the values of V4.1's Engram table rows (and
their scales) over every device. Activations: the tokens entering the MoE
are split over every data and expert device, and so are the cache's slots (data-parallel attention).
"""

from __future__ import annotations

import math

import jax
from jax.sharding import NamedSharding, PartitionSpec

# logical axis → mesh axis (None: replicated)
RULES: dict[str, str | tuple[str, ...] | None] = {
    "layers": None,  # the stacked-layer axis of a layer group
    "expert": "ep",  # routed experts
    "heads": "tp",  # attention query heads, and the output projection's groups that carry them
    "ffn": "tp",  # the FFN width (moe_intermediate_size) of the routed and the shared experts
    "embed": None,  # the hidden size
    "engram_dim": ("dp", "ep", "tp"),  # the values of a row of V4.1's Engram tables: split over every device
    "tokens": ("dp", "ep"),  # tokens entering the MoE: attention is data-parallel over every device
    "slots": ("dp", "ep"),  # the cache's sequences: each device keeps the cache of its own slots
}

Axes = tuple[str | None, ...]


def mesh_axes(mesh, logical: str | None) -> tuple[str, ...]:
    """The axes of `mesh` (of size > 1) that `logical` maps to."""
    axes = RULES.get(logical) if logical else None
    axes = (axes,) if isinstance(axes, str) else axes or ()
    return tuple(a for a in axes if a in mesh.axis_names and mesh.shape[a] > 1)


def slot_axes(mesh, num_slots: int) -> tuple[str, ...]:
    """The mesh axes the cache's slot axis splits over: those of the "slots" rule, as many (in order) as
    evenly divide `num_slots`; a slot count no axis divides stays replicated."""
    return _dividing(mesh, mesh_axes(mesh, "slots"), num_slots)


def _dividing(mesh, axes: tuple[str, ...], size: int) -> tuple[str, ...]:
    chosen: list[str] = []
    for a in axes:
        if size % (math.prod(mesh.shape[c] for c in chosen) * mesh.shape[a]) == 0:
            chosen.append(a)
    return tuple(chosen)


def declared_axes(var) -> Axes | None:
    """The logical axes a module declared for the variable `var` (None: none declared)."""
    return var.get_metadata().get("axes")


def logical_axes(path: tuple, var) -> Axes:
    """Logical names of the axes of the dsjax variable `var` at state path `path` (stacked layer groups
    add "layers" in front of what the module declared)."""
    ndim = len(var.get_value().shape)
    lead = ("layers",) if path[0] == "groups" else ()
    declared = declared_axes(var)
    axes = lead + (tuple(declared) if declared is not None else (None,) * (ndim - len(lead)))
    if len(axes) != ndim:
        raise ValueError(f"variable {'.'.join(map(str, path))} has {ndim} axes but declares {axes}")
    return axes


def spec_of(mesh, axes: Axes, shape: tuple[int, ...]) -> PartitionSpec:
    """The partition of an array of `shape` whose axes are `axes`: each axis over the mesh axes its rule
    names that divide it evenly (an axis they do not divide stays whole)."""
    used: set[str] = set()
    spec = []
    for name, size in zip(axes, shape):
        chosen = _dividing(mesh, tuple(a for a in mesh_axes(mesh, name) if a not in used), size)
        used |= set(chosen)
        spec.append(None if not chosen else chosen[0] if len(chosen) == 1 else chosen)
    return PartitionSpec(*spec)


def param_sharding(mesh: jax.sharding.Mesh, path: tuple, var) -> NamedSharding:
    """Where the variable `var` at state path `path` lives on `mesh`, by RULES."""
    return NamedSharding(mesh, spec_of(mesh, logical_axes(path, var), tuple(var.get_value().shape)))
