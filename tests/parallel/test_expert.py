"""Expert parallelism on 8 CPU devices: the same logits and greedy tokens as one device, no expert weight
ever all-gathered."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import dsjax
from dsjax import SamplingParams, generate
from dsjax.config import ModelConfig
from dsjax.parallel.mesh import make_mesh
from dsjax.parallel.shard import shard_model
from dsjax.quantize import quantize_model
from tests.helpers import assert_close

IDS = jnp.asarray(np.random.default_rng(0).integers(0, 500, (2, 11)))  # 22 tokens: padded to 24 for 8 shards


@pytest.fixture(scope="module")
def model():
    return dsjax.DeepseekV4(ModelConfig.preset("tiny"), rngs=nnx.Rngs(3), dtype=jnp.float32)


PROMPTS = [[5, 17, 300, 2], [7, 9], [11, 12, 13], [1]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=32)


@pytest.fixture(scope="module")
def one_device_tokens(model):
    return [r.tokens for r in generate(model, PROMPTS, GREEDY, max_batch=4)]


def forward(model, ids):
    return nnx.jit(lambda m, x: m(x))(model, ids)


@pytest.mark.parametrize("spec", ["dp=8", "ep=8", "dp=2,ep=4", "dp=4,tp=2", "dp=2,ep=2,tp=2"])
def test_logits_equal_one_device(model, spec):
    mesh = make_mesh(spec)
    with jax.set_mesh(mesh):
        out = forward(shard_model(model, mesh), IDS)
    assert_close(np.asarray(out), np.asarray(forward(model, IDS)), rtol=1e-5)


@pytest.mark.parametrize("spec", ["dp=8", "ep=8", "dp=2,ep=4", "dp=4,tp=2", "dp=2,ep=2,tp=2"])
def test_greedy_decode_equals_one_device(model, one_device_tokens, spec):
    mesh = make_mesh(spec)
    with jax.set_mesh(mesh):
        got = [r.tokens for r in generate(shard_model(model, mesh), PROMPTS, GREEDY, max_batch=4)]
    assert got == one_device_tokens and all(len(t) == 32 for t in got)


def test_fp4_experts_split_over_the_expert_axis(model):
    quantized = quantize_model(model)
    mesh = make_mesh("dp=2,ep=4")
    sharded = shard_model(quantized, mesh)
    gate_up = sharded.groups[1].layers[0].mlp.experts.gate_up_proj[...]
    assert gate_up.dtype == jnp.int8 and gate_up.sharding.spec[1] == "ep"
    with jax.set_mesh(mesh):
        out = forward(sharded, IDS)
    assert_close(np.asarray(out), np.asarray(forward(quantized, IDS)), rtol=1e-5)


def test_expert_weights_are_never_all_gathered(model):
    """In the compiled sharded forward, no all-gather produces an array the size of a whole expert
    weight (stacked or one layer's): each device only ever holds its own experts."""
    mesh = make_mesh("ep=8")
    sharded = shard_model(model, mesh)
    graphdef, state = nnx.split(sharded)
    with jax.set_mesh(mesh):
        hlo = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x)).lower(state, IDS).compile().as_text()
    whole = set()
    for path, var in nnx.to_flat_state(state):
        if path[-2:] in (("experts", "gate_up_proj"), ("experts", "down_proj")):
            shape = tuple(var.get_value().shape)
            whole |= {shape, shape[1:]}
    gathered = {tuple(int(d) for d in m.group(1).split(",") if d)
                for m in re.finditer(r"= \w+\[([\d,]*)\]\{[^}]*\} all-gather", hlo)}
    assert gathered, "expected the token all-gathers of the expert-parallel path"
    assert not gathered & whole, gathered & whole


def test_an_expert_axis_that_does_not_divide_the_experts_is_refused():
    model = dsjax.DeepseekV4(ModelConfig.preset("tiny").replace(n_routed_experts=6, num_experts_per_tok=2),
                             rngs=nnx.Rngs(0), dtype=jnp.float32)
    mesh = make_mesh("dp=2,ep=4")
    with jax.set_mesh(mesh), pytest.raises(ValueError, match=r"expert axis \(4\) must divide n_routed_experts \(6\)"):
        forward(model, IDS)


def test_cache_slots_are_split_and_decoding_does_not_recompile(model):
    """Data-parallel attention: each device holds the cache of its own slots; the steps keep that layout,
    so the decode loop reuses its programs."""
    from dsjax.engine.steps import Engine

    mesh = make_mesh("dp=2,ep=4")
    sharded = shard_model(model, mesh)
    params = SamplingParams(temperature=0.0, max_tokens=12)
    with jax.set_mesh(mesh):
        cache = Engine(sharded, num_slots=8, max_len=64, chunk_size=16).new_cache()
        leaf = jax.tree.leaves(cache.groups)[0]
        assert leaf.sharding.spec[:2] == (None, ("dp", "ep")) and leaf.addressable_shards[0].data.shape[1] == 1
        assert cache.lengths.sharding.is_fully_replicated
        generate(sharded, [[5, 6, 7]] * 8, params, max_batch=8)
        warm = Engine.compilations()
        out = generate(sharded, [[9, 8, 7]] * 3 + [[1, 2, 3]] * 5, params, max_batch=8)  # same shapes
        assert Engine.compilations() == warm and all(len(r.tokens) == 12 for r in out)
