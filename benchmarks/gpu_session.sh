#!/usr/bin/env bash
# What a GPU session checks and measures, in stages of at most 10 minutes each, one device call per
# stage (see /work/.library/device). A machine stays warm only 30 s after a call, so make the calls
# back to back; each stage installs optc itself, so a fresh machine also works (it rebuilds artifacts).
#   run(command="bash benchmarks/gpu_session.sh check", timeout_s=600)  # gpu tests + kernel benchmark
#   run(command="bash benchmarks/gpu_session.sh bf16", timeout_s=600)   # serving: 8B bf16, CUDA graphs,
#                                                                       # eager, transformers + compile
#   run(command="bash benchmarks/gpu_session.sh int4", timeout_s=600)   # serving: 8B int4 RTN g128
# Installs optc into the device image (torch, triton, transformers are there; gguf is not needed for
# random: models). Logs and JSON go to $OUT (fetched back by the device tool); every step has its own
# timeout so the logs come back even when a step runs long. Record every number in docs/PERF.md.
set -uo pipefail
stage=${1:-check}
case "$stage" in check|bf16|int4) ;; *) echo "unknown stage '$stage': check, bf16 or int4" >&2; exit 2 ;; esac
OUT=${OUT:-build/gpu-session}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . || exit 1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv > "$OUT/gpu.csv"
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" \
  | tee "$OUT/versions.txt"
case "$stage" in
  check)
    timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="--import-mode=importlib -ra" tests \
      2>&1 | tee "$OUT/pytest-gpu.log"
    timeout 240 python3 benchmarks/kernels.py --json "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.log"
    echo "== summary"; tail -3 "$OUT/pytest-gpu.log"; tail -40 "$OUT/kernels.log" ;;
  bf16|int4)
    timeout 570 python3 benchmarks/serving.py --device cuda --configs "$stage" --quiet \
      $([ "$stage" = int4 ] && echo --no-compare-hf) --json "$OUT/serving-$stage.json" 2>&1 | tee "$OUT/serving-$stage.log"
    echo "== summary"; tail -12 "$OUT/serving-$stage.log" ;;
esac
