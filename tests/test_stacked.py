"""StackedSlice: one entry of a stacked array, handed on uncut through a variable's `[...]`."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsjax.stacked import StackedSlice, as_array


def test_reads_like_the_entry_it_names():
    stack = jnp.arange(24, dtype=jnp.float32).reshape(3, 2, 4)
    view = StackedSlice(stack, jnp.int32(2))
    assert view.shape == (2, 4) and view.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(view.array()), np.asarray(stack[2]))
    np.testing.assert_array_equal(np.asarray(view[1, 1:3]), np.asarray(stack[2, 1, 1:3]))
    np.testing.assert_array_equal(np.asarray(as_array(view)), np.asarray(stack[2]))
    assert as_array(stack) is stack


def test_passes_through_a_variable_and_jit_uncut():
    """`variable[...]` hands the view itself on (a kernel may index the stack), and it is a pytree: it
    crosses jit as its stack and index."""
    stack = jnp.arange(12, dtype=jnp.int32).reshape(3, 4)
    var = nnx.Param(StackedSlice(stack, jnp.int32(1)))
    assert isinstance(var[...], StackedSlice) and var.shape == (4,)

    @jax.jit
    def second_of_entry(view):
        assert isinstance(view, StackedSlice) and view.stack.shape == (3, 4)
        return view[1]

    assert int(second_of_entry(var[...])) == 5
