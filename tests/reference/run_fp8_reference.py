"""Torch side of the FP8/FP4 checkpoint test (runs in the Python 3.11 reference environment).

    python run_fp8_reference.py CHECKPOINT_DIR IDS.npy OUT.npy

Loads a quantized checkpoint that dsjax wrote with transformers 5.23.0 (on CPU it dequantizes FP8
blocks and FP4 experts at load, in fp32 here) and saves its logits for the token ids.
"""

import sys

import numpy as np
import torch
from transformers import DeepseekV4ForCausalLM

torch.set_grad_enabled(False)
torch.set_num_threads(1)
folder, ids_path, out_path = sys.argv[1:4]
model = DeepseekV4ForCausalLM.from_pretrained(folder, dtype=torch.float32)
assert {p.dtype for p in model.parameters()} == {torch.float32}, "expected a dequantized fp32 model"
ids = torch.from_numpy(np.load(ids_path))
np.save(out_path, model(ids).logits.numpy())
