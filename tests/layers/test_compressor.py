"""HCA and CSA compressors against the reference (entries and their visibility masks), and their cached
form against the uncached one."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsjax.cache import layer_cache
from dsjax.config import CSA, HCA, ModelConfig
from dsjax.model import DeepseekV4
from tests.helpers import CASES, assert_close, layers_of


@pytest.mark.parametrize("case", list(CASES))
def test_compressed_entries_match_reference(load_case, capture, case):
    model, cap = load_case(case), capture(case)
    checked = set()
    for i in layers_of(model.cfg, CSA) + layers_of(model.cfg, HCA):
        comp = model.layer(i).self_attn.compressor
        x = jnp.asarray(cap[f"L{i}.compressor.in0"])
        ref_entries = cap[f"L{i}.compressor.out0"][:, 0]  # [B,1,T,D] -> [B,T,D]
        assert ref_entries.shape[1] > 0
        assert_close(comp.compress(x), ref_entries, what=f"{case} layer {i}")
        checked.add(model.cfg.layer_types[i])
    assert checked == {CSA, HCA}


@pytest.mark.parametrize("case", list(CASES))
def test_hca_visibility_matches_reference_bias(load_case, capture, case):
    model, cap = load_case(case), capture(case)
    for i in layers_of(model.cfg, HCA):
        x = jnp.asarray(cap[f"L{i}.compressor.in0"])
        q_res = jnp.asarray(cap[f"L{i}.compressor.in1"])
        pos = jnp.asarray(cap[f"L{i}.compressor.in2"])
        pos = jnp.broadcast_to(pos, x.shape[:2])
        _, visible = model.layer(i).self_attn.compressor(x, q_res, pos)
        ref_bias = cap[f"L{i}.compressor.out1"][:, 0]  # 0 where visible, -inf elsewhere
        np.testing.assert_array_equal(np.asarray(visible), ref_bias == 0)
        assert not np.all(ref_bias == 0) and np.any(ref_bias == 0)


@pytest.mark.parametrize("attention_type", [CSA, HCA])
def test_cached_compression_in_chunks_matches_compress(attention_type):
    """`compress_into` over uneven chunks (one row shorter) stores the entries `compress` gives for the
    whole sequence, and for CSA the indexer's keys too."""
    cfg = ModelConfig.preset("tiny")
    comp = DeepseekV4(cfg, rngs=nnx.Rngs(2)).layer(layers_of(cfg, attention_type)[0]).self_attn.compressor
    x_bsh = jnp.asarray(np.random.default_rng(0).normal(size=(2, 37, cfg.hidden_size)), jnp.float32)
    lengths = np.asarray([37, 30])
    cache = layer_cache(cfg, attention_type, 2, 40, jnp.float32)
    parts = [(comp, cache.compressor)] + ([(comp.indexer, cache.indexer)] if attention_type == CSA else [])
    for module, state in parts:
        for k in range(0, 37, 7):
            n_valid = jnp.asarray(np.clip(lengths - k, 0, 7))
            state = module.compress_into(x_bsh[:, k:k + 7], state, jnp.asarray(np.minimum(k, lengths)), n_valid)
        for b, n in enumerate(lengths):
            want = module.compress(x_bsh[b:b + 1, :n])[0]
            assert_close(state.entries[b, :len(want)], want, rtol=1e-5, what=f"{type(module).__name__} row {b}")
            assert not np.any(np.asarray(state.entries[b, len(want):]))
