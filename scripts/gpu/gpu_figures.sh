#!/usr/bin/env bash
# The GPU figures in one device call (issue "GPU figures"): the wheels the GPU image lacks (../shared/gpu/README.md),
# the GPU-marked tests, then bench_gpu in full. Usage on the device machine: bash scripts/gpu/gpu_figures.sh MINUTES
set -o pipefail
minutes=${1:-6}
out=${OUT:-runs/gpu}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee "$out/nvidia_smi.txt"
python3 -c "import torch, transformers, peft, accelerate; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__, 'peft', peft.__version__, 'accelerate', accelerate.__version__)" | tee -a "$out/nvidia_smi.txt"
timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider -x 2>&1 | tail -25 | tee "$out/pytest_gpu.txt"
timeout $(( ${minutes%.*} * 60 + 150 )) python3 benchmarks/bench_gpu.py --minutes "$minutes" --out "$out" 2>&1 | tee "$out/bench_gpu.log"
