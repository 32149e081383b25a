"""DeepSeek-V4.1 checkpoints in the release layout: `save_v41` + `dsjax.load_model` round trips (float, and FP8
weights / FP4 experts / FP8 Engram tables), the release's tensor names and shapes (spec §4), weights of parts
dsjax does not run kept and written back, errors naming the tensor, and the tokenizer's Engram token map."""

import json
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

import dsjax
from dsjax.checkpoint.names_v41 import release_shapes
from dsjax.checkpoint.safetensors_io import CheckpointError, iter_tensors
from dsjax.checkpoint.save_v41 import save_v41
from dsjax.checkpoint.synthetic import write_synthetic_v41
from dsjax.config import QuantConfig
from dsjax.config_v41 import V41Config
from dsjax.engram_hash import EngramHasher, compressed_token_map
from dsjax.layers.ngram_hash import NgramHash, default_token_map
from dsjax.model_v41 import DeepseekV41
from dsjax.presets import tiny_v41_vocabulary
from tests.helpers import assert_close

CFG = V41Config.preset("tiny-v4.1")
QUANT = QuantConfig((32, 32), "ue8m0", "fp4")
QCFG = CFG.replace(quantization=QUANT)
E4M3, E8M0 = np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e8m0fnu)
IDS = np.random.default_rng(0).integers(3, 250, (2, 24)).astype(np.int32)

_forward = jax.jit(lambda graphdef, state, ids: nnx.merge(graphdef, state).forward(ids), static_argnums=0)


def _flat(model) -> dict[str, np.ndarray]:
    return {".".join(str(p) for p in path): np.asarray(var.get_value())
            for path, var in nnx.to_flat_state(nnx.state(model, nnx.Variable))}


def _random_model(cfg: V41Config, seed: int) -> DeepseekV41:
    """A random tiny-v4.1 model whose every gate is non-trivial. With a quantization config its storage is
    drawn directly (e4m3 weights, FP4 code bytes, ue8m0 scales around 2^-6) over an abstract model: building
    one quantizes every weight eagerly, which takes far longer."""
    rng = np.random.default_rng(seed)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: DeepseekV41(cfg, rngs=nnx.Rngs(seed))))
    for path, var in nnx.to_flat_state(state):
        name = ".".join(str(p) for p in path)
        sds = var.get_value()
        dtype, shape = np.dtype(sds.dtype), sds.shape
        if name.startswith("ngram_hash."):
            continue  # tables derived from the token map, filled below
        if dtype == E4M3:
            value = rng.uniform(-2, 2, shape).astype(E4M3)
        elif dtype == np.uint8:  # ue8m0 scales
            value = rng.integers(119, 123, shape).astype(np.uint8)
        elif dtype == np.int8:  # two FP4 codes per byte
            value = rng.integers(-128, 128, shape).astype(np.int8)
        elif name.endswith(("norm.weight", "q_weight", "k_weight")):
            value = rng.uniform(0.5, 1.5, shape).astype(dtype)
        elif name.endswith(("hc.scale", "hc.base", "sinks", "bias_vl", "e_score_correction_bias")):
            value = rng.normal(0, 0.5, shape).astype(dtype)
        else:
            value = rng.normal(0, 0.05, shape).astype(dtype)
        var.set_value(jnp.asarray(value))
    model = nnx.merge(graphdef, state)
    model.ngram_hash = NgramHash(EngramHasher.from_config(cfg, default_token_map(cfg.vocab_size,
                                                                               cfg.engram_compressed_vocab_size)))
    return model


@pytest.fixture(scope="module")
def float_model():
    return _random_model(CFG, 1)


@pytest.fixture(scope="module")
def quant_model():
    return _random_model(QCFG, 2)


