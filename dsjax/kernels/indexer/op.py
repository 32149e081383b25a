"""The indexer's decode scores as the model calls them: the GPU or TPU kernel where it applies, else
the pure-JAX reference (`dispatch.py`)."""

from __future__ import annotations

import functools

import jax

from dsjax.kernels.dispatch import dispatch, over_slots, reads_records
from dsjax.kernels.indexer.mosaic_tpu import index_scores_tpu
from dsjax.kernels.indexer.reference import index_scores_reference
from dsjax.kernels.indexer.triton import index_scores_gpu


def index_scores(q_bhc: jax.Array, weights_bh: jax.Array, keys, keys_len_b: jax.Array, scale: float, *,
                 kernels: str = "auto") -> jax.Array:
    """`reference.index_scores_reference`'s result, by the kernel `kernels` selects for the platform
    (under a mesh, on each device's slots: `dispatch.over_slots`)."""
    return over_slots(functools.partial(_index_scores, scale=scale, kernels=kernels),
                      dict(q_bhc=q_bhc, weights_bh=weights_bh, keys=keys, keys_len_b=keys_len_b))


def _index_scores(q_bhc, weights_bh, keys, keys_len_b, scale, *, kernels):
    kernels = reads_records(kernels, keys)
    args = (q_bhc, weights_bh, keys, keys_len_b, scale)
    return dispatch(functools.partial(index_scores_reference, *args), kernels=kernels,
                    gpu=lambda interpret: index_scores_gpu(*args, interpret=interpret),
                    tpu=lambda: index_scores_tpu(*args))
