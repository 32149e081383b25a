"""The indexer's scores as the model calls them: the GPU or TPU kernel where it applies, else the
pure-JAX reference (`dispatch.py`). V4.1's MXFP4 index key records go to the GPU kernel as stored; the
TPU kernel does not read them (the reference runs there)."""

from __future__ import annotations

import functools

import jax

from dsjax.cache_formats import Records
from dsjax.kernels.dispatch import dispatch, over_slots
from dsjax.kernels.indexer.mosaic_tpu import index_scores_chunk_tpu
from dsjax.kernels.indexer.reference import index_scores_chunk_reference
from dsjax.kernels.indexer.triton import index_scores_chunk_gpu


def index_scores(q_bchc: jax.Array, weights_bch: jax.Array, keys, keys_len_bc: jax.Array, scale: float, *,
                 kernels: str = "auto") -> jax.Array:
    """`reference.index_scores_chunk_reference`'s `[B, C, T]` scores of C queries per slot (C = 1: decode),
    by the kernel `kernels` selects for the platform (under a mesh, on each device's slots:
    `dispatch.over_slots`)."""
    return over_slots(functools.partial(_index_scores, scale=scale, kernels=kernels),
                      dict(q_bchc=q_bchc, weights_bch=weights_bch, keys=keys, keys_len_bc=keys_len_bc))


def _index_scores(q_bchc, weights_bch, keys, keys_len_bc, scale, *, kernels):
    args = (q_bchc, weights_bch, keys, keys_len_bc, scale)
    decode = q_bchc.shape[1] == 1
    tpu = None if isinstance(keys, Records) else functools.partial(index_scores_chunk_tpu, *args)
    # Decode keeps the tiling swept for it; a chunk takes block_q queries per key block.
    tiling = dict(block_q=1) if decode else {}
    return dispatch(functools.partial(index_scores_chunk_reference, *args), kernels=kernels,
                    gpu=lambda interpret: index_scores_chunk_gpu(*args, **tiling, interpret=interpret), tpu=tpu)
