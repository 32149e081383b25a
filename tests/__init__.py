"""dsjax's tests. `CPU_TEST_FLAGS`: XLA flags of every test process (`conftest.py` says why)."""

CPU_TEST_FLAGS = "--xla_backend_optimization_level=0"
