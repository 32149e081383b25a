"""Running the processes of a multi-process test on localhost."""

from __future__ import annotations

import os
import socket
import subprocess
import threading
import time
from pathlib import Path

from tests import CPU_TEST_FLAGS

ROOT = Path(__file__).resolve().parents[2]
# jax's own variables for a distributed run: a test's processes get only what it gives them.
_DISTRIBUTED_ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "JAX_LOCAL_DEVICE_IDS",
                    "JAX_COORDINATOR_PORT", "JAX_COORDINATOR_BIND_ADDRESS")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_env(local_devices: int, **extra: str) -> dict[str, str]:
    """The environment of one process: `local_devices` CPU devices, no inherited distributed settings."""
    env = {k: v for k, v in os.environ.items() if k not in _DISTRIBUTED_ENV}
    env.update(XLA_FLAGS=f"--xla_force_host_platform_device_count={local_devices} {CPU_TEST_FLAGS}",
               JAX_PLATFORMS="cpu")
    env.update(extra)
    return env


def run_processes(commands: list[list[str]], envs: list[dict[str, str]], timeout: float = 600,
                  grace: float = 20) -> tuple[list[int], list[str]]:
    """Start one process per command (cwd: the repository), wait for all; returns (exit codes, logs:
    stdout and stderr together). Once one fails, the others get `grace` seconds before they are killed
    (they may be waiting for it in a collective)."""
    procs = [subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for cmd, env in zip(commands, envs)]
    logs: list[str | None] = [None] * len(procs)
    readers = []

    def read(i: int) -> None:
        logs[i] = procs[i].stdout.read()

    for i in range(len(procs)):
        t = threading.Thread(target=read, args=(i,), daemon=True)
        t.start()
        readers.append(t)
    deadline = time.monotonic() + timeout
    failed_at = None
    try:
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
                failed_at = now
            if now > deadline or (failed_at is not None and now > failed_at + grace):
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p, t in zip(procs, readers):
            p.wait()
            t.join(timeout=10)
    return [p.returncode for p in procs], [log or "" for log in logs]


def tails(logs: list[str], n: int = 3000) -> str:
    return "\n".join(f"--- process {i} ---\n{log[-n:]}" for i, log in enumerate(logs))
