"""Speculative decoding's drafts and verification (dsjax.engine.speculative): the emitted tokens' distribution is the
target's (chi-square over many seeds on a toy vocabulary, and a wrong draft distribution that the test catches),
greedy verification is the longest matching prefix, a row's result depends on its seed alone, and DSpark's greedy
drafts follow its heads token by token."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy import stats

from dsjax.cache import init_cache
from dsjax.config_v41 import V41Config
from dsjax.engine import speculative
from dsjax.engine.sampling import SamplingArrays, SamplingParams, distribution
from dsjax.layers import dspark
from dsjax.model_v41 import DeepseekV41
from tests.helpers import dspark_model

V, K, N = 6, 3, 40_000  # toy vocabulary, drafts a step, rows (one seed each)
P_MIN = 1e-6  # the seeds are fixed, so a pass or a failure is deterministic


def _toy(seed: int):
    rng = np.random.default_rng(seed)
    target = rng.normal(0, 1.5, (K + 1, V))  # logits at positions 0 … K
    # The draft's at 0 … K − 1: near the target's, as a trained drafter's are, so that every count of kept drafts
    # happens often, yet different enough that many are rejected.
    return jnp.asarray(target, jnp.float32), jnp.asarray(target[:K] + rng.normal(0, 1.0, (K, V)), jnp.float32)


def _arrays(params: SamplingParams, n: int) -> SamplingArrays:
    return SamplingArrays.of([params] * n, list(range(n)))


def _run(params: SamplingParams, n_draft: int, seed: int = 0, wrong_draft_probs: bool = False):
    """Each row: drafts drawn from the draft distributions, verified against the target's; returns the target's
    distributions per position and the emitted tokens (−1 past what a row emitted)."""
    target, draft = _toy(seed)
    arrays = _arrays(params, N)
    one = _arrays(params, 1)
    q = np.asarray(distribution(target, SamplingArrays(*(jnp.repeat(x, K + 1) for x in (
        one.temperature, one.top_k, one.top_p, one.seed)), modes=one.modes)))
    p = distribution(draft, SamplingArrays(*(jnp.repeat(x, K) for x in (one.temperature, one.top_k, one.top_p,
                                                                          one.seed)), modes=one.modes))
    position = jnp.full((N,), 100, jnp.int32)
    drafts = jnp.stack([speculative.draw(jnp.broadcast_to(p[i], (N, V)), arrays.seed, position + i,
                                         speculative.DRAFT_STREAM) for i in range(K)], 1)
    probs = jnp.broadcast_to(jnp.full((K, V), 1 / V) if wrong_draft_probs else p, (N, K, V))
    out = speculative.verify(jnp.broadcast_to(target, (N, K + 1, V)), drafts, probs, jnp.full((N,), n_draft),
                             arrays, position)
    accepted, token, drafts = np.asarray(out.accepted), np.asarray(out.token), np.asarray(drafts)
    emitted = np.full((N, K + 1), -1)
    for i in range(K + 1):
        emitted[:, i] = np.where(accepted > i, drafts[:, min(i, K - 1)], np.where(accepted == i, token, -1))
    return q, emitted, accepted


def _p_value(tokens: np.ndarray, q: np.ndarray) -> float:
    counts = np.bincount(tokens, minlength=V)
    assert counts[q == 0].sum() == 0, "a token outside the target's top-k/top-p cut was emitted"
    support = q > 0
    if support.sum() < 2:
        return 1.0
    expected = q[support].astype(np.float64)
    return float(stats.chisquare(counts[support], expected / expected.sum() * counts.sum()).pvalue)


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=4, top_p=0.9)],
                         ids=["plain", "filtered"])
def test_emitted_tokens_are_distributed_as_the_target_samples(params):
    """Position i's token (where a row emits one) against the target's distribution at i: the drafts the
    verification keeps and the token it draws after them are, together, the target's samples."""
    q, emitted, accepted = _run(params, K)
    assert 0.05 < (accepted == 0).mean() < 0.95 and (accepted == K).any()  # the drafts are neither all right nor wrong
    for i in range(K + 1):
        got = emitted[:, i][emitted[:, i] >= 0]
        assert got.size > 1000
        assert _p_value(got, q[i]) > P_MIN, f"position {i}"


def test_a_wrong_draft_distribution_is_caught():
    """The test's power: verifying drafts against a distribution they were not drawn from (uniform) biases the
    emitted tokens, and the chi-square test sees it."""
    q, emitted, _ = _run(SamplingParams(temperature=1.0), K, wrong_draft_probs=True)
    assert min(_p_value(emitted[:, i][emitted[:, i] >= 0], q[i]) for i in range(K)) < P_MIN


def test_fewer_drafts_a_row_verify_only_those():
    q, emitted, accepted = _run(SamplingParams(temperature=1.0), 1)
    assert accepted.max() == 1 and (emitted[:, 2:] == -1).all()
    assert _p_value(emitted[:, 0], q[0]) > P_MIN and _p_value(emitted[:, 1][emitted[:, 1] >= 0], q[1]) > P_MIN


