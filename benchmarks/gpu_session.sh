#!/usr/bin/env bash
# The GPU session plan: what a session with a lent H100/H200 checks and measures, as stages of one
# device call each (see /work/.library/device: 10 minutes a command, 30 minutes of device time a
# session, a machine that starts bare with a cold Triton cache and no network, warm 30 s after a call).
#
#   bash benchmarks/gpu_session.sh --dry-run [STAGE ...]   # every stage's commands, limits and estimate
#   run(command="bash benchmarks/gpu_session.sh smoke", timeout_s=600)   # then the next stage, at once
#
# Stages, in the order to run them. The first session with an H100 (2026-11-23, docs/PERF.md) ran
# smoke, kernel-tests, bf16-b1, int4-b1, kernels-w4a16, kernels-small, bf16-b64, hf-b1 (its
# transformers half failed), int4-b64, awq-8b and the two profiles in 26 minutes of device time, each
# stage faster than first estimated; the estimates below are those measurements (rounded up), with
# the 8B build (~1.5 min) counted wherever a stage may be the first on its machine to need it.
# Next: the two first-look stages (issue 34), then the regression stages, then what is left unmeasured.
#   first-look     one bounded call (<= 540 s of steps) with what a first look at a GPU needs, most valuable
#                  first: setup (its preflight prints the copy-bandwidth yardstick), the tests an H200 failed
#                  (fp8 W8A8's accumulator bound and end to end, int8 end to end on a cold autotune cache, AWQ
#                  CUDA vs CPU), the int4 / int8 kernel rows at Llama-3-8B shapes for M = 1, 8, 32, 512
#                  (w4a16, tinygemm, w8a16), and bf16 and int4 8B served at batch 1 (two builds)
#   first-look-rest  the rest of the first look, at once on the same machine (its 8B builds stay on disk):
#                  fp8 weight-only and fp8 W8A8 8B built and served at batch 1 and 64, bf16 and int4 at
#                  batch 1 again (the same call's baseline) and at batch 64
#   smoke          CUDA-graph and end-to-end GPU tests (the capture, the engine, AWQ/GPTQ on cuda, NCCL
#                  tensor parallelism at N = 1 with captured collectives), first
#   kernel-tests   the kernels' GPU tests, except every-autotune-config
#   families       the family kernel paths (first run on an H200 on 2026-11-26, docs/PERF.md): attention with
#                  soft cap, sliding window and head dims 256 / 96 at Gemma / Qwen3 / Phi-3 shapes (float,
#                  int8 and fp8 KV), each family's random preset built for cuda against its references, and
#                  Gemma 3's sliding layers on cuda with CUDA graphs, their KV blocks bounded by the window;
#                  the fused MoE kernel (never run on a GPU) at Mixtral-8x7B and Qwen3-MoE shapes
#   quantized      every quantized kernel path never yet run on a GPU: a tiny artifact per path against its
#                  torch references (int4/int8 linears and lm_heads, fp8, fp8/int8 W8A8, int8/fp8 KV), and
#                  the fp8, W8A8 and tinygemm (torch.int4pack) kernels on Llama-3-8B shapes
#   hf-b1          transformers (its own torch.compile, static cache) against optc bf16 at batch 1
#   kernels-w4a16  benchmarks/kernels.py: int4 linears (autotuned per shape and M bucket), and torch's tinygemm
#                  (the torch.int4pack candidate) on the same shapes
#   kernels-w8a16  benchmarks/kernels.py: int8 linears
#   kernels-small  benchmarks/kernels.py: norms, activation, RoPE, paged attention
#   kernels-gemma  benchmarks/kernels.py at Gemma 3 270M and Gemma 2 2B shapes: GeGLU, offset norms, head dim
#                  256 RoPE and attention, global and .local (sliding window) rows
#   awq-8b         `optc build recipes/llama-awq.yaml` on random:llama-3-8b with --device cuda (timed)
#   profile-int4, profile-bf16   benchmarks/profile_decode.py: GPU time per kernel of a batch-1 decode step
#   int4-b1, bf16-b1              serving 8B int4 (RTN g128) / bf16 (CUDA graphs, then eager) at batch 1
#   int4-b64, bf16-b64            the same at batch 64
#   int4tg-b1, int4tg-b64         8B int4 with torch's tinygemm (torch.int4pack) bound instead of triton.w4a16
#   autotune-all   the GPU test that runs every autotune config
#   hf-b64         transformers against optc bf16 at batch 64
#   tensorrt       `optc export --format tensorrt` of a tiny artifact: the engine builds and deserializes (skipped,
#                  saying so, where the tensorrt package does not import: the GPU image has not had it so far)
#   fake           the plan's self-test (no GPU): writes a row every 0.2 s; tests kill it midway
#
# What every stage does, so that a stage killed at any moment still returns what it measured:
# - prints free disk first, and removes the temporary folders a killed artifact build leaves behind;
# - installs optc with no index and no pip version check (no network there); a missing package fails
#   at once with its name;
# - runs each step under `timeout -s INT` (pytest prints its summary on SIGINT; Python scripts stop at
#   the row in progress), output tee'd to $OUT/STAGE.log as it comes;
# - benchmark rows are appended to $OUT/STAGE.jsonl the moment each is measured (flushed and synced),
#   and the stage's last step prints the table rebuilt from those lines (benchmarks/results.py);
# - pytest runs verbose, with per-test durations and a per-test timeout (pytest-timeout);
# - TRITON_CACHE_AUTOTUNING=1 keeps autotune timings on disk (~/.triton/cache) where the Triton
#   there supports it, so a stage on the same warm machine reuses an earlier stage's picks;
#   the quantized GEMMs' autotuning itself uses short benchmark runs (kernels/_splitk.py).
# Estimates below are for a cold machine (empty Triton cache, no artifacts): Triton compiles ~1.5 s
# each for sm_90 (kernels.py --compile-only on a 2-core VM: see docs/PERF.md), 8B random build ~2.5 min
# (2 min 14 s on 2 vCPUs), a 15 GB artifact load ~0.5 min without the sha256 (--skip-verify-built),
# ~1 min with it. Each stage's bound (every step's timeout plus a 10 s kill grace) stays under 570 s,
# so the stage ends, and prints its table, before the device tool's 600 s limit; the first-look stages'
# under 540 s (9 minutes).
set -uo pipefail
cd "$(dirname "$0")/.."

