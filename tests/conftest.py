"""Shared fixtures: tiny random models (no download) and, for slow tests, the real default model."""
from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = (REPO.parent / "shared" / "data").resolve()


# The files with the slowest tests, slowest first (pytest --durations): pytest-xdist hands each file to a worker in
# collection order, so these start first and the two workers end together instead of one waiting on the other.
SLOW_FILES = ("test_determinism.py", "test_slurm.py", "test_end_to_end.py", "test_screening.py", "test_precision.py", "test_resume.py",
              "test_book.py", "test_strategies.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        name = item.path.name
        return SLOW_FILES.index(name) if name in SLOW_FILES else len(SLOW_FILES)

    items.sort(key=rank)  # stable: the order within a file is kept


@pytest.fixture(scope="session", autouse=True)
def fresh_result_caches(tmp_path_factory):
    """The evaluation store and the execution cache start empty in every session, so that no test passes by
    reading what an earlier session stored; dequantized checkpoints (models/) are shared: they only cost time."""
    from cel_utils.paths import cache_dir

    models = cache_dir() / "models"
    models.mkdir(parents=True, exist_ok=True)
    cache = tmp_path_factory.mktemp("cel-cache")
    (cache / "models").symlink_to(models.resolve(), target_is_directory=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CEL_CACHE_DIR", str(cache))
        yield cache


@pytest.fixture(autouse=True)
def alone_among_workers(request, tmp_path_factory):
    """Under pytest-xdist (`make test` runs two workers), a test marked `alone` waits until the other worker's test
    has ended and keeps it from starting another: it counts processes machine-wide (the sandbox's `nobody` ones),
    which a sandbox run beside it would add to. Every other test holds a shared lock on the same file."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        yield
        return
    mode = fcntl.LOCK_EX if request.node.get_closest_marker("alone") else fcntl.LOCK_SH
    with open(tmp_path_factory.getbasetemp().parent / "alone.lock", "a") as lock:  # the workers' common folder
        fcntl.flock(lock, mode)
        yield


@pytest.fixture(params=["default-attention", "math-attention"])
def attention_backend(request):
    """The test twice: with PyTorch's own choice of attention kernel, and with the plain math kernel.

    The CPU's fused kernels differ by machine (AVX2, AVX-512) and have computed silently wrong attention (a mask
    of another dtype than the queries, torch 2.13): numerics-sensitive tests that pass under both kernels show
    the package's numbers do not hang on a kernel, and a kernel difference fails one of the two on any machine.
    """
    if request.param == "default-attention":
        yield request.param
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        yield request.param


@pytest.fixture(scope="session")
def data_dir() -> str:
    """The local data mirror (CI and this machine have ../shared/data; $CEL_DATA_DIR overrides)."""
    path = os.environ.get("CEL_DATA_DIR") or str(SHARED_DATA)
    if not Path(path).is_dir():
        pytest.skip(f"no local data mirror at {path}")
    return path


@pytest.fixture(scope="session")
def tokenizer():
    from transformers import AutoTokenizer

    from cel_utils.models.loading import DEFAULT_MODEL, locate

    return AutoTokenizer.from_pretrained(locate(DEFAULT_MODEL)[0])


@pytest.fixture(scope="session")
def tiny_models(tokenizer):
    """One tiny random-weight model per supported family, built from configs."""
    from cel_utils.models.loading import random_model
    from cel_utils.models.random_models import FAMILIES

    return {family: random_model(family, tokenizer=tokenizer) for family in FAMILIES}


@pytest.fixture(scope="session")
def default_model():
    from cel_utils.models.loading import load_model

    return load_model()


@pytest.fixture(scope="session")
def gemma_model():
    """The second model, Gemma 3 270M (dequantized once into the shared cache: ~2 min the first time, ~20 s after)."""
    from cel_utils.models.loading import load_model

    return load_model("gemma3-270m")
