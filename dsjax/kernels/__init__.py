"""Kernels, one folder per operation: `reference.py` (pure JAX, runs everywhere), `gpu.py` / `tpu.py`
(Pallas), and `op.py`, the function the model calls, which picks one by platform."""
