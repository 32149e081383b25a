"""Checkpoint fixtures."""

import pytest

from dsjax.checkpoint.synthetic import write_synthetic
from dsjax.config import ModelConfig


@pytest.fixture(scope="session")
def release(tmp_path_factory):
    """A tiny checkpoint in DeepSeek's release format (FP8 + FP4 experts, original names), 12 shards, with a
    tokenizer file beside it. Tests copy it before changing anything."""
    folder = tmp_path_factory.mktemp("release") / "src"
    write_synthetic(folder, ModelConfig.preset("tiny"), max_shard_bytes=60_000, seed=3)
    (folder / "tokenizer_config.json").write_text('{"note": "travels with the weights"}')
    return folder
