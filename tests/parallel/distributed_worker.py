"""One process of the two-process test: 4 CPU devices each, one global dp=2,ep=4 mesh over both.

    python -m tests.parallel.distributed_worker PROCESS_ID PORT CHECKPOINT OUT
"""

import json
import os
import sys

from tests import CPU_TEST_FLAGS  # noqa: E402

os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count=4 {CPU_TEST_FLAGS}"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402


def main() -> None:
    pid, port, checkpoint, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=pid)
    import numpy as np
    from flax import nnx
    from jax.experimental import multihost_utils

    import dsjax
    from dsjax import RunConfig, SamplingParams, generate
    from dsjax.parallel.mesh import make_mesh

    from tests.parallel.test_distributed import IDS, PROMPTS

    mesh = make_mesh("dp=2,ep=4")
    assert len(jax.devices()) == 8 and len(jax.local_devices()) == 4
    model = dsjax.load_model(checkpoint, mesh=mesh)  # each process reads only its devices' arrays
    with jax.set_mesh(mesh):
        logits = multihost_utils.process_allgather(nnx.jit(lambda m, x: m(x))(model, np.asarray(IDS)), tiled=True)
        tokens = [r.tokens for r in generate(model, PROMPTS, SamplingParams(temperature=0.0, max_tokens=16),
                                             run=RunConfig(slots=4, max_len=64, chunk_size=64))]
    np.save(f"{out}.{pid}.npy", np.asarray(logits))
    with open(f"{out}.{pid}.json", "w") as f:
        json.dump(tokens, f)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
