"""Image requests through `dsjax generate`: data URLs and local files in the three protocols, several
images and images in history, prompt usage equal to the recipe's count, error records for bad or refused
images (the job goes on), and text-only requests unchanged by the encoder."""

import base64
import io
import json

import deepseek_recipe as dr
import numpy as np
import pytest
from PIL import Image

from dsjax.batch.job import JobConfig, run_job
from dsjax.batch.results import comparable
from dsjax.cli import main
from tests.batch.test_job import JOB, records, write_jsonl
from tests.helpers import recipe_prompt_tokens

M = "DeepSeek-V4.1-Flash"


def _png(w: int, h: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (h, w, 3), np.uint8)).save(out, "PNG")
    return out.getvalue()


def _data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def chat(cid, content, history=(), **kw):
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": M, "messages": [*history, {"role": "user", "content": content}], "max_tokens": 3,
                     "temperature": 0, **kw}}


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}




def test_image_requests_end_to_end(tmp_path, tiny_vision_model_dir):
    small, wide = _png(40, 30, 1), _png(300, 120, 2)
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "wide.png").write_bytes(wide)
    history = [{"role": "user", "content": [{"type": "text", "text": "Remember this."}, image_part(_data_url(wide))]},
               {"role": "assistant", "content": "Done.", "reasoning_content": ""}]
    items = [
        chat("one", [{"type": "text", "text": "What is it?"}, image_part(_data_url(small))]),
        chat("two", [image_part(_data_url(small)), {"type": "text", "text": "and"}, image_part("imgs/wide.png")],
             thinking={"type": "disabled"}),
        chat("history", [{"type": "text", "text": "And now?"}, image_part(_data_url(small))], history=history),
        chat("text", "Just text."),
        {"custom_id": "responses", "method": "POST", "url": "/v1/responses",
         "body": {"model": M, "max_output_tokens": 3, "temperature": 0, "input": [{"role": "user", "content": [
             {"type": "input_text", "text": "See"}, {"type": "input_image",
                                                     "image_url": f"file://{tmp_path}/imgs/wide.png"}]}]}},
        {"custom_id": "messages", "method": "POST", "url": "/v1/messages",
         "body": {"model": M, "max_tokens": 3, "temperature": 0, "messages": [{"role": "user", "content": [
             {"type": "image", "source": {"type": "url", "url": "imgs/wide.png"}},
             {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                          "data": base64.b64encode(small).decode()}},
             {"type": "text", "text": "Both?"}]}]}},
    ]
    inp = write_jsonl(tmp_path / "in.jsonl", items)
    # chunks of 64 tokens: every image (184 to 202 tokens) straddles chunk boundaries
    summary = run_job(JobConfig(model=tiny_vision_model_dir, input=inp, output=str(tmp_path / "out.jsonl"), **JOB))
    assert summary["requests_ok"] == len(items) and summary["requests_failed"] == 0
    recs = {r["custom_id"]: r for r in records(tmp_path / "out.jsonl")}
    local = {"imgs/wide.png": _data_url(wide), f"file://{tmp_path}/imgs/wide.png": _data_url(wide)}
    for item in items:
        rec = recs[item["custom_id"]]
        assert rec["response"]["status_code"] == 200, rec
        usage = rec["response"]["body"]["usage"]
        body = json.loads(json.dumps(item["body"]))
        for path, url in local.items():  # the recipe itself takes no files: count them as their data URL
            body = json.loads(json.dumps(body).replace(json.dumps(path), json.dumps(url)))
        if item["custom_id"] == "messages":
            body["messages"][0]["content"][0]["source"] = {"type": "base64", "media_type": "image/png",
                                                           "data": base64.b64encode(wide).decode()}
        want = recipe_prompt_tokens(body, f"{tiny_vision_model_dir}/tokenizer.json", item["url"])
        got = usage.get("prompt_tokens", usage.get("input_tokens"))
        assert got == want, (item["custom_id"], got, want)
    assert recs["text"]["response"]["body"]["usage"]["prompt_tokens"] < 100
    assert recs["two"]["response"]["body"]["usage"]["prompt_tokens"] > 184 + 202


