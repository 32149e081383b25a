"""Facts about accelerators that kernel tilings and `dsjax export` use, one table keyed by the
`device_kind` jax gives a device (or an abstract device is lowered for)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class DeviceFacts:
    """One accelerator: `platform` ("cuda", "rocm" or "tpu"); `cores`, its streaming multiprocessors
    (NVIDIA), compute units (AMD) or TensorCores per chip (TPU); `smem_bytes`, the most shared memory
    one thread block may use (NVIDIA's opt-in maximum; None where no kernel here needs it)."""

    platform: str
    cores: int
    smem_bytes: int | None = None


# The kinds jax's Pallas lowerings recognise.
DEVICES: dict[str, DeviceFacts] = {
    "NVIDIA A100": DeviceFacts("cuda", 108, 163 * 1024),
    "NVIDIA H100": DeviceFacts("cuda", 132, 227 * 1024),
    "NVIDIA H200": DeviceFacts("cuda", 132, 227 * 1024),
    "NVIDIA B200": DeviceFacts("cuda", 148, 227 * 1024),
    "gfx942": DeviceFacts("rocm", 304),
    "TPU v4": DeviceFacts("tpu", 2),
    "TPU v5": DeviceFacts("tpu", 2),
    "TPU v5p": DeviceFacts("tpu", 2),
    "TPU v5 lite": DeviceFacts("tpu", 1),
    "TPU v6 lite": DeviceFacts("tpu", 1),
}

# The GPU the kernels' tilings were measured on (docs/benchmarks.md); they size their grids for it
# whatever GPU runs them.
TUNED_GPU = "NVIDIA H200"


def device_facts(kind: str) -> DeviceFacts:
    """The facts of device kind `kind` (as jax names it, e.g. "NVIDIA H200"). Raises KeyError, naming
    the known kinds, for any other: a tiling must not guess a device's size."""
    try:
        return DEVICES[kind]
    except KeyError:
        raise KeyError(f"no facts for device kind {kind!r}; known: {', '.join(DEVICES)}") from None


def core_count(kind: str) -> int | None:
    """`device_facts(kind).cores`, or None for a kind not in the table (jax then leaves it unset)."""
    facts = DEVICES.get(kind)
    return None if facts is None else facts.cores
