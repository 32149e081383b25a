"""Test setup: 8 host CPU devices, and one run of the Hugging Face reference shared by every parity test."""

import os

from tests import CPU_TEST_FLAGS  # noqa: E402

# The tests compile many small programs and run each briefly: LLVM's optimisation passes cost more than
# they save here (CPU_TEST_FLAGS turns them off; the suite ran about a third faster, every test passing).
os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count=8 {CPU_TEST_FLAGS}")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import fcntl  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from tests.reference.spec import SPEC  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
HARNESS = ROOT / "tests" / "reference" / "run_reference.py"


def _mappings() -> tuple[int, int]:
    """(memory mappings of this process, the kernel's limit), or (0, 1) where /proc does not tell."""
    try:
        with open("/proc/self/maps", "rb") as f:
            used = sum(1 for _ in f)
        with open("/proc/sys/vm/max_map_count") as f:
            return used, int(f.read())
    except (OSError, ValueError):
        return 0, 1


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """After a test file, drop jax's compiled programs if this process holds over half the memory
    mappings the kernel allows (`vm.max_map_count`, 65,530 by default). Each compiled program keeps
    mappings of its machine code; a test worker that had compiled thousands of them passed the limit
    near the end of the suite, and LLVM crashed it with a segmentation fault while compiling. Clearing
    only then keeps the programs that later files reuse (clearing after every file cost 9% more time)."""
    yield
    used, limit = _mappings()
    if used > limit // 2:
        import gc

        import jax

        jax.clear_caches()
        gc.collect()


