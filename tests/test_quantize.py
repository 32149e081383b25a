"""Quantized models end to end: FP8 linears and FP4/FP8 experts stay low precision on the device, give the
logits of weights dequantized up front, load in transformers with the same logits, and take no more
device memory than their bytes."""

import gc
import json
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

import dsjax
from dsjax.checkpoint.safetensors_io import CheckpointError, iter_tensors
from dsjax.checkpoint.save import save_model
from dsjax.config import ConfigError, ModelConfig, QuantConfig
from dsjax.model import DeepseekV4
from dsjax.quantize import V4_QUANT, dequantize_model, quantize_model
from tests.conftest import reference_python
from tests.helpers import assert_close

SCRIPT = Path(__file__).parent / "reference" / "run_fp8_reference.py"
ODD_BLOCKS = QuantConfig(weight_block_size=(16, 24), scale_fmt="float", expert_dtype="fp8")


def _storage(model) -> dict[str, set]:
    """Dtypes of the quantizable leaves: linear weights and the routed experts."""
    out: dict[str, set] = {}
    for path, var in nnx.to_flat_state(nnx.state(model)):
        leaf = path[-1]
        if leaf in ("weight", "gate_up_proj", "down_proj"):
            key = "experts" if leaf != "weight" else ".".join(str(p) for p in path[-3:-1])
            out.setdefault(key, set()).add(np.dtype(var.get_value().dtype))
    return out


@pytest.fixture(scope="module")
def quantized_checkpoint(load_case, reference, tmp_path_factory):
    """The reference's `mixed` model (every parameter non-trivial) quantized V4-style (ue8m0 FP8 blocks,
    FP4 experts) and saved with the original DeepSeek names, as the release is."""
    folder = tmp_path_factory.mktemp("fp8") / "mixed-fp8"
    model = quantize_model(load_case("mixed"), V4_QUANT)
    save_model(model, folder, naming="original")
    return folder


def test_checkpoint_holds_fp8_weights_and_fp4_experts(quantized_checkpoint):
    dtypes = {name: value.dtype for name, _, value in iter_tensors(str(quantized_checkpoint))}
    assert dtypes["layers.1.attn.wq_a.weight"] == ml_dtypes.float8_e4m3fn
    assert dtypes["layers.1.attn.wq_a.scale"] == ml_dtypes.float8_e8m0fnu
    assert dtypes["layers.1.ffn.experts.3.w1.weight"] == np.int8  # two e2m1 codes per byte
    assert dtypes["layers.1.ffn.shared_experts.w2.weight"] == ml_dtypes.float8_e4m3fn
    # kept in float as the reference keeps them (spec §11/§13)
    for name in ("layers.1.attn.compressor.wkv.weight", "layers.1.attn.indexer.weights_proj.weight",
                 "layers.1.ffn.gate.weight", "head.weight", "embed.weight", "layers.1.hc_attn_scale"):
        assert jnp.issubdtype(dtypes[name], jnp.floating) and dtypes[name] != ml_dtypes.float8_e4m3fn, name
    assert dtypes["layers.1.attn.indexer.wq_b.weight"] == ml_dtypes.float8_e4m3fn


def test_kept_weights_give_the_logits_of_weights_dequantized_up_front(quantized_checkpoint, reference,
                                                                       load_case):
    kept = dsjax.load_model(quantized_checkpoint, weights="keep")
    storage = _storage(kept)
    assert storage["experts"] == {np.dtype(np.int8)}
    assert storage["self_attn.q_a_proj"] == {np.dtype(ml_dtypes.float8_e4m3fn)}
    assert storage["shared_experts.gate_proj"] == {np.dtype(ml_dtypes.float8_e4m3fn)}
    upfront = dsjax.load_model(quantized_checkpoint, weights="bf16")  # dequantized at load, fp32 here
    assert upfront.cfg.quantization is None and _storage(upfront)["experts"] == {np.dtype(np.float32)}
    ids = jnp.asarray(np.load(reference / "mixed" / "input_ids_64.npy"))
    ours = np.asarray(kept(ids))
    assert_close(ours, np.asarray(upfront(ids)), rtol=1e-5, what="on-the-fly vs up-front dequantization")
    assert_close(ours, np.asarray(dequantize_model(kept)(ids)), rtol=1e-5, what="dequantize_model")
    # and quantization is real: the float original differs by far more than that
    float_logits = np.load(reference / "mixed" / "logits_64.npy")
    assert np.abs(ours - float_logits).max() > 1e-3 * np.abs(float_logits).max()


