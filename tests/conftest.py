"""Shared pytest hooks."""

import pytest
import torch
from hypothesis import settings

# Property tests draw the same examples on every run (CI must not pass or fail by the draw); a defect one of them
# finds is pinned as its own test (see tests/test_plan.py::test_known_staircase_case_misses_the_goal).
settings.register_profile("deterministic", derandomize=True, database=None)
settings.load_profile("deterministic")

# The tests' models are tiny: on a shared 2-core machine two intra-op threads contend and make them 10-100x
# slower than one. One thread also makes float results independent of the machine's core count.
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` are skipped, with the reason, on machines without CUDA."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