STAGES="first-look first-look-rest lora smoke kernel-tests families quantized hf-b1 kernels-w4a16 kernels-w8a16 kernels-small kernels-gemma awq-8b
        profile-int4 profile-bf16 int4-b1 bf16-b1 int4tg-b1 int4-b64 bf16-b64 int4tg-b64 autotune-all hf-b64 tensorrt
        fake"
GRACE=10            # seconds a step gets after SIGINT before SIGKILL
MAX_BOUND=570       # every stage's steps end within this many seconds (device commands stop at 600)
PY=${PYTHON:-python3}
OUT=${OUT:-build/gpu-session/out}
ROWS=build/gpu-session/rows   # every stage's rows, kept on the machine for tables across stages
export PYTHONUNBUFFERED=1 TRITON_CACHE_AUTOTUNING=1

DRY=0
BOUND=0
STAGE=
LOG=/dev/null

step() {  # step SECONDS CMD ...: CMD under `timeout -s INT`, its output tee'd to the stage log
  local secs=$1
  shift
  BOUND=$((BOUND + secs + GRACE))
  if ((DRY)); then
    printf '    [%3ss] %s\n' "$secs" "$*"
    return 0
  fi
  echo "== $* (limit ${secs} s)" | tee -ia "$LOG"
  local start=$SECONDS
  timeout -s INT -k "$GRACE" "$secs" "$@" 2>&1 | tee -ia "$LOG"
  local rc=${PIPESTATUS[0]}
  echo "== exit $rc after $((SECONDS - start)) s$( ((rc == 124 || rc == 130)) && echo ' (time limit: SIGINT)')" \
    | tee -ia "$LOG"
  return "$rc"
}

estimate() {  # estimate MINUTES WHY: the stage's expected time on a cold machine
  EST=$1
  EST_WHY=$2
}

setup() {  # disk, stale temporaries, the install and the packages it needs
  if ((DRY)); then
    echo "    df -h . /tmp; rm -rf build/bench-serving/.*.tmp-* (a killed build's temporaries)"
  else
    df -h . /tmp 2>&1 | tee -ia "$LOG"
    rm -rf build/bench-serving/.*.tmp-*
  fi
  step 30 "$PY" -m pip install -q --no-index --disable-pip-version-check --no-deps --no-build-isolation -e . \
    || exit 1
  step 30 "$PY" benchmarks/gpu_preflight.py || exit 1
  step 10 nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.max.sm,clocks.max.mem --format=csv
}

PYTEST=("$PY" -m pytest -v -m gpu -p no:cacheprovider -o "addopts=--import-mode=importlib -ra" --durations=20)

pytest_stage() {  # pytest_stage SECONDS PER_TEST_SECONDS ARGS ...
  local secs=$1 per=$2
  shift 2
  step "$secs" "${PYTEST[@]}" --timeout="$per" "$@"
}

kernels_stage() {  # kernels_stage SECONDS PREFIXES [MODEL]
  step "$1" "$PY" benchmarks/kernels.py --only "$2" --model "${3:-llama-3-8b}" --warmup 5 --repeats 30 \
    --jsonl "$OUT/$STAGE.jsonl"
  table "$OUT/$STAGE.jsonl"
}

