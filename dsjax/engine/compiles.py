"""How long jax spent preparing programs (tracing, lowering, compiling or loading from the persistent
cache) while a `CompileClock` was running, so that a job's summary can keep start-up apart from work.

jax reports each phase through `jax.monitoring` as a time span; nested and back-to-back spans are merged,
so a second is counted once however many phases it belongs to.
"""

from __future__ import annotations

import threading

import jax

_PHASES = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
           "/jax/core/compile/backend_compile_duration")
_COMPILED = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT = "/jax/compilation_cache/cache_hits"


class CompileClock:
    """A context manager that records jax's compile-time spans while it is entered (from any thread)."""

    def __init__(self):
        self._spans: list[tuple[float, float]] = []
        self.programs = 0  # executables built or loaded
        self.cache_hits = 0  # of those, loaded from the persistent compilation cache
        self._mu = threading.Lock()

    def _span(self, event: str, start: float, end: float, **_) -> None:
        if event in _PHASES:
            with self._mu:
                self._spans.append((start, end))
                self.programs += event == _COMPILED

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
            spans = sorted((max(s, since), e) if since is not None else (s, e) for s, e in self._spans
                           if since is None or e > since)
        total, reach = 0.0, float("-inf")
        for start, end in spans:
            if end > reach:
                total += end - max(start, reach)
                reach = end
        return total
