"""The transformers / TRL / torch / DeepSpeed internals hf_accum depends on, one module per subject, each pinned by
a test that fails when upstream changes it. Import the subject you need (no grab-bag)."""
