"""`scripts/compile_passes.py`: XLA's own events of a compile, added up by name from jax's profile."""

import importlib.util
from pathlib import Path

import jax
import jax.numpy as jnp

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "compile_passes.py"
spec = importlib.util.spec_from_file_location("compile_passes", SCRIPT)
passes = importlib.util.module_from_spec(spec)
spec.loader.exec_module(passes)


def test_events_of_a_compile_are_xlas_passes_without_python_frames(tmp_path):
    lowered = jax.jit(lambda x: jnp.sin(x) @ x.T + 1).lower(jnp.ones((64, 64)))
    with jax.profiler.trace(str(tmp_path)):
        lowered.compile()
    seconds, count = passes.xla_events(str(tmp_path))
    assert seconds["backend_compile_and_load"] > 0 and count["backend_compile_and_load"] == 1
    assert any("algsimp" in name for name in seconds)  # an HLO pass, by its name
    assert not any(name.startswith("$") for name in seconds)  # jax's Python frames are left out
