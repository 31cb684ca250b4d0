"""`python -m gpu_bench` from benchmarks/: the same run as `python benchmarks/bench_gpu.py`."""

import sys

from .run import main

sys.exit(main())
