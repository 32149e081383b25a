"""The store of whole compiled programs: what a key depends on, that a stored program loads and runs in
another store (as in another process) without tracing, that damaged entries are dropped and the store stays
bounded, and that an engine's precompile loads every program it stored before."""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsjax.compile_cache import compile_cache
from dsjax.engine import programs
from dsjax.engine.compiles import CompileClock
from dsjax.engine.engine import Engine
from dsjax.engine.generate import generate
from dsjax.engine.programs import ProgramStore, describe
from dsjax.engine.sampling import SamplingParams
from dsjax.run_config import RunConfig


@functools.partial(jax.jit, static_argnums=0, donate_argnums=1)
def _scaled(k, x, y):
    return x * k + y, {"total": jnp.sum(y)}


def _compiled(k=3, n=4):
    return _scaled.lower(k, jnp.ones(n), jnp.arange(n, dtype=jnp.float32)).compile()


def test_a_stored_program_loads_in_another_store_and_runs(tmp_path):
    ProgramStore(str(tmp_path)).save("k1", _compiled())
    loaded = ProgramStore(str(tmp_path)).load("k1")
    out, aux = loaded(jnp.ones(4), jnp.arange(4, dtype=jnp.float32))  # the static argument is baked in
    np.testing.assert_array_equal(np.asarray(out), [3, 4, 5, 6])
    assert float(aux["total"]) == 6
    assert ProgramStore(str(tmp_path)).load("another") is None


def test_a_damaged_entry_is_a_miss_and_is_removed(tmp_path):
    store = ProgramStore(str(tmp_path))
    store.save("k", _compiled())
    path = tmp_path / ("k" + programs._SUFFIX)
    path.write_bytes(path.read_bytes()[:100])  # cut short
    assert store.load("k") is None and not path.exists()


def test_the_store_drops_its_least_recently_used_entries_past_its_bound(tmp_path):
    store = ProgramStore(str(tmp_path))
    store.save("a", _compiled(1))
    size = os.path.getsize(tmp_path / ("a" + programs._SUFFIX))
    store.max_bytes = 2 * size + size // 2  # room for two
    store.save("b", _compiled(2))
    os.utime(tmp_path / ("a" + programs._SUFFIX), (1, 1))
    os.utime(tmp_path / ("b" + programs._SUFFIX), (2, 2))
    assert store.load("a") is not None  # now the most recently used
    store.save("c", _compiled(3))
    assert sorted(p.removesuffix(programs._SUFFIX) for p in os.listdir(tmp_path)) == ["a", "c"]


def test_the_key_covers_the_parts_the_inputs_the_flags_the_config_and_the_source(monkeypatch, tmp_path):
    store = ProgramStore(str(tmp_path))
    x = jnp.ones((2, 3))
    base = store.key("decode", describe((x,)))
    assert store.key("decode", describe((x,))) == base  # stable
    assert store.key("prefill", describe((x,))) != base
    assert store.key("decode", describe((jnp.ones((2, 4)),))) != base  # shape
    assert store.key("decode", describe((x.astype(jnp.bfloat16),))) != base  # dtype
    assert store.key("decode", describe((jax.device_put(x, jax.devices()[1]),))) != base  # device
    assert store.key("decode", describe(((x,),))) != base  # tree
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", "") + " --xla_cpu_enable_fast_math=false")
    assert store.key("decode", describe((x,))) != base
    monkeypatch.undo()
    assert store.key("decode", describe((x,))) == base
    before = jax.config.jax_numpy_rank_promotion
    jax.config.update("jax_numpy_rank_promotion", "raise" if before != "raise" else "allow")
    try:
        assert store.key("decode", describe((x,))) != base
    finally:
        jax.config.update("jax_numpy_rank_promotion", before)
    monkeypatch.setattr(programs, "_source_digest", lambda: "another dsjax")
    assert store.key("decode", describe((x,))) != base


@pytest.fixture
def model(load_case):
    """The model, with jax's persistent cache off and its memory cleared: what XLA compiles here is stored
    (what jax would load from its cache or hand back from memory, both filled by earlier tests, is not)."""
    jax.clear_caches()
    with compile_cache(enabled=False):
        yield load_case("mixed")


