#!/usr/bin/env bash
# Everything a GPU session checks and measures, in one device call (see /work/.library/device):
#   run(command="bash benchmarks/gpu_session.sh", timeout_s=600)
# Installs optc into the device image (torch, triton, transformers are there; gguf is not needed for
# random: models), then: the `gpu` tests (parity with transformers on CUDA, CUDA-graph replay vs eager,
# Triton kernels on hardware), the kernel benchmark and the serving benchmark. Logs and JSON go to
# $OUT (fetched back by the device tool); record every number in docs/PERF.md.
set -uo pipefail
OUT=${OUT:-build/gpu-session}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . || exit 1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv > "$OUT/gpu.csv"
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" \
  | tee "$OUT/versions.txt"
timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="--import-mode=importlib -ra" tests \
  2>&1 | tee "$OUT/pytest-gpu.log"
timeout 150 python3 benchmarks/kernels.py --json "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.log"
timeout 180 python3 benchmarks/serving.py --device cuda --json "$OUT/serving.json" 2>&1 | tee "$OUT/serving.log"
echo "== summary"; tail -3 "$OUT/pytest-gpu.log"; tail -25 "$OUT/kernels.log"; tail -12 "$OUT/serving.log"