def test_greedy_keeps_the_longest_matching_prefix_then_the_target_argmax():
    rng = np.random.default_rng(3)
    b = 64
    target = jnp.asarray(rng.normal(size=(b, K + 1, V)), jnp.float32)
    best = np.asarray(jnp.argmax(target, -1))
    # Drafts right up to a random place, then wrong there (and random after it).
    right = rng.integers(0, K + 1, b)
    drafts = np.where(np.arange(K) < right[:, None], best[:, :K], (best[:, :K] + rng.integers(1, V, (b, K))) % V)
    n_draft = rng.integers(0, K + 1, b)
    arrays = _arrays(SamplingParams(temperature=0.0), b)
    onehot = jax.nn.one_hot(drafts, V)
    out = speculative.verify(target, jnp.asarray(drafts), onehot, jnp.asarray(n_draft), arrays,
                             jnp.arange(b, dtype=jnp.int32))
    want = np.minimum(right, n_draft)
    np.testing.assert_array_equal(np.asarray(out.accepted), want)
    np.testing.assert_array_equal(np.asarray(out.token), best[np.arange(b), want])


def test_a_rows_result_depends_on_its_seed_alone():
    target, draft = _toy(1)
    params = [SamplingParams(temperature=0.9, seed=s) for s in (11, 22, 33)]
    arrays = SamplingArrays.of(params, [0, 0, 0])
    p = jnp.broadcast_to(jax.nn.softmax(draft / 0.9, -1), (3, K, V))
    drafts = jnp.asarray([[1, 2, 3], [0, 0, 0], [5, 4, 3]])
    pos = jnp.asarray([7, 30, 9])
    whole = speculative.verify(jnp.broadcast_to(target, (3, K + 1, V)), drafts, p, jnp.asarray([3, 2, 3]), arrays, pos)
    alone = speculative.verify(target[None], drafts[1:2], p[1:2], jnp.asarray([2]),
                               SamplingArrays.of(params[1:2], [0]), pos[1:2])
    assert (int(whole.accepted[1]), int(whole.token[1])) == (int(alone.accepted[0]), int(alone.token[0]))


def test_greedy_drafts_follow_the_heads_token_by_token():
    """Draft i is the argmax of head(norm(h_i)) plus the Markov bias of draft i − 1 (the emitted token first);
    confidences are probabilities."""
    base = V41Config.preset("tiny-v4.1")
    cfg = base.replace(num_nextn_predict_layers=2, compress_ratios=base.compress_ratios + (0, 0),
                       dspark_block_size=4, dspark_noise_token_id=254, dspark_target_layer_ids=(5, 6, 7),
                       dspark_markov_rank=8, dspark_n_routed_experts=4, dspark_num_experts_per_tok=2)
    model = DeepseekV41(cfg, rngs=nnx.Rngs(0))
    markov = model.mtp[-1].markov_head.head
    markov.weight.set_value(markov.weight[...] * 200)  # a bias strong enough to change the argmax
    state = jax.random.normal(jax.random.key(1), (3, cfg.dspark_block_size, cfg.hidden_size))
    first = jnp.asarray([5, 17, 200])
    drafts = speculative.draft_tokens(model, state, first, _arrays(SamplingParams(temperature=0.0), 3),
                                      jnp.asarray([10, 20, 30]))
    previous = jnp.concatenate([first[:, None], drafts.tokens[:, :-1]], 1)
    normed, transition, _ = dspark.draft_heads(model.mtp, state, previous)
    np.testing.assert_array_equal(drafts.tokens, jnp.argmax(model.logits(normed) + transition, -1))
    head_only = jnp.argmax(model.logits(normed), -1)
    assert (np.asarray(head_only) != np.asarray(drafts.tokens)).any()  # the Markov bias mattered
    np.testing.assert_array_equal(drafts.probs.max(-1), 1.0)
    assert ((drafts.confidence > 0) & (drafts.confidence < 1)).all()


_extend = jax.jit(lambda m, tokens, cache, start, n: m.extend(tokens, cache, start, n))
_extend_recorded = jax.jit(lambda m, tokens, cache, start, n: (lambda r: (*m.extend(tokens, cache, start, n, record=r),
                                                                          r))({}))
_step = jax.jit(speculative.speculative_step)
_propose = jax.jit(speculative.propose)
_context = jax.jit(speculative.write_context)


