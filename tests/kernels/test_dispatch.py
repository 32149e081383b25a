"""`dispatch`: which kernel runs, and what a kernel that cannot tile the shapes leaves to the next one;
`over_slots`: under a mesh each device runs the op on its own cache slots; elsewhere the op runs as is."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsjax.kernels.dispatch import CannotTile, dispatch, over_slots
from dsjax.parallel.mesh import make_mesh


def _reference():
    return jnp.zeros(2)


def _tiles(interpret=False):
    return jnp.ones(2)


def _cannot_tile(interpret=False):
    raise CannotTile("these shapes do not tile")


def _bad_argument(interpret=False):
    raise ValueError("a bad argument")


def test_the_first_gpu_kernel_that_tiles_runs():
    assert float(dispatch(_reference, kernels="interpret", gpu=(_cannot_tile, _tiles)).sum()) == 2.0
    # auto: lowered for cuda (a branch); the kernel runs on a GPU, the reference on any other backend.
    program = jax.make_jaxpr(lambda: dispatch(_reference, kernels="auto", gpu=(_cannot_tile, _tiles)))()
    assert "platform_index" in str(program)
    want = 2.0 if jax.default_backend() == "gpu" else 0.0
    assert float(dispatch(_reference, kernels="auto", gpu=(_cannot_tile, _tiles)).sum()) == want


@pytest.mark.parametrize("kernels", ["interpret", "auto"])
def test_a_kernel_that_cannot_tile_leaves_the_reference(kernels):
    got = dispatch(_reference, kernels=kernels, gpu=_cannot_tile, tpu=_cannot_tile)
    assert float(got.sum()) == 0.0
    # Left out, not merely not lowered: a dispatch with no kernel left is the reference alone.
    assert "platform_index" not in str(jax.make_jaxpr(
        lambda: dispatch(_reference, kernels=kernels, gpu=_cannot_tile, tpu=_cannot_tile))())


@pytest.mark.parametrize("kernels,where", [("interpret", "gpu"), ("auto", "gpu"), ("auto", "tpu")])
def test_any_other_error_of_a_kernel_propagates(kernels, where):
    with pytest.raises(ValueError, match="a bad argument"):
        dispatch(_reference, kernels=kernels, **{where: _bad_argument})


def test_kernels_reference_traces_no_kernel():
    assert float(dispatch(_reference, kernels="reference", gpu=_bad_argument, tpu=_bad_argument).sum()) == 0.0


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
