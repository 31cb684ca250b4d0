"""PYTORCH_CUDA_ALLOC_CONF: expandable segments unless the user chose, never after CUDA started; one line says which."""

import os
import subprocess
import sys

import pytest

from hf_accum.compat import allocator


@pytest.mark.parametrize("environ, started, outcome, value", [
    ({}, False, "set", "expandable_segments:True"),
    ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}, False, "user", "max_split_size_mb:128"),
    ({"PYTORCH_CUDA_ALLOC_CONF": ""}, False, "user", ""),  # set to empty on purpose: the default allocator
    ({}, True, "late", None),
])
def test_choose(environ, started, outcome, value):
    assert allocator.choose(environ, lambda: started) == outcome
    assert environ.get("PYTORCH_CUDA_ALLOC_CONF") == value
    said = allocator.line(outcome, environ)
    assert said.startswith("hf_accum: ") and "\n" not in said
    assert ("expandable_segments:True" in said) == (outcome in ("set", "late"))


def test_importing_hf_accum_sets_it_before_torch_loads():
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_CUDA_ALLOC_CONF"}
    code = ("import os, sys, hf_accum; assert 'torch' not in sys.modules; "
            "print(os.environ['PYTORCH_CUDA_ALLOC_CONF'], hf_accum.compat.allocator.OUTCOME)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["expandable_segments:True", "set"]
    env["PYTORCH_CUDA_ALLOC_CONF"] = "backend:native"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["backend:native", "user"]
