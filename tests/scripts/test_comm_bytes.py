"""`scripts/comm_bytes.py`: bytes a device sends per MoE layer, and none on one device."""

import importlib.util
import sys
from pathlib import Path

from dsjax.config import ModelConfig

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
spec = importlib.util.spec_from_file_location("comm_bytes", SCRIPTS / "comm_bytes.py")
comm_bytes = importlib.util.module_from_spec(spec)
sys.modules.setdefault("comm_bytes", comm_bytes)
spec.loader.exec_module(comm_bytes)


def test_one_device_exchanges_nothing_and_two_do():
    cfg = ModelConfig.preset("tiny")
    assert comm_bytes.layer_bytes(cfg, 1, 16) == {"gathered": 0.0, "ragged_mean": 0.0, "ragged_max": 0.0}
    two = comm_bytes.layer_bytes(cfg, 2, 16)
    assert two["gathered"] > 0 and two["ragged_max"] >= two["ragged_mean"] > 0