def test_a_second_engine_loads_every_program_without_tracing_and_generates_the_same(model, tmp_path):
    prompts = [[3, 4, 5], [6, 7, 8, 9, 10, 11, 12, 13, 14, 15]]
    sampling = [SamplingParams(temperature=0.0, max_tokens=4), SamplingParams(temperature=0.8, max_tokens=5, seed=3)]
    first = Engine(model, RunConfig(slots=2, max_len=32, chunk_size=8), programs=ProgramStore(str(tmp_path)))
    n = first.precompile()
    assert first.programs_loaded == 0 and len(os.listdir(tmp_path)) == n
    want = generate(model, prompts, sampling, engine=first)

    second = Engine(model, RunConfig(slots=2, max_len=32, chunk_size=8), programs=ProgramStore(str(tmp_path)))
    with CompileClock() as clock:
        assert second.precompile() == n
        got = generate(model, prompts, sampling, engine=second)
    assert second.programs_loaded == n and second.load_seconds > 0
    traced = {name for name, phases in clock.by_function.items() if "trace" in phases}
    assert not traced & {"decode", "prefill_chunk", "sample_rows", "new_cache"}, traced
    assert clock.programs == 0 and second.fallbacks == 0
    assert [r.tokens for r in got] == [r.tokens for r in want]


def test_another_engine_shape_misses(model, tmp_path):
    store = ProgramStore(str(tmp_path))
    Engine(model, RunConfig(slots=2, max_len=32, chunk_size=8), programs=store).precompile(buckets=[2])
    longer = Engine(model, RunConfig(slots=2, max_len=40, chunk_size=8), programs=store)
    longer.precompile(buckets=[2])
    assert longer.programs_loaded == 6  # the samplers only: they hold nothing of the model or the cache
    again = Engine(model, RunConfig(slots=2, max_len=40, chunk_size=8), programs=store)
    assert again.precompile(buckets=[2]) == again.programs_loaded == 9


def test_a_precompiled_program_refusing_its_inputs_falls_back_to_jit(model):
    """A program checks its inputs before it runs; refused (other shapes, placements), the call goes
    through jit, which compiles its own, and the engine counts it."""
    engine = Engine(model, RunConfig(slots=2, max_len=32, chunk_size=8))
    engine._compiled[("scaled",)] = _compiled(3, 4)
    jitted = functools.partial(_scaled, 3)
    out, _ = engine._call(("scaled",), jitted, jnp.ones(4), jnp.zeros(4))
    assert engine.fallbacks == 0 and float(out[0]) == 3
    out, _ = engine._call(("scaled",), jitted, jnp.ones(5), jnp.zeros(5))  # refused: another shape
    assert engine.fallbacks == 1 and out.shape == (5,)


def test_a_program_jax_loaded_from_its_own_cache_is_not_stored(tmp_path):
    """Such an executable does not serialize again faithfully; what XLA compiles here does."""
    lower = lambda: jax.jit(lambda x: jnp.cos(x) * 2).lower(jnp.ones(7))  # noqa: E731 (a new Lowered each time)
    with compile_cache(str(tmp_path)):
        first, fresh = programs.compile_for_store(lower())
        again, fresh_again = programs.compile_for_store(lower())
    assert fresh and not fresh_again
    np.testing.assert_array_equal(np.asarray(first(jnp.zeros(7))), np.asarray(again(jnp.zeros(7))))


def test_later_buckets_that_are_stored_load_at_once_with_no_background(model, tmp_path):
    first = Engine(model, RunConfig(slots=2, max_len=32, chunk_size=8), programs=ProgramStore(str(tmp_path)))
    n = first.precompile(buckets=[2], later=[1])
    first.background.join(timeout=300)
    assert first.background_built == 1 and len(os.listdir(tmp_path)) == n  # stored by the background too
    second = Engine(model, RunConfig(slots=2, max_len=32, chunk_size=8), programs=ProgramStore(str(tmp_path)))
    assert second.precompile(buckets=[2], later=[1]) == second.programs_loaded == n
    assert second.background is None and second.pending_buckets() == [] and second.prefill_size(1) == 1


def test_a_program_jax_hands_back_from_memory_is_not_stored():
    """jax keeps compiled programs in memory too: lowering the same function for the same inputs again
    gives back the one it holds (which may have come from its persistent cache), with no compile."""
    f = jax.jit(lambda x: jnp.tan(x) + 3)
    first, fresh = programs.compile_for_store(f.lower(jnp.ones(5)))
    again, fresh_again = programs.compile_for_store(f.lower(jnp.ones(5)))
    assert fresh and not fresh_again