def test_transformers_reads_our_fp8_checkpoint_with_the_same_logits(quantized_checkpoint, reference, tmp_path):
    ids_path = reference / "mixed" / "input_ids_64.npy"
    out = tmp_path / "logits.npy"
    proc = subprocess.run([reference_python(), str(SCRIPT), str(quantized_checkpoint), str(ids_path), str(out)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ours = np.asarray(dsjax.load_model(quantized_checkpoint)(jnp.asarray(np.load(ids_path))))
    assert_close(ours, np.load(out), rtol=1e-5, what="dsjax FP8/FP4 vs transformers' dequantized load")


@pytest.mark.parametrize("quant", [V4_QUANT, ODD_BLOCKS], ids=["fp4-ue8m0", "fp8-float-16x24"])
@pytest.mark.parametrize("naming", ["hf", "original"])
def test_save_and_load_round_trip_every_byte(quant, naming, tmp_path):
    model = quantize_model(DeepseekV4(ModelConfig.preset("tiny"), rngs=nnx.Rngs(3)), quant)
    save_model(model, tmp_path, naming=naming)
    assert json.loads((tmp_path / "config.json").read_text())["quantization_config"]["expert_dtype"] \
        == quant.expert_dtype
    loaded = dsjax.load_model(tmp_path)
    assert loaded.cfg.quantization == quant
    for (path, a), (_, b) in zip(nnx.to_flat_state(nnx.state(model)), nnx.to_flat_state(nnx.state(loaded))):
        a, b = a.get_value(), b.get_value()
        assert a.dtype == b.dtype, path
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8), err_msg=str(path))


def test_device_memory_after_loading_stays_near_the_fp8_bytes(tmp_path):
    model = quantize_model(DeepseekV4(ModelConfig.preset("tiny"), rngs=nnx.Rngs(0), dtype=jnp.bfloat16), V4_QUANT)
    save_model(model, tmp_path, naming="original")
    del model
    stored = sum(v.nbytes for _, _, v in iter_tensors(str(tmp_path)))
    gc.collect()
    before = sum(x.nbytes for x in jax.live_arrays())
    loaded = dsjax.load_model(tmp_path, dtype=jnp.bfloat16)
    gc.collect()
    grew = sum(x.nbytes for x in jax.live_arrays()) - before
    assert grew < 1.1 * stored, f"loading {stored:,} checkpoint bytes left {grew:,} bytes of live arrays"
    assert loaded.cfg.quantization == V4_QUANT


@pytest.fixture
def fp8_folder(tmp_path):
    save_model(quantize_model(DeepseekV4(ModelConfig.preset("tiny"), rngs=nnx.Rngs(0)), V4_QUANT), tmp_path,
               naming="original")
    path = next(tmp_path.glob("*.safetensors"))

    def edit(fn):
        tensors = {n: v for n, _, v in iter_tensors(str(tmp_path)) if Path(_).name == path.name}
        tensors = {n: np.array(v) for n, v in tensors.items()}
        fn(tensors)
        save_file(tensors, path)
        return tmp_path

    return edit


def test_weight_without_its_scale_is_named(fp8_folder):
    folder = fp8_folder(lambda t: t.pop("layers.0.attn.wq_a.scale"))
    with pytest.raises(CheckpointError, match=r"layers\.0\.attn\.wq_a\.weight.*no scale"):
        dsjax.load_model(folder)
    with pytest.raises(CheckpointError, match=r"layers\.0\.attn\.wq_a\.weight.*no scale"):
        dsjax.load_model(folder, weights="bf16")


def test_scales_that_are_not_powers_of_two_are_refused_for_ue8m0(fp8_folder):
    def fp32_scale(t):
        t["layers.0.attn.wq_a.scale"] = np.full(t["layers.0.attn.wq_a.scale"].shape, 0.3, np.float32)
    with pytest.raises(CheckpointError, match=r"wq_a\.scale.*not powers of two"):
        dsjax.load_model(fp8_folder(fp32_scale))


def test_fp4_expert_stored_as_fp8_is_refused(fp8_folder):
    def wrong(t):
        w = t["layers.1.ffn.experts.0.w1.weight"]
        t["layers.1.ffn.experts.0.w1.weight"] = np.zeros(w.shape, ml_dtypes.float8_e4m3fn)
    with pytest.raises(CheckpointError, match=r"experts\.0\.w1\.weight.*FP4"):
        dsjax.load_model(fp8_folder(wrong))


def test_scales_without_quantization_config_are_refused(fp8_folder):
    folder = fp8_folder(lambda t: None)
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["quantization_config"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="no quantization_config"):
        dsjax.load_model(folder)


@pytest.mark.parametrize("qc, message", [
    ({"quant_method": "bitsandbytes"}, "quant_method"),
    ({"quant_method": "fp8", "activation_scheme": "static"}, "activation_scheme"),
    ({"quant_method": "fp8", "scale_fmt": "e5m2"}, "scale_fmt"),
    ({"quant_method": "fp8", "expert_dtype": "int4"}, "expert_dtype"),
])
def test_bad_quantization_config_is_named(qc, message):
    raw = {**ModelConfig.preset("tiny").to_hf(), "quantization_config": qc}
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf(raw)


def test_top_level_expert_dtype_fills_in_the_quantization_config():
    raw = {**ModelConfig.preset("tiny").to_hf(), "expert_dtype": "fp4",
           "quantization_config": {"quant_method": "fp8", "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}}
    cfg = ModelConfig.from_hf(raw)
    assert cfg.quantization == V4_QUANT
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg


def test_quantize_model_refuses_a_quantized_model():
    model = quantize_model(DeepseekV4(ModelConfig.preset("tiny"), rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match="already quantized"):
        quantize_model(model)
    with pytest.raises(ValueError, match="weights must be"):
        dsjax.load_model("/nonexistent", weights="fp8")
