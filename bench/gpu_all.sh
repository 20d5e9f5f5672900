#!/usr/bin/env bash
# Every GPU check of the project in one device run (~9 min on an H100), most valuable first, each part bounded:
#   1. bench/gpu_learner.sh: the learner's MFU before/after per Qwen2.5 shape (issue 27), then gpu_smoke (all its
#      checks, the fast learner's log-probs against the eager learner's among them), with transformers 4.57.6
#      from the wheels in .whl/ (pip download ... transformers==4.57.6 tokenizers==0.22.2 huggingface_hub==0.36.2)
#   2. bench/gpu_path.sh's learner and cuda-line checks with the machine's own transformers (5.x)
# DIAG=1: part 1 profiles the learner instead (bench/gpu_learner.sh DIAG=1, ~8 min: no before rows, no gpu_smoke),
# and part 2 is skipped. Logs go to $OUT (the device tool's folder) when it is set.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_all}; mkdir -p "$OUT"
nvidia-smi -L; python3 -c "import torch, transformers; print('machine: torch', torch.__version__, 'transformers', transformers.__version__)"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/tf457 .whl/*.whl || echo "no .whl: the machine's transformers"
BENCH_S=${BENCH_S:-$([ "${DIAG:-0}" != 0 ] && echo 480 || echo 345)} SMOKE_S=140 PYTHONPATH=/tmp/tf457 PYTHON=python3 \
  bash bench/gpu_learner.sh "$@" 2>&1 | tee "$OUT/learner.log"
[ "${DIAG:-0}" != 0 ] || CHECKS="learner cuda-line" TOTAL=100 PY=python3 bash bench/gpu_path.sh 2>&1 | tee "$OUT/path.log"
