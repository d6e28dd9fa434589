"""Shared fixtures: tiny random models (no download) and, for slow tests, the real default model."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = (REPO.parent / "shared" / "data").resolve()


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

    from cel_utils.models import DEFAULT_MODEL, _locate

    return AutoTokenizer.from_pretrained(_locate(DEFAULT_MODEL)[0])


@pytest.fixture(scope="session")
def tiny_models(tokenizer):
    """One tiny random-weight model per supported family, built from configs."""
    from cel_utils.random_models import FAMILIES, random_model

    return {family: random_model(family, tokenizer=tokenizer) for family in FAMILIES}


@pytest.fixture(scope="session")
def default_model():
    from cel_utils.models import load_model

    return load_model()
