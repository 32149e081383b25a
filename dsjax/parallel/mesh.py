"""Mesh specifications: `"dp=2,ep=4"` → the size of each parallel axis."""

from __future__ import annotations

AXES = ("dp", "ep", "tp")  # data (cache slots), expert, tensor (heads, expert FFN width)


def parse_mesh(spec: str) -> dict[str, int]:
    """Parse `"dp=2,ep=4,tp=1"` (any subset of dp, ep, tp, each at most once) into {axis: size}; axes left
    out have size 1."""
    sizes = dict.fromkeys(AXES, 1)
    seen = set()
    for part in spec.split(","):
        name, eq, value = part.strip().partition("=")
        if not eq or name not in AXES or not value.strip().isdigit() or int(value) < 1:
            raise ValueError(f"mesh {spec!r}: expected comma-separated AXIS=SIZE with AXIS in {AXES} and "
                             f"SIZE ≥ 1, got {part.strip()!r}")
        if name in seen:
            raise ValueError(f"mesh {spec!r}: axis {name!r} given twice")
        seen.add(name)
        sizes[name] = int(value)
    return sizes


def make_mesh(spec: str | dict[str, int], devices=None):
    """A mesh with axes (dp, ep, tp) over `devices` (default: all), sized by `spec`; Auto axes, so that
    jit propagates the parameters' shardings. The sizes must multiply to the number of devices."""
    import jax
    import numpy as np

    sizes = parse_mesh(spec) if isinstance(spec, str) else {**dict.fromkeys(AXES, 1), **spec}
    devices = list(jax.devices() if devices is None else devices)
    n = int(np.prod([sizes[a] for a in AXES]))
    if n != len(devices):
        raise ValueError(f"mesh {sizes} needs {n} devices; {len(devices)} are available")
    return jax.make_mesh(tuple(sizes[a] for a in AXES), AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3,
                         devices=devices)
