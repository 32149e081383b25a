"""The training objective and loop on the tiny preset: losses, what each aux loss trains, and learning."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsjax.config import ModelConfig
from dsjax.layers.moe import balance_loss
from dsjax.training.loss import LossWeights, evaluate, token_nll, training_loss, unigram_entropy
from dsjax.training.train import TrainConfig, cast_like, init_model, train


@pytest.fixture(scope="module")
def model():
    return init_model(ModelConfig.preset("tiny"), seed=0)


@pytest.fixture(scope="module")
def rows():
    return np.random.default_rng(0).integers(0, 512, (4, 40)).astype(np.int32)


def test_hash_table_sends_each_token_to_distinct_experts(model):
    cfg = model.cfg
    for i, (_, mlp) in enumerate(cfg.layer_kinds):
        if mlp == "hash_moe":
            table = np.asarray(model.layer(i).mlp.gate.tid2eid[...])
            assert table.shape == (cfg.vocab_size, cfg.num_experts_per_tok)
            assert all(len(set(r)) == len(r) for r in table) and table.max() < cfg.n_routed_experts
            assert len(np.unique(table[:, 0])) == cfg.n_routed_experts


def test_recorded_forward_gives_the_same_logits_and_every_intermediate(model, rows):
    plain = model.forward(jnp.asarray(rows))
    logits, per_layer = model.forward(jnp.asarray(rows), record=True)
    np.testing.assert_array_equal(np.asarray(plain), np.asarray(logits))
    assert len(per_layer) == model.cfg.num_hidden_layers
    for (attn, mlp), rec in zip(model.cfg.layer_kinds, per_layer):
        assert rec["attn_hc_comb"].shape == (4, 40, 4, 4) and rec["expert_ids"].shape == (4, 40, 2)
        np.testing.assert_allclose(np.asarray(rec["ffn_hc_comb"]).sum(-2), 1.0, atol=1e-3)  # Sinkhorn
        assert ("indexer_kl" in rec) == (attn == "compressed_sparse_attention")
        assert ("moe_balance" in rec) == (mlp == "moe")
        if "indexer_picks" in rec:
            picks = np.asarray(rec["indexer_picks"])
            assert picks.sum(-1).max() <= model.cfg.index_topk and picks[:, :3].sum() == 0  # causal
            assert float(rec["indexer_kl"]) >= 0


def test_loss_is_mean_nll_and_aux_losses_train_only_their_parts(model, rows):
    tokens = jnp.asarray(rows)
    total, m = training_loss(model, tokens, LossWeights(indexer=1.0, balance=0.01))
    assert float(total) == pytest.approx(float(m["ce"] + m["indexer_kl"] + 0.01 * m["moe_balance"]), rel=1e-6)
    assert float(m["ce"]) == pytest.approx(evaluate(model, rows), rel=1e-5)

    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    # Jitted once, the loss weights traced: op-by-op differentiation of the whole model is slower than
    # compiling it, and both weightings then share one program.
    grad_fn = jax.jit(jax.grad(lambda p, w_indexer, w_balance: training_loss(
        nnx.merge(graphdef, p, rest), tokens, LossWeights(w_indexer, w_balance))[0]))

    def grads(weights):
        return {"/".join(map(str, k)): float(jnp.abs(v.get_value()).sum())
                for k, v in nnx.to_flat_state(grad_fn(params, weights.indexer, weights.balance))}

    ce_only, kl_only = grads(LossWeights(0.0, 0.0)), None
    indexer = [k for k in ce_only if "/indexer/" in k]
    assert indexer and all(ce_only[k] == 0 for k in indexer)  # top-k selection passes no gradient
    kl_only = jax.tree.map(lambda a, b: b - a, ce_only, grads(LossWeights(1.0, 0.0)))
    assert all(kl_only[k] != 0 for k in indexer if "weight" in k)
    assert all(kl_only[k] == 0 for k in ce_only if "/indexer/" not in k)  # the KL is detached from the model


def test_balance_loss_is_one_when_balanced_and_larger_when_not():
    scores = jnp.ones((8, 4))
    balanced = jnp.asarray([[0, 1], [2, 3]] * 4)
    assert float(balance_loss(scores, balanced)) == pytest.approx(1.0)
    skewed = jnp.asarray([[0, 1]] * 8)
    peaked = scores.at[:, :2].set(3.0)
    assert float(balance_loss(peaked, skewed)) > 1.4


def test_unigram_entropy_and_token_nll():
    rows = np.asarray([[5, 1, 1, 2, 2]])
    assert unigram_entropy(rows, 8) == pytest.approx(np.log(2))
    logits = jnp.log(jnp.asarray([[[0.25, 0.75]]]))
    assert float(token_nll(logits, jnp.asarray([[1]]))[0, 0]) == pytest.approx(-np.log(0.75), rel=1e-6)


def test_a_short_run_learns_a_repeating_text_and_casts_for_shipping():
    cfg = ModelConfig.preset("tiny")
    base = np.random.default_rng(1).integers(3, 500, 24)
    rows = np.stack([np.roll(np.tile(base, 3), -i)[:40] for i in range(24)]).astype(np.uint16)
    log = []
    model = train(cfg, TrainConfig(steps=40, batch_size=8, eval_every=20, learning_rate=3e-3), rows[:20],
                  rows[20:], log.append)
    assert [e["step"] for e in log] == [20, 40]
    assert log[-1]["heldout_ce"] < 0.5 * np.log(cfg.vocab_size) and log[-1]["ce"] < log[0]["ce"]
    shipped = cast_like(model, jnp.bfloat16)
    assert shipped.embed_tokens.weight[...].dtype == jnp.bfloat16
    assert shipped.layer(0).attn_hc.fn[...].dtype == jnp.float32  # mHC stays fp32, as the reference keeps it
    assert abs(evaluate(shipped, rows[20:]) - log[-1]["heldout_ce"]) < 0.05


def test_v41_indexer_distillation_trains_only_the_csa2_indexers():
    """V4.1's CSA2 indexers get the same distillation objective: cross-entropy gives them no gradient (top-k passes
    none), the KL reaches every indexer's query side and the Full layers' key projections, and nothing else."""
    from tests.helpers import dspark_model

    model = dspark_model(seed=1)
    tokens = jnp.asarray(np.random.default_rng(2).integers(3, 250, (2, 40)), jnp.int32)
    _, m = training_loss(model, tokens)
    assert float(m["indexer_kl"]) > 0
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    grad_fn = jax.jit(jax.grad(lambda p, w: training_loss(nnx.merge(graphdef, p, rest), tokens,
                                                          LossWeights(w, 0.0))[0]))

    def grads(w):
        return {"/".join(map(str, k)): float(jnp.abs(v.get_value()).sum()) for k, v in
                nnx.to_flat_state(grad_fn(params, w))}

    ce_only = grads(0.0)
    with_kl = grads(1.0)
    indexer = [k for k in ce_only if "/indexer/" in k and not k.startswith("mtp")]
    assert indexer and all(ce_only[k] == 0 for k in indexer)
    moved = {k for k in ce_only if with_kl[k] != ce_only[k]}
    assert moved and moved <= set(indexer)
    assert any("q_b_proj" in k for k in moved) and any("k_proj" in k for k in moved)


_ONE_COMPILE = """
import logging, sys
import jax
import numpy as np
from dsjax.config import ModelConfig
from dsjax.training.train import TrainConfig, train

