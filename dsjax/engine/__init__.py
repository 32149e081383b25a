"""The inference engine: `Engine` (`engine.py`) runs the jitted steps (`steps.py`) over the cache's slots
(`slots.py`), samples (`sampling.py`) and keeps its compiled programs (`programs.py`; `compiles.py` times
them); the scheduler batches requests continuously (`scheduler.py`, and `generate.py` over it); images are
prepared on the host (`pixels.py`) and encoded (`encoder.py`); `aot.py` traces the steps ahead of time for
`dsjax plan` and `dsjax export`; `scoring.py` scores given tokens."""
