"""The `dsjax bench` workload through Hugging Face's `DeepseekV4ForCausalLM` (PyTorch) on the same GPU:
the same config (a preset cut to its first layers), random bf16 weights from the same initializer
(std `initializer_range`), random hash routing as `dsjax bench` gives it, random prompts; one prefill
forward, then greedy decode steps through the model's own cache, as `generate()` runs them.

    python scripts/bench_hf.py --preset v4-flash --layers 4 --batch 1 32 128 --prompt-len 512 --gen-len 64 \
        --with-dsjax --json hf.jsonl

`--with-dsjax` then runs `dsjax bench` with the same arguments in a fresh process (after freeing the GPU)
and prints both side by side: the ratio is measured in one run on one GPU. The weights are equal in
shape, dtype and distribution, not in value: two copies of the V4-Flash-width weights (51 GB each at 4
layers) would not fit the GPU together, and speed depends on the values only through the routing, which
is uniform in both.

Needs torch with CUDA and transformers with `models/deepseek_v4` (5.23.0 is the reference version).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time


def hf_config(preset: str, layers: int | None, config_json: str | None = None):
    """The transformers config of `dsjax bench`'s model: the same preset, cut the same way (or a
    `config.json` written from it, where dsjax is not importable)."""
    from transformers import DeepseekV4Config

    if config_json:
        raw = json.load(open(config_json))
    else:
        from dsjax.bench import bench_config

        raw = bench_config(preset, layers, "bf16").to_hf()
    return DeepseekV4Config.from_dict(raw)


def build(config, seed: int, device: str = "cuda"):
    """The model on the GPU in bf16 with the initializer's weights and random `tid2eid` rows."""
    import torch
    from transformers import DeepseekV4ForCausalLM

    torch.manual_seed(seed)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(device):
        model = DeepseekV4ForCausalLM._from_config(config, attn_implementation="eager",
                                                   dtype=torch.bfloat16)
    torch.set_default_dtype(torch.float32)
    g = torch.Generator(device=device).manual_seed(seed + 1)
    for name, buf in model.named_buffers():
        if name.endswith("tid2eid"):  # zeros from the initializer would route every token to expert 0
            noise = torch.rand(buf.shape[0], config.n_routed_experts, generator=g, device=device)
            buf.copy_(noise.topk(buf.shape[1], dim=1).indices.to(buf.dtype))
    return model.eval()


def run_hf(model, batch: int, prompt_len: int, gen_len: int, seed: int) -> dict:
    """Prefill and `gen_len - 1` greedy decode steps (the first token comes from the prefill)."""
    import torch

    device = model.device
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    g = torch.Generator(device=device).manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt_len), generator=g, device=device)

    def generate(ids, steps):
        sync()
        t0 = time.perf_counter()
        out = model(input_ids=ids, use_cache=True)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        sync()
        t1 = time.perf_counter()
        cache = out.past_key_values
        for _ in range(steps):
            out = model(input_ids=token, past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            token = out.logits[:, -1].argmax(-1, keepdim=True)
        sync()
        return t1 - t0, time.perf_counter() - t1

    with torch.no_grad():
        generate(ids[:, :min(prompt_len, 16)], 2)  # warm-up
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        prefill_s, decode_s = generate(ids, gen_len - 1)
    steps = gen_len - 1
    return {"batch": batch, "prompt_len": prompt_len, "gen_len": gen_len, "prefill_s": prefill_s,
            "prefill_tokens_per_s": batch * prompt_len / prefill_s, "decode_step_s": decode_s / steps,
            "decode_tokens_per_s_per_seq": steps / decode_s, "decode_tokens_per_s": batch * steps / decode_s,
            "peak_memory_bytes": torch.cuda.max_memory_allocated() if cuda else None}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="v4-flash")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, nargs="+", required=True)
    p.add_argument("--prompt-len", type=int, required=True)
    p.add_argument("--gen-len", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--config-json", help="a config.json to use instead of --preset/--layers (where dsjax is "
                   "not importable, e.g. the reference's Python 3.11 environment)")
    p.add_argument("--device", default="cuda", help="cuda (the benchmark), or cpu (a smoke test of this script)")
    p.add_argument("--json", help="append one JSON row per run here")
    p.add_argument("--with-dsjax", action="store_true",
                   help="then run `dsjax bench` with the same arguments and print both side by side")
    p.add_argument("--dsjax-args", default="", help="further arguments for `dsjax bench` (e.g. '--no-breakdown')")
    args = p.parse_args(argv)
    if min(args.batch) < 1 or args.prompt_len < 1 or args.gen_len < 2:
        p.error("--batch and --prompt-len must be positive and --gen-len at least 2")

    import torch
    import transformers

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_hf.py needs a CUDA GPU (or --device cpu for a smoke test)")
    if args.with_dsjax and args.config_json:
        p.error("--with-dsjax builds dsjax's model from --preset/--layers: drop --config-json")
    config = hf_config(args.preset, args.layers, args.config_json)
    model = build(config, args.seed, args.device)
    device = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, {device}: "
          f"{args.config_json or args.preset} × {config.num_hidden_layers} layers, eager attention, bf16", flush=True)
    hf_rows = {}
    name = args.config_json or args.preset
    for b in args.batch:
        try:
            row = run_hf(model, b, args.prompt_len, args.gen_len, args.seed)
        except torch.cuda.OutOfMemoryError as e:
            row = {"batch": b, "prompt_len": args.prompt_len, "gen_len": args.gen_len,
                   "error": f"out of GPU memory: {str(e).splitlines()[0]}"}
            torch.cuda.empty_cache()
        row = {"impl": "hf", "transformers": transformers.__version__, "device": device, "model": name,
               "layers": config.num_hidden_layers, **row}
        hf_rows[b] = row
        print(json.dumps(row), flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(row) + "\n")
    if not args.with_dsjax:
        return 0
    del model
    torch.cuda.empty_cache()
    ours_json = (args.json or "bench_hf") + ".dsjax.jsonl"
    open(ours_json, "w").close()
    cmd = [sys.executable, "-m", "dsjax.cli", "bench", "--preset", args.preset, "--layers", str(args.layers),
           "--batch", *map(str, args.batch), "--prompt-len", str(args.prompt_len), "--gen-len", str(args.gen_len),
           "--seed", str(args.seed), "--json", ours_json, *args.dsjax_args.split()]
    print("$ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    ours = {r["batch"]: r for r in map(json.loads, open(ours_json))}
    print(f"\n{'batch':>6} {'HF decode tok/s':>16} {'dsjax decode tok/s':>19} {'ratio':>7} "
          f"{'HF prefill tok/s':>17} {'dsjax prefill tok/s':>20} {'dsjax of roofline':>18}")
    for b in args.batch:
        h, o = hf_rows[b], ours.get(b, {})
        hd, od = h.get("decode_tokens_per_s"), o.get("decode_tokens_per_s")
        print(f"{b:>6} {hd or float('nan'):>16.1f} {od or float('nan'):>19.1f} "
              f"{(od / hd) if hd and od else float('nan'):>7.2f} {h.get('prefill_tokens_per_s', float('nan')):>17.0f} "
              f"{o.get('prefill_tokens_per_s', float('nan')):>20.0f} {100 * o.get('decode_of_roofline', float('nan')):>17.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