@pytest.mark.parametrize("flag", [False, True])
def test_bad_and_refused_images_become_error_records(tmp_path, tiny_vision_model_dir, listener, flag):
    port, hits = listener
    good = _data_url(_png(40, 30, 3))
    items = [
        chat("remote", [image_part(f"http://127.0.0.1:{port}/a.png")]),
        chat("localhost", [image_part(f"http://localhost:{port}/a.png")]),
        chat("undecodable", [image_part("data:image/png;base64," + base64.b64encode(b"not an image").decode())]),
        chat("missing-file", [image_part("no/such.png")]),
        chat("too-large", [image_part("big.png")]),
        chat("over-quota", [image_part(good)] * 601),  # the recipe's quota: 600 images per request
        chat("fine", [{"type": "text", "text": "ok"}, image_part(good)]),
    ]
    (tmp_path / "big.png").write_bytes(_png(8, 8, 1) + bytes(20 << 20))  # past the 20 MiB a file may have
    inp = write_jsonl(tmp_path / "in.jsonl", items)
    out = str(tmp_path / "out.jsonl")
    args = ["generate", "--model", tiny_vision_model_dir, "--input", inp, "--output", out, "--slots", "2",
            "--max-len", "512", "--chunk-size", "64", "--dtype", "float32", "--quiet"]
    assert main(args + (["--allow-remote-images"] if flag else [])) == 0
    recs = {r["custom_id"]: r for r in records(out)}
    codes = {cid: (r["error"] or {}).get("code") for cid, r in recs.items()}
    refused = "image_refused" if not flag else "invalid_image"
    assert codes == {"remote": refused, "localhost": refused, "undecodable": "invalid_image",
                     "missing-file": "invalid_image", "too-large": "invalid_image", "over-quota": "invalid_image",
                     "fine": None}
    assert "over the 20971520-byte limit" in recs["too-large"]["error"]["message"]
    assert "600 images" in recs["over-quota"]["error"]["message"]
    if not flag:
        assert "--allow-remote-images" in recs["remote"]["error"]["message"]
    assert "no/such.png" in recs["missing-file"]["error"]["message"]
    assert hits == []  # nothing connected to the loopback listener, with or without the flag


def test_text_requests_are_unchanged_by_the_encoder(tmp_path, tiny_blind_model_dir, tiny_vision_model_dir):
    """The same decoder with and without an image encoder: text-only records are identical (a request of
    each protocol, thinking on and off)."""
    from tests.batch.test_job import MIXED

    picked = [{**r, "body": {**r["body"], "model": M}} for r in MIXED
              if r["custom_id"] in ("chat-system", "chat-no-thinking", "responses", "messages")]
    inp = write_jsonl(tmp_path / "in.jsonl", picked)
    outs = []
    for name, model in (("blind", tiny_blind_model_dir), ("seeing", tiny_vision_model_dir)):
        # The blind model's config (no encoder) says V4's prompt format; both are asked for V4.1's.
        run_job(JobConfig(model=model, input=inp, output=str(tmp_path / f"{name}.jsonl"), prompt_format="v4.1",
                          **JOB))
        outs.append(sorted((comparable(r) for r in records(tmp_path / f"{name}.jsonl")), key=lambda r: r["custom_id"]))
    assert outs[0] == outs[1]


