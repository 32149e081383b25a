"""Multi-process (multi-host) runs: starting `jax.distributed` from command-line flags or the environment,
and the little host-side agreement a multi-process batch job needs.

Every process of a run is started with the same command; together they see one global set of devices
and run the same program (SPMD). `initialize_from` decides from the flags and the environment whether
this is such a run and, if so, calls `jax.distributed.initialize`:

- `--coordinator HOST:PORT --num-processes N --process-id I`, each of which may instead come from
  `JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES` and `JAX_PROCESS_ID` (flags win). All three are needed.
- `--distributed`: let jax find the three itself in a cluster environment it knows (Slurm, Open MPI,
  Cloud TPU, Kubernetes with the `kubernetes` package); flags or variables given still win. Opt-in,
  because jax's Slurm and Open MPI detection also limits each process to one local GPU.
- neither: a single-process run; `jax.distributed` is not started.

jax itself reads `JAX_COORDINATOR_ADDRESS`, `JAX_LOCAL_DEVICE_IDS`, `JAX_COORDINATOR_BIND_ADDRESS` and
(for a detected cluster) `JAX_COORDINATOR_PORT`; dsjax reads `JAX_NUM_PROCESSES` and `JAX_PROCESS_ID`,
which jax 0.11 does not. CPU collectives across processes use jax's default implementation, gloo.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Mapping, Sequence

import numpy as np

ENV = {"coordinator": "JAX_COORDINATOR_ADDRESS", "num_processes": "JAX_NUM_PROCESSES",
       "process_id": "JAX_PROCESS_ID"}
FLAGS = {"coordinator": "--coordinator", "num_processes": "--num-processes", "process_id": "--process-id"}


@dataclasses.dataclass(frozen=True)
class DistributedSpec:
    """What `jax.distributed.initialize` is called with; None fields are left for jax to detect
    (only when `detect`)."""

    coordinator: str | None
    num_processes: int | None
    process_id: int | None
    detect: bool = False


def add_distributed_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "multi-process runs", "Start the same command once per process (one per host, usually); together "
        "the processes run one sharded job over all their devices (--mesh covers them all). Only process 0 "
        "writes the output. See docs/parallelism.md.")
    g.add_argument("--coordinator", metavar="HOST:PORT",
                   help="process 0's address and a free port, the same on every process "
                   "(default: $JAX_COORDINATOR_ADDRESS)")
    g.add_argument("--num-processes", type=int, metavar="N", help="number of processes (default: "
                   "$JAX_NUM_PROCESSES)")
    g.add_argument("--process-id", type=int, metavar="I", help="this process's number, 0 to N-1 (default: "
                   "$JAX_PROCESS_ID)")
    g.add_argument("--distributed", action="store_true", help="let jax detect the three above from the "
                   "cluster (Slurm, Open MPI, Cloud TPU, Kubernetes)")


def _int(value: str, name: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None


def spec_from(args: argparse.Namespace | None = None, env: Mapping[str, str] | None = None
              ) -> DistributedSpec | None:
    """The distributed setting that `args` (flags of `add_distributed_args`; None: no flags) and `env`
    (default: `os.environ`) ask for, or None for a single-process run. Raises ValueError when they ask
    for one inconsistently (some of the three settings without the others, a bad value)."""
    env = os.environ if env is None else env
    values: dict = {}
    source: dict = {}
    for key in ENV:
        flag = getattr(args, key, None) if args is not None else None
        if flag is not None:
            values[key], source[key] = flag, FLAGS[key]
        elif env.get(ENV[key], "").strip():
            raw = env[ENV[key]].strip()
            values[key] = raw if key == "coordinator" else _int(raw, "$" + ENV[key])
            source[key] = "$" + ENV[key]
        else:
            values[key] = None
    detect = bool(getattr(args, "distributed", False)) if args is not None else False
    if not detect and all(v is None for v in values.values()):
        return None
    if not detect:
        missing = [f"{FLAGS[k]} (or ${ENV[k]})" for k, v in values.items() if v is None]
        if missing:
            given = ", ".join(f"{source[k]}" for k, v in values.items() if v is not None)
            raise ValueError(f"a multi-process run needs --coordinator, --num-processes and --process-id "
                             f"(or $JAX_COORDINATOR_ADDRESS, $JAX_NUM_PROCESSES, $JAX_PROCESS_ID), or "
                             f"--distributed to detect them from the cluster: {given} given, "
                             f"{' and '.join(missing)} missing")
    coord, n, pid = values["coordinator"], values["num_processes"], values["process_id"]
    if coord is not None:
        host, colon, port = coord.rpartition(":")
        if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{source['coordinator']} must be HOST:PORT, got {coord!r}")
    if n is not None and n < 1:
        raise ValueError(f"{source['num_processes']} must be at least 1, got {n}")
    if pid is not None and pid < 0:
        raise ValueError(f"{source['process_id']} must be at least 0, got {pid}")
    if n is not None and pid is not None and pid >= n:
        raise ValueError(f"{source['process_id']} {pid} is not below {source['num_processes']} {n}: process "
                         f"ids run from 0 to N-1")
    return DistributedSpec(coord, n, pid, detect)


def multi_process_env(env: Mapping[str, str] | None = None) -> list[str]:
    """The variables of a multi-process launch that are set in `env` (default: `os.environ`), or [] if
    none is or `JAX_NUM_PROCESSES` is 1: for commands that must run on one process only."""
    env = os.environ if env is None else env
    names = [v for v in ENV.values() if env.get(v, "").strip()]
    return [] if env.get(ENV["num_processes"], "").strip() == "1" else names


def initialize_from(args: argparse.Namespace | None = None, env: Mapping[str, str] | None = None
                    ) -> DistributedSpec | None:
    """Start `jax.distributed` as `spec_from(args, env)` says; returns that spec (None: nothing started).

    Call it first thing, before anything touches a jax backend (`jax.devices()`, any computation)."""
    import jax

    spec = spec_from(args, env)
    if spec is None:
        return None
    try:
        jax.distributed.initialize(
            coordinator_address=spec.coordinator, num_processes=spec.num_processes, process_id=spec.process_id,
            # Explicit settings are used as given: no cluster detection (which would also pin devices).
            cluster_detection_method=None if spec.detect else "deactivate")
    except ValueError as e:
        if spec.detect and "defined" in str(e):  # jax found no cluster to fill in the missing values
            raise ValueError(f"--distributed: jax could not detect the run from the environment ({e}); give "
                             "--coordinator, --num-processes and --process-id") from None
        raise
    return spec


def process_index() -> int:
    import jax

    return jax.process_index()


def process_count() -> int:
    import jax

    return jax.process_count()


def broadcast_bytes(data: bytes) -> bytes:
    """Process 0's `data` on every process (what the others pass is ignored). Collective: every process
    must call it at the same point."""
    if process_count() == 1:
        return data
    n = int(_exchange(np.array([len(data)], np.int64))[0, 0])
    if n == 0:
        return b""
    buf = np.frombuffer(data, np.uint8) if process_index() == 0 else np.zeros(n, np.uint8)
    return _exchange(buf)[0].tobytes()


def allgather_bytes(data: bytes, size: int) -> list[bytes]:
    """Every process's `data` (exactly `size` bytes on each), in process order. Collective."""
    if len(data) != size:
        raise ValueError(f"allgather_bytes: expected {size} bytes, got {len(data)}")
    if process_count() == 1:
        return [data]
    return [row.tobytes() for row in _exchange(np.frombuffer(data, np.uint8))]


def _exchange(row: np.ndarray) -> np.ndarray:
    """Every process's `row` (one shape and dtype on all) stacked in process order, returned only once every
    local device has done its part of the collective. jax's `multihost_utils` helpers return as soon as the
    first local device has: a process that then exits can leave its other devices' collectives, and a
    peer's, unfinished, and a multi-process job that refused its input hung at exit so."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()).reshape(jax.process_count(), jax.local_device_count()),
                ("processes", "local"))
    rows = jax.make_array_from_process_local_data(NamedSharding(mesh, PartitionSpec("processes")), row[None])
    out = jax.jit(_copy, out_shardings=NamedSharding(mesh, PartitionSpec()))(rows)
    return np.asarray(out.block_until_ready().addressable_data(0))


def _copy(x):
    return x


def describe(processes: Sequence[int]) -> str:
    return ("process " if len(processes) == 1 else "processes ") + ", ".join(map(str, processes))