def _prefill(model, prompts, max_len, chunk=8):
    """The prompts through the cache in chunks (their DSpark context keys written); the greedy first token."""
    b = len(prompts)
    lengths = jnp.asarray([len(p) for p in prompts], jnp.int32)
    cache = init_cache(model, b, max_len)
    rings = speculative.new_state(model, b).rings
    last = np.zeros((b, model.cfg.vocab_size), np.float32)
    for start in range(0, max(map(len, prompts)), chunk):
        ids = np.zeros((b, chunk), np.int32)
        for r, p in enumerate(prompts):
            ids[r, :max(0, min(chunk, len(p) - start))] = p[start:start + chunk]
        n = jnp.clip(lengths - start, 0, chunk)
        hidden, cache, record = _extend_recorded(model, jnp.asarray(ids), cache, jnp.full((b,), start, jnp.int32), n)
        rings = _context(model, rings, record["features"], jnp.full((b,), start, jnp.int32), n)
        logits = np.asarray(model.logits(hidden))
        for r, p in enumerate(prompts):
            if start <= len(p) - 1 < start + chunk:
                last[r] = logits[r, len(p) - 1 - start]
    return cache, rings, jnp.asarray(last.argmax(-1), jnp.int32)


def _greedy_plain(model, prompts, steps, max_len):
    cache, _, token = _prefill(model, prompts, max_len)
    out = [token]
    for _ in range(steps - 1):
        hidden, cache = _extend(model, token[:, None], cache, cache.lengths, jnp.ones_like(token))
        token = jnp.argmax(model.logits(hidden)[:, 0], -1).astype(jnp.int32)
        out.append(token)
    return np.stack([np.asarray(t) for t in out], 1)


def _greedy_speculative(model, prompts, steps, max_len, oracle=None, seed=0):
    """Greedy decoding by DSpark drafts and verification; with `oracle` (the right tokens `[B, steps]`), the drafts
    are replaced before each step by the right ones with random corruptions, so that every count of kept drafts
    happens. Returns the tokens and the counts of kept drafts seen."""
    b = len(prompts)
    params = SamplingArrays.of([SamplingParams(temperature=0.0)] * b, [0] * b)
    cache, rings, token = _prefill(model, prompts, max_len)
    state = speculative.DraftState(rings, token, _propose(model, rings, token, cache.lengths, params),
                                   jnp.full((b,), 10 ** 6, jnp.int32))
    k = model.cfg.dspark_block_size
    out = [[int(t)] for t in np.asarray(token)]
    kept_seen, rng = [], np.random.default_rng(seed)
    while min(map(len, out)) < steps:
        if oracle is not None:
            drafts = np.zeros((b, k), np.int64)
            for r in range(b):
                right = oracle[r, len(out[r]):len(out[r]) + k]
                right = np.pad(right, (0, k - len(right)))
                wrong = rng.random(k) < 0.25
                drafts[r] = np.where(wrong, (right + 1 + rng.integers(0, 200, k)) % model.cfg.vocab_size, right)
            state = dataclasses.replace(state, drafts=speculative.Drafts(
                jnp.asarray(drafts, jnp.int32), jax.nn.one_hot(drafts, model.cfg.vocab_size), state.drafts.confidence))
        n_draft = jnp.asarray(rng.integers(0, k + 1, b) if oracle is not None else np.full(b, k), jnp.int32)
        cache, state, emitted, n = _step(model, cache, state, params, n_draft)
        for r in range(b):
            out[r] += np.asarray(emitted[r, :int(n[r])]).tolist()
            kept_seen.append(int(n[r]) - 1)
    return np.asarray([o[:steps] for o in out]), kept_seen


@pytest.fixture(scope="module")
def drafting():
    model = dspark_model(0)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(3, 250, 11).tolist(), rng.integers(3, 250, 14).tolist()]
    return model, prompts


def test_greedy_with_drafts_often_right_gives_the_same_tokens(drafting):
    """Drafts that are the right tokens but for random corruptions, and random draft counts a step (0 … k): every
    count of kept drafts happens, and the tokens are still those of plain greedy decoding."""
    model, prompts = drafting
    steps, max_len = 24, 64
    want = _greedy_plain(model, prompts, steps + 8, max_len)
    got, kept = _greedy_speculative(model, prompts, steps, max_len, oracle=want)
    np.testing.assert_array_equal(got, want[:, :steps])
    assert set(kept) >= {0, 1, 2, 3}, sorted(set(kept))


def test_a_long_chunks_context_keys_are_those_of_its_last_window(drafting):
    """A chunk longer than the window projects only its last window's positions; the rings are those of writing
    every position (rows of several lengths, one shorter than the window, one empty)."""
    model, _ = drafting
    w = model.cfg.sliding_window
    rng = np.random.default_rng(2)
    features = jnp.asarray(rng.normal(size=(4, 3 * w, len(model.cfg.dspark_target_layer_ids) * model.cfg.hidden_size)),
                           jnp.float32)
    start, n = jnp.asarray([0, 5, 17, 3], jnp.int32), jnp.asarray([3 * w, w + 3, w - 2, 0], jnp.int32)
    rings = speculative.new_state(model, 4).rings
    got = _context(model, rings, features, start, n)
    want = rings
    for i in range(3):  # the same chunk a window at a time: every position projected
        part = jnp.clip(n - i * w, 0, w)
        want = _context(model, want, features[:, i * w:(i + 1) * w], start + i * w, part)
    for g, r in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(r))
