"""Two processes on localhost, 4 CPU devices each, run the sharded forward and decode of a converted
checkpoint and agree with one process."""

import json
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import dsjax
from dsjax import RunConfig, SamplingParams, generate
from dsjax.checkpoint.convert import convert
from tests.helpers import assert_close
from tests.parallel.processes import free_port, process_env, run_processes, tails

IDS = [[5, 17, 300, 2, 41, 99, 7, 260, 3, 11, 480], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
PROMPTS = [[5, 17, 300, 2], [7, 9], [11, 12, 13], [1]]


@pytest.mark.heavy
def test_two_processes_agree_with_one(release, tmp_path):
    checkpoint = tmp_path / "orbax"
    convert(release, checkpoint, ep=4, progress=False)
    port, out = str(free_port()), str(tmp_path / "out")
    codes, logs = run_processes([[sys.executable, "-m", "tests.parallel.distributed_worker", str(pid), port,
                                  str(checkpoint), out] for pid in (0, 1)], [process_env(4)] * 2)
    assert codes == [0, 0], tails(logs)

    model = dsjax.load_model(release)
    want_logits = np.asarray(model(jnp.asarray(IDS)))
    want_tokens = [r.tokens for r in generate(model, PROMPTS, SamplingParams(temperature=0.0, max_tokens=16),
                                              run=RunConfig(slots=4, max_len=64, chunk_size=64))]
    for pid in (0, 1):
        assert_close(np.load(f"{out}.{pid}.npy"), want_logits, rtol=1e-5)
        assert json.loads(Path(f"{out}.{pid}.json").read_text()) == want_tokens
