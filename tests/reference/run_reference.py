"""Parity harness: runs the Hugging Face DeepSeek-V4 reference (torch, CPU, fp32) and writes what the
dsjax tests compare against. It runs in its own Python 3.11 environment (torch's CPU wheel exists
only there), as `python run_reference.py SPEC.json OUT_DIR`.

For every case in the spec it builds `DeepseekV4ForCausalLM` from a config, gives every parameter and
buffer a non-trivial random value (nothing left at 0, 1 or identity), and writes:
  OUT/<case>/hf/        save_pretrained(save_original_format=False), sharded: HF module names
  OUT/<case>/hybrid/    save_pretrained(): what transformers writes by default
  OUT/<case>/original/  the original DeepSeek names, sharded by hand; reloaded through
                        transformers to prove the naming is one it accepts
  OUT/<case>/logits_<T>.npy     logits for input_ids_<T>.npy, for each sequence length T
  OUT/<case>/logits_bf16_<T>.npy the same from a bf16 load, for the longest sequence
  OUT/<case>/generate_<T>.npz   greedy generate(): prompt, new tokens, per-step logits
  OUT/<case>/capture.npz        per-module inputs and outputs for the longest sequence
It also writes OUT/configs.json (derived config fields and rope tables for each raw config) and
OUT/param_counts.json (parameter counts of default-config models, built on the meta device).
"""

from __future__ import annotations

import json
import math
import os
import sys

import numpy as np
import torch
from safetensors.torch import save_file
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as mdl

torch.set_grad_enabled(False)
torch.set_num_threads(1)  # tiny models; several test workers may run this at once


# ----------------------------------------------------------------------------------- random weights
def randomize(model: torch.nn.Module, seed: int) -> None:
    """Every parameter and buffer gets a random value with a sensible scale; none stays 0/1/identity."""
    g = torch.Generator().manual_seed(seed)
    cfg = model.config

    def normal(shape, std, mean=0.0):
        return torch.randn(shape, generator=g) * std + mean

    for name, p in list(model.named_parameters()) + list(model.named_buffers()):
        leaf = name.rsplit(".", 1)[-1]
        if "inv_freq" in name:
            continue
        shape = p.shape
        if leaf == "tid2eid":
            rows = [torch.randperm(cfg.n_routed_experts, generator=g)[: shape[1]] for _ in range(shape[0])]
            value = torch.stack(rows).to(p.dtype)
        elif leaf == "e_score_correction_bias":
            value = normal(shape, 0.3)
        elif leaf == "sinks":
            value = normal(shape, 1.0)
        elif leaf == "position_bias":
            value = normal(shape, 0.7)
        elif leaf in ("fn", "hc_fn"):
            value = normal(shape, 0.5 / math.sqrt(shape[1]) * 4)
        elif leaf in ("base", "hc_base"):
            value = normal(shape, 0.5)
        elif leaf in ("scale", "hc_scale"):
            value = torch.rand(shape, generator=g) + 0.5
        elif leaf == "bias":
            value = normal(shape, 0.1)
        elif name.endswith("norm.weight") or leaf == "weight" and p.dim() == 1:
            value = normal(shape, 0.2, mean=1.0)
        elif "embed_tokens" in name:
            value = normal(shape, 1.0)
        elif leaf == "gate_up_proj":
            value = normal(shape, 1.0 / math.sqrt(shape[-1]))
        elif leaf == "down_proj" and p.dim() == 3:
            value = normal(shape, 1.0 / math.sqrt(shape[-1]))
        elif p.dim() == 2:
            value = normal(shape, 1.0 / math.sqrt(shape[1]))
        else:
            raise RuntimeError(f"no random rule for {name} {tuple(shape)}")
        p.copy_(value)


