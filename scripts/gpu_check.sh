#!/usr/bin/env bash
# On the GPU machine: import check, the kernel tests on the GPU (CPU-tier cases run on CUDA too,
# plus the gpu-marked ones), logs into $OUT. Usage: bash scripts/gpu_check.sh [pytest args]
set -uo pipefail
out=${OUT:-/tmp/out}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv \
  | tee "$out/gpu.txt"
python - <<'PY' 2>&1 | tee -a "$out/gpu.txt"
import torch, triton, tritune.kernels
print("torch", torch.__version__, "triton", triton.__version__, "cuda", torch.version.cuda)
print("cuda initialised after import tritune.kernels:", torch.cuda.is_initialized())
PY
timeout 420 python -m pytest -q -x -p no:cacheprovider --timeout 300 "$@" 2>&1 | tee "$out/gpu_tests.log" | tail -40
