"""Parity harness for DeepSeek-V4.1's DSpark drafter: NeMo AutoModel 0.7.0's `DeepseekV41DSparkBackbone` (torch,
CPU, fp32), run in `.venv-ref41` as `python run_v41_dspark_reference.py SPEC.json OUT_DIR`, the spec being
`tests/reference/spec_v41_dspark.py`'s SPEC as JSON. It reuses run_v41_reference.py's model building, random
weights and release-name checks (same folder).

For each case it builds the target (`DeepseekV41ForCausalLM`) and the drafter (NeMo's backbone for the case's
`num_nextn_predict_layers` stages, with the target's embedding and head), gives both random weights (run_v41_reference's
rules) and writes into OUT/<case>/:
  ckpt/model.safetensors   the target's and the drafter's tensors in float32 under the release's names (`mtp.*`
                           through NeMo's DSpark state-dict adapter, `to_hf`; checked against deepseek_v41_spec.md
                           §4.3's names), with config.json and the tokenizer
  input_ids.npy            int64 [B, T], random ids (BOS first)
  features.npy             fp32 [B, T, len(target layers) * H]: for each target layer, the streams its attention
                           mixes receive (after its Engram update; NeMo's `get_dspark_target_feature_modules`) averaged
                           over the streams, concatenated in `dspark_target_layer_ids` order
  anchors.npy              int64 [B, A]: each block's anchor position a (the block's inputs sit at a … a + k − 1:
                           the token at a, then noise tokens; the context it sees is positions a − window … a − 1)
  draft_<variant>.npz      for variant in (identity, quantized): NeMo's backbone on those blocks (fp8 window-key
                           rounding replaced by the identity, or as is):
      normed [B, A, k, H]       the final stage's collapsed state after the final norm
      transition [B, A, k, V]   the Markov bias from each position's previous token (the anchor's token, then the
                                input ids after it)
      confidence [B, A, k]      NeMo's confidence logits, fed the normed state (the release feeds the state before the
                                norm; DeepInfer does too)
      logits [B, A, k, V]       head(normed) in fp32 + transition: the draft's logits
OUT/done is written last, only when everything succeeded.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run_v41_reference as v41  # noqa: E402
from nemo_automodel.components.models.common import BackendConfig  # noqa: E402
from nemo_automodel.components.models.deepseek_v41 import dspark as nemo_dspark  # noqa: E402
from nemo_automodel.components.models.deepseek_v41.dspark import DeepseekV41DSparkBackbone  # noqa: E402
from nemo_automodel.components.models.deepseek_v41.state_dict_adapter import (  # noqa: E402
    DeepseekV41DSparkStateDictAdapter,
)
from safetensors.torch import save_file  # noqa: E402

VARIANTS = ("identity", "quantized")
DSPARK_BACKEND = dict(v41.CPU_BACKEND, enable_hf_state_dict_adapter=True)


def expected_dspark_names(text: dict) -> set[str]:
    """`mtp.*` names of deepseek_v41_spec.md §4.3 for this config (a sliding-only block per stage; the first stage's
    main projection and norm; the last stage's norm, Markov head and confidence head)."""
    names = set()
    stages = text["num_nextn_predict_layers"]
    for s in range(stages):
        p = f"mtp.{s}."
        names |= {p + n for n in ("attn_norm.weight", "ffn_norm.weight", "attn.attn_sink", "attn.q_norm.weight",
                                  "attn.kv_norm.weight", "ffn.gate.weight", "ffn.gate.bias")}
        names |= {f"{p}hc_{site}_{part}" for site in ("attn", "ffn") for part in ("fn", "base", "scale")}
        names |= {f"{p}attn.{w}.weight" for w in ("wq_a", "wq_b", "wkv", "wo_a", "wo_b")}
        names |= {f"{p}ffn.shared_experts.{w}.weight" for w in ("w1", "w2", "w3")}
        names |= {f"{p}ffn.experts.{e}.{w}.weight" for e in range(text["dspark_n_routed_experts"])
                  for w in ("w1", "w2", "w3")}
    last = f"mtp.{stages - 1}."
    names |= {"mtp.0.main_proj.weight", "mtp.0.main_norm.weight", last + "norm.weight",
              last + "markov_head.embed.weight", last + "markov_head.head.weight", last + "confidence_head.proj.weight"}
    return names


def dspark_state_dict(backbone, config, text: dict) -> dict[str, torch.Tensor]:
    adapter = DeepseekV41DSparkStateDictAdapter(config, backbone.moe_config, BackendConfig(**DSPARK_BACKEND),
                                                dtype=torch.float32)
    out = adapter.to_hf({k: v for k, v in backbone.state_dict().items() if "_extra_state" not in k})
    out = {k: v.detach().to(torch.float32).clone().contiguous() for k, v in out.items()}
    # The MoE gate's image bias: NeMo's gate always has one, DeepInfer's container declares one, dsjax's drafter
    # routes no image tokens (spec §4.3 leaves open whether the release ships it), so it is dropped here.
    out = {k: v for k, v in out.items() if not k.endswith(".ffn.gate.bias_vl")}
    expected = expected_dspark_names(text)
    if set(out) != expected:
        raise RuntimeError(f"DSpark names differ from the spec: extra {sorted(set(out) - expected)[:10]}, "
                           f"missing {sorted(expected - set(out))[:10]}")
    return out


def target_features(model, ids: torch.Tensor, layer_ids: list[int]) -> torch.Tensor:
    """[B, T, len(layer_ids) * H]: the streams each target layer's attention mixes receive, averaged over them."""
    modules = model.get_dspark_target_feature_modules(list(layer_ids))
    seen: dict[int, torch.Tensor] = {}
    hooks = [m.register_forward_pre_hook(lambda mod, args, i=i: seen.__setitem__(i, args[0].detach().clone()))
             for i, m in enumerate(modules)]
    try:
        model.model(ids)
    finally:
        for h in hooks:
            h.remove()
    if sorted(seen) != list(range(len(modules))):
        raise RuntimeError(f"feature hooks saw {sorted(seen)} of {len(modules)} layers")
    return torch.cat([seen[i].float().mean(dim=2) for i in range(len(modules))], dim=-1)


def run_case(case: dict, out_dir: str) -> None:
    folder = os.path.join(out_dir, case["name"])
    ckpt = os.path.join(folder, "ckpt")
    os.makedirs(ckpt, exist_ok=True)
    raw, text = case["config"], case["config"]["text_config"]
    tokenizer = v41.build_tokenizer(case["vocabulary"], raw)
    torch.manual_seed(case["seed"])
    model = v41.build_model(raw, tokenizer)
    v41.randomize(model, case["seed"])
    v41.check_randomized(model)
    config = model.config.text_config
    backbone = DeepseekV41DSparkBackbone(config, BackendConfig(**DSPARK_BACKEND)).float().eval()
    v41.randomize(backbone, case["seed"] + 100)
    v41.check_randomized(backbone)
    for stage in backbone.mtp:  # no image tokens reach the drafter; keep its image bias out of the comparison
        stage.ffn.gate.bias_vl.zero_()

    state = v41.released_state_dict(model, raw)
    state.update(dspark_state_dict(backbone, config, text))
    save_file(state, os.path.join(ckpt, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(ckpt, "config.json"), "w") as f:
        json.dump(raw, f, indent=2)
    tokenizer.save_pretrained(ckpt)

    rng = np.random.default_rng(case["seed"] + 1)
    b, t = case["batch"], case["seq_len"]
    choices = np.array([i for i in range(3, text["vocab_size"]) if i not in (raw["image_token_id"],
                                                                              text["dspark_noise_token_id"])])
    ids_np = rng.choice(choices, (b, t)).astype(np.int64)
    ids_np[:, 0] = raw["bos_token_id"]
    anchors_np = np.asarray(case["anchors"], np.int64)
    k = text["dspark_block_size"]
    if anchors_np.shape[0] != b or anchors_np.min() < 1 or anchors_np.max() > t - k:
        raise RuntimeError(f"anchors must lie in 1 … T − block for every row: {anchors_np.tolist()}")
    ids = torch.from_numpy(ids_np)
    with v41.cache_quantization("identity"):
        features = target_features(model, ids, text["dspark_target_layer_ids"])
    np.save(os.path.join(folder, "input_ids.npy"), ids_np)
    np.save(os.path.join(folder, "features.npy"), features.numpy())
    np.save(os.path.join(folder, "anchors.npy"), anchors_np)

    anchors = torch.from_numpy(anchors_np)
    n_anchors = anchors.shape[1]
    keep = torch.ones_like(anchors, dtype=torch.bool)
    block_ids = anchors[..., None] + torch.arange(k)  # [B, A, k] positions of the block's inputs
    inputs = torch.full((b, n_anchors, k), text["dspark_noise_token_id"], dtype=torch.long)
    inputs[..., 0] = torch.gather(ids, 1, anchors)
    previous = torch.gather(ids, 1, block_ids.reshape(b, -1)).reshape(b, n_anchors, k)  # token before each target
    noise = model.model.embed_tokens(inputs.reshape(b, -1)).float()
    positions = backbone.build_position_ids(anchors, t)
    mask = backbone.build_attention_mask(anchors, keep, t, torch.float32)
    head = model.lm_head.weight.float()
    for variant in VARIANTS:
        original = nemo_dspark.quantize_cache
        if variant == "identity":  # the drafter's own import of the fp8 rounding (window keys, draft keys)
            nemo_dspark.quantize_cache = lambda values, *, format, block_size: values.clone()  # noqa: A002
        try:
            out = backbone(noise, features, position_ids=positions, attention_mask=mask,
                           previous_token_ids=previous.reshape(b, -1))
        finally:
            nemo_dspark.quantize_cache = original
        normed = out.normalized_hidden_states.float().reshape(b, n_anchors, k, -1)
        transition = out.transition_logits.float().reshape(b, n_anchors, k, -1)
        logits = normed @ head.T + transition
        if not all(bool(torch.isfinite(x).all()) for x in (normed, transition, out.confidence_pred, logits)):
            raise RuntimeError(f"{variant}: non-finite draft outputs")
        np.savez(os.path.join(folder, f"draft_{variant}.npz"), normed=normed.numpy(), transition=transition.numpy(),
                 confidence=out.confidence_pred.float().reshape(b, n_anchors, k).numpy(), logits=logits.numpy())
    a = np.load(os.path.join(folder, "draft_identity.npz"))["logits"]
    q = np.load(os.path.join(folder, "draft_quantized.npz"))["logits"]
    print(f"{case['name']}: draft logits std {a.std():.3g}, |quantized - identity| max {np.abs(a - q).max():.3g}",
          file=sys.stderr)


if __name__ == "__main__":
    v41.run_harness("run_v41_dspark_reference.py", lambda spec, out_dir: [run_case(c, out_dir) for c in spec["cases"]])
