"""The optimiser loop: AdamW on fp32 master weights, forward and backward in `compute_dtype`.

Reproducible from the seed: initial weights, the hash-routing table, the row order and any sampling inside
the loss all derive from it. The aux losses (indexer distillation, expert balance) are those of `training_loss`.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from dsjax.config import ModelConfig
from dsjax.config_v41 import V41Config
from dsjax.model import DeepseekV4, with_kernels
from dsjax.model_v41 import DeepseekV41
from dsjax.training.loss import LossWeights, evaluate, training_loss


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 4000
    batch_size: int = 32
    learning_rate: float = 3e-3
    warmup_steps: int = 200
    final_lr_fraction: float = 0.05
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    compute_dtype: str = "bfloat16"
    seed: int = 0
    eval_every: int = 500
    loss_weights: LossWeights = LossWeights()
    # How the forward's kernel-backed operations run, and so what is differentiated (`dsjax.run_config.KERNELS`).
    kernels: str = "auto"
    # Seconds the loop may take, compilation and evaluations included: the run then ends when it runs out, its
    # learning-rate schedule fitted to the steps that fit (at most `steps`). None: exactly `steps` steps.
    time_budget: float | None = None


Model = DeepseekV4 | DeepseekV41
# Everything but DSpark's stages: the target. The stages train afterwards against it frozen (`training.dspark`).
TARGET = nnx.All(nnx.Param, nnx.Not(nnx.PathContains("mtp")))


def _model_class(cfg: ModelConfig | V41Config) -> type:
    return DeepseekV41 if isinstance(cfg, V41Config) else DeepseekV4


def init_model(cfg: ModelConfig | V41Config, seed: int, dtype=jnp.float32, token_map: np.ndarray | None = None
               ) -> Model:
    """Fresh weights from `seed` (either family), with a hash-routing table that sends each token to k distinct
    experts; a V4.1 model's Engram hashes with `token_map` (the tokenizer's, `engram_hash.tokenizer_token_map`)."""
    extra = {} if token_map is None else {"token_map": token_map}
    model = _model_class(cfg)(cfg, rngs=nnx.Rngs(seed), dtype=dtype, **extra)
    rng = np.random.default_rng(seed)
    k, e = cfg.num_experts_per_tok, cfg.n_routed_experts
    for path, var in nnx.to_flat_state(nnx.state(model)):
        if path[-1] == "tid2eid":
            shape = var.get_value().shape  # [repeats, V, k]
            table = np.stack([np.argsort(rng.random((shape[1], e)), axis=-1)[:, :k] for _ in range(shape[0])])
            var.set_value(jnp.asarray(table, var.get_value().dtype))
    return model


def cast_like(model: Model, dtype) -> Model:
    """`model` with each weight in the dtype a model built with `dtype` gives it (fp32 ones stay fp32)."""
    target = nnx.eval_shape(lambda: _model_class(model.cfg)(model.cfg, rngs=nnx.Rngs(0), dtype=dtype))
    graphdef, abstract = nnx.split(target)
    state = jax.tree.map(lambda a, v: jnp.asarray(v).astype(a.dtype), abstract, nnx.state(model))
    return nnx.merge(graphdef, state)


def _schedule(tc: TrainConfig, steps: int) -> optax.Schedule:
    """Warm-up then cosine decay over `steps` (the run's length, which a time budget may set while it runs)."""
    warmup = min(tc.warmup_steps, steps // 2)  # short runs (tests) still decay
    return optax.warmup_cosine_decay_schedule(0.0, tc.learning_rate, warmup, steps,
                                              tc.learning_rate * tc.final_lr_fraction)


def _optimizer(tc: TrainConfig) -> optax.GradientTransformation:
    """Clipping, then AdamW whose learning rate is an input of each step (`_LR`), so that the schedule's length can
    change without compiling the step again."""
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)  # noqa: E731
    adamw = optax.inject_hyperparams(optax.adamw, static_args=("mask",))
    return optax.chain(optax.clip_by_global_norm(tc.grad_clip),
                       adamw(learning_rate=0.0, b1=0.9, b2=0.95, weight_decay=tc.weight_decay, mask=decay_mask))


_LR = 1  # the chain's AdamW state, whose hyperparams hold the learning rate


def planned_steps(tc: TrainConfig, done: int, elapsed: float, step_seconds: float, eval_seconds: float) -> int:
    """The run's length when `done` steps took `elapsed` seconds of `tc.time_budget` (compilation included) and
    a step now takes `step_seconds`, an evaluation (every `eval_every` steps and at the end) `eval_seconds`: as
    many more steps as the rest of the budget holds, the last evaluation included, and at most `tc.steps`."""
    per_step = step_seconds + eval_seconds / tc.eval_every
    more = int((tc.time_budget - elapsed - eval_seconds) // per_step) if per_step > 0 else tc.steps
    return int(min(tc.steps, max(done, done + more)))


def fit(model: Model, trainable: nnx.filterlib.Filter, loss: Callable, tc: TrainConfig, train_rows: np.ndarray,
        evaluate_fn: Callable[[Model], dict], log: Callable[[dict], None] = print) -> Model:
    """AdamW on the `trainable` weights of `model` (the rest frozen), forward and backward in `tc.compute_dtype`:
    `loss(model, tokens [B,S], key) → (total, metrics)` on `tc.batch_size` rows drawn from `train_rows` each step.
    Logs the mean metrics and `evaluate_fn(model)` (the model running `tc.kernels`) every `eval_every` steps and at
    the end. With `tc.time_budget`, the run's length (and its learning-rate schedule) is set from the steps' measured
    time, at most `tc.steps`: after the first steps, then at every evaluation; each entry says it (`planned_steps`)."""
    cls = _model_class(model.cfg)
    compute = with_kernels(nnx.eval_shape(lambda: cls(model.cfg, rngs=nnx.Rngs(0), dtype=jnp.dtype(tc.compute_dtype))),
                           tc.kernels)
    compute_graphdef, compute_train, compute_frozen, _ = nnx.split(compute, trainable, nnx.Param, ...)
    graphdef, params, frozen, rest = nnx.split(model, trainable, nnx.Param, ...)
    dtypes = jax.tree.map(lambda a: a.dtype, compute_train)
    frozen_compute = jax.tree.map(lambda x, a: jnp.asarray(x).astype(a.dtype), frozen, compute_frozen)
    tx = _optimizer(tc)
    opt_state = tx.init(params)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt_state, frozen, rest, tokens, key, lr):
        def loss_fn(p):
            p = jax.tree.map(lambda x, d: x.astype(d), p, dtypes)
            return loss(nnx.merge(compute_graphdef, p, frozen, rest), tokens, key)

        (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        opt_state[_LR].hyperparams["learning_rate"] = lr
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, dict(metrics, grad_norm=optax.tree.norm(grads))

    def replan(done: int, elapsed: float, step_seconds: float, eval_seconds: float) -> tuple[int, optax.Schedule]:
        steps = planned_steps(tc, done, elapsed, step_seconds, eval_seconds)
        return steps, _schedule(tc, steps)

    rng = np.random.default_rng(tc.seed)
    key = jax.random.key(tc.seed)
    total = tc.steps
    schedule = _schedule(tc, total)
    probe = min(10, tc.eval_every)  # steps after the first whose time sets a budgeted run's length before any evaluation
    t0, tokens_seen, running, timing = time.perf_counter(), 0, [], {}
    t_mark, i_mark, eval_seconds = t0, 0, 0.0
    i = 0
    while i < total:
        i += 1
        batch = train_rows[rng.integers(0, len(train_rows), tc.batch_size)].astype(np.int32)
        params, opt_state, metrics = step(params, opt_state, frozen_compute, rest, jnp.asarray(batch),
                                          jax.random.fold_in(key, i), jnp.asarray(schedule(i - 1), jnp.float32))
        tokens_seen += batch.size
        running.append(metrics)
        if i == 1 or (tc.time_budget and i == 1 + probe):
            jax.block_until_ready(params)
            now = time.perf_counter()
            if i == 1:  # compilation and one step, apart from the steady state that the later entries show
                timing["first_step_seconds"] = round(now - t0, 1)
            elif i < total:
                total, schedule = replan(i, now - t0, (now - t_mark) / (i - i_mark), eval_seconds)
            t_mark, i_mark = now, i
        if i % tc.eval_every == 0 or i == total:
            host = jax.device_get(running)
            running = []
            now = time.perf_counter()
            entry = {"step": i, "tokens": tokens_seen, "seconds": round(now - t0, 1), **timing}
            step_seconds = (now - t_mark) / max(i - i_mark, 1)
            timing = {}
            for k in host[0]:
                mean = np.mean([np.asarray(m[k], np.float64) for m in host], axis=0)
                entry[k] = round(float(mean), 4) if mean.ndim == 0 else [round(float(x), 4) for x in mean]
            t_eval = time.perf_counter()
            # the evaluation runs the kernels the steps run (on a GPU, "reference" keeps its compile short too)
            entry.update(evaluate_fn(with_kernels(nnx.merge(graphdef, params, frozen, rest), tc.kernels)))
            t_mark, i_mark = time.perf_counter(), i
            eval_seconds = t_mark - t_eval
            entry["eval_seconds"] = round(eval_seconds, 1)
            if tc.time_budget and i < total:
                total, schedule = replan(i, t_mark - t0, step_seconds, eval_seconds)
            if tc.time_budget:
                entry["planned_steps"] = total
            log(entry)
    return nnx.merge(graphdef, params, frozen, rest)


def train(cfg: ModelConfig | V41Config, tc: TrainConfig, train_rows: np.ndarray, heldout_rows: np.ndarray,
          log: Callable[[dict], None] = print, token_map: np.ndarray | None = None) -> Model:
    """Train a model of `cfg` from scratch on `train_rows [N, S]` (a V4.1 model's DSpark stages excepted, which
    keep their initial weights); logs a dict every `eval_every` steps and at the end."""
    return fit(init_model(cfg, tc.seed, token_map=token_map), TARGET, lambda m, tokens, key: training_loss(m, tokens, tc.loss_weights),
               tc, train_rows, lambda m: {"heldout_ce": round(evaluate(m, heldout_rows), 4)}, log)
