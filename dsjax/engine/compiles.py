"""How long jax spent preparing programs (tracing, lowering, compiling or loading from the persistent
cache) while a `CompileClock` was running, so that a job's summary can keep start-up apart from work.

jax reports each phase through `jax.monitoring` as a time span; nested and back-to-back spans are merged,
so a second is counted once however many phases it belongs to.
"""

from __future__ import annotations

import threading

import jax

_PHASES = {"/jax/core/compile/jaxpr_trace_duration": "trace",
           "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
           "/jax/core/compile/backend_compile_duration": "compile"}
_COMPILED = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT = "/jax/compilation_cache/cache_hits"
# The name of `Engine.precompile`'s background thread: what it compiles is counted apart.
BACKGROUND_THREAD = "dsjax-background-compile"


class CompileClock:
    """A context manager that records jax's compile-time spans while it is entered (from any thread)."""

    def __init__(self):
        self._spans: list[tuple[float, float]] = []  # merged: sorted, disjoint
        self._total = 0.0
        self.programs = 0  # executables built or loaded
        self.cache_hits = 0  # of those, loaded from the persistent compilation cache
        # Seconds jax spent per function and phase ("trace", "lower", "compile"), for `-v` reports.
        self.by_function: dict[str, dict[str, float]] = {}
        self._mu = threading.Lock()
        # What `Engine.precompile`'s background thread prepared, kept out of everything above.
        self.background_programs = 0
        self._background_spans: list[tuple[float, float]] = []

    def _span(self, event: str, start: float, end: float, fun_name: str = "?", **_) -> None:
        if event in _PHASES and threading.current_thread().name == BACKGROUND_THREAD:
            with self._mu:  # built alongside the work, not before or inside it: counted apart
                self.background_programs += event == _COMPILED
                self._background_spans = _merged([*self._background_spans, (start, end)])
            return
        if event in _PHASES:
            with self._mu:  # spans come only while compiling: merging here keeps `seconds()` cheap
                self._spans = _merged([*self._spans, (start, end)])
                self._total = sum(e - s for s, e in self._spans)
                self.programs += event == _COMPILED
                phases = self.by_function.setdefault(fun_name, {})
                phases[_PHASES[event]] = phases.get(_PHASES[event], 0.0) + end - start

    def _event(self, event: str, **_) -> None:
        if event == _CACHE_HIT:
            with self._mu:
                self.cache_hits += 1

    def __enter__(self) -> "CompileClock":
        jax.monitoring.register_event_time_span_listener(self._span)
        jax.monitoring.register_event_listener(self._event)
        return self

    def __exit__(self, *exc) -> None:
        jax.monitoring.unregister_event_time_span_listener(self._span)
        jax.monitoring.unregister_event_listener(self._event)

    def seconds(self, since: float | None = None) -> float:
        """Wall seconds covered by compile spans (those after `since`, a `time.time()`, if given)."""
        with self._mu:
            if since is None:
                return self._total
            return sum(e - max(s, since) for s, e in self._spans if e > since)


    def background_seconds(self) -> float:
        """Wall seconds covered by the background thread's compile spans."""
        with self._mu:
            return sum(e - s for s, e in self._background_spans)

    def slowest(self, n: int = 8) -> list[tuple[str, dict[str, float]]]:
        """The `n` functions jax spent longest preparing, with their seconds per phase."""
        with self._mu:
            items = [(name, dict(p)) for name, p in self.by_function.items()]
        return sorted(items, key=lambda kv: -sum(kv[1].values()))[:n]


def _merged(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out
