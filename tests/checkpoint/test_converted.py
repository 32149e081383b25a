"""Converted checkpoints load onto one device or a mesh, and refuse manifests that do not fit."""

import json

import numpy as np
import pytest
from flax import nnx

import dsjax
from dsjax.checkpoint import converted
from dsjax.checkpoint.convert import convert
from dsjax.checkpoint.safetensors_io import CheckpointError
from dsjax.parallel.mesh import make_mesh
from tests.checkpoint.test_convert import IDS
from tests.helpers import assert_close, assert_same_state


def test_loading_onto_a_mesh_gives_each_device_its_experts(release, tmp_path):
    convert(release, tmp_path / "o", ep=4, progress=False)
    mesh = make_mesh("dp=2,ep=4")
    sharded = dsjax.load_model(tmp_path / "o", mesh=mesh)
    single = dsjax.load_model(release)
    assert_same_state(single, sharded)
    e = single.cfg.n_routed_experts
    for path, var in nnx.to_flat_state(nnx.state(sharded)):
        value = var.get_value()
        if path[-2:] == ("experts", "gate_up_proj"):
            assert value.sharding.spec[:2] == (None, "ep")
            assert {s.data.shape[1] for s in value.addressable_shards} == {e // 4}
        elif path[-1] == "weight" and path[0] == "embed_tokens":
            assert value.sharding.is_fully_replicated and len(value.devices()) == 8
    assert_close(np.asarray(nnx.jit(lambda m, x: m(x))(sharded, IDS)), np.asarray(single(IDS)), rtol=1e-5)
    from_safetensors = dsjax.load_model(release, mesh=mesh)  # via one device
    assert_same_state(single, from_safetensors)
    assert from_safetensors.groups[0].layers[0].mlp.experts.gate_up_proj[...].sharding.spec[1] == "ep"



def test_a_manifest_from_another_version_is_refused(release, tmp_path):
    convert(release, tmp_path / "o", progress=False)
    path = tmp_path / "o" / converted.MANIFEST
    man = json.loads(path.read_text())
    path.write_text(json.dumps({**man, "version": 99}))
    with pytest.raises(CheckpointError, match="version 99; this dsjax reads 'dsjax-orbax' version 1"):
        dsjax.load_model(tmp_path / "o")


def test_an_array_missing_from_the_manifest_is_named(release, tmp_path):
    convert(release, tmp_path / "o", ep=4, progress=False)
    path = tmp_path / "o" / converted.MANIFEST
    man = json.loads(path.read_text())
    del man["pieces"]["model.layers.2.mlp.experts.down_proj.4"]
    path.write_text(json.dumps(man))
    with pytest.raises(CheckpointError, match=r"lacks or repeats parts of 1 array.*model\.layers\.2\.mlp\.experts\.down_proj'"):
        dsjax.load_model(tmp_path / "o")


def test_a_relative_path_converts_and_loads(release, tmp_path, monkeypatch):
    """`dsjax convert ... --out converted` then `--model converted`: Orbax wants absolute paths."""
    monkeypatch.chdir(tmp_path)
    convert(release, "o", progress=False)
    assert_same_state(dsjax.load_model(release), dsjax.load_model("o"))
