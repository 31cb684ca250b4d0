"""One command that checks hf_accum's plan on a GPU; writes one JSON (every figure) and one PNG, prints a table.

    python benchmarks/bench_gpu.py --out DIR            # CUDA: a ~1B Llama from config in bf16 (built for < 9 min)
    python benchmarks/bench_gpu.py --quick --out DIR    # CPU, a tiny Llama: every section, well under a minute
    python benchmarks/bench_gpu.py --sections 2,5 --minutes 4 --out DIR

The sections, one file each, are the package benchmarks/gpu_bench/ (its __init__ lists what each measures).
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]  # hf_accum from this checkout, and the gpu_bench package beside us

from gpu_bench.run import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