def _run_folder(tmp_path_factory) -> Path:
    """This test run's temporary folder: under xdist the parent of each worker's, so the workers agree."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(autouse=True, scope="session")
def _dsjax_cache_in_the_run(tmp_path_factory):
    """The `dsjax` commands the tests run, in this process or in the processes they start, keep their
    compile cache (`dsjax.compile_cache`) in this run's temporary folder, never in the user's ~/.cache:
    a run starts from an empty cache, and pytest removes it with the run's other folders (it keeps the
    last three runs'). The xdist workers share it (it is made for sharing: jax locks it around every read
    and write), so a program one worker's command compiled, the other's loads. A run that sets
    DSJAX_CACHE_DIR keeps its own."""
    if os.environ.get("DSJAX_CACHE_DIR"):
        yield
        return
    os.environ["DSJAX_CACHE_DIR"] = str(_run_folder(tmp_path_factory) / "dsjax-cache")
    yield
    del os.environ["DSJAX_CACHE_DIR"]


@pytest.fixture(autouse=True, scope="session")
def _shared_compilation_cache(tmp_path_factory):
    """One persistent compilation cache for the whole run, shared by the xdist workers and the processes
    the tests start (but `dsjax` commands, which use their own: see above): the workers compile many of the
    same programs (the tiny models' steps), and each compiles one only if the other has not yet (programs
    that take over jax's default second to compile). A run that sets JAX_COMPILATION_CACHE_DIR keeps its
    own. tests/engine, tests/batch and three more files took 424 s with it, 454 s without."""
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        yield
        return
    import jax

    folder = str(_run_folder(tmp_path_factory) / "jax-cache")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = folder  # for the processes the tests start
    jax.config.update("jax_compilation_cache_dir", folder)
    yield
    jax.config.update("jax_compilation_cache_dir", None)
    del os.environ["JAX_COMPILATION_CACHE_DIR"]


def reference_python() -> str:
    return os.environ.get("DSJAX_REF_PYTHON", str(ROOT / ".venv-ref" / "bin" / "python"))


@pytest.fixture(scope="session")
def reference(tmp_path_factory) -> Path:
    """Folder of reference outputs (checkpoints, logits, per-module captures); see run_reference.py."""
    py = reference_python()
    if not os.path.exists(py):
        pytest.fail(f"the reference environment is missing: {py} does not exist. Create it with "
                    "`bash .ci/setup` or point DSJAX_REF_PYTHON at a Python 3.11 with torch==2.13.0 "
                    "and transformers==5.23.0.")
    # One run per test session, shared by the xdist workers (their base temp dirs share a parent).
    spec_text = json.dumps(SPEC, sort_keys=True)
    key = hashlib.sha256(spec_text.encode() + HARNESS.read_bytes() + py.encode()).hexdigest()[:16]
    shared = tmp_path_factory.getbasetemp().parent
    out = shared / f"reference-{key}"
    with open(shared / f"reference-{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "done").exists():
            out.mkdir(exist_ok=True)
            (out / "spec.json").write_text(spec_text)
            proc = subprocess.run([py, str(HARNESS), str(out / "spec.json"), str(out)], capture_output=True,
                                  text=True)
            if proc.returncode != 0:
                pytest.fail(f"reference harness failed:\n{proc.stderr[-4000:]}")
            (out / "done").write_text("ok")
    return out


HARNESS_V41 = ROOT / "tests" / "reference" / "run_v41_reference.py"


def reference_v41_python() -> str:
    return os.environ.get("DSJAX_REF41_PYTHON", str(ROOT / ".venv-ref41" / "bin" / "python"))


def _run_v41_harness(tmp_path_factory, harness: Path, spec: dict, name: str) -> Path:
    """The output folder of one run of a NeMo harness (in `.venv-ref41`) over `spec`, made once per test session
    and shared by the xdist workers (their base temp dirs share a parent)."""
    py = reference_v41_python()
    if not os.path.exists(py):
        pytest.fail(f"the V4.1 reference environment is missing: {py} does not exist. Create it with "
                    "`bash .ci/setup` or point DSJAX_REF41_PYTHON at a Python 3.11 with torch==2.13.0+cpu, "
                    "transformers==5.18.0 and nemo-automodel==0.7.0.")
    spec_text = json.dumps(spec, sort_keys=True)
    # run_v41_dspark_reference.py imports run_v41_reference.py: both are part of its key.
    key = hashlib.sha256(spec_text.encode() + harness.read_bytes() + HARNESS_V41.read_bytes()
                         + py.encode()).hexdigest()[:16]
    shared = tmp_path_factory.getbasetemp().parent
    out = shared / f"{name}-{key}"
    with open(shared / f"{name}-{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "done").exists():
            out.mkdir(exist_ok=True)
            (out / "spec.json").write_text(spec_text)
            proc = subprocess.run([py, str(harness), str(out / "spec.json"), str(out)], capture_output=True,
                                  text=True)
            if proc.returncode != 0 or not (out / "done").exists():
                pytest.fail(f"{harness.name} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return out


@pytest.fixture(scope="session")
def reference_v41(tmp_path_factory) -> Path:
    """Folder of V4.1 reference outputs from NeMo AutoModel (release checkpoint, logits with and without cache
    quantization, captures, greedy decoding); see run_v41_reference.py."""
    from tests.reference.spec_v41 import SPEC as SPEC_V41

    return _run_v41_harness(tmp_path_factory, HARNESS_V41, SPEC_V41, "reference-v41")


@pytest.fixture(scope="session")
def reference_v41_dspark(tmp_path_factory) -> Path:
    """Folder of NeMo AutoModel's DSpark drafter outputs (a checkpoint with `mtp.*`, target features, draft
    blocks' states, Markov bias, confidence and logits); see run_v41_dspark_reference.py."""
    from tests.reference.spec_v41_dspark import SPEC as SPEC_DSPARK

    return _run_v41_harness(tmp_path_factory, ROOT / "tests" / "reference" / "run_v41_dspark_reference.py",
                            SPEC_DSPARK, "reference-v41-dspark")


_MODELS: dict = {}


@pytest.fixture(scope="session")
def load_case(reference):
    """`load_case(case, naming="hf", dtype=float32)` → the dsjax model for a reference case (cached)."""
    import jax.numpy as jnp

    import dsjax

    def load(case: str, naming: str = "hf", dtype=jnp.float32):
        key = (case, naming, dtype)
        if key not in _MODELS:
            _MODELS[key] = dsjax.load_model(reference / case / naming, dtype=dtype)
        return _MODELS[key]

    return load


@pytest.fixture(scope="session")
def capture(reference):
    """`capture(case)` → dict of the reference's per-module inputs/outputs for its longest sequence."""
    cache = {}

    def get(case: str):
        if case not in cache:
            cache[case] = dict(np.load(reference / case / "capture.npz"))
        return cache[case]

    return get


def assert_close(ours, ref, rtol: float = 1e-5, what: str = "") -> None:
    """max |ours − ref| ≤ rtol · max |ref| (the parity criterion, scaled to the tensor)."""
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    assert ours.shape == ref.shape, f"{what}: shape {ours.shape} != {ref.shape}"
    err = np.max(np.abs(ours - ref)) if ref.size else 0.0
    scale = max(np.max(np.abs(ref)) if ref.size else 0.0, 1e-30)
    assert err <= rtol * scale, f"{what}: max |diff| {err:.3g} > {rtol:g} × max |ref| {scale:.3g}"


@pytest.fixture(scope="session")
def release(tmp_path_factory):
    """A tiny checkpoint in DeepSeek's release format (FP8 + FP4 experts, original names), 12 shards, with a
    tokenizer file beside it. Tests copy it before changing anything."""
    from dsjax.checkpoint.synthetic import write_synthetic
    from dsjax.config import ModelConfig

    folder = tmp_path_factory.mktemp("release") / "src"
    write_synthetic(folder, ModelConfig.preset("tiny"), max_shard_bytes=60_000, seed=3)
    (folder / "tokenizer_config.json").write_text('{"note": "travels with the weights"}')
    return folder


def pytest_collection_modifyitems(items):
    """Heavy tests first (a stable sort, so the rest keep their order): with two xdist workers, a
    two-minute test drawn last would leave one worker idle while the other finishes it."""
    items.sort(key=lambda item: item.get_closest_marker("heavy") is None)


def pytest_report_header(config):
    """The platform the tests run on: JAX_PLATFORMS is "cpu" here unless the caller set it, so a GPU machine
    runs the GPU tests only with JAX_PLATFORMS=cuda,cpu (they skip with "needs a GPU" otherwise)."""
    return f"jax platforms: {os.environ['JAX_PLATFORMS']} (set JAX_PLATFORMS=cuda,cpu to run the GPU tests on a GPU)"
