#!/usr/bin/env bash
# The GPU checks of issue 24, for one CUDA GPU, in at most ~3 minutes (each check bounded; the total too).
#
#     bash bench/gpu_path.sh            # from the repository root, with the python that has torch (CUDA) and transformers
#     PY=/path/to/python bash bench/gpu_path.sh
#
# It needs torch with CUDA and transformers (4.56+ or 5.x), aiohttp for the smoke test, pytest and pytest-asyncio for
# the tests; no network, no bubblewrap and no Jupyter (nothing here starts a kernel). Each check prints PASS or FAIL:
#   1. learner     configs/gpu_example.yaml's learner (learner.device cuda, bf16 mixed precision, activation
#                  checkpointing, the KL reference at kl_coef 0.001) on one CUDA rank with tiny-random: two steps
#                  (KL 0 at step 1, > 0 at step 2), a bf16 export
#   2. cuda-line   with the GPU hidden (CUDA_VISIBLE_DEVICES=""): learner.device=cuda stops with one line naming what
#                  nvidia-smi sees; gpu_smoke FAILs its first check with that line
#   3. gpu-smoke   bench/gpu_smoke.py on 1 CUDA rank (two embedded CPU servers): every check passes
#   4. tests       the learner and server tests with this machine's transformers, on CPU (GPU hidden)
# CHECKS="learner cuda-line" runs only those. The last line: ALL n PASS, or n of m FAIL.
set -u
cd "$(dirname "$0")/.."
export PY=${PY:-python}
export L0_MIN_CACHE=${L0_MIN_CACHE:-/tmp/l0_min-gpu-path/cache} PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
WORK=/tmp/l0_min-gpu-path
mkdir -p "$WORK"
START=$(date +%s)
TOTAL=${TOTAL:-175}
PASSED=0
FAILED=0

# run NAME LIMIT CMD...: CMD under min(LIMIT, what is left of TOTAL) seconds; its output in $WORK/NAME.log
run() {
  local name=$1 limit=$2 left
  shift 2
  [[ " ${CHECKS:-learner cuda-line gpu-smoke tests} " == *" $name "* ]] || return 0
  left=$((TOTAL - ($(date +%s) - START)))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -le 5 ]; then echo "FAIL  $name  not run: the ${TOTAL} s budget is spent"; FAILED=$((FAILED + 1)); return; fi
  local t0=$(date +%s)
  timeout -k 5 "$limit" "$@" > "$WORK/$name.log" 2>&1
  local rc=$? secs=$(($(date +%s) - t0))
  if [ $rc -eq 0 ]; then
    PASSED=$((PASSED + 1)); echo "PASS  $name  ($secs s) $(grep -h '^OK ' "$WORK/$name.log" | tail -3 | tr '\n' ' ')"
  else
    FAILED=$((FAILED + 1)); echo "FAIL  $name  (rc $rc$([ $rc -eq 124 ] || [ $rc -eq 137 ] && echo ": timed out at $limit s"), $secs s); the log's tail:"
    tail -25 "$WORK/$name.log" | sed 's/^/      /'
  fi
}

echo "# $(nvidia-smi -L 2>/dev/null | head -1); $($PY -c 'import torch, transformers; print(f"torch {torch.__version__} (CUDA {torch.version.cuda}, available {torch.cuda.is_available()}), transformers {transformers.__version__}")' 2>&1 | tail -1)"

run learner 180 "$PY" - <<'EOF'
import sys, time
sys.path.insert(0, ".")
import torch
from safetensors import safe_open
from l0_min import config as configlib
from l0_min.episode import Row
from l0_min.learner import Learner, close_distributed
from l0_min.models import resolve_model

t0 = time.perf_counter()
cfg = configlib.resolve(["model.path=tiny-random"], "configs/gpu_example.yaml")
assert (cfg.learner.device, cfg.algo.kl_coef, cfg.learner.mixed_precision, cfg.learner.activation_checkpointing) == ("cuda", 0.001, True, "full")
cfg.learner.lr = 1e-4  # the config's 1e-6 can leave every bf16-rounded weight as it was: KL 0 at step 2 too
learner = Learner(resolve_model(cfg.model.path), cfg.learner, cfg.algo, total_steps=2, temperature=cfg.sampling.temperature)
assert learner.device.type == "cuda" and learner.ref is not None, (learner.device, learner.ref)
rows = [Row([3 + j % 256 for j in range(n)], [0.0] * 8 + [1.0] * (n - 8), [0.0] * 8 + [1.0 - 2 * (i % 2)] * (n - 8), [0.0] * 8 + [-5.0] * (n - 8))
        for i, n in enumerate((40, 300, 120, 700))]
s1, s2 = learner.train_step(rows), learner.train_step(rows)
assert s1["kl"] == 0.0 and s2["kl"] > 0, (s1["kl"], s2["kl"])  # the reference is the step-0 policy
out = learner.export_hf("/tmp/l0_min-gpu-path/export", dtype=cfg.model.serving_dtype(True))
with safe_open(str(out / "model.safetensors"), "pt") as f:
    dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
assert dtypes == {"BF16"}, dtypes
print(f"OK learner on {learner.device}: KL {s1['kl']:.1e} -> {s2['kl']:.2e}, loss {s2['loss']:.4f}, export {sorted(dtypes)}, "
      f"peak {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB, {time.perf_counter() - t0:.0f} s")
close_distributed()
EOF

cuda_line() {
  CUDA_VISIBLE_DEVICES= "$PY" - <<'EOF' || return 1
import sys
sys.path.insert(0, ".")
from l0_min.learner import init_distributed
try:
    init_distributed(device="cuda")
except RuntimeError as e:
    line = str(e)
    assert "\n" not in line and "learner.device=cuda but torch" in line and "nvidia-smi sees" in line, line
    print("OK " + line)
else:
    raise SystemExit("init_distributed(device='cuda') did not stop with CUDA hidden")
EOF
  local out rc
  out=$(CUDA_VISIBLE_DEVICES= "$PY" bench/gpu_smoke.py 2>&1); rc=$?
  echo "$out" | tail -5
  [ $rc -eq 1 ] && echo "$out" | head -1 | grep -q '^FAIL  collectives  learner.device=cuda but torch' && echo "OK gpu_smoke's first check FAILs with the line"
}
export -f cuda_line
run cuda-line 40 bash -c cuda_line

run gpu-smoke 75 "$PY" -m torch.distributed.run --standalone --nproc_per_node=1 bench/gpu_smoke.py
grep -h '^\(PASS\|FAIL\)' "$WORK/gpu-smoke.log" | sed 's/^/      /'

# on CPU (the GPU hidden), this machine's transformers: the tests that load, shard, step and serve models
run tests 90 env CUDA_VISIBLE_DEVICES= "$PY" -m pytest -q -x -p no:cacheprovider -o addopts="" \
  tests/test_learner.py tests/test_serve.py -k "not raises_reward and not smollm2"
grep -h 'passed\|failed\|error' "$WORK/tests.log" | tail -2 | sed 's/^/      /'

echo "$([ $FAILED -eq 0 ] && echo "ALL $PASSED PASS" || echo "$FAILED of $((PASSED + FAILED)) FAIL") in $(($(date +%s) - START)) s (logs: $WORK)"
