"""`dsjax info`: parameter counts from abstract shapes, checked against the reference's meta-device count."""

import json

import pytest

from dsjax.cli import main
from dsjax.config import ModelConfig
from dsjax.info import COMPONENTS, model_info


def test_v4_flash_count_matches_reference(reference):
    ref = json.loads((reference / "param_counts.json").read_text())["v4-flash"]
    info = model_info(ModelConfig.preset("v4-flash"))
    assert info.total == ref
    assert sum(info.by_component.values()) == info.total
    assert set(info.by_component) == set(COMPONENTS)


def test_v41_flash_is_552b():
    cfg = ModelConfig.preset("v4.1-flash")
    assert cfg.num_hidden_layers == 40
    info = model_info(cfg)
    assert abs(info.total - 552e9) / 552e9 < 0.01
    assert info.active < info.total / 20
    assert info.bytes_fp4_experts < info.bytes_fp8 < info.bytes_bf16


def test_info_cli(capsys):
    assert main(["info", "--preset", "v4.1-flash"]) == 0
    out = capsys.readouterr().out
    assert "total 554.53B parameters" in out and "routed_experts" in out and "active per token" in out
    assert "cache per token" in out and "compressed_sparse_attention" in out


def test_info_cli_bad_preset(capsys):
    assert main(["info", "--preset", "v9"]) == 2
    assert "unknown preset" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["tiny", "v4-flash", "v4.1-flash"])
def test_presets_build(name):
    ModelConfig.preset(name).validate()
