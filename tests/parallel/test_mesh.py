"""Mesh specs: parsing, validation, and meshes over the 8 test devices."""

import jax
import pytest

from dsjax.parallel.mesh import make_mesh, parse_mesh


def test_specs_parse_with_defaults_of_one():
    assert parse_mesh("ep=8") == {"dp": 1, "ep": 8, "tp": 1}
    assert parse_mesh(" dp=2 , ep=2,tp=2") == {"dp": 2, "ep": 2, "tp": 2}


@pytest.mark.parametrize("spec,message", [
    ("ep", "AXIS=SIZE"), ("pp=2", "AXIS=SIZE"), ("ep=0", "AXIS=SIZE"), ("ep=two", "AXIS=SIZE"),
    ("ep=2,ep=4", "given twice"),
])
def test_bad_specs_are_refused(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_mesh(spec)


def test_meshes_use_every_device_with_auto_axes():
    mesh = make_mesh("dp=2,ep=4")
    assert dict(mesh.shape) == {"dp": 2, "ep": 4, "tp": 1}
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
    with pytest.raises(ValueError, match="needs 4 devices; 8 are available"):
        make_mesh("ep=4")
