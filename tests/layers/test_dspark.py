"""DSpark's stages on random weights: what a draft block sees (its context window, the whole block), the stages'
MoE, and the release names of `mtp.*` (parity with NeMo: tests/test_dspark_matches_reference.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsjax.checkpoint import names_v41
from dsjax.config_v41 import V41Config
from dsjax.layers import dspark

CFG = V41Config.preset("tiny-v4.1").replace(
    num_nextn_predict_layers=3, compress_ratios=V41Config.preset("tiny-v4.1").compress_ratios + (0, 0, 0),
    dspark_block_size=5, dspark_noise_token_id=254, dspark_target_layer_ids=(5, 6, 7), dspark_markov_rank=8,
    dspark_n_routed_experts=6, dspark_num_experts_per_tok=3)
T, K = 20, CFG.dspark_block_size


@pytest.fixture(scope="module")
def stages():
    out = nnx.List([dspark.DSparkStage(CFG, s == 0, s == 2, rngs=nnx.Rngs(s)) for s in range(3)])
    for path, var in nnx.to_flat_state(nnx.state(out, nnx.Variable)):  # non-trivial gates and sinks
        if path[-1] in ("sinks", "e_score_correction_bias", "base"):
            var.set_value(jax.random.normal(jax.random.key(len(path)), var.get_value().shape, jnp.float32))
    return out


def block_states(stages, features_btf, x_bkh, anchor: int) -> np.ndarray:
    positions = jnp.arange(T)[None]
    keys = dspark.context_keys(stages, dspark.main_states(stages, features_btf), positions)
    visible = dspark.context_visible(positions, jnp.asarray([anchor]), CFG.sliding_window)
    block = anchor + jnp.arange(K)[None]
    return np.asarray(dspark.draft_states(stages, x_bkh, block, keys, jnp.broadcast_to(visible[:, None], (1, K, T))))


@pytest.fixture(scope="module")
def inputs():
    rng = np.random.default_rng(0)
    features = jnp.asarray(rng.normal(size=(1, T, 3 * CFG.hidden_size)), jnp.float32)
    x = jnp.asarray(rng.normal(size=(1, K, CFG.hidden_size)), jnp.float32)
    return features, x


def test_a_block_sees_the_window_before_its_anchor_only(stages, inputs):
    """The context keys at a − window … a − 1 move every draft state; those before the window, at the anchor or
    after it do not (they are the target's positions the block itself stands for)."""
    features, x = inputs
    anchor = 14
    base = block_states(stages, features, x, anchor)
    for t in range(T):
        changed = features.at[0, t].add(1.0)
        moved = np.abs(block_states(stages, changed, x, anchor) - base).max(axis=(0, 2))
        inside = anchor - CFG.sliding_window <= t < anchor
        assert (moved > 1e-6).all() if inside else (moved == 0).all(), (t, moved)


def test_a_block_is_bidirectional(stages, inputs):
    """Every draft position reads every other one: changing the last input moves the first position's state."""
    features, x = inputs
    base = block_states(stages, features, x, 9)
    moved = block_states(stages, features, x.at[0, K - 1].add(1.0), 9)
    assert (np.abs(moved - base).max(axis=(0, 2)) > 1e-6).all()


def test_heads_draft_the_next_tokens_from_previous_ones(stages, inputs):
    """The Markov bias depends on each position's previous token alone; the confidence logits are fp32, one a
    position."""
    features, x = inputs
    state = jnp.asarray(block_states(stages, features, x, 9))
    previous = jnp.asarray([[3, 4, 5, 6, 7]])
    normed, transition, confidence = dspark.draft_heads(stages, state, previous)
    _, again, _ = dspark.draft_heads(stages, state, previous.at[0, 2].set(8))
    changed = np.abs(np.asarray(again - transition)).max(axis=(0, 2))
    assert (changed[[0, 1, 3, 4]] == 0).all() and changed[2] > 0
    assert transition.dtype == confidence.dtype == jnp.float32 and confidence.shape == (1, K)
    assert normed.shape == state.shape


def test_the_stages_route_over_their_own_experts(stages):
    moe = stages[1].ffn
    assert moe.gate.weight.shape == (CFG.dspark_n_routed_experts, CFG.hidden_size)
    assert moe.gate.cfg.num_experts_per_tok == CFG.dspark_num_experts_per_tok
    assert not hasattr(moe.gate, "bias_vl")
    assert stages[0].main_proj is not None and stages[1].main_proj is None and stages[2].markov_head is not None


@pytest.mark.parametrize("release, ours", [
    ("mtp.2.attn.wq_a.weight", "mtp.2.attn.q_a_proj.weight"),
    ("mtp.0.hc_ffn_fn", "mtp.0.ffn_hc.fn"),
    ("mtp.1.ffn.gate.bias", "mtp.1.ffn.gate.e_score_correction_bias"),
    ("mtp.0.main_proj.weight", "mtp.0.main_proj.weight"),
    ("mtp.2.markov_head.embed.weight", "mtp.2.markov_head.embed.weight"),
    ("mtp.2.confidence_head.proj.weight", "mtp.2.confidence_head.proj.weight"),
])
def test_release_names_of_the_stages(release, ours):
    assert names_v41.to_dsjax(release) == ours and names_v41.to_release(ours) == release


def test_release_expert_names_of_the_stages():
    part = names_v41.to_dsjax("mtp.1.ffn.experts.5.w3.weight")
    assert (part.path, part.expert, part.part) == ("mtp.1.ffn.experts.gate_up_proj", 5, "w3")