def test_each_image_lands_on_its_own_placeholders(tmp_path, tiny_vision_model_dir):
    """With the encoder replaced by a known function (row r of an image of W px: [W, r, ...]), the spliced
    positions are exactly the prompt's image tokens, each image's rows on its own run, in order."""
    import types

    from dsjax.batch.jobfile import InputLine
    from dsjax.batch.job import _encode_images
    from dsjax.batch.recipe import Recipe
    from dsjax.config import ModelConfig

    cfg = ModelConfig.preset("tiny-vision")
    recipe = Recipe(f"{tiny_vision_model_dir}/tokenizer.json", 4096, (1,), vision=cfg.vision)
    pngs = [_png(40, 30, 1), _png(300, 120, 2), _png(100, 100, 3)]
    body = chat("x", [image_part(_data_url(pngs[0])), {"type": "text", "text": "then"},
                      image_part(_data_url(pngs[1]))],
                history=[{"role": "user", "content": [image_part(_data_url(pngs[2]))]},
                         {"role": "assistant", "content": "ok", "reasoning_content": ""}])["body"]
    prep = recipe.prepare(InputLine(1, "x", "/v1/chat/completions", body))

    def known(pixels):  # row i of an image W px wide: W·1000 + i everywhere
        h, w = pixels.shape[:2]
        n = cfg.vision.image_tokens(w, h)
        return np.repeat(w * 1000.0 + np.arange(n, dtype=np.float32)[:, None], cfg.hidden_size, axis=1)

    engine = types.SimpleNamespace(cfg=cfg, encode_images=lambda images: [known(p) for p in images])
    text = recipe.prepare(InputLine(2, "y", "/v1/chat/completions", chat("y", "just text")["body"]))
    # requests are encoded together: each gets its own images' rows, a text-only one none
    none, spliced = _encode_images(engine, [text, prep])
    assert none is None
    placeholders = np.flatnonzero(np.asarray(prep.prompt) == recipe.image_token_id)
    np.testing.assert_array_equal(spliced.positions, placeholders)
    # in prompt order: the history's image, then the last turn's two
    resolver = dr.ImageResolver(dr.ReqwestImageFetcher.with_max_bytes(1 << 24), dr.OpenCvImagePreprocessor())
    widths = [resolver.resolve([dr.BytesImageSource(pngs[k])], dr.ImageQuota()).images[0].width for k in (2, 0, 1)]
    assert len(set(widths)) == 3 and len(prep.images) == 3
    first = 0
    for span, w in zip(prep.images, widths):
        assert np.all(np.diff(spliced.positions[first:first + span.length]) == 1)
        want = np.repeat(w * 1000.0 + np.arange(span.length)[:, None], cfg.hidden_size, axis=1)
        np.testing.assert_array_equal(spliced.embeds[first:first + span.length], want)
        first += span.length
    assert first == len(placeholders)
    # An encoder whose count disagrees with the recipe's is dsjax's bug: raised, not blamed on the image.
    engine = types.SimpleNamespace(cfg=cfg, encode_images=lambda images: [known(p)[1:] for p in images])
    with pytest.raises(RuntimeError, match="the encoder made .* embeddings for an image the recipe counts as"):
        _encode_images(engine, [prep])


def test_image_requests_on_a_mesh_give_the_same_records(tmp_path, tiny_vision_model_dir):
    """`--mesh dp=2,ep=4`: the encoder runs with the sharded model and the greedy answers are unchanged."""
    items = [chat("a", [{"type": "text", "text": "What is it?"}, image_part(_data_url(_png(40, 30, 5)))]),
             chat("b", "Just text."), chat("c", [image_part(_data_url(_png(200, 90, 6)))], max_tokens=4)]
    inp = write_jsonl(tmp_path / "in.jsonl", items)
    outs = []
    for mesh in ([], ["--mesh", "dp=2,ep=4"]):
        out = str(tmp_path / f"{len(outs)}.jsonl")
        assert main(["generate", "--model", tiny_vision_model_dir, "--input", inp, "--output", out,
                     "--slots", "4", "--max-len", "512", "--chunk-size", "64", "--dtype", "float32",
                     "--quiet", *mesh]) == 0
        outs.append(sorted((comparable(r) for r in records(out)), key=lambda r: r["custom_id"]))
    assert all(r["response"]["status_code"] == 200 for r in outs[0])
    assert outs[0] == outs[1]


