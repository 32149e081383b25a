"""Engines shared by the engine tests: compiling the steps dominates their cost on CPU, and engines of
one model and shape share compiled programs."""

import pytest

from dsjax.engine.engine import Engine
from dsjax.run_config import RunConfig

_ENGINES = {}


@pytest.fixture
def engine_for(load_case):
    """`engine_for(case, slots=4)`: an Engine with max_len 96 and prefill chunks of 8 tokens."""
    def get(case: str, slots: int = 4) -> Engine:
        key = (case, slots)
        if key not in _ENGINES:
            _ENGINES[key] = Engine(load_case(case), RunConfig(slots=slots, max_len=96, chunk_size=8))
        return _ENGINES[key]
    return get
