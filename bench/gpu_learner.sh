#!/usr/bin/env bash
# Issue 27 on one GPU, in one run (~6-7 min on an H100; at most 9.5, the timeouts): the learner's MFU before/after
# for Qwen2.5-3B, 1.5B and 0.5B shapes (bench/learner.py --mfu: progress lines, a table, the before/after log-prob
# check per shape, one RESULT line per shape; no new row starts after 270 s), then bench/gpu_smoke.py on the tiny
# model, whose "fast learner" check compares the fast path's log-probs with the eager path's on CUDA.
# Arguments go to the bench (e.g. --shapes 3b, --after learner.compile=none).
#   PYTHON=.venv/bin/python bash bench/gpu_learner.sh
#   SMOKE=0 bash bench/gpu_learner.sh            # the bench only
#   DIAG=1 bash bench/gpu_learner.sh             # where the after rows' time goes (~6 min on an H200): no before
#     rows (docs/results.md has them); the after row at 3B, 1.5B and 0.5B, then each with K/V heads repeated (the
#     kernel before issue 35), learner.reshard=false at 0.5B and 3B, one 65,536-token micro-batch at 0.5B (the
#     per-pass fixed costs), each step profiled (the device's time by kind of kernel, its idle share, the host's
#     waits, the longest kernels, torch.compile's graph breaks); each row's line as soon as it ends; no gpu_smoke
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
$PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA')"
if [ "${DIAG:-0}" != 0 ]; then
  timeout ${BENCH_S:-500} $PY bench/learner.py --mfu --no-before --profile --budget-s ${BUDGET_S:-400} \
    --shapes 3b,1.5b,0.5b --variant repkv kernel=torch_varlen_repeat_kv --variant gathered@0.5b,3b learner.reshard=false \
    --variant mb64k@0.5b learner.micro_batch_tokens=65536 "$@"
else
  timeout ${BENCH_S:-390} $PY bench/learner.py --mfu "$@"
fi
bench=$?
smoke=skipped
if [ "${SMOKE:-1}" != 0 ] && [ "${DIAG:-0}" = 0 ]; then
  timeout ${SMOKE_S:-180} $PY -m torch.distributed.run --standalone --nproc_per_node=1 bench/gpu_smoke.py
  smoke=$?
fi
echo "gpu_learner: bench exit $bench, gpu_smoke exit $smoke"