def test_image_requests_on_a_v41_checkpoint(tmp_path, tiny_v41_vision_dir, listener):
    """A release-layout V4.1 checkpoint reads images with the release's encoder through `dsjax generate`:
    data URLs and local files, prompt usage equal to the recipe's count, error records for a refused and an
    undecodable image. The first answer token's logprob equals the model's own full forward with the
    encoder's rows spliced into the prompt (so the engine's batched encoding, chunked spliced prefill and
    image routing are those of the model)."""
    from flax import nnx

    import dsjax
    from dsjax.batch.images import inline_local_images
    from dsjax.batch.jobfile import InputLine
    from dsjax.batch.recipe import Recipe
    from dsjax.engine.encoder import encode_images
    from dsjax.engine.pixels import decode_image
    from dsjax.engine.steps import StaticGraph

    port, hits = listener
    small, wide = _png(40, 30, 1), _png(300, 120, 2)
    (tmp_path / "wide.png").write_bytes(wide)
    no_think = dict(thinking={"type": "disabled"}, logprobs=True)
    items = [chat("one", [{"type": "text", "text": "the cat"}, image_part(_data_url(small))], **no_think),
             chat("two", [image_part("wide.png"), {"type": "text", "text": "and"}, image_part(_data_url(small))],
                  **no_think),
             chat("text", "the dog sat", **no_think),
             chat("refused", [image_part(f"http://127.0.0.1:{port}/a.png")]),
             chat("undecodable", [image_part("data:image/png;base64," + base64.b64encode(b"not a png").decode())])]
    items = [{**i, "body": {**i["body"], "model": M}} for i in items]
    inp = write_jsonl(tmp_path / "in.jsonl", items)
    out = str(tmp_path / "out.jsonl")
    assert main(["generate", "--model", tiny_v41_vision_dir, "--input", inp, "--output", out, "--slots", "2",
                 "--max-len", "1024", "--chunk-size", "64", "--dtype", "float32", "--quiet"]) == 0
    recs = {r["custom_id"]: r for r in records(out)}
    assert {cid: (r["error"] or {}).get("code") for cid, r in recs.items()} == {
        "one": None, "two": None, "text": None, "refused": "image_refused", "undecodable": "invalid_image"}
    assert hits == []
    tokenizer = f"{tiny_v41_vision_dir}/tokenizer.json"
    recipe = Recipe(tokenizer, 1024, (1,), vision=dsjax.load_model(tiny_v41_vision_dir).cfg.vision)
    for cid in ("one", "two", "text"):
        body = json.loads(json.dumps(items[[i["custom_id"] for i in items].index(cid)]["body"]))
        body = inline_local_images(body, str(tmp_path), 1 << 24)
        assert recs[cid]["response"]["body"]["usage"]["prompt_tokens"] == recipe_prompt_tokens(
            body, tokenizer, "/v1/chat/completions")
    # The engine's first answer token against the model's full forward with the encoder's rows spliced in.
    model = dsjax.load_model(tiny_v41_vision_dir)
    prep = recipe.prepare(InputLine(1, "two", "/v1/chat/completions",
                                    inline_local_images(items[1]["body"], str(tmp_path), 1 << 24)))
    ids = np.asarray(prep.prompt)[None]
    embeds = np.array(model.embed_tokens(ids))
    image = np.zeros(ids.shape, bool)
    graphdef, params = nnx.split(model)
    for span in prep.images:
        rows = encode_images(model, StaticGraph(graphdef), params, [decode_image(span.data, model.cfg.vision)])[0]
        embeds[0, span.start:span.start + span.length] = rows
        image[0, span.start:span.start + span.length] = True
    logits = np.asarray(model.forward(ids, image, embeds=embeds))[0, -1]
    logprobs = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
    first = recs["two"]["response"]["body"]["choices"][0]["logprobs"]["content"][0]
    assert first["logprob"] == pytest.approx(float(logprobs.max()), abs=1e-4)


def test_images_are_encoded_as_their_requests_enter_the_scheduler(tmp_path, tiny_vision_model_dir, monkeypatch):
    """Twenty image requests in one window on 4 slots: the encoder takes `IMAGE_REQUESTS` requests at a time as
    the scheduler admits them, so the first results are written before the last images are encoded (a whole
    window's embeddings are never held at once), and its compiles count as the generation's."""
    from dsjax.batch import job

    items = [chat(f"r{i}", [{"type": "text", "text": "Which?"}, image_part(_data_url(_png(40 + 14 * (i % 3), 30, i)))])
             for i in range(20)]
    inp = write_jsonl(tmp_path / "in.jsonl", items)
    out = tmp_path / "out.jsonl"
    calls = []
    encode = job._encode_images

    def counted(engine, preps):
        calls.append((len(preps), len(records(out)) if out.exists() else 0))
        return encode(engine, preps)

    monkeypatch.setattr(job, "_encode_images", counted)
    summary = run_job(JobConfig(model=tiny_vision_model_dir, input=inp, output=str(out), **JOB))
    assert summary["requests_ok"] == 20
    assert [n for n, _ in calls] == [8, 8, 4]
    assert calls[0][1] == 0 and calls[-1][1] > 0, calls
    assert summary["programs_compiled_during_generation"] >= 1
