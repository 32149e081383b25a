"""`kernels.devices`: the one table of device facts, its lookups, and its readers (the GPU tilings,
`dsjax export`'s abstract devices)."""

import pytest

from dsjax.export import DEVICE_KINDS, abstract_device
from dsjax.kernels.devices import DEVICES, TUNED_GPU, core_count, device_facts
from dsjax.kernels.sparse_attention import mosaic_gpu
from dsjax.kernels.sparse_attention.op import gpu_tiling, mosaic_splits


def test_known_kinds_have_their_facts():
    assert device_facts("NVIDIA H200").cores == 132
    assert device_facts("NVIDIA H200").smem_bytes == 227 * 1024
    assert device_facts("NVIDIA B200").cores == 148
    assert device_facts("TPU v6 lite").platform == "tpu" and device_facts("TPU v6 lite").smem_bytes is None
    assert core_count("gfx942") == 304


def test_an_unknown_kind_is_an_error_naming_the_known_ones_or_no_core_count():
    with pytest.raises(KeyError, match="no facts for device kind 'NVIDIA H300'; known: NVIDIA A100"):
        device_facts("NVIDIA H300")
    assert core_count("NVIDIA H300") is None
    assert core_count("cpu") is None


def test_every_platforms_default_export_kind_is_in_the_table():
    for platform, kind in DEVICE_KINDS.items():
        if platform != "cpu":
            assert device_facts(kind).platform == platform


def test_facts_are_well_formed():
    for kind, facts in DEVICES.items():
        assert facts.platform in ("cuda", "rocm", "tpu"), kind
        assert facts.cores >= 1, kind
        assert facts.smem_bytes is None or facts.platform == "cuda", kind


@pytest.mark.parametrize("platform,kind,cores", [("cuda", None, 132), ("cuda", "NVIDIA B200", 148),
                                                 ("tpu", None, 1), ("cuda", "NVIDIA H300", None)])
def test_export_takes_core_counts_from_the_table(platform, kind, cores):
    assert abstract_device(platform, kind).num_cores == cores


def test_tilings_size_their_grids_for_the_tuned_gpu():
    cores = device_facts(TUNED_GPU).cores
    assert mosaic_splits(1, 10 ** 6) == cores
    assert gpu_tiling(1, 32, 10 ** 6)["num_splits"] == cores  # one head block: a split per core
    assert mosaic_gpu._SMEM_BYTES == device_facts(TUNED_GPU).smem_bytes
