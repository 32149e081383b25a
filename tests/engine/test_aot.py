"""`engine.aot.mesh_devices`: which devices a plan or an export compiles for when the host has fewer than the mesh."""

import types

import jax
import pytest

from dsjax.engine import aot


REAL_DEVICES = jax.devices


def _gpus(n):
    return [types.SimpleNamespace(platform="gpu", id=i) for i in range(n)]


def _one_gpu(backend=None):
    """`jax.devices` of a host with one GPU (and the test's CPU devices)."""
    return _gpus(1) if backend is None else REAL_DEVICES(backend)


def test_a_host_with_enough_devices_uses_its_own():
    assert aot.mesh_devices(4) == jax.devices()[:4]


def test_a_gpu_host_with_fewer_gpus_compiles_for_as_many_compile_only_gpus(monkeypatch):
    monkeypatch.setattr(aot.jax, "devices", _one_gpu)
    asked = []
    monkeypatch.setattr(aot, "compile_only_gpus", lambda n: asked.append(n) or _gpus(n))
    got = aot.mesh_devices(8)
    assert asked == [8] and len(got) == 8 and all(d.platform == "gpu" for d in got)


def test_without_compile_only_gpus_it_says_so_and_compiles_for_the_cpu(monkeypatch):
    monkeypatch.setattr(aot.jax, "devices", _one_gpu)

    def refuse(n):
        raise RuntimeError("UNIMPLEMENTED: topology")

    monkeypatch.setattr(aot, "compile_only_gpus", refuse)
    with pytest.warns(UserWarning, match=r"could not describe 8 GPUs like this host's .*UNIMPLEMENTED: topology.*"
                                         r"host's CPU devices instead"):
        got = aot.mesh_devices(8)
    assert got == REAL_DEVICES("cpu")[:8]


def test_too_few_devices_anywhere_is_refused():
    with pytest.raises(ValueError, match="the mesh needs 64 devices; only 8 are available"):
        aot.mesh_devices(64)
