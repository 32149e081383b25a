"""Attention block (q path, shared KV, sinks, window + compressed keys, de-rotation, grouped output)
against the reference module, layer by layer."""

import jax.numpy as jnp
import numpy as np
import pytest

from dsjax.layers.attention import window_visible
from tests.helpers import CASES, assert_close


def positions(batch, t):
    return jnp.broadcast_to(jnp.arange(t), (batch, t))


@pytest.mark.parametrize("case", list(CASES))
def test_attention_matches_reference(load_case, capture, case):
    model, cap = load_case(case), capture(case)
    for i in range(CASES[case]):
        x = cap[f"L{i}.self_attn.in0"]
        ours = model.layer(i).self_attn(jnp.asarray(x), positions(*x.shape[:2]))
        assert_close(ours, cap[f"L{i}.self_attn.out0"], what=f"{case} layer {i} ({model.cfg.layer_types[i]})")


def test_window_sees_sw_keys_including_itself():
    pos = jnp.arange(10)[None]
    vis = np.asarray(window_visible(pos, pos, 4))[0]
    assert vis[9].tolist() == [False] * 6 + [True] * 4
    assert vis[0].tolist() == [True] + [False] * 9
