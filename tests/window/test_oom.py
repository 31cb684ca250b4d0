"""oom.is_oom: out-of-memory errors are recognised by type or message; everything else is not."""

import pytest
import torch

from hf_accum.window.oom import free_memory, is_oom


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


# --- the one guard (oom.guarded) every step that may run out of memory goes through ------------------------------
def test_guarded_returns_the_result_or_frees_memory_after_an_oom(monkeypatch):
    import hf_accum.window.oom as oom

    freed = []
    monkeypatch.setattr(oom, "free_memory", lambda: freed.append(True))
    assert oom.guarded(lambda: 7) == (7, False) and freed == []

    def fails():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    assert oom.guarded(fails) == (None, True) and freed == [True]


def test_guarded_lets_every_other_error_through(monkeypatch):
    import hf_accum.window.oom as oom

    monkeypatch.setattr(oom, "free_memory", lambda: pytest.fail("freed after an error that is not an OOM"))

    def shape_error():
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        oom.guarded(shape_error)

    def fails():
        raise torch.OutOfMemoryError("CUDA out of memory.")

    with pytest.raises(torch.OutOfMemoryError):  # catch=False: the caller cannot recover here
        oom.guarded(fails, catch=False)

    class Signal(Exception):
        pass

    def signal_during_an_oom():
        try:
            fails()
        except torch.OutOfMemoryError:
            raise Signal("re-run") from None  # its __context__ is still the OOM

    assert is_oom(pytest.raises(Signal, signal_during_an_oom).value)  # would be taken for an OOM...
    with pytest.raises(Signal):
        oom.guarded(signal_during_an_oom, never=(Signal,))  # ...but `never` lets it through
