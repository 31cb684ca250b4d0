"""oom.is_oom: out-of-memory errors are recognised by type or message; everything else is not."""

import pytest
import torch

from hf_accum.oom import free_memory, is_oom


@pytest.mark.parametrize(
    "exc",
    [
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 79.15 GiB total capacity)"),
        RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
        RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"),
        RuntimeError(
            "[enforce fail at alloc_cpu.cpp:121] data. DefaultCPUAllocator: can't allocate memory: "
            "you tried to allocate 1099511627776 bytes. Error code 12 (Cannot allocate memory)"
        ),
        RuntimeError("MPS backend out of memory (MPS allocated: 1.00 GB)"),
        RuntimeError("HIP out of memory. Tried to allocate 2.00 GiB"),
        MemoryError(),
    ],
    ids=["torch-oom", "cuda-message", "cublas", "cudnn-alloc", "cpu-allocator", "mps", "hip", "python-memoryerror"],
)
def test_out_of_memory_errors_are_recognised(exc):
    assert is_oom(exc)


@pytest.mark.parametrize(
    "exc",
    [
        RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 5x6)"),
        RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED."),  # a kernel limit, not memory
        ValueError("out of memory"),  # right words, wrong type: not an allocator error
        KeyError("memory"),
        RuntimeError("CUDA error: an illegal memory access was encountered"),
    ],
)
def test_other_errors_are_not(exc):
    assert not is_oom(exc)


def test_a_wrapped_oom_is_found_through_the_chain():
    try:
        try:
            raise torch.OutOfMemoryError("CUDA out of memory")
        except torch.OutOfMemoryError as inner:
            raise ValueError("step failed") from inner
    except ValueError as outer:
        assert is_oom(outer)


def test_a_real_cpu_allocation_failure_is_recognised():
    try:
        torch.empty(1 << 62, dtype=torch.uint8)  # 4 EiB: refused by the allocator, nothing is touched
    except Exception as exc:  # noqa: BLE001 - the point is to classify whatever comes out
        assert is_oom(exc)
    else:  # pragma: no cover
        pytest.fail("allocating 4 EiB succeeded")


def test_free_memory_runs_without_cuda():
    free_memory()
