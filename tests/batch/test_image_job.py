"""Image requests through `dsjax generate`: data URLs and local files in the three protocols, several
images and images in history, prompt usage equal to the recipe's count, error records for bad or refused
images (the job goes on), and text-only requests unchanged by the encoder."""

import base64
import io
import json
import socketserver
import threading

import deepseek_recipe as dr
import numpy as np
import pytest
from PIL import Image

from dsjax.batch.job import JobConfig, run_job
from dsjax.cli import main
from tests.batch.conftest import JOB
from tests.batch.test_job import canonical, records, write_jsonl

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


def _recipe_count(body: dict, endpoint) -> int:
    """The recipe's own prompt count: the encoded prompt (one placeholder per image) plus its
    `image_token_adjustment`."""
    tok = dr.Tokenizer.from_file(_TOKENIZER[0])
    conv = endpoint(body).convert(dr.ConversionOptions())
    prompt = dr.DeepseekV41Encoding().with_tokenizer(tok).encode(conv.conversation)
    sources = [s for m in conv.conversation.messages for s in m.image_sources]
    data = dr.ImageResolver(dr.ReqwestImageFetcher.with_max_bytes(1 << 24), dr.OpenCvImagePreprocessor()).resolve(
        sources, dr.ImageQuota())
    return len(prompt) + data.image_token_adjustment()


_TOKENIZER = []


def test_image_requests_end_to_end(tmp_path, tiny_vision_model_dir):
    _TOKENIZER[:] = [f"{tiny_vision_model_dir}/tokenizer.json"]
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
    endpoints = {"/v1/chat/completions": dr.ChatCompletionRequest, "/v1/responses": dr.ResponsesRequest,
                 "/v1/messages": dr.MessagesRequest}
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
        want = _recipe_count(body, endpoints[item["url"]])
        got = usage.get("prompt_tokens", usage.get("input_tokens"))
        assert got == want, (item["custom_id"], got, want)
    assert recs["text"]["response"]["body"]["usage"]["prompt_tokens"] < 100
    assert recs["two"]["response"]["body"]["usage"]["prompt_tokens"] > 184 + 202


@pytest.fixture
def listener():
    hits = []

    class Count(socketserver.BaseRequestHandler):
        def handle(self):
            hits.append(self.client_address)

    server = socketserver.TCPServer(("127.0.0.1", 0), Count)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1], hits
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("flag", [False, True])
def test_bad_and_refused_images_become_error_records(tmp_path, tiny_vision_model_dir, listener, flag):
    port, hits = listener
    good = _data_url(_png(40, 30, 3))
    items = [
        chat("remote", [image_part(f"http://127.0.0.1:{port}/a.png")]),
        chat("localhost", [image_part(f"http://localhost:{port}/a.png")]),
        chat("undecodable", [image_part("data:image/png;base64," + base64.b64encode(b"not an image").decode())]),
        chat("missing-file", [image_part("no/such.png")]),
        chat("fine", [{"type": "text", "text": "ok"}, image_part(good)]),
    ]
    inp = write_jsonl(tmp_path / "in.jsonl", items)
    out = str(tmp_path / "out.jsonl")
    args = ["generate", "--model", tiny_vision_model_dir, "--input", inp, "--output", out, "--max-batch", "2",
            "--max-len", "512", "--chunk-size", "64", "--dtype", "float32", "--quiet"]
    assert main(args + (["--allow-remote-images"] if flag else [])) == 0
    recs = {r["custom_id"]: r for r in records(out)}
    codes = {cid: (r["error"] or {}).get("code") for cid, r in recs.items()}
    refused = "image_refused" if not flag else "invalid_image"
    assert codes == {"remote": refused, "localhost": refused, "undecodable": "invalid_image",
                     "missing-file": "invalid_image", "fine": None}
    if not flag:
        assert "--allow-remote-images" in recs["remote"]["error"]["message"]
    assert "no/such.png" in recs["missing-file"]["error"]["message"]
    assert hits == []  # nothing connected to the loopback listener, with or without the flag


def test_text_requests_are_unchanged_by_the_encoder(tmp_path, tiny_blind_model_dir, tiny_vision_model_dir):
    """The same decoder with and without an image encoder: text-only records are identical."""
    from tests.batch.test_job import MIXED

    inp = write_jsonl(tmp_path / "in.jsonl", MIXED)
    outs = []
    for name, model in (("blind", tiny_blind_model_dir), ("seeing", tiny_vision_model_dir)):
        run_job(JobConfig(model=model, input=inp, output=str(tmp_path / f"{name}.jsonl"), **JOB))
        outs.append(sorted((canonical(r) for r in records(tmp_path / f"{name}.jsonl")), key=lambda r: r["custom_id"]))
    assert outs[0] == outs[1]