# ----------------------------------------------------------------------------------- original names
_HF_TO_ORIGINAL_LAYER = [
    ("input_layernorm.", "attn_norm."),
    ("post_attention_layernorm.", "ffn_norm."),
    ("attn_hc.fn", "hc_attn_fn"), ("attn_hc.base", "hc_attn_base"), ("attn_hc.scale", "hc_attn_scale"),
    ("ffn_hc.fn", "hc_ffn_fn"), ("ffn_hc.base", "hc_ffn_base"), ("ffn_hc.scale", "hc_ffn_scale"),
    ("self_attn.sinks", "attn.attn_sink"),
    ("self_attn.compressor.indexer.q_b_proj.", "attn.indexer.wq_b."),
    ("self_attn.compressor.indexer.scorer.weights_proj.", "attn.indexer.weights_proj."),
    ("self_attn.compressor.indexer.kv_proj.", "attn.indexer.compressor.wkv."),
    ("self_attn.compressor.indexer.gate_proj.", "attn.indexer.compressor.wgate."),
    ("self_attn.compressor.indexer.position_bias", "attn.indexer.compressor.ape"),
    ("self_attn.compressor.indexer.kv_norm.", "attn.indexer.compressor.norm."),
    ("self_attn.compressor.kv_proj.", "attn.compressor.wkv."),
    ("self_attn.compressor.gate_proj.", "attn.compressor.wgate."),
    ("self_attn.compressor.position_bias", "attn.compressor.ape"),
    ("self_attn.compressor.kv_norm.", "attn.compressor.norm."),
    ("self_attn.q_a_proj.", "attn.wq_a."), ("self_attn.q_a_norm.", "attn.q_norm."),
    ("self_attn.q_b_proj.", "attn.wq_b."), ("self_attn.kv_proj.", "attn.wkv."),
    ("self_attn.kv_norm.", "attn.kv_norm."),
    ("self_attn.o_a_proj.", "attn.wo_a."), ("self_attn.o_b_proj.", "attn.wo_b."),
    ("mlp.gate.e_score_correction_bias", "ffn.gate.bias"),
    ("mlp.gate.", "ffn.gate."),
    ("mlp.shared_experts.gate_proj.", "ffn.shared_experts.w1."),
    ("mlp.shared_experts.up_proj.", "ffn.shared_experts.w3."),
    ("mlp.shared_experts.down_proj.", "ffn.shared_experts.w2."),
]


def original_state_dict(model) -> dict[str, torch.Tensor]:
    """The model's tensors under the original DeepSeek release names (per-expert w1/w2/w3)."""
    out = {}
    inter = model.config.moe_intermediate_size
    top = {"model.embed_tokens.weight": "embed.weight", "lm_head.weight": "head.weight",
           "model.norm.weight": "norm.weight", "model.hc_head.hc_fn": "hc_head_fn",
           "model.hc_head.hc_base": "hc_head_base", "model.hc_head.hc_scale": "hc_head_scale"}
    for name, t in model.state_dict().items():
        if name in top:
            out[top[name]] = t
            continue
        assert name.startswith("model.layers."), name
        layer, rest = name[len("model.layers."):].split(".", 1)
        prefix = f"layers.{layer}."
        if rest == "mlp.experts.gate_up_proj":
            for e in range(t.shape[0]):
                out[f"{prefix}ffn.experts.{e}.w1.weight"] = t[e, :inter].clone()
                out[f"{prefix}ffn.experts.{e}.w3.weight"] = t[e, inter:].clone()
            continue
        if rest == "mlp.experts.down_proj":
            for e in range(t.shape[0]):
                out[f"{prefix}ffn.experts.{e}.w2.weight"] = t[e].clone()
            continue
        for hf, orig in _HF_TO_ORIGINAL_LAYER:
            if rest.startswith(hf):
                rest = orig + rest[len(hf):]
                break
        else:
            raise RuntimeError(f"no original name for {name}")
        out[prefix + rest] = t
    return out


def save_sharded(tensors: dict[str, torch.Tensor], folder: str, n_shards: int) -> None:
    os.makedirs(folder, exist_ok=True)
    names = sorted(tensors)
    weight_map = {}
    for i in range(n_shards):
        fname = f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors"
        part = {k: tensors[k].contiguous() for k in names[i::n_shards]}
        save_file(part, os.path.join(folder, fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in part})
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)


# ----------------------------------------------------------------------------------- captures
CAPTURED_MODULES = {
    "attn_hc": lambda layer: layer.attn_hc,
    "ffn_hc": lambda layer: layer.ffn_hc,
    "input_layernorm": lambda layer: layer.input_layernorm,
    "self_attn": lambda layer: layer.self_attn,
    "compressor": lambda layer: layer.self_attn.compressor,
    "indexer": lambda layer: getattr(layer.self_attn.compressor, "indexer", None),
    "mlp": lambda layer: layer.mlp,
    "gate": lambda layer: layer.mlp.gate,
    "experts": lambda layer: layer.mlp.experts,
    "shared_experts": lambda layer: layer.mlp.shared_experts,
    "layer": lambda layer: layer,
}


def _np(x):
    return x.detach().to(torch.float32).numpy() if x.is_floating_point() else x.detach().numpy()


def capture(model, input_ids) -> dict[str, np.ndarray]:
    """Inputs and outputs of the modules named in CAPTURED_MODULES, in every layer, for one forward."""
    store: dict[str, np.ndarray] = {}
    hooks = []

    def hook_for(key):
        def hook(module, args, kwargs, output):
            inputs = list(args)
            if not inputs and "hidden_states" in kwargs:
                inputs = [kwargs["hidden_states"]]
            for i, a in enumerate(inputs):
                if isinstance(a, torch.Tensor):
                    store[f"{key}.in{i}"] = _np(a)
            outs = output if isinstance(output, tuple) else (output,)
            for i, o in enumerate(outs):
                if isinstance(o, torch.Tensor):
                    store[f"{key}.out{i}"] = _np(o)
        return hook

    for li, layer in enumerate(model.model.layers):
        for name, get in CAPTURED_MODULES.items():
            has_compressor = layer.self_attn.compressor is not None
            module = get(layer) if name not in ("compressor", "indexer") or has_compressor else None
            if module is not None:
                hooks.append(module.register_forward_hook(hook_for(f"L{li}.{name}"), with_kwargs=True))
    hooks.append(model.model.hc_head.register_forward_hook(hook_for("hc_head"), with_kwargs=True))
    try:
        model(input_ids=input_ids)
    finally:
        for h in hooks:
            h.remove()
    return store


