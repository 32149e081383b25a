"""Kernels, one folder per operation: `reference.py` (pure JAX, runs everywhere), a Pallas file per
lowering (`triton.py`: Pallas-Triton, GPUs; `mosaic_gpu.py`: Mosaic GPU, Hopper; `mosaic_tpu.py`:
Mosaic TPU), and `op.py`, the function the model calls, which picks one by platform (`dispatch.py`).
`devices.py` holds the device facts tilings use; `gpu_*` / `triton_*` helpers serve those kernels only."""
