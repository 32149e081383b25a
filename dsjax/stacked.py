"""One entry of a stacked array, named but not cut out.

A layer group runs its layers with one `lax.scan` over their stacked weights (`model.StackedLayers`).
The scan hands each layer a dynamic slice of every stacked weight. XLA reads such a slice in place
only where it can fold the slice into the consumer (its "dynamic-slice fusion", which takes Mosaic GPU
custom calls such as tokamax's). A Pallas Triton kernel is not taken, so XLA copied each layer's
quantized experts before the expert kernel read them: 7 ms per decode step at V4-Flash widths
(docs/benchmarks.md). Weights marked `read_in_place` therefore reach the layer as a `StackedSlice`,
which a kernel that can index the stack itself reads as it is; anything else calls `array()`.
"""

from __future__ import annotations

import dataclasses

import jax

# Variable metadata: the scan passes this variable to its layers as a `StackedSlice`.
READ_IN_PLACE = "read_in_place"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StackedSlice:
    """`stack[index]`, not materialised. Reads like the slice through a variable's `[...]`."""

    stack: jax.Array
    index: jax.Array  # int32 scalar

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.stack.shape[1:])

    @property
    def dtype(self):
        return self.stack.dtype

    def array(self) -> jax.Array:
        """The slice itself (XLA may copy it)."""
        return jax.lax.dynamic_index_in_dim(self.stack, self.index, axis=0, keepdims=False)

    def __getitem__(self, key):
        # `variable[...]` forwards here: hand the slice on untouched; any other indexing cuts it out.
        return self if key is Ellipsis else self.array()[key]


def as_array(x: jax.Array | StackedSlice) -> jax.Array:
    """`x` itself, or the slice a `StackedSlice` names."""
    return x.array() if isinstance(x, StackedSlice) else x
