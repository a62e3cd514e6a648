#!/usr/bin/env bash
# The CUDA engine's checks and measurements on a GPU machine that reaches no package index, in one
# call there (about two and a half minutes on an H200):
#
#   benchmarks/gpu_offline.sh pack     # here: wheels of this checkout and the two missing dependencies into .whl/
#   benchmarks/gpu_offline.sh run      # there, in a copy of the checkout with .whl/: everything below
#
# `run` installs the wheels into /tmp/site (the machine's Python must already have numpy, pluggy,
# typer, rich, safetensors, tokenizers, jinja2, ml_dtypes, threadpoolctl, cuda-python, NVRTC,
# pytest and transformers), makes a SmolLM2-135M-shaped model with random weights, and runs:
# gpu_check.sh (GPU tests, greedy tokens against the CPU engine, tokens/s at batch 1 and 32, a 60 s
# `pie tune` and what its profile buys); gpu_split_k.py; gpu_profile.py at batch 1 and 32 twice,
# each time also with the GEMM never split along k; `pie bench`; and Nsight Compute's per-kernel
# times of a batch-32 decode and prefill when ncu is there. The log and the tuned profile go to
# $PIE_GPU_RESULTS (default ./gpu-results).
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

if [ "${1:-}" = pack ]; then
  set -e
  rm -rf .whl && mkdir .whl
  for package in pie-core pie-engine-cpu pie-engine-cuda; do
    "$PYTHON" -m pip wheel --quiet --no-deps --no-build-isolation -w .whl "./$package"
  done
  "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: -d .whl gguf platformdirs
  ls -l .whl
  exit 0
fi
if [ "${1:-}" != run ]; then
  echo "usage: $0 pack|run" >&2
  exit 2
fi

RESULTS=${PIE_GPU_RESULTS:-gpu-results}
mkdir -p "$RESULTS"
LOG=$RESULTS/log.txt
export PYTHONUNBUFFERED=1
"$PYTHON" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
MODEL=/tmp/smol
start=$(date +%s)
stamp() { echo "== [$(($(date +%s) - start)) s] $*" | tee -a "$LOG"; }

stamp "model: SmolLM2-135M-shaped, random weights"
"$PYTHON" -c "from pie.testing.models import make_hf_model as m; m('$MODEL', vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True, rope_theta=100000.0, max_position_embeddings=8192)" >/dev/null 2>&1

stamp gpu_check.sh
PIE_GPU_PYTHON=$PYTHON PIE_GPU_MODEL=$MODEL PIE_GPU_TUNE_BUDGET=60 PIE_GPU_PROFILE=$RESULTS/cuda-profile.toml \
  timeout 300 bash benchmarks/gpu_check.sh 2>&1 | tee -a "$LOG" | grep -v '^\.*$'

stamp gpu_split_k.py
timeout 90 "$PYTHON" benchmarks/gpu_split_k.py 2>&1 | tee -a "$LOG"

UNSPLIT="import runpy, sys
from pie_engine_cuda import launch
launch.gemm_splits = lambda tiles, k, multiprocessors: 1
sys.argv[0] = 'benchmarks/gpu_profile.py'
runpy.run_path(sys.argv[0], run_name='__main__')"
for round in 1 2; do
  stamp "gpu_profile.py, GEMM unsplit, round $round"
  timeout 60 "$PYTHON" -c "$UNSPLIT" --model $MODEL --batches 1,32 --steps 32 --top 0 2>&1 | tee -a "$LOG" | grep '^=='
  stamp "gpu_profile.py, round $round"
  timeout 60 "$PYTHON" benchmarks/gpu_profile.py --model $MODEL --batches 1,32 --steps 32 --top 12 2>&1 | tee -a "$LOG" | grep '^=='
done

stamp "pie bench"
timeout 60 pie bench --model $MODEL --engine cuda --runs 3 2>&1 | tee -a "$LOG"

NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
if [ -n "$NCU" ]; then
  for phase in decode prefill; do
    stamp "ncu, batch-32 $phase"
    timeout 90 "$NCU" --profile-from-start off --clock-control none --cache-control none \
      --metrics gpu__time_duration.sum --csv --log-file "$RESULTS/kernels-$phase.csv" \
      "$PYTHON" benchmarks/gpu_profile.py --model $MODEL --kernels $phase --batches 32 --steps 3 >/dev/null 2>&1
    "$PYTHON" benchmarks/gpu_profile.py --summarize "$RESULTS/kernels-$phase.csv" 2>&1 | tee -a "$LOG" | head -n 12
  done
fi
stamp done
