"""The transformers / TRL / torch / DeepSpeed internals hf_accum depends on, one module per subject, each pinned by
a test that fails when upstream changes it. Import the subject you need (no grab-bag). Also what hf_accum sets
in other libraries when it is imported: CUDA's allocator setting (`allocator.py`) and the exact messages no user can
act on (`_quiet.py`). The bottom wing: it imports nothing of hf_accum's; every wing may import it."""
