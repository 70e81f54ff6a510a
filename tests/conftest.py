import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
torch.set_num_threads(min(2, os.cpu_count() or 1))

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data"
MODELS = DATA / "models"
TEXT = DATA / "text"


@pytest.fixture(scope="session")
def data_dir():
    if not DATA.exists():
        pytest.fail(f"shared data not found at {DATA}; the repository must sit beside shared/")
    return DATA
