"""The rules table: routed experts split over ep, everything else replicated."""

from jax.sharding import PartitionSpec as P

from dsjax.parallel.mesh import make_mesh
from dsjax.parallel.rules import logical_axes, param_sharding


def test_expert_leaves_and_their_scales_split_over_the_expert_axis():
    mesh = make_mesh("dp=2,ep=4")
    for leaf in ("gate_up_proj", "down_proj_scale_inv"):
        path = ("groups", 1, "layers", 0, "mlp", "experts", leaf)
        assert logical_axes(path, 4) == ("layers", "expert", None, None)
        assert param_sharding(mesh, path, 4).spec == P(None, "ep", None, None)
    shared = ("groups", 1, "layers", 0, "mlp", "shared_experts", "up_proj", "weight")
    assert param_sharding(mesh, shared, 3).spec == P(None, None, None)
    assert param_sharding(mesh, ("embed_tokens", "weight"), 2).spec == P(None, None)


def test_an_axis_of_size_one_is_left_out():
    path = ("groups", 0, "layers", 0, "mlp", "experts", "gate_up_proj")
    assert param_sharding(make_mesh("dp=8"), path, 4).spec == P(None, None, None, None)
