"""Variable kinds: `nnx.Param` for learned weights, `Buffer` for persistent non-parameter state.

The reference keeps `tid2eid` and `e_score_correction_bias` as buffers: they are loaded from the
checkpoint but are not counted as parameters.
"""

from flax import nnx


class Buffer(nnx.Variable):
    """A persistent, non-learned tensor that a checkpoint carries (e.g. the hash router's table)."""
