"""FP8/FP4 on an accelerator: do the quantizers give the CPU's bytes, and does a quantized model give the
logits of its dequantized copy? (The runs recorded in docs/benchmarks.md.)

    JAX_PLATFORMS=cuda,cpu python scripts/check_quant_gpu.py
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

import dsjax
from dsjax.embedded import MODEL_DIR
from dsjax.quant import divide_rn, pack_kv, quantize_fp4, quantize_fp8
from dsjax.quantize import V4_QUANT, quantize_model


def main() -> None:
    print(jax.devices(), flush=True)
    rng = np.random.default_rng(5)
    w = (rng.normal(size=(512, 384)) * np.exp(rng.normal(size=(512, 1)) * 4)).astype(np.float32)
    cpu = jax.devices("cpu")[0]
    fns = {"divide_rn": lambda x: divide_rn(448.0, jnp.abs(x) + 1e-3), "quantize_fp8": quantize_fp8,
           "quantize_fp8 ue8m0": lambda x: quantize_fp8(x, scale_fmt="ue8m0"), "quantize_fp4": quantize_fp4,
           "pack_kv fp8": lambda x: pack_kv(x, "fp8", 64), "pack_kv fp4": lambda x: pack_kv(x, "fp4", 64)}
    for name, fn in fns.items():
        t = time.perf_counter()
        on_device = jax.tree.leaves(jax.block_until_ready(jax.jit(fn)(w)))
        seconds = time.perf_counter() - t
        with jax.default_device(cpu):
            on_cpu = jax.tree.leaves(jax.jit(fn)(w))
        same = all(np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
                   for a, b in zip(on_device, on_cpu))
        print(f"{name}: same bytes as the CPU {same} (compile + run {seconds:.1f} s)", flush=True)
    model = quantize_model(dsjax.load_model(MODEL_DIR), V4_QUANT)
    ids = jnp.asarray(np.load(f"{MODEL_DIR}/heldout.npy")[:4, :256])
    kept, upfront = np.asarray(model(ids)), np.asarray(dsjax.dequantize_model(model)(ids))
    print(f"embedded model, FP8+FP4 kept vs dequantized up front: max |Δlogit| {np.abs(kept - upfront).max():.3g}")


if __name__ == "__main__":
    main()