@pytest.fixture(scope="module")
def float_folder(float_model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("v41") / "float"
    save_v41(float_model, folder)
    return folder


@pytest.fixture(scope="module")
def quant_folder(quant_model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("v41") / "quant"
    save_v41(quant_model, folder)
    return folder


def logits(model, template) -> np.ndarray:
    """`model`'s logits through `template`'s program (one compiled forward per weight layout, whichever model
    the weights come from: a loaded model's kept weights make its own graph a new static value)."""
    return np.asarray(_forward(nnx.graphdef(template), nnx.state(model), jnp.asarray(IDS)))


def _tensors(folder) -> dict[str, np.ndarray]:
    return {name: np.array(value) for name, _, value in iter_tensors(str(folder))}


def _write(folder, files: dict[str, dict[str, np.ndarray]], source) -> None:
    """A checkpoint folder of `files` (file name → tensors), no index, with `source`'s config.json."""
    folder.mkdir(parents=True)
    shutil.copy(source / "config.json", folder / "config.json")
    for name, tensors in files.items():
        save_file(tensors, str(folder / name), metadata={"format": "pt"})


def _assert_same_variables(got, want):
    a, b = _flat(got), _flat(want)
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype, key
        np.testing.assert_array_equal(a[key].view(np.uint8), b[key].view(np.uint8), err_msg=key)


# ----------------------------------------------------------------------------------------- round trips

def test_float_round_trip(float_model, float_folder):
    loaded = dsjax.load_model(float_folder)
    assert isinstance(loaded, DeepseekV41)
    assert loaded.cfg == float_model.cfg == CFG
    assert len(loaded.kept_weights) == 0
    _assert_same_variables(loaded, float_model)
    want = logits(float_model, float_model)
    np.testing.assert_array_equal(logits(loaded, float_model), want)
    assert np.abs(want).max() > 0


def test_quantized_round_trip_is_exact_and_bf16_matches_keep(float_model, quant_model, quant_folder):
    """FP8 weights, FP4 experts and FP8 Engram tables come back byte for byte; dequantized at load
    (`weights="bf16"`) they give the logits the kept storage gives."""
    keep = dsjax.load_model(quant_folder)
    assert keep.cfg == QCFG
    flat = _flat(keep)
    assert flat["layers.1.engram.table"].dtype == E4M3 and flat["layers.1.engram.table_scale"].dtype == np.uint8
    assert flat["layers.0.ffn.experts.gate_up_proj"].dtype == np.int8
    assert flat["layers.0.attn.q_a_proj.weight"].dtype == E4M3
    _assert_same_variables(keep, quant_model)
    want = logits(quant_model, quant_model)
    np.testing.assert_array_equal(logits(keep, quant_model), want)
    dense = dsjax.load_model(quant_folder, weights="bf16")
    assert dense.cfg == CFG  # the same model with its weights dequantized: the float model's program
    assert all(v.dtype.kind == "f" for k, v in _flat(dense).items() if not k.startswith("ngram_hash."))
    assert_close(logits(dense, float_model), want, rtol=1e-5, what="weights='bf16' against 'keep'")


# -------------------------------------------------------------------------------------------- names

def _spec_shapes(cfg: V41Config) -> dict[str, tuple[tuple, str]]:
    """Spec §4 for the tiny preset, written from its tables with the tiny dimensions: name → (shape, dtype)
    for a few tensors of each kind, FP8 `X.weight` with its `X.scale` (ceil(out/32), ceil(in/32))."""
    h, d, nh, qr = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.q_lora_rank
    inter, e, c, ni = cfg.moe_intermediate_size, cfg.n_routed_experts, cfg.index_head_dim, cfg.index_n_heads
    og, olr, hd = cfg.o_groups, cfg.o_lora_rank, cfg.engram_head_dim
    up = lambda n: -(-n // 32)  # noqa: E731
    out = {"embed.weight": ((cfg.vocab_size, h), "F32"), "head.weight": ((cfg.vocab_size, h), "F32"),
           "norm.weight": ((h,), "F32")}

    def fp8(name, rows, cols):
        out[name + ".weight"] = ((rows, cols), "F8_E4M3")
        out[name + ".scale"] = ((up(rows), up(cols)), "F8_E8M0")

    for layer in (0, 2, 5):
        p = f"layers.{layer}."
        out[p + "hc_attn_fn"] = out[p + "hc_ffn_fn"] = ((24, 4 * h), "F32")
        out[p + "hc_attn_base"] = ((24,), "F32")
        out[p + "hc_ffn_scale"] = ((3,), "F32")
        out[p + "attn.attn_sink"] = ((nh,), "F32")
        out[p + "ffn.gate.bias"] = out[p + "ffn.gate.bias_vl"] = ((e,), "F32")
        out[p + "ffn.gate.weight"] = ((e, h), "F32")
        fp8(p + "attn.wq_a", qr, h)
        fp8(p + "attn.wq_b", nh * d, qr)
        fp8(p + "attn.wkv", d, h)
        fp8(p + "attn.wo_a", og * olr, nh * d // og)
        fp8(p + "attn.wo_b", h, og * olr)
        fp8(p + "ffn.shared_experts.w1", inter, h)
        fp8(p + "ffn.shared_experts.w2", h, inter)
        for x in (0, e - 1):  # FP4 experts: two codes per int8, a ue8m0 scale per 32 inputs
            out[p + f"ffn.experts.{x}.w1.weight"] = out[p + f"ffn.experts.{x}.w3.weight"] = ((inter, h // 2), "I8")
            out[p + f"ffn.experts.{x}.w1.scale"] = ((inter, h // 32), "F8_E8M0")
            out[p + f"ffn.experts.{x}.w2.weight"] = ((h, inter // 2), "I8")
            out[p + f"ffn.experts.{x}.w2.scale"] = ((h, inter // 32), "F8_E8M0")
    out["layers.2.attn.compressor.wkv.weight"] = out["layers.2.attn.compressor.wgate.weight"] = ((d, h), "F32")
    out["layers.2.attn.compressor.norm.weight"] = ((d,), "F32")
    out["layers.2.attn.indexer.wk.weight"] = ((c, d), "F32")
    out["layers.2.attn.indexer.k_norm.weight"] = ((c,), "F32")
    out["layers.2.attn.indexer.weights_proj.weight"] = ((ni, h), "F32")
    fp8("layers.2.attn.indexer.wq_b", ni * c, qr)
    for layer, rows in zip(cfg.engram_layer_ids, cfg.engram_num_embeddings):
        p = f"layers.{layer}.engram."
        out[p + "embed.weight"] = ((rows, hd), "F8_E4M3")  # row-wise: a scale per 32 values of a row
        out[p + "embed.scale"] = ((rows, up(hd)), "F8_E8M0")
        fp8(p + "wkv", (cfg.hc_mult + 1) * h, cfg.engram_hash_heads * hd)
        out[p + "q_weight"] = out[p + "k_weight"] = ((cfg.hc_mult, h), "F32")
    return out


_ST = {np.dtype(np.float32): "F32", E4M3: "F8_E4M3", E8M0: "F8_E8M0", np.dtype(np.int8): "I8"}


def test_release_names_and_shapes(quant_folder):
    names = {name: (tuple(v.shape), _ST.get(v.dtype, str(v.dtype))) for name, _, v in iter_tensors(str(quant_folder))}
    want = _spec_shapes(CFG)
    for name, spec in want.items():
        assert name in names, f"{name} missing"
        assert names[name] == spec, f"{name}: {names[name]} != {spec}"
    # Which layers own which parts (spec §4.2 "present in"): compressors and index keys at the KV sources
    # (wgate only at ratio 2), index queries at the index sources, Engram at its layers.
    def layers_with(suffix):
        return sorted(int(n.split(".")[1]) for n in names if n.startswith("layers.") and n.endswith(suffix))
    assert layers_with("attn.compressor.wkv.weight") == [2, 4]
    assert layers_with("attn.compressor.wgate.weight") == [2]
    assert layers_with("attn.indexer.wk.weight") == layers_with("attn.indexer.k_norm.weight") == [2, 4]
    assert layers_with("attn.indexer.wq_b.weight") == layers_with("attn.indexer.weights_proj.weight") == [2, 3, 4, 6]
    assert layers_with("engram.embed.weight") == layers_with("engram.wkv.weight") == [1, 3]
    assert layers_with("ffn.gate.bias_vl") == list(range(8)) == layers_with("attn.attn_sink")
    assert len([n for n in names if n.startswith("layers.7.ffn.experts.")]) == 6 * CFG.n_routed_experts
    # Nothing V4 had and V4.1 has not, and no dsjax-internal names.
    internal = ("q_a_proj", "q_b_proj", "kv_proj", "o_a_proj", "o_b_proj", "gate_proj", "up_proj", "down_proj",
                "k_proj", "scorer", "attn_hc", "ffn_hc", "lm_head", "embed_tokens", "scale_inv", "table", "sinks",
                "e_score", "ngram_hash")
    assert not [n for n in names if any(x in n for x in ("hc_head", "tid2eid", ".ape") + internal)]


def test_release_names_of_a_float_checkpoint(float_folder):
    """The same names without scales; float weights in the model's dtype; experts per expert, [out, in]."""
    tensors = _tensors(float_folder)
    assert not [n for n in tensors if n.endswith(".scale")]
    # FP4 experts are stored two codes per byte: their float shape has twice the columns.
    want = {n: (s[0], 2 * s[1]) if dt == "I8" else s for n, (s, dt) in _spec_shapes(CFG).items()
            if not n.endswith(".scale")}
    for name, shape in want.items():
        assert tensors[name].shape == shape and tensors[name].dtype == np.float32, name
    assert tensors["layers.1.engram.embed.weight"].shape == (CFG.engram_num_embeddings[0], CFG.engram_head_dim)
    assert tensors["layers.0.ffn.experts.3.w1.weight"].shape == (CFG.moe_intermediate_size, CFG.hidden_size)
    assert tensors["layers.0.ffn.experts.3.w2.weight"].shape == (CFG.hidden_size, CFG.moe_intermediate_size)


def test_expert_layout_of_a_float_checkpoint(float_model, float_folder):
    """w1 (gate), w3 (up), w2 (down) of one expert in [out, in], computed by hand from the merged variables."""
    tensors, flat = _tensors(float_folder), _flat(float_model)
    inter = CFG.moe_intermediate_size
    gate_up, down = flat["layers.5.ffn.experts.gate_up_proj"][3], flat["layers.5.ffn.experts.down_proj"][3]
    x = np.random.default_rng(4).normal(size=CFG.hidden_size).astype(np.float32)
    np.testing.assert_allclose(tensors["layers.5.ffn.experts.3.w1.weight"] @ x, (x @ gate_up)[:inter], rtol=1e-5)
    np.testing.assert_allclose(tensors["layers.5.ffn.experts.3.w3.weight"] @ x, (x @ gate_up)[inter:], rtol=1e-5)
    y = x[:inter]
    np.testing.assert_allclose(tensors["layers.5.ffn.experts.3.w2.weight"] @ y, y @ down, rtol=1e-5)


# ------------------------------------------------------------------------------------- kept weights

def test_dspark_tensors_in_a_config_without_stages_are_refused(quant_folder, tmp_path):
    """DSpark's stages are part of the model: their tensors in a checkpoint whose config has no stages belong to
    no parameter, and the error names one."""
    src = tmp_path / "with_mtp"
    extra = {"mtp.0.main_norm.weight": np.ones(64, ml_dtypes.bfloat16)}
    _write(src, {"model-00001-of-00002.safetensors": _tensors(quant_folder),
                 "model-00002-of-00002.safetensors": extra}, quant_folder)
    with pytest.raises(CheckpointError, match="unexpected tensor 'mtp.0.main_norm.weight'"):
        dsjax.load_model(src)


def _with_stages():
    """The quantized test config with two DSpark stages (FP8 projections, FP4 experts, bf16 heads)."""
    return QCFG.replace(num_nextn_predict_layers=2, compress_ratios=QCFG.compress_ratios + (0, 0),
                        dspark_target_layer_ids=(5, 6, 7), dspark_markov_rank=8, dspark_n_routed_experts=4,
                        dspark_num_experts_per_tok=3)


def test_dspark_stages_load_and_save_back_as_read(tmp_path):
    """A release checkpoint with two DSpark stages (FP8 projections, FP4 experts, bf16 heads): every `mtp.*`
    tensor of the spec's list loads into the model's stages and is written back, the quantized ones byte for byte
    and the float ones with their values (in the model's dtype, as every float weight)."""
    cfg = _with_stages()
    src = tmp_path / "src"
    write_synthetic_v41(src, cfg, seed=3)
    model = dsjax.load_model(src)
    assert len(model.mtp) == 2 and len(model.kept_weights) == 0
    read = _tensors(src)
    mtp = {n for n in read if n.startswith("mtp.")}
    assert {n for n in release_shapes(cfg) if n.startswith("mtp.")} <= mtp
    assert read["mtp.1.ffn.experts.3.w2.weight"].dtype == np.int8 and read["mtp.0.main_proj.scale"].dtype == E8M0
    out = tmp_path / "written"
    save_v41(model, out)
    written = _tensors(out)
    assert written.keys() == read.keys()
    for name in sorted(mtp):
        if read[name].dtype in (E4M3, E8M0, np.dtype(np.int8)):
            assert written[name].dtype == read[name].dtype, name
            np.testing.assert_array_equal(written[name].view(np.uint8), read[name].view(np.uint8), err_msg=name)
        else:
            np.testing.assert_array_equal(written[name].astype(np.float32), read[name].astype(np.float32), name)


def test_a_run_that_does_not_draft_leaves_the_stages_unread(tmp_path):
    """`load_model(drafter=False)`, from release tensors and from a `dsjax convert` folder: no stages on the device,
    a config without them, and the backbone's variables those of the whole load, byte for byte."""
    from dsjax.checkpoint.convert import convert

    cfg = _with_stages()
    src = tmp_path / "src"
    write_synthetic_v41(src, cfg, seed=3)
    whole = dsjax.load_model(src)
    convert(str(src), str(tmp_path / "converted"))
    for folder in (src, tmp_path / "converted"):
        model = dsjax.load_model(folder, drafter=False)
        assert model.mtp is None and model.cfg.num_nextn_predict_layers == 0, folder
        mine = {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
        theirs = {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(whole, nnx.Param))
                  if p[0] != "mtp"}
        assert mine.keys() == theirs.keys() and mine
        for p in mine:
            assert mine[p].tobytes() == theirs[p].tobytes(), (folder, p)


def test_image_encoder_tensors_in_a_text_only_config_are_refused(quant_folder, tmp_path):
    """The image encoder runs in dsjax (it is no longer kept aside): its tensors in a checkpoint whose config
    has no vision_config belong to no parameter, and the error names one."""
    src = tmp_path / "with_vision"
    extra = {"vision.blocks.0.attn.wqkv.weight": np.zeros((96, 32), ml_dtypes.bfloat16)}
    _write(src, {"model-00001-of-00002.safetensors": _tensors(quant_folder),
                 "model-00002-of-00002.safetensors": extra}, quant_folder)
    with pytest.raises(CheckpointError, match="unexpected tensor 'vision.blocks.0.attn.wqkv.weight'"):
        dsjax.load_model(src)


# ------------------------------------------------------------------------------------------- errors

@pytest.fixture(scope="module")
def float_tensors(float_folder):
    return _tensors(float_folder)


def _edited(tmp_path, float_folder, float_tensors, edit) -> str:
    tensors = dict(float_tensors)
    edit(tensors)
    folder = tmp_path / "edited"
    _write(folder, {"model.safetensors": tensors}, float_folder)
    return folder


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop("layers.2.attn.compressor.wgate.weight"),
     r"lacks 1 tensor\(s\): layers\.2\.attn\.compressor\.wgate\.weight$"),
    (lambda t: t.pop("layers.3.engram.embed.weight"), r"lacks 1 tensor\(s\): layers\.3\.engram\.embed\.weight$"),
    (lambda t: t.pop("layers.6.ffn.experts.7.w3.weight"), r"lacks 1 tensor\(s\): layers\.6\.ffn\.experts\.\*$"),
    (lambda t: t.update({"layers.5.attn.compressor.wkv.weight": np.zeros((64, 64), np.float32)}),
     r"model\.safetensors: unexpected tensor 'layers\.5\.attn\.compressor\.wkv\.weight'"),
    (lambda t: t.update({"layers.2.attn.compressor.ape": np.zeros((2, 64), np.float32)}),
     r"unexpected tensor 'layers\.2\.attn\.compressor\.ape'"),
    (lambda t: t.update({"hc_head_fn": np.zeros((4, 256), np.float32)}), r"unexpected tensor 'hc_head_fn'"),
    (lambda t: t.update({"layers.9.ffn.experts.0.w1.weight": np.zeros((32, 64), np.float32)}),
     r"unexpected tensor 'layers\.9\.ffn\.experts\.0\.w1\.weight'; its layer does not exist"),
    (lambda t: t.update({"layers.0.ffn.experts.8.w1.weight": np.zeros((32, 64), np.float32)}),
     r"'layers\.0\.ffn\.experts\.8\.w1\.weight' names expert 8, but the config has 8"),
    (lambda t: t.update({"layers.0.attn.wq_a.weight": np.zeros((32, 63), np.float32)}),
     r"model\.safetensors: tensor 'layers\.0\.attn\.wq_a\.weight' has shape \[32, 63\], expected \[32, 64\]"),
    (lambda t: t.update({"layers.4.ffn.experts.2.w2.weight": np.zeros((32, 64), np.float32)}),
     r"tensor 'layers\.4\.ffn\.experts\.2\.w2\.weight' has shape \[32, 64\], expected \[64, 32\]"),
    (lambda t: t.update({"layers.1.engram.embed.weight": np.zeros((383, 16), np.float32)}),
     r"tensor 'layers\.1\.engram\.embed\.weight' has shape \[383, 16\], expected \[384, 16\]"),
    (lambda t: t.update({"model.layers.0.attn_norm.weight": t["layers.0.attn_norm.weight"]}),
     r"tensor '(model\.)?layers\.0\.attn_norm\.weight' appears twice"),
], ids=["missing", "missing engram table", "missing expert", "unexpected compressor", "unexpected ape",
        "unexpected hc_head", "expert of no layer", "expert past the count", "wrong shape", "wrong expert shape",
        "wrong table rows", "duplicate by prefix"])
def test_broken_checkpoints_name_the_tensor(tmp_path, float_folder, float_tensors, edit, message):
    with pytest.raises(CheckpointError, match=message):
        dsjax.load_model(_edited(tmp_path, float_folder, float_tensors, edit))


def test_a_tensor_in_two_files_is_named(tmp_path, float_folder, float_tensors):
    tensors = dict(float_tensors)
    again = {"layers.3.attn.wkv.weight": tensors["layers.3.attn.wkv.weight"]}
    folder = tmp_path / "twice"
    _write(folder, {"model-00001-of-00002.safetensors": tensors, "model-00002-of-00002.safetensors": again},
           float_folder)
    with pytest.raises(CheckpointError, match=r"tensor layers\.3\.attn\.wkv\.weight appears in both .*"
                                              r"model-00001-of-00002\.safetensors and .*model-00002-of-00002"):
        dsjax.load_model(folder)


def test_a_quantized_weight_without_its_scale_is_named(tmp_path, quant_folder):
    tensors = _tensors(quant_folder)
    tensors.pop("layers.1.attn.wq_a.scale")
    folder = tmp_path / "no_scale"
    _write(folder, {"model.safetensors": tensors}, quant_folder)
    with pytest.raises(CheckpointError, match=r"tensor 'layers\.1\.attn\.wq_a\.weight' \(float8_e4m3fn\) has no "
                                              r"scale"):
        dsjax.load_model(folder)


# ---------------------------------------------------------------------------------------- tokenizer

def _tokenizer_json(vocab: list[str]) -> dict:
    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
            "pre_tokenizer": {"type": "Whitespace"}, "post_processor": None, "decoder": None,
            "model": {"type": "WordLevel", "vocab": {t: i for i, t in enumerate(vocab)}, "unk_token": vocab[2]}}


def test_a_tokenizer_of_another_compressed_size_is_refused(tmp_path, float_folder):
    folder = tmp_path / "ckpt"
    shutil.copytree(float_folder, folder)
    vocab = tiny_v41_vocabulary()[:3] + [f"w{i}" for i in range(252)] + ["<｜deepseek_image｜>"]  # 256 distinct keys
    (folder / "tokenizer.json").write_text(json.dumps(_tokenizer_json(vocab)))
    with pytest.raises(CheckpointError, match=r"tokenizer\.json: its vocabulary compresses to 256 Engram ids, but "
                                              r"the config's engram_compressed_vocab_size is 123"):
        dsjax.load_model(folder)


def test_the_tokenizer_gives_the_engram_token_map(tmp_path, float_model, float_folder):
    folder = tmp_path / "ckpt"
    shutil.copytree(float_folder, folder)
    vocab = tiny_v41_vocabulary()
    (folder / "tokenizer.json").write_text(json.dumps(_tokenizer_json(vocab), ensure_ascii=False))
    model = dsjax.load_model(folder)
    want, size = compressed_token_map(vocab, vocab)
    assert size == CFG.engram_compressed_vocab_size
    got = np.asarray(model.ngram_hash.token_map[...])
    np.testing.assert_array_equal(got, want)
    assert not np.array_equal(got, default_token_map(CFG.vocab_size, size))  # not the map used without one
    # Without the tokenizer the same weights load with the default map.
    plain = dsjax.load_model(float_folder)
    np.testing.assert_array_equal(np.asarray(plain.ngram_hash.token_map[...]), default_token_map(CFG.vocab_size, 123))
