"""The embedded default model (`model/`, trained by `scripts/train_tiny.py`) and the demo's requests."""

from __future__ import annotations

import os

HERE = os.path.dirname(os.path.abspath(__file__))
MODEL_DIR = os.path.join(HERE, "model")
SAMPLE_REQUESTS = os.path.join(HERE, "requests.jsonl")
