"""DeepSeek-V4.1 on 8 CPU devices against one device: a random tiny-v4.1 model (Engram, CSA2's shared entries
and candidate pool, the decoder's global cache) placed by the rules table generates the same greedy tokens and
log-probabilities within 1e-6 through the engine (the experts' sums meet
in another order), and its Engram tables stay split (never all-gathered).

The runs prefill each request alone (`batch_invariant`): a prefill of several rows on one device and of one row
per device round differently (about 1e-5), which a near-tie in the candidate pool's block choice can then carry
to 1e-2 in a later token's log-probability."""

import re

import jax
import numpy as np
import pytest
from flax import nnx

from dsjax import SamplingParams, generate
from dsjax.parallel.mesh import make_mesh
from dsjax.parallel.shard import shard_model
from dsjax.run_config import RunConfig
from tests.test_model_v41 import _random_model

# Longer prompts than the candidate pool keeps (4 blocks of 8 ratio-1 entries) and the sliding window (8).
PROMPTS = [list(np.random.default_rng(k).integers(3, 250, n)) for k, n in enumerate([45, 2, 37, 9, 41, 1, 20, 33])]
SAMPLING = SamplingParams(temperature=0.0, max_tokens=12, logprobs=2)
RUN = RunConfig(slots=8, max_len=64, chunk_size=16, batch_invariant=True)


@pytest.fixture(scope="module")
def model():
    return _random_model(0)


@pytest.fixture(scope="module")
def one_device(model):
    return generate(model, PROMPTS, SAMPLING, run=RUN)


def test_greedy_tokens_and_logprobs_equal_one_device(model, one_device):
    mesh = make_mesh("dp=2,ep=4")  # the slots over all 8 devices, the experts over 4
    with jax.set_mesh(mesh):
        got = generate(shard_model(model, mesh), PROMPTS, SAMPLING, run=RUN)
    assert [r.tokens for r in got] == [r.tokens for r in one_device]
    assert all(len(r.tokens) == 12 for r in got)
    a = np.array([[t.logprob for t in r.logprobs] for r in got])
    b = np.array([[t.logprob for t in r.logprobs] for r in one_device])
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=0)


def test_engram_tables_are_split_over_every_device_and_never_all_gathered(model):
    mesh = make_mesh("ep=8")
    layer = next(layer for layer in shard_model(model, mesh).layers if layer.engram is not None)
    table = layer.engram.table[...]
    assert table.addressable_shards[0].data.shape == (table.shape[0], table.shape[1] // 8)
    cfg = model.cfg
    h = np.random.default_rng(0).normal(size=(2, 5, cfg.hc_mult, cfg.hidden_size)).astype(np.float32)
    rows = np.random.default_rng(1).integers(0, table.shape[0], (2, 5, cfg.engram_hash_heads)).astype(np.int32)
    live = np.ones((2, 5), bool)
    graphdef, state = nnx.split(layer.engram)
    with jax.set_mesh(mesh):
        step = jax.jit(lambda s, *a: nnx.merge(graphdef, s)(*a))
        got = step(state, h, rows, live)
        hlo = step.lower(state, h, rows, live).compile().as_text()
    gathered = {tuple(int(d) for d in m.group(1).split(",") if d)
                for m in re.finditer(r"= \w+\[([\d,]*)\]\{[^}]*\} all-gather", hlo)}
    assert tuple(table.shape) not in gathered, gathered
    one = next(layer for layer in model.layers if layer.engram is not None).engram
    np.testing.assert_allclose(np.asarray(got), np.asarray(one(h, rows, live)), rtol=1e-6)