serving_stage() {  # serving_stage SECONDS SERVING_ARGS ...
  local secs=$1
  shift
  step "$secs" "$PY" benchmarks/serving.py --device cuda --quiet --skip-verify-built --jsonl "$OUT/$STAGE.jsonl" "$@"
  if ((!DRY)); then mkdir -p "$ROWS" && cp "$OUT/$STAGE.jsonl" "$ROWS/" 2>/dev/null; fi
  table "$ROWS"/*.jsonl  # this stage's rows and earlier stages' on this machine (int4 rows get HF ratios)
}

table() {  # the table rebuilt from JSON lines (also after a step that was killed)
  step 30 "$PY" benchmarks/results.py table "$@"
}

stage() {  # define (and, unless --dry-run, run) stage $1
  STAGE=$1
  BOUND=0
  case "$STAGE" in
    first-look)
      estimate 7 "setup 0.3 (15 s on an H200); 1 + 4 failing-test cases with two tiny builds each ~1.5; kernel rows ~1.5 (w4a16 + tinygemm 67 s cold on an H200); two 8B builds ~75 s each, 2 runs at batch 1 ~0.5"
      setup
      pytest_stage 110 90 tests/test_fp8_accumulation.py tests/test_kernels_e2e.py tests/test_build_device.py \
        -k "accumulator or fp8-w8a8 or int8-bs16 or awq"
      step 90 "$PY" benchmarks/kernels.py --only w4a16,tinygemm,w8a16 --warmup 5 --repeats 30 \
        --jsonl "$OUT/$STAGE.jsonl"
      step 210 "$PY" benchmarks/serving.py --device cuda --quiet --skip-verify-built --jsonl "$OUT/$STAGE.jsonl" \
        --configs bf16,int4 --batch-sizes 1 --no-compare-hf --no-eager ;;
    first-look-rest)
      estimate 7 "setup 0.3; fp8 and fp8 W8A8 8B builds ~75 s each (bf16 and int4 ~80 s more each on a fresh machine); 8 runs, an 8B load each, ~25 s"
      setup
      serving_stage 390 --configs fp8,bf16,fp8w8a8,int4 --batch-sizes 1,64 --no-compare-hf --no-eager ;;
    smoke)
      estimate 1.5 "measured 56 s on a cold Triton cache: setup 0.3, 7 tests 0.6"
      setup
      pytest_stage 330 150 tests/test_cuda_graphs.py tests/test_gpu.py tests/test_build_device.py \
        tests/test_tensor_parallel_lifecycle.py ;;
    kernel-tests)
      estimate 2 "measured 94 s: setup 0.3, 79 tests with their compiles 1.3"
      setup
      pytest_stage 390 120 tests/test_kernels_attention.py tests/test_kernels_norm.py tests/test_kernels_rope.py \
        tests/test_kernels_linear.py tests/test_kernels_w4a16_tiles.py -k "not every_autotune" ;;
    families)
      estimate 4 "setup 0.3, 20 attention tests at family shapes (~60 compiles), 8 tiny family builds served on cuda (~10 s each), 18 fused MoE cases (unmeasured, ~1)"
      setup
      pytest_stage 420 150 tests/test_kernels_attention_window.py tests/test_kernels_families.py \
        tests/test_sliding_window_kv.py tests/test_kernels_moe.py ;;
    quantized)
      estimate 4 "setup 0.3, 10 tiny artifacts built twice and served with their kernels compiled (~15 s each), 8 fp8/W8A8 and 16 tinygemm kernel tests"
      setup
      pytest_stage 420 150 tests/test_kernels_e2e.py tests/test_kernels_fp8.py tests/test_kernels_int4pack.py \
        tests/test_fp8_accumulation.py ;;
    tensorrt)
      estimate 2 "setup 0.3, tiny artifacts and their ONNX exports 0.5, one TensorRT engine build (unmeasured) ~1"
      setup
      pytest_stage 300 240 tests/test_export.py -k tensorrt ;;
    autotune-all)
      estimate 4 "setup 0.5 + ~110 compiles (every w4a16/w8a16 config at two shapes) 3 + runs 0.5"
      setup
      pytest_stage 390 300 tests/test_kernels_linear.py tests/test_kernels_w4a16_tiles.py -k every_autotune ;;
    kernels-small)
      estimate 1.5 "measured 25 s with per-call event timing; CUDA-graph timing adds 2 captures per case"
      setup
      kernels_stage 330 rms_norm,add_rms_norm,gated_act,rope_kv_store,paged_decode,paged_prefill ;;
    kernels-gemma)
      estimate 2.5 "two models' norm, activation, RoPE and attention rows (about 40 cases, compiles included)"
      setup
      kernels_stage 170 rms_norm,add_rms_norm,gated_act,rope_kv_store,paged_decode,paged_prefill gemma-3-270m
      kernels_stage 170 rms_norm,add_rms_norm,gated_act,rope_kv_store,paged_decode,paged_prefill gemma-2-2b ;;
    kernels-w4a16 | kernels-w8a16)
      estimate 1.5 "measured 37 s for w4a16 with per-call event timing; CUDA-graph timing adds 2 captures per case"
      setup
      kernels_stage 390 "${STAGE#kernels-}$([[ $STAGE == kernels-w4a16 ]] && echo ,tinygemm,gemlite)" ;;
    bf16-b1 | bf16-b64 | int4-b1 | int4-b64 | int4tg-b1 | int4tg-b64)
      local config=${STAGE%-b*} batch=${STAGE#*-b}
      if [[ $config == bf16 ]]; then
        estimate 3 "measured 139 s at batch 1 (8B build 92 s, graphs and eager runs 34 s), 67 s at batch 64 (built)"
      else
        estimate 3 "measured 150 s at batch 1 (8B RTN build 82 s, load, autotune, run 55 s), 61 s at batch 64 (built)"
      fi
      setup
      serving_stage 390 --configs "$config" --batch-sizes "$batch" --no-compare-hf ;;
    awq-8b)
      estimate 4 "measured 228 s: random 8B init and AWQ on the GPU 199 s (target: <= 5 min), write 5 GB"
      setup
      step 390 optc build recipes/llama-awq.yaml --model random:llama-3-8b --device cuda --force \
        --out build/bench-serving/llama-3-8b-awq ;;
    hf-b1 | hf-b64)
      estimate 5 "measured 206 s up to transformers' failure (8B build 1.5, optc 1, transformers compile 1); its run 1"
      setup
      serving_stage 390 --configs bf16 --batch-sizes "${STAGE#hf-b}" --no-eager ;;
    lora)
      estimate 5 "setup 0.3; the captured-adapter GPU test ~1 (it skips where peft does not import: carry its wheel); the 8B bf16 build where no earlier stage left it ~1.5 and its batch-1 row 0.5 (the base's step time beside the deltas'); the BGMV deltas of one step at batch 1 and 8 ~0.5"
      setup
      pytest_stage 120 100 tests/test_cuda_graphs.py -k adapter_steps_equal
      serving_stage 210 --configs bf16 --batch-sizes 1 --no-compare-hf --no-eager
      for batch in 1 8; do
        step 25 "$PY" benchmarks/lora_deltas.py build/bench-serving/llama-3-8b-bf16 --device cuda --batch "$batch" \
          --rank 16 --slots 0,1,2,3 --repeats 20 --json "$OUT/lora-deltas-b$batch.json"
      done ;;
    profile-int4 | profile-bf16)
      estimate 4 "measured 218 s for int4 (8B build 121 s, two loads, 2 x 45 decode steps, the profile)"
      setup
      step 390 "$PY" benchmarks/profile_decode.py --config "${STAGE#profile-}" --batch 1 ;;
    fake)
      estimate 0.1 "no GPU: a row every 0.2 s until its limit (tests kill it midway)"
      step "${FAKE_SECONDS:-60}" "$PY" benchmarks/results.py fake --jsonl "$OUT/$STAGE.jsonl" --rows 100000 --interval 0.2
      table "$OUT/$STAGE.jsonl" ;;
    *)
      echo "unknown stage '$STAGE'; stages: $STAGES" >&2
      exit 2 ;;
  esac
}

if [[ ${1:-} == --dry-run ]]; then
  shift
  DRY=1
  total=0
  for name in ${@:-$STAGES}; do
    echo "stage $name:"
    stage "$name"
    total=$(awk -v a="$total" -v b="$EST" 'BEGIN { print a + b }')
    echo "  estimate: ~$EST min on a cold machine ($EST_WHY); bound: $BOUND s of steps (limit $MAX_BOUND);" \
      "running total ~$total min"
    ((BOUND <= MAX_BOUND)) || { echo "stage $name: its steps can run $BOUND s, over $MAX_BOUND" >&2; exit 1; }
  done
  exit 0
fi
[[ $# == 1 ]] || { echo "usage: $0 STAGE | --dry-run [STAGE ...]; stages: $STAGES" >&2; exit 2; }
mkdir -p "$OUT"
LOG="$OUT/$1.log"
DRY=1 stage "$1" >/dev/null  # unknown stages fail here, before anything runs
echo "== stage $1: estimate ~$EST min ($EST_WHY); bound $BOUND s; $(date -u +%FT%TZ)" | tee -ia "$LOG"
stage "$1"
echo "== stage $1 done $(date -u +%FT%TZ)" | tee -ia "$LOG"