# ----------------------------------------------------------------------------------- spec
def run_case(case: dict, out_dir: str) -> None:
    folder = os.path.join(out_dir, case["name"])
    os.makedirs(folder, exist_ok=True)
    config = DeepseekV4Config(**case["config"])
    torch.manual_seed(case["seed"])
    model = DeepseekV4ForCausalLM(config).eval().to(torch.float32)
    randomize(model, case["seed"])

    model.save_pretrained(os.path.join(folder, "hf"), save_original_format=False, max_shard_size="200KB")
    model.save_pretrained(os.path.join(folder, "hybrid"))
    orig_dir = os.path.join(folder, "original")
    save_sharded(original_state_dict(model), orig_dir, n_shards=3)
    config.save_pretrained(orig_dir)

    g = torch.Generator().manual_seed(case["seed"] + 1)
    reloaded = DeepseekV4ForCausalLM.from_pretrained(orig_dir, dtype=torch.float32).eval()
    for t in case["seq_lens"]:
        ids = torch.randint(0, config.vocab_size, (case["batch"], t), generator=g)
        logits = model(input_ids=ids).logits
        check = reloaded(input_ids=ids).logits
        if not torch.equal(logits, check):
            raise RuntimeError(f"{case['name']}: the original-name checkpoint reloads to different logits")
        np.save(os.path.join(folder, f"input_ids_{t}.npy"), ids.numpy())
        np.save(os.path.join(folder, f"logits_{t}.npy"), _np(logits))
    generate_greedy(model, case, folder, g)
    t = max(case["seq_lens"])
    ids = torch.from_numpy(np.load(os.path.join(folder, f"input_ids_{t}.npy")))
    bf16 = DeepseekV4ForCausalLM.from_pretrained(os.path.join(folder, "hf"), dtype=torch.bfloat16).eval()
    np.save(os.path.join(folder, f"logits_bf16_{t}.npy"), _np(bf16(input_ids=ids).logits))
    np.savez(os.path.join(folder, "capture.npz"), input_ids=ids.numpy(), **capture(model, ids))


def generate_greedy(model, case: dict, folder: str, g: torch.Generator) -> None:
    """Greedy `generate` with the V4 cache for each prompt length, EOS disabled so every run is full
    length; saves the prompt, the new tokens and the per-step logits."""
    model.generation_config.eos_token_id = None
    n_new = case["generate"]["new_tokens"]
    for t in case["generate"]["prompt_lens"]:
        ids = torch.randint(0, model.config.vocab_size, (1, t), generator=g)
        out = model.generate(input_ids=ids, max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, eos_token_id=None)
        np.savez(os.path.join(folder, f"generate_{t}.npz"), prompt=ids[0].numpy(),
                 tokens=out.sequences[0, t:].numpy(), logits=np.stack([_np(x[0]) for x in out.logits]))


def derived_config(raw: dict) -> dict:
    config = DeepseekV4Config(**raw)
    rot = mdl.DeepseekV4RotaryEmbedding(config)
    return {
        "layer_types": config.layer_types,
        "mlp_layer_types": config.mlp_layer_types,
        "compress_rates": config.compress_rates,
        "qk_rope_head_dim": config.qk_rope_head_dim,
        "rope_parameters": config.rope_parameters,
        "inv_freq_main": rot.main_inv_freq.tolist(),
        "inv_freq_compress": rot.compress_inv_freq.tolist(),
        "scaling_main": rot.main_attention_scaling,
        "scaling_compress": rot.compress_attention_scaling,
    }


def param_count(raw: dict) -> int:
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(DeepseekV4Config(**raw))
    return sum(p.numel() for p in model.parameters())


def main() -> None:
    spec_path, out_dir = sys.argv[1], sys.argv[2]
    with open(spec_path) as f:
        spec = json.load(f)
    os.makedirs(out_dir, exist_ok=True)
    for case in spec.get("cases", []):
        run_case(case, out_dir)
    with open(os.path.join(out_dir, "configs.json"), "w") as f:
        json.dump([derived_config(raw) for raw in spec.get("configs", [])], f)
    with open(os.path.join(out_dir, "param_counts.json"), "w") as f:
        json.dump({name: param_count(raw) for name, raw in spec.get("param_counts", {}).items()}, f)


if __name__ == "__main__":
    main()
