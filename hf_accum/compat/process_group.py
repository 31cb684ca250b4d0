"""torch.distributed's default process group: its size and its private key-value store (the rank-agreement
protocol's out-of-band channel). Pinned by tests/compat/test_compat.py.
"""

from __future__ import annotations


def world_size() -> int:
    """Ranks of the default process group (1 without one)."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def default_store():
    """The default process group's key-value store (the launcher's TCPStore under torchrun, which outlives any one
    rank), or None without a process group. torch keeps it private: `distributed_c10d._get_default_store`."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()
