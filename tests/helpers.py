"""Shared test helpers."""

from tests.conftest import assert_close  # noqa: F401

CASES = {"mixed": 6, "legacy": 5}  # case name → number of layers


def layers_of(cfg, attention_type=None, mlp_type=None):
    return [i for i, (a, m) in enumerate(cfg.layer_kinds)
            if (attention_type is None or a == attention_type) and (mlp_type is None or m == mlp_type)]


def assert_same_state(a, b) -> None:
    """Two models hold the same variables, dtype for dtype and byte for byte."""
    import numpy as np
    from flax import nnx

    sa = {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(a))}
    sb = {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(b))}
    assert sa.keys() == sb.keys()
    for p in sa:
        assert sa[p].dtype == sb[p].dtype and sa[p].shape == sb[p].shape, p
        assert sa[p].tobytes() == sb[p].tobytes(), p


def recipe_prompt_tokens(body: dict, tokenizer: str, url: str = "/v1/chat/completions") -> int:
    """deepseek-recipe's own prompt count for a V4.1 request body: its encoded prompt (one placeholder per
    image) plus the images' `image_token_adjustment` (data URLs only: nothing is fetched)."""
    import deepseek_recipe as dr

    endpoint = {"/v1/chat/completions": dr.ChatCompletionRequest, "/v1/responses": dr.ResponsesRequest,
                "/v1/messages": dr.MessagesRequest}[url]
    conv = endpoint(body).convert(dr.ConversionOptions())
    prompt = dr.DeepseekV41Encoding().with_tokenizer(dr.Tokenizer.from_file(tokenizer)).encode(conv.conversation)
    sources = [s for m in conv.conversation.messages for s in m.image_sources]
    if not sources:
        return len(prompt)
    images = dr.ImageResolver(dr.ReqwestImageFetcher.with_max_bytes(1 << 24), dr.OpenCvImagePreprocessor())
    return len(prompt) + images.resolve(sources, dr.ImageQuota()).image_token_adjustment()


def mesh_cuda_module(fn, *args) -> str:
    """`fn` of `args`' shapes lowered for 8 H200s as a dp=2, ep=4 mesh (abstract devices: none needed)."""
    import jax

    from dsjax.export import abstract_device, disabled_checks

    mesh = jax.sharding.AbstractMesh((2, 4, 1), ("dp", "ep", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 3,
                                     abstract_device=abstract_device("cuda"))
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]
    with jax.sharding.use_abstract_mesh(mesh):
        return jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=disabled_checks("cuda"))(
            *specs).mlir_module()


def dspark_model(seed: int = 0, **changes):
    """tiny-v4.1 with three DSpark stages (5-token blocks, target layers 5-7, rank-8 Markov bias, 4 experts top-2)
    and config `changes`, fp32, every gate the init leaves trivial (sinks, router biases, mHC bases, norms) made
    random, so that no part of a test's path is an identity."""
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from dsjax.config_v41 import V41Config
    from dsjax.model_v41 import DeepseekV41

    base = V41Config.preset("tiny-v4.1")
    cfg = base.replace(**{"num_nextn_predict_layers": 3, "compress_ratios": base.compress_ratios + (0, 0, 0),
                          "dspark_block_size": 5, "dspark_noise_token_id": 254, "dspark_target_layer_ids": (5, 6, 7),
                          "dspark_markov_rank": 8, "dspark_n_routed_experts": 4, "dspark_num_experts_per_tok": 2,
                          **changes})
    model = DeepseekV41(cfg, rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed)
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Variable)):
        name = ".".join(map(str, path))
        if name.endswith(("sinks", "e_score_correction_bias", "bias_vl", "hc.base", "norm.weight")):
            var.set_value(jnp.asarray(rng.normal(1.0 if name.endswith("norm.weight") else 0.0, 0.5,
                                                 var.get_value().shape), jnp.float32))
    return model
