"""Cached generation against the reference's `generate(do_sample=False)` with its V4 cache."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsjax.cache import init_cache
from dsjax.engine.generate import generate
from dsjax.engine.sampling import SamplingParams
from tests.helpers import assert_close
from tests.reference.spec import CASES

GREEDY = SamplingParams(temperature=0.0, max_tokens=32, stop_token_ids=[])


def ref_runs(reference, case):
    spec = next(c for c in CASES if c["name"] == case)
    return [np.load(reference / case / f"generate_{t}.npz") for t in spec["generate"]["prompt_lens"]]


@pytest.mark.parametrize("case", [c["name"] for c in CASES])
def test_greedy_tokens_match_reference(reference, load_case, engine_for, case):
    """All prompts through a 4-slot engine with 8-token prefill chunks, so windows straddle chunks."""
    runs = ref_runs(reference, case)
    results = generate(load_case(case), [r["prompt"].tolist() for r in runs], GREEDY, engine=engine_for(case))
    for run, res in zip(runs, results):
        assert res.tokens == run["tokens"].tolist(), f"prompt of {len(run['prompt'])} tokens"
        assert res.finish_reason == "length"


@pytest.mark.parametrize("case", [c["name"] for c in CASES])
def test_teacher_forced_step_logits_match_reference(reference, load_case, case, chunk=5):
    """Prefill in chunks, then feed the reference's tokens one by one: every step's logits match."""
    model = load_case(case)
    graphdef, params = nnx.split(model)

    @jax.jit
    def step(params, cache, tokens, start, n_valid):
        m = nnx.merge(graphdef, params)
        hidden, cache = m.extend(tokens, cache, start, n_valid)
        last = jnp.take_along_axis(hidden, (n_valid - 1)[:, None, None], axis=1)
        return m.logits(last)[:, 0], cache

    for run in ref_runs(reference, case):
        prompt, tokens, ref_logits = run["prompt"], run["tokens"], run["logits"]
        cache = init_cache(model, 1, 64)
        pos = 0
        while pos < len(prompt):
            part = prompt[pos:pos + chunk]
            padded = np.zeros((1, chunk), np.int32)
            padded[0, :len(part)] = part
            logits, cache = step(params, cache, jnp.asarray(padded), jnp.asarray([pos]), jnp.asarray([len(part)]))
            pos += len(part)
        steps = [np.asarray(logits)[0]]
        one = jax.jit(lambda p, c, t, s: step(p, c, t, s, jnp.ones((1,), jnp.int32)))
        for i, tok in enumerate(tokens[:-1]):
            logits, cache = one(params, cache, jnp.asarray([[tok]]), jnp.asarray([len(prompt) + i]))
            steps.append(np.asarray(logits)[0])
        assert_close(np.stack(steps), ref_logits, rtol=1e-4, what=f"{case} prompt {len(prompt)}")
