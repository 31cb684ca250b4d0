"""Scripts the multi-rank and subprocess tests launch (torchrun, a second Python process): each puts the
repository root on sys.path and imports the shared references from tests.exactness."""
