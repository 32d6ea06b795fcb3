# finetune: every target installs what it needs into .venv first, so on a fresh machine
#   make demo   trains the offline demo with FSDP2 on 2 processes and reports before/after
#   make test   runs lint and the test suite (what CI runs)
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
ACCELERATE := $(VENV)/bin/accelerate
STAMP := $(VENV)/.installed-$(shell cksum < pyproject.toml | cut -d' ' -f1)

DEMO_DIR := outputs/demo
DEMO_RECIPE := recipes/demo/tiny_llama.yaml
CONFIG ?= accelerate_configs/fsdp2_full_shard.yaml
NUM_PROCESSES ?= 2
# The demo is offline by construction; this makes any accidental hub access fail fast.
OFFLINE := HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

.PHONY: help setup demo train-tiny export plan test lint format clean

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F ':.*## ' '{printf "  %-12s %s\n", $$1, $$2}'

setup: $(STAMP) ## create .venv with finetune and its dependencies

# A torch that is already installed (GPU machines) is kept: the venv sees system packages and
# pip finds torch satisfied. Elsewhere the CPU wheel is pinned, since an unpinned torch pulls CUDA.
$(STAMP): pyproject.toml
	@if $(PYTHON) -c "import torch" 2>/dev/null; then \
		echo "using the installed torch"; $(PYTHON) -m venv --system-site-packages $(VENV); \
	else \
		$(PYTHON) -m venv $(VENV) && $(PY) -m pip install --quiet torch==2.13.0; \
	fi
	$(PY) -m pip install --quiet -e ".[dev]"
	rm -f $(VENV)/.installed-* && touch $@

demo: $(STAMP) ## offline demo: build a tiny Llama and data, fine-tune with FSDP2, export, compare
	$(OFFLINE) $(PY) -m finetune demo build --dir $(DEMO_DIR)
	$(MAKE) --no-print-directory train-tiny
	$(OFFLINE) $(PY) -m finetune demo report --dir $(DEMO_DIR)

# The demo model is tiny, so it trains in fp32 on any hardware (--mixed_precision no).
train-tiny: $(STAMP) ## train the demo recipe (after `finetune demo build`)
	$(OFFLINE) $(ACCELERATE) launch --config_file $(CONFIG) --num_processes $(NUM_PROCESSES) --mixed_precision no \
		-m finetune train $(DEMO_RECIPE)

# make export CKPT=outputs/demo/run/checkpoints/step_300 OUT=exported [DTYPE=bf16] [MAX_SHARD_SIZE=5GB]
export: $(STAMP) ## write checkpoint CKPT as a Hugging Face folder OUT (one process, no launcher)
	@test -n "$(CKPT)" -a -n "$(OUT)" || { echo "make export needs CKPT=<checkpoint or output dir> OUT=<folder>"; exit 2; }
	$(PY) -m finetune export $(CKPT) $(OUT) $(if $(DTYPE),--dtype $(DTYPE)) --max-shard-size $(or $(MAX_SHARD_SIZE),5GB)

# make plan RECIPE=recipes/demo/tiny_llama.yaml [CONFIG=...] [NUM_PROCESSES=8] [NUM_MACHINES=1] [GPU_MEMORY=80GB]
plan: $(STAMP) ## memory per device for RECIPE under CONFIG on NUM_PROCESSES devices, and a verdict
	$(OFFLINE) $(PY) -m finetune plan $(or $(RECIPE),$(DEMO_RECIPE)) --config $(CONFIG) \
		--num-processes $(NUM_PROCESSES) --num-machines $(or $(NUM_MACHINES),1) --gpu-memory $(or $(GPU_MEMORY),80GB)

test: lint ## lint, then the test suite (CPU only; multi-process tests use 2 processes over gloo)
	$(OFFLINE) $(PY) -m pytest

lint: $(STAMP) ## ruff check and format check
	$(VENV)/bin/ruff check finetune tests
	$(VENV)/bin/ruff format --check finetune tests

format: $(STAMP) ## apply ruff fixes and formatting
	$(VENV)/bin/ruff check --fix finetune tests
	$(VENV)/bin/ruff format finetune tests

clean: ## remove outputs and the virtual environment
	rm -rf outputs $(VENV)