compiled = []
class Seen(logging.Handler):
    def emit(self, record):
        if record.getMessage().startswith("Compiling jit(step)"):
            compiled.append(record)
logging.getLogger("jax").addHandler(Seen())
jax.config.update("jax_log_compiles", True)
rows = np.tile(np.arange(33) % 7, (8, 1)).astype(np.int32)
log = []
train(ModelConfig.preset("tiny"), TrainConfig(steps=3, batch_size=2, eval_every=1, warmup_steps=1,
      kernels=sys.argv[1]), rows, rows[:2], log.append)
assert [e["step"] for e in log] == [1, 2, 3] and "first_step_seconds" in log[0] and "eval_seconds" in log[0]
print("compiled", len(compiled))
"""


def test_the_training_step_compiles_once_in_a_fresh_process():
    """A fresh interpreter, where nothing has imported tokamax yet: the step compiles once over steps and
    evaluations (an import inside the first trace used to change jax's tracing context and compile it twice)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _ONE_COMPILE, "reference"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-2:] == ["compiled", "1"], out.stdout[-2000:]


def test_training_refuses_an_unknown_kernels_choice():
    with pytest.raises(ValueError, match="kernels"):
        train(ModelConfig.preset("tiny"), TrainConfig(steps=1, batch_size=2, kernels="pallas"),
              np.zeros((4, 9), np.int32), np.zeros((1, 9), np.int32), lambda e: None)


def test_planned_steps_fill_the_rest_of_the_budget_and_no_more():
    from dsjax.training.train import planned_steps

    tc = TrainConfig(steps=1000, eval_every=100, time_budget=100.0)
    # 40 s gone, 0.1 s a step, 2 s an evaluation: 58 s left after the last evaluation, 0.12 s a step with evaluations
    assert planned_steps(tc, 50, 40.0, 0.1, 2.0) == 50 + 483
    assert planned_steps(tc, 50, 40.0, 0.01, 0.0) == 1000  # never past `steps`
    assert planned_steps(tc, 50, 120.0, 0.1, 2.0) == 50  # out of time: stop where it is


def test_a_time_budget_ends_the_run_where_it_runs_out():
    """A budget far too small ends the run after the steps that measure the step time, with a final entry saying
    so; a budget far too large runs every step. Either way the model that comes back has trained."""
    cfg = ModelConfig.preset("tiny")
    rows = np.random.default_rng(0).integers(3, 500, (12, 24)).astype(np.int32)
    short, long = [], []
    m = train(cfg, TrainConfig(steps=40, batch_size=2, eval_every=20, time_budget=1e-3), rows, rows[:2], short.append)
    assert [e["step"] for e in short] == [11] and short[-1]["planned_steps"] == 11
    train(cfg, TrainConfig(steps=40, batch_size=2, eval_every=20, time_budget=1e6), rows, rows[:2], long.append)
    assert [e["step"] for e in long] == [20, 40] and [e["planned_steps"] for e in long] == [40, 40]
    fresh = init_model(cfg, seed=0)
    assert not np.array_equal(np.asarray(m.embed_tokens.weight[...]), np.asarray(fresh.embed_tokens.weight[...]))


def test_evaluations_run_the_kernels_the_steps_run(model, rows):
    """A run's evaluations trace the model with `tc.kernels`, not the model's own setting: on a GPU the evaluation
    would otherwise compile the platform's kernels beside a "reference" run's XLA programs."""
    from dsjax.training.train import TARGET, fit

    seen = []

    def evaluate_fn(m):
        seen.append({getattr(sub, "kernels") for _, sub in nnx.iter_graph(m) if hasattr(sub, "kernels")})
        return {}

    assert {getattr(sub, "kernels") for _, sub in nnx.iter_graph(model) if hasattr(sub, "kernels")} == {"auto"}
    fit(model, TARGET, lambda m, tokens, key: training_loss(m, tokens, LossWeights()),
        TrainConfig(steps=2, batch_size=2, eval_every=1, kernels="reference"), rows, evaluate_fn, lambda e: None)
    assert seen == [{"reference"}, {"reference"}]
