"""The DSpark drafter's training objective and loop (`dsjax/training/dspark.py`) on a tiny V4.1 with three stages."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsjax.layers.dspark import context_keys, context_visible, draft_heads, draft_states, main_states
from dsjax.training.dspark import DraftLossWeights, block_losses, evaluate_drafter, sample_anchors, train_drafter
from dsjax.training.train import TARGET, TrainConfig, train
from tests.helpers import dspark_model


@pytest.fixture(scope="module")
def model():
    return dspark_model(seed=2)


def test_anchors_are_distinct_increasing_and_leave_a_next_token():
    a = np.asarray(sample_anchors(jax.random.key(0), 3, 10, 9))
    assert a.shape == (3, 9) and (np.diff(a, axis=1) > 0).all()
    assert (a == np.arange(9)).all()  # every position but the last: all of them
    b = np.asarray(sample_anchors(jax.random.key(1), 64, 40, 4))
    assert b.min() >= 0 and b.max() <= 38 and (np.diff(b, axis=1) > 0).all()
    assert len(np.unique(b[:, 0])) > 5  # random, not fixed
    with pytest.raises(ValueError, match="10 anchors do not fit rows of 10 tokens"):
        sample_anchors(jax.random.key(0), 1, 10, 10)


def _reference_block(model, tokens_s, anchor):
    """One block as the engine drafts it: every context key of the row, masked by `context_visible`."""
    cfg = model.cfg
    k = cfg.dspark_block_size
    s = tokens_s.shape[0]
    hidden, per_layer = model.hidden_states(tokens_s[None], record=True)
    from dsjax.layers.dspark import target_features
    feats = target_features([per_layer[i]["attn_streams"] for i in cfg.dspark_target_layer_ids])
    positions = jnp.arange(s)[None]
    contexts = context_keys(model.mtp, main_states(model.mtp, feats), positions)
    visible = jnp.broadcast_to(context_visible(positions, jnp.asarray([anchor]), cfg.sliding_window)[:, None], (1, k, s))
    ids = jnp.asarray([[int(tokens_s[anchor])] + [cfg.dspark_noise_token_id] * (k - 1)])
    state = draft_states(model.mtp, model.embed_tokens(ids), anchor + jnp.arange(k)[None], contexts, visible)
    previous = jnp.asarray([[int(tokens_s[min(anchor + i, s - 1)]) for i in range(k)]])
    normed, transition, confidence = draft_heads(model.mtp, state, previous)
    return model.logits(normed) + transition, confidence, model.logits(hidden)[0]


def test_training_blocks_are_the_blocks_the_engine_drafts(model):
    """The windowed gather of context keys gives each anchor's block exactly what the full-row formulation with
    `context_visible` (the engine's) gives: at the row's start (a window cut short), in the middle (a full window
    of 8) and where the block runs past the row's end (those targets masked)."""
    tokens = jnp.asarray(np.random.default_rng(3).integers(3, 250, 30), jnp.int32)
    anchors = jnp.asarray([[0, 3, 17, 27]], jnp.int32)
    k = model.cfg.dspark_block_size
    _, m = block_losses(model, tokens[None], anchors)
    # recompute the objective's parts from the reference blocks
    ce, l1, n = 0.0, 0.0, 0
    keep = np.zeros(k)
    counts = np.zeros(k)
    for a in [0, 3, 17, 27]:
        logits, _, target = _reference_block(model, tokens, a)
        for i in range(k):
            if a + 1 + i >= 30:
                continue
            lp = jax.nn.log_softmax(logits[0, i])
            ce -= float(lp[int(tokens[a + 1 + i])])
            p, q = jax.nn.softmax(logits[0, i]), jax.nn.softmax(target[a + i])
            d = float(jnp.abs(p - q).sum())
            assert 1 - 0.5 * d == pytest.approx(float(jnp.minimum(p, q).sum()), abs=1e-5)  # the keep chance
            l1 += d
            keep[i] += 1 - 0.5 * d
            counts[i] += 1
            n += 1
    assert float(m["draft_ce"]) == pytest.approx(ce / n, rel=1e-5)
    assert float(m["draft_l1"]) == pytest.approx(l1 / n, rel=1e-5)
    np.testing.assert_allclose(np.asarray(m["keep_by_position"]), keep / counts, rtol=1e-5)


def test_confidence_term_is_the_bce_against_the_detached_keep_chance(model):
    tokens = jnp.asarray(np.random.default_rng(4).integers(3, 250, (2, 24)), jnp.int32)
    anchors = jnp.asarray([[2, 9], [0, 15]], jnp.int32)
    only = DraftLossWeights(ce=0.0, l1=0.0, confidence=1.0)
    graphdef, stages, rest = nnx.split(model, nnx.PathContains("mtp"), ...)
    grads = jax.grad(lambda p: block_losses(nnx.merge(graphdef, p, rest), tokens, anchors, only)[0])(stages)
    flat = {"/".join(map(str, k)): float(jnp.abs(v.get_value()).sum()) for k, v in nnx.to_flat_state(grads)}
    assert any(v > 0 for k, v in flat.items() if "confidence_head" in k)
    # the target of the BCE is detached: the Markov head's output (draft logits) gets no gradient from it
    assert flat["mtp/2/markov_head/head/weight"] == 0


@pytest.mark.heavy
def test_the_target_then_the_drafter_learn_and_each_leaves_the_other_alone():
    """A repeating text: the target's training leaves the stages at their initial weights, the drafter's leaves
    the target bit for bit, and the drafter's keep rate and expected accepted length rise."""
    cfg = dspark_model().cfg
    base = np.random.default_rng(1).integers(3, 250, 12)
    rows = np.stack([np.roll(np.tile(base, 4), -i)[:40] for i in range(12)]).astype(np.uint16)
    fresh = nnx.state(dspark_model().__class__(cfg, rngs=nnx.Rngs(0)), nnx.PathContains("mtp"))
    target = train(cfg, TrainConfig(steps=30, batch_size=6, eval_every=30, learning_rate=3e-3), rows[:10], rows[10:],
                   lambda e: None)
    stages_after = nnx.state(target, nnx.PathContains("mtp"))
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), fresh, stages_after))
    before = evaluate_drafter(target, rows[10:], anchors=8)
    log = []
    drafter = train_drafter(target, TrainConfig(steps=30, batch_size=6, eval_every=15, learning_rate=3e-3),
                            rows[:10], rows[10:], DraftLossWeights(anchors=8), log.append)
    assert [e["step"] for e in log] == [15, 30]
    same = jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), nnx.state(target, TARGET), nnx.state(drafter, TARGET))
    assert jax.tree.all(same)
    after = log[-1]
    assert after["heldout_expected_accepted"] > before["heldout_expected_accepted"] + 0.5
    assert after["heldout_draft_ce"] < before["heldout_draft_ce"]
    assert len(after["keep_by_position"]) == cfg.dspark_block_size


def test_train_drafter_refuses_a_model_without_stages():
    from dsjax.config_v41 import V41Config
    from dsjax.model_v41 import DeepseekV41

    plain = DeepseekV41(V41Config.preset("tiny-v4.1"), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="no DSpark stages to train"):
        train_drafter(plain, TrainConfig(steps=1), np.zeros((2, 16), np.uint16), np.zeros((1, 16), np.uint16))
