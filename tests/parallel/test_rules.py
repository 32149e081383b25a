"""The rules table: modules declare logical axes; experts split over ep, heads and FFN width over tp."""

import dataclasses

import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from dsjax.checkpoint.targets import abstract_model
from dsjax.config import ModelConfig, QuantConfig
from dsjax.parallel.mesh import make_mesh
from dsjax.parallel.rules import logical_axes, param_sharding, spec_of


@pytest.fixture(scope="module")
def variables():
    cfg = ModelConfig.preset("tiny")
    return {path: var for path, var in abstract_model(cfg)[1]}


@pytest.fixture(scope="module")
def fp8_variables():
    quant = QuantConfig(weight_block_size=(16, 16), scale_fmt="float", expert_dtype="fp8")
    cfg = dataclasses.replace(ModelConfig.preset("tiny"), quantization=quant)
    return {path: var for path, var in abstract_model(cfg)[1]}


def layer(*rest):
    return ("groups", 1, "layers", 0) + rest


def test_modules_declare_their_axes(variables):
    assert logical_axes(layer("mlp", "experts", "gate_up_proj"), variables[layer("mlp", "experts", "gate_up_proj")]) \
        == ("layers", "expert", "embed", "ffn")
    assert logical_axes(layer("mlp", "experts", "down_proj"), variables[layer("mlp", "experts", "down_proj")]) \
        == ("layers", "expert", "ffn", "embed")
    q_b = layer("self_attn", "q_b_proj", "weight")
    assert logical_axes(q_b, variables[q_b]) == ("layers", "heads", None)
    assert logical_axes(layer("self_attn", "sinks"), variables[layer("self_attn", "sinks")]) == ("layers", "heads")
    o_b = layer("self_attn", "o_b_proj", "weight")
    assert logical_axes(o_b, variables[o_b]) == ("layers", "embed", "heads")
    embed = ("embed_tokens", "weight")
    assert logical_axes(embed, variables[embed]) == (None, None)  # small or undeclared: replicated


def test_quantized_weights_and_their_scales_split_alike(fp8_variables):
    mesh = make_mesh("dp=2,ep=2,tp=2")
    for leaf in ("gate_up_proj", "gate_up_proj_scale_inv"):
        path = layer("mlp", "experts", leaf)
        # stored [E, out=2I, in=H]: experts over ep, the FFN rows over tp
        assert param_sharding(mesh, path, fp8_variables[path]).spec == P(None, "ep", "tp", None)
    for leaf in ("weight", "weight_scale_inv"):
        path = layer("self_attn", "q_b_proj", leaf)
        assert param_sharding(mesh, path, fp8_variables[path]).spec == P(None, "tp", None)


def test_rules_map_to_mesh_axes(variables):
    mesh = make_mesh("dp=2,ep=4")
    path = layer("mlp", "experts", "gate_up_proj")
    assert param_sharding(mesh, path, variables[path]).spec == P(None, "ep", None, None)
    shared = layer("mlp", "shared_experts", "up_proj", "weight")
    assert param_sharding(mesh, shared, variables[shared]).spec == P(None, None, None)
    tp = make_mesh("dp=4,tp=2")
    assert param_sharding(tp, shared, variables[shared]).spec == P(None, "tp", None)
    assert param_sharding(tp, path, variables[path]).spec == P(None, None, None, "tp")


def test_an_axis_of_size_one_or_one_that_does_not_divide_is_left_out(variables):
    path = layer("mlp", "experts", "gate_up_proj")
    assert param_sharding(make_mesh("dp=8"), path, variables[path]).spec == P(None, None, None, None)
    mesh = make_mesh("ep=2,tp=4")
    assert spec_of(mesh, ("heads", "expert"), (6, 4)) == P(None, "ep")


def test_a_declaration_of_the_wrong_length_is_refused():
    var = nnx.Param(jnp.zeros((3, 4)), axes=("heads",))
    with pytest.raises(ValueError, match="declares"):
        logical_axes(("x",), var)
