"""`RunConfig`: the run options, validated once, each bad value refused with the field's name."""

import dataclasses
import warnings

import jax.numpy as jnp
import pytest

from dsjax.quant import KV_DTYPES
from dsjax.run_config import DTYPES, KERNELS, WEIGHTS, RunConfig, RunConfigError, auto_chunk_size


def test_defaults_are_valid_and_every_choice_is_taken():
    run = RunConfig()
    assert (run.slots, run.max_len, run.chunk_size, run.dtype, run.kv_dtype, run.weights, run.kernels,
            run.mesh) == (8, 4096, 256, "bfloat16", None, "keep", "auto", None)
    for name, choices in (("dtype", DTYPES), ("weights", WEIGHTS), ("kernels", KERNELS), ("kv_dtype", KV_DTYPES)):
        for value in choices:
            assert getattr(RunConfig(**{name: value}), name) == value
    assert RunConfig(mesh="dp=2,ep=4").mesh == "dp=2,ep=4"


@pytest.mark.parametrize("field,value,message", [
    ("slots", 0, "slots must be an integer of at least 1, got 0"),
    ("slots", 2.0, "slots must be an integer of at least 1, got 2.0"),
    ("slots", True, "slots must be an integer of at least 1, got True"),
    ("max_len", 1, "max_len must be an integer of at least 2, got 1"),
    ("max_len", "64", "max_len must be an integer of at least 2, got '64'"),
    ("chunk_size", -3, "chunk_size must be an integer of at least 1, got -3"),
    ("dtype", "float16", "dtype must be one of"),
    ("weights", "fp4", "weights must be one of"),
    ("kernels", "pallas", "kernels must be one of"),
    ("kv_dtype", "int4", "kv_dtype must be one of"),
    ("mesh", "xp=8", "mesh 'xp=8': expected comma-separated AXIS=SIZE"),
    ("mesh", "ep=2,ep=4", "mesh 'ep=2,ep=4': axis 'ep' given twice"),
    ("mesh", 8, "mesh must be a spec such as 'dp=2,ep=4', got 8"),
    ("batch_invariant", 1, "batch_invariant must be true or false, got 1"),
])
def test_each_bad_value_is_refused_naming_its_field(field, value, message):
    with pytest.raises(RunConfigError) as e:
        RunConfig(**{field: value})
    assert str(e.value).startswith(field) and message in str(e.value)
    assert isinstance(e.value, ValueError)  # callers that catch ValueError catch it too


def test_replace_validates_again_and_the_config_is_frozen():
    run = RunConfig(slots=4)
    assert run.replace(max_len=64) == RunConfig(slots=4, max_len=64)
    with pytest.raises(RunConfigError, match="max_len"):
        run.replace(max_len=0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.slots = 2


def test_fp8_weights_are_the_old_spelling_of_keep():
    with pytest.warns(DeprecationWarning, match="'fp8' is now spelled 'keep'"):
        run = RunConfig(weights="fp8")
    assert run.weights == "keep" and run == RunConfig()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        RunConfig(weights="bf16")  # the current spellings warn of nothing


def test_derived_values():
    assert RunConfig(dtype="float32").jnp_dtype == jnp.float32
    assert RunConfig().jnp_dtype == jnp.bfloat16
    assert RunConfig().quantized and not RunConfig(weights="bf16").quantized


@pytest.mark.parametrize("slots,max_len,platform,want", [
    (1, 1_048_002, "gpu", 8192),    # one long prompt: the measured best
    (8, 1_048_002, "gpu", 8192),    # 65,536 tokens a step
    (16, 1_048_002, "gpu", 4096),
    (128, 1_048_002, "tpu", 512),   # 128 × 512 in one step
    (1024, 4096, "gpu", 256),       # never below 256
    (4, 600, "gpu", 1024),          # never more than max_len needs (600 tokens: 1,024)
    (4, 1024, "gpu", 1024),
    (1, 1_048_002, "cpu", 256),     # CPUs keep the default
])
def test_auto_chunk_size(slots, max_len, platform, want):
    assert auto_chunk_size(slots, max_len, platform) == want
