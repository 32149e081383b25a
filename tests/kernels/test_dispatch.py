"""`over_slots`: under a mesh each device runs the op on its own cache slots; elsewhere the op runs as is."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsjax.kernels.dispatch import over_slots
from dsjax.parallel.mesh import make_mesh


def _run(slots: int, mesh_spec: str | None):
    seen = []

    def op(x_bd, empty_b0, pair, w, bias):
        seen.append((x_bd.shape, empty_b0.shape, pair[1].shape))
        return x_bd * w + bias + empty_b0.sum() + pair[0] - pair[1]

    x = jnp.arange(slots * 3, dtype=jnp.float32).reshape(slots, 3)
    pair = (jnp.ones((slots, 1)), jnp.full((slots, 3), 2.0))
    fn = jax.jit(lambda x, p, w: over_slots(op, dict(x_bd=x, empty_b0=jnp.zeros((slots, 0)), pair=p),
                                            dict(w=w, bias=0.5)))
    if mesh_spec is None:
        out = fn(x, pair, jnp.float32(2))
    else:
        mesh = make_mesh(mesh_spec) if mesh_spec != "one" else jax.sharding.Mesh(
            np.array(jax.devices()[:1]), ("ep",), axis_types=(jax.sharding.AxisType.Auto,))
        with jax.set_mesh(mesh):
            out = fn(x, pair, jnp.float32(2))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(x) * 2 + 0.5 - 1)
    return seen


@pytest.mark.parametrize("slots,mesh_spec,local", [(8, "dp=2,ep=4", 1), (16, "ep=8", 2), (6, "dp=2,ep=4", 3),
                                                   (5, "dp=2,ep=4", 5), (8, None, 8), (8, "one", 8)])
def test_each_device_gets_its_own_slots(slots, mesh_spec, local):
    """8 devices: 8 or 16 slots split 8 ways, 6 over dp only (ep=4 does not divide them), 5 not at all
    (the op then runs as it is, partitioned by XLA); no mesh or one device: the op as it is. Zero-sized
    arrays, pytrees and Python numbers arrive as given."""
    assert _run(slots, mesh_spec) == [((local, 3), (local, 0), (local, 3))]
