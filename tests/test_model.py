"""Model structure: layer grouping, scanned stacks, and compile cost that does not grow with depth."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsjax.config import CSA, HCA, HASH_MOE, MOE, ModelConfig
from dsjax.model import DeepseekV4, layer_groups


def test_layer_groups_cover_schedule_in_order():
    kinds = ModelConfig.preset("v4-flash").layer_kinds
    groups = layer_groups(kinds)
    assert [(g.start, len(g.pattern), g.repeats) for g in groups] == [(0, 1, 3), (3, 2, 20)]
    rebuilt = [g.pattern[p] for g in groups for r in range(g.repeats) for p in range(len(g.pattern))]
    assert tuple(rebuilt) == kinds
    assert groups[1].pattern == ((CSA, MOE), (HCA, MOE)) and groups[0].pattern == ((HCA, HASH_MOE),)


def _lowered_size(num_layers: int) -> int:
    cfg = ModelConfig.from_hf({**ModelConfig.preset("tiny").to_hf(), "num_hidden_layers": num_layers,
                               "layer_types": None, "mlp_layer_types": None})
    model = nnx.eval_shape(lambda: DeepseekV4(cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(model)

    def fwd(state, ids):
        return nnx.merge(graphdef, state)(ids)

    text = jax.jit(fwd).lower(state, jax.ShapeDtypeStruct((1, 16), jnp.int32)).as_text()
    return len(text)


def test_program_size_does_not_grow_with_depth():
    """The 43-layer schedule lowers to the same program as an 11-layer one: layers are scanned."""
    small, deep = _lowered_size(11), _lowered_size(43)
    assert abs(deep - small) / small < 0.02, (small, deep)


def test_layer_view_matches_stacked_weights():
    cfg = ModelConfig.preset("tiny")
    model = DeepseekV4(cfg, rngs=nnx.Rngs(3))
    layer = model.layer(2)
    group = model.groups[2]
    np.testing.assert_array_equal(np.asarray(layer.self_attn.kv_proj.weight[...]),
                                  np.asarray(group.layers[0].self_attn.kv_proj.weight[...][0]))
