"""Torch side of the quantization parity tests (runs in the Python 3.11 reference environment).

    python run_quant_reference.py OUT.npz

Makes random FP8 / FP4 bytes and scales with torch and dequantizes them with transformers 5.23.0's own
code (`integrations/finegrained_fp8.py`): `Fp8Dequantize` as the loader runs it, `_dequantize_fp8_weight`
for weights with partial edge blocks, and `Fp8Quantize` for the quantizer. Saves inputs and outputs as
raw bytes, so the test compares bit patterns.
"""

import sys
from types import SimpleNamespace

import numpy as np
import torch
from transformers.integrations.finegrained_fp8 import Fp8Dequantize, Fp8Quantize, _dequantize_fp8_weight

g = torch.Generator().manual_seed(0)
out = {}


def fp8_bytes(*shape):
    b = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    b[(b & 0x7F) == 0x7F] = 0x3C  # e4m3fn has NaN at 0x7F/0xFF: replace by 1.5
    return b


def save(name, **tensors):
    for k, t in tensors.items():
        t = t.contiguous()
        if t.dtype in (torch.float8_e4m3fn, torch.float8_e8m0fnu):
            t = t.view(torch.uint8)
        out[f"{name}.{k}"] = t.numpy()


deq = Fp8Dequantize(None)
for name, shape, scale_kind in [("fp8_whole", (256, 384), "float"), ("fp8_e8m0", (128, 256), "e8m0"),
                                ("fp8_u8", (256, 128), "uint8"), ("fp8_experts", (3, 256, 128), "float")]:
    q = fp8_bytes(*shape).view(torch.float8_e4m3fn)
    grid = shape[:-2] + (shape[-2] // 128, shape[-1] // 128)
    if scale_kind == "float":
        s = torch.rand(grid, generator=g) * 0.01 + 1e-4
    else:
        s = torch.randint(110, 135, grid, generator=g, dtype=torch.uint8)
        if scale_kind == "e8m0":
            s = s.view(torch.float8_e8m0fnu)
    save(name, q=q, s=s, out=deq._dequantize_one(q, s, output_dtype=torch.float32))

q = fp8_bytes(300, 200).view(torch.float8_e4m3fn)  # partial edge blocks in both directions
s = torch.rand((3, 2), generator=g) * 0.01 + 1e-4
save("fp8_edges", q=q, s=s, out=_dequantize_fp8_weight(q.clone(), s, [128, 128], torch.float32))

for name, shape in [("fp4", (64, 96)), ("fp4_experts", (3, 32, 64))]:
    packed = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8).view(torch.int8)
    s = torch.randint(115, 135, shape[:-1] + (shape[-1] * 2 // 32,), generator=g, dtype=torch.uint8)
    save(name, q=packed, s=s, out=deq._dequantize_one(packed, s, output_dtype=torch.float32))

for fmt in ("float", "ue8m0"):
    quantizer = Fp8Quantize(SimpleNamespace(quantization_config=SimpleNamespace(
        weight_block_size=(128, 128), scale_fmt=fmt)))
    w = torch.randn((256, 384), generator=g) * torch.logspace(-3, 1, 384)
    w[:128, :128] = 0  # an all-zero block
    res = quantizer._quantize_one("x.weight", w)
    save(f"quant_{fmt}", w=w, q=res["x.weight"], s=res["x.weight_scale_inv"])

np.savez(sys.argv[1], **out)
