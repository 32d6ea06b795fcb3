# finetune: every target installs what it needs into .venv first, so on a fresh machine
#   make demo   trains the offline demo with FSDP2 on 2 processes and reports before/after
#   make test   runs lint and the test suite (what CI runs)
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
# VENV= (empty) runs an existing environment's $(PYTHON) as it is, installing nothing: a GPU machine's, which
# keeps its own torch (what it lacks travels as wheels: make gpu-wheels, then make gpu-check).
PY := $(if $(VENV),$(VENV)/bin/python,$(PYTHON))
ACCELERATE := $(if $(VENV),$(VENV)/bin/accelerate,$(PY) -m accelerate.commands.accelerate_cli)
RUFF := $(PY) -m ruff
STAMP := $(if $(VENV),$(VENV)/.installed-$(shell cksum < pyproject.toml | cut -d' ' -f1))

DEMO_DIR := outputs/demo
DEMO_RECIPE := recipes/demo/tiny_llama.yaml
# Launch settings; every train-* target has its own defaults and takes these as overrides (the one-GPU targets
# run single_gpu.yaml; CONFIG=accelerate_configs/fsdp2_full_shard.yaml NUM_PROCESSES=8 shards them with their WRAP).
CONFIG ?= accelerate_configs/fsdp2_full_shard.yaml
NUM_PROCESSES ?= 2
NUM_MACHINES ?= 1
MACHINE_RANK ?= 0
MAIN_PROCESS_IP ?=
MAIN_PROCESS_PORT ?= 29500
# The demo is offline by construction; this makes any accidental hub access fail fast.
OFFLINE := HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

TRAIN_TARGETS := train-gpt2 train-gpt2-medium train-gpt2-xl train-1b train-8b train-70b train-qwen-7b train-mistral-7b \
	train-8b-lora train-qwen-7b-lora train-70b-qlora train-qwen3-8b train-qwen3-8b-128k train-qwen3-30b-a3b train-qwen3-30b-a3b-64k \
	train-qwen3-30b-a3b-lora \
	train-gpt-oss-20b-lora train-mixtral-lora train-qwen-7b-tools train-8b-dpo train-qwen-7b-dpo \
	train-qwen3-8b-grpo train-qwen3-8b-grpo-lora train-qwen3-8b-grpo-tools train-qwen3-1.7b-distill train-qwen3-1.7b-distill-on-policy
.PHONY: help setup test-fast test-bench demo demo-lora demo-dpo demo-kto demo-grpo demo-rm demo-distill train-tiny train $(TRAIN_TARGETS) check export plan bench bench-gpu \
	gpu-wheels gpu-check test test-gpu lint format clean

help: ## list the targets
	@grep -E '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | awk -F ':.*## ' '{printf "  %-18s %s\n", $$1, $$2}'

setup: $(STAMP) ## create .venv with finetune and its dependencies

# A torch that is already installed (GPU machines) is kept: the venv sees system packages and
# pip finds torch satisfied. Elsewhere the CPU wheel is pinned, since an unpinned torch pulls CUDA.
ifneq ($(VENV),)
$(STAMP): pyproject.toml
	@if $(PYTHON) -c "import torch" 2>/dev/null; then \
		echo "using the installed torch"; $(PYTHON) -m venv --system-site-packages $(VENV); \
	else \
		$(PYTHON) -m venv $(VENV) && $(PY) -m pip install --quiet torch==2.13.0; \
	fi
	@# liger-kernel's fused kernels (model.kernels: liger) are Triton GPU kernels: installed where CUDA is.
	@# (-W ignore: numpy, which torch warns it lacks, comes with finetune's dependencies on the next line.)
	$(PY) -m pip install --quiet -e ".[dev$$($(PY) -W ignore -c 'import torch; print(",gpu" * torch.cuda.is_available())')]"
	rm -f $(VENV)/.installed-* && touch $@
endif

# The SFT demo's paths under DEMO_DIR (the recipe's own are outputs/demo's).
DEMO_SFT := data.train_path=$(DEMO_DIR)/data/train.jsonl data.eval_path=$(DEMO_DIR)/data/eval.jsonl
DEMO_RUN = model.name_or_path=$(DEMO_DIR)/base $(DEMO_SFT) output.dir=$(DEMO_DIR)/run
demo: $(STAMP) ## offline demo: build a tiny Llama and data, fine-tune with FSDP2, export, compare
	$(OFFLINE) $(PY) -m finetune demo build --dir $(DEMO_DIR)
	$(MAKE) --no-print-directory train-tiny ARGS="$(DEMO_RUN) $(ARGS)"
	$(OFFLINE) $(PY) -m finetune demo report --dir $(DEMO_DIR) --run $(DEMO_DIR)/run

# The same demo with LoRA instead of full fine-tuning: rank-64 adapters on every linear layer and a
# trained lm_head (the demo's base is a random init, so the head has to learn the digits), exported as
# the adapter (final/) and merged (final_merged/), which the report evaluates.
DEMO_LORA := peft.r=64 peft.alpha=128 'peft.modules_to_save=[lm_head]' output.export_merged=true
demo-lora: $(STAMP) ## the offline demo with LoRA adapters instead of every weight; report on the merged export
	$(OFFLINE) $(PY) -m finetune demo build --dir $(DEMO_DIR)
	$(MAKE) --no-print-directory train-tiny ARGS="output.dir=$(DEMO_DIR)/run-lora $(DEMO_LORA) $(ARGS)"
	$(OFFLINE) $(PY) -m finetune demo report --dir $(DEMO_DIR) --run $(DEMO_DIR)/run-lora

# The second post-training stage on the demo: the SFT run's export (made first if missing) preference-tuned with
# DPO on pairs of the training lists (the correct reversal preferred over a near miss), reference precomputed.
DEMO_DPO := model.name_or_path=$(DEMO_DIR)/run/final data.train_path=$(DEMO_DIR)/data/pairs_train.jsonl \
	data.eval_path=$(DEMO_DIR)/data/pairs_eval.jsonl data.format=auto preference.loss=dpo preference.beta=0.1 \
	optim.lr=5e-5 optim.warmup_steps=5 train.max_steps=60 train.eval_every_steps=30 train.log_every_steps=10
demo-dpo: $(STAMP) ## the demo's second stage: DPO of the SFT model on correct-vs-near-miss pairs; report before/after
	$(OFFLINE) $(PY) -m finetune demo build --dir $(DEMO_DIR)
	@test -f $(DEMO_DIR)/run/final/config.json || $(MAKE) --no-print-directory train-tiny ARGS="$(DEMO_RUN)"
	$(MAKE) --no-print-directory train-tiny ARGS="output.dir=$(DEMO_DIR)/run-dpo $(DEMO_DPO) $(ARGS)"
	$(OFFLINE) $(PY) -m finetune demo report --dir $(DEMO_DIR) --run $(DEMO_DIR)/run-dpo --before $(DEMO_DIR)/run/final

# KTO on the demo (docs/preference.md): the SFT run's export (made first if missing) tuned by KTO on the DPO demo's
# pairs made unpaired (recipes/demo/tiny_llama_kto.yaml: 16 pairs = 32 samples a step), beside DPO on the same pairs
# and steps; a report for each.
demo-kto: $(STAMP) ## KTO of the SFT model from the demo's pairs made unpaired, beside DPO on the same steps; reports
	$(OFFLINE) $(PY) -m finetune demo build --dir $(DEMO_DIR)
	@test -f $(DEMO_DIR)/run/final/config.json || $(MAKE) --no-print-directory train-tiny ARGS="$(DEMO_RUN)"
	@test -f $(DEMO_DIR)/run-dpo/final/config.json || $(MAKE) --no-print-directory train-tiny \
		ARGS="output.dir=$(DEMO_DIR)/run-dpo $(DEMO_DPO)"
	$(MAKE) --no-print-directory train-tiny DEMO_RECIPE=recipes/demo/tiny_llama_kto.yaml ARGS="$(DEMO_KTO) $(ARGS)"
	@echo "DPO (make demo-dpo's run):"
	$(OFFLINE) $(PY) -m finetune demo report --dir $(DEMO_DIR) --run $(DEMO_DIR)/run-dpo --before $(DEMO_DIR)/run/final
	@echo "KTO, the same pairs unpaired:"
	$(OFFLINE) $(PY) -m finetune demo report --dir $(DEMO_DIR) --run $(DEMO_DIR)/run-kto --before $(DEMO_DIR)/run/final
DEMO_KTO := model.name_or_path=$(DEMO_DIR)/run/final data.train_path=$(DEMO_DIR)/data/pairs_train.jsonl \
	data.eval_path=$(DEMO_DIR)/data/pairs_eval.jsonl output.dir=$(DEMO_DIR)/run-kto

# Online RL on the demo: a partly trained SFT model (40 steps, made first if missing: about 40% exact match) trained
# by GRPO with the exact-reversal reward (recipes/demo/tiny_llama_grpo.yaml), then the report before and after.
DEMO_GRPO := model.name_or_path=$(DEMO_DIR)/run-partial/final data.train_path=$(DEMO_DIR)/data/prompts_train.jsonl \
	data.eval_path=$(DEMO_DIR)/data/prompts_eval.jsonl output.dir=$(DEMO_DIR)/run-grpo
demo-grpo: $(STAMP) ## online RL on the demo: GRPO of a partly trained reverser, rewarded for exact reversals; report
	$(OFFLINE) $(PY) -m finetune demo build --dir $(DEMO_DIR)
	@test -f $(DEMO_DIR)/run-partial/final/config.json || $(MAKE) --no-print-directory train-tiny \
		ARGS="model.name_or_path=$(DEMO_DIR)/base $(DEMO_SFT) output.dir=$(DEMO_DIR)/run-partial train.max_steps=40 \
		train.eval_every_steps=40"
	$(MAKE) --no-print-directory train-tiny DEMO_RECIPE=recipes/demo/tiny_llama_grpo.yaml ARGS="$(DEMO_GRPO) $(ARGS)"
	$(OFFLINE) $(PY) -m finetune demo report --dir $(DEMO_DIR) --run $(DEMO_DIR)/run-grpo \
		--before $(DEMO_DIR)/run-partial/final

# A learned reward on the demo (docs/reward_models.md): the 40-step model of demo-grpo (made first if missing) samples
# replies to the training lists; each wrong one (and hard negatives: a near miss, one digit changed at each position,
# the list unreversed), paired with the correct reversal, trains a reward model from the SFT run's export (made first
# if missing; recipes/demo/tiny_llama_reward.yaml, 6,400 steps, held-out pair accuracy in its log); then GRPO of the
# 40-step model rewarded by that reward model alone (recipes/demo/tiny_llama_grpo_rm.yaml, 32 prompts a step); the
# report before and after. About 23 minutes on 2 CPU cores.
DEMO_RM := data.train_path=$(DEMO_DIR)/data/rm_pairs_train.jsonl data.eval_path=$(DEMO_DIR)/data/rm_pairs_eval.jsonl \
	model.name_or_path=$(DEMO_DIR)/run/final output.dir=$(DEMO_DIR)/run-rm train.max_steps=6400 \
	train.eval_every_steps=800 optim.schedule=constant
DEMO_GRPO_RM := model.name_or_path=$(DEMO_DIR)/run-partial/final \
	data.train_path=$(DEMO_DIR)/data/prompts_train.jsonl data.eval_path=$(DEMO_DIR)/data/prompts_eval.jsonl \
	output.dir=$(DEMO_DIR)/run-grpo-rm
demo-rm: $(STAMP) ## a reward model of the demo from the policy's own replies, then GRPO rewarded by it alone; report
	$(OFFLINE) $(PY) -m finetune demo build --dir $(DEMO_DIR)
	@test -f $(DEMO_DIR)/run/final/config.json || $(MAKE) --no-print-directory train-tiny ARGS="$(DEMO_RUN)"
	@test -f $(DEMO_DIR)/run-partial/final/config.json || $(MAKE) --no-print-directory train-tiny \
		ARGS="model.name_or_path=$(DEMO_DIR)/base $(DEMO_SFT) output.dir=$(DEMO_DIR)/run-partial train.max_steps=40 \
		train.eval_every_steps=40"
	$(OFFLINE) $(PY) -m finetune demo build-rm --dir $(DEMO_DIR) --policy $(DEMO_DIR)/run-partial/final
	$(MAKE) --no-print-directory train-tiny DEMO_RECIPE=recipes/demo/tiny_llama_reward.yaml ARGS="$(DEMO_RM)"
	$(MAKE) --no-print-directory train-tiny DEMO_RECIPE=recipes/demo/tiny_llama_grpo_rm.yaml \
		ARGS="$(DEMO_GRPO_RM) 'rl.rewards=[{model: $(DEMO_DIR)/run-rm/final, label: rm}]' $(ARGS)"
	$(OFFLINE) $(PY) -m finetune demo report --dir $(DEMO_DIR) --run $(DEMO_DIR)/run-grpo-rm \
		--before $(DEMO_DIR)/run-partial/final

# Distillation on the demo (docs/distillation.md): the SFT run's export (made first if missing) teaches a student of
# half its layers and width. One warm student (100 SFT steps from random init), then 50 more steps of each of SFT,
# off-policy distillation (the data's replies graded by the teacher) and on-policy distillation
# (recipes/demo/tiny_llama_distill.yaml: the student's own completions graded); first on the demo's data, then on
# data where DISTILL_NOISE of the lists have a wrong reply (the same error every time), which the teacher, trained
# on correct replies, knows better than. A report for each case.
DISTILL_NOISE ?= 0.3
# Inside distill_case: $(1) the case (clean or noisy), $(2) its training data.
DISTILL_DATA = data.train_path=$(2) data.eval_path=$(DEMO_DIR)/data/eval.jsonl
DISTILL_WARM = model.name_or_path=$(DEMO_DIR)/distill/$(1)/warm/final $(DISTILL_DATA) train.max_steps=50 \
	train.eval_every_steps=50
DISTILLED = DEMO_RECIPE=recipes/demo/tiny_llama_distill.yaml ARGS="$(DISTILL_WARM) distill.teacher=$(DEMO_DIR)/run/final
define distill_case
	$(MAKE) --no-print-directory train-tiny ARGS="model.name_or_path=$(DEMO_DIR)/student $(DISTILL_DATA) \
		train.max_steps=100 train.eval_every_steps=100 output.dir=$(DEMO_DIR)/distill/$(1)/warm $(ARGS)"
	$(MAKE) --no-print-directory train-tiny ARGS="$(DISTILL_WARM) output.dir=$(DEMO_DIR)/distill/$(1)/sft $(ARGS)"
	$(MAKE) --no-print-directory train-tiny $(DISTILLED) distill.on_policy_fraction=0 distill.max_new_tokens=null \
		output.dir=$(DEMO_DIR)/distill/$(1)/off-policy $(ARGS)"
	$(MAKE) --no-print-directory train-tiny $(DISTILLED) output.dir=$(DEMO_DIR)/distill/$(1)/on-policy $(ARGS)"
	$(OFFLINE) $(PY) -m finetune demo report-distill --dir $(DEMO_DIR) --case "$(1) data" \
		--before $(DEMO_DIR)/distill/$(1)/warm/final --sft $(DEMO_DIR)/distill/$(1)/sft \
		--distilled $(DEMO_DIR)/distill/$(1)/off-policy $(DEMO_DIR)/distill/$(1)/on-policy
endef
demo-distill: $(STAMP) ## distillation on the demo: SFT vs off- and on-policy distillation from a warm student, clean and noisy data
	$(OFFLINE) $(PY) -m finetune demo build --dir $(DEMO_DIR) --noise $(DISTILL_NOISE)
	@test -f $(DEMO_DIR)/run/final/config.json || $(MAKE) --no-print-directory train-tiny ARGS="$(DEMO_RUN)"
	$(call distill_case,clean,$(DEMO_DIR)/data/train.jsonl)
	$(call distill_case,noisy,$(DEMO_DIR)/data/train_noisy.jsonl)

# Agents on the demo (finetune/run/demo_agent.py): lists stored under keys the model must look up with a tool
# before reversing them; SFT on tool-using traces (recipes/demo/agent_sft.yaml), then GRPO over episodes that call
# the tool (recipes/demo/agent_grpo.yaml); the report plays the 200 held-out prompts as episodes before and after.
AGENT_DIR = $(DEMO_DIR)/agent
DEMO_AGENT := model.name_or_path=$(AGENT_DIR)/run-sft/final data.train_path=$(AGENT_DIR)/data/prompts_train.jsonl \
	data.eval_path=$(AGENT_DIR)/data/prompts_eval.jsonl output.dir=$(AGENT_DIR)/run-grpo
demo-agent: $(STAMP) ## agents on the demo: SFT on tool-using traces, then GRPO over episodes that call the tool; report
	$(OFFLINE) $(PY) -m finetune demo build-agent --dir $(DEMO_DIR)
	@test -f $(AGENT_DIR)/run-sft/final/config.json || $(MAKE) --no-print-directory train-tiny \
		DEMO_RECIPE=recipes/demo/agent_sft.yaml ARGS="model.name_or_path=$(AGENT_DIR)/base \
		data.train_path=$(AGENT_DIR)/data/sft_train.jsonl data.eval_path=$(AGENT_DIR)/data/sft_eval.jsonl \
		output.dir=$(AGENT_DIR)/run-sft"
	$(MAKE) --no-print-directory train-tiny DEMO_RECIPE=recipes/demo/agent_grpo.yaml ARGS="$(DEMO_AGENT) $(ARGS)"
	$(OFFLINE) $(PY) -m finetune demo report-agent --dir $(DEMO_DIR) --run $(AGENT_DIR)/run-grpo \
		--before $(AGENT_DIR)/run-sft/final

# The demo model is tiny, so it trains in fp32 on any hardware (--mixed_precision no).
train-tiny: $(STAMP) ## train the demo recipe (after `finetune demo build`)
	$(OFFLINE) $(ACCELERATE) launch --config_file $(CONFIG) --num_processes $(NUM_PROCESSES) --mixed_precision no \
		-m finetune train $(DEMO_RECIPE) $(ARGS)

# One target per recipe: its recipe, FSDP wrap class, accelerate config and process count.
# Multi-node: run the same target on every machine with NUM_MACHINES, MACHINE_RANK and MAIN_PROCESS_IP
# (accelerate_configs/slurm_multi_node.sbatch does this under SLURM). Recipe overrides: ARGS="optim.lr=1e-5";
# MIXED_PRECISION=no|bf16|fp16 overrides the accelerate config's.
train-gpt2: ## GPT-2 small, TL;DR, 2 GPUs (recipes/gpt2/gpt2-small.yaml)
train-gpt2: RECIPE = recipes/gpt2/gpt2-small.yaml
train-gpt2: WRAP = GPT2Block
train-gpt2-medium: ## GPT-2 medium, TL;DR, 4 GPUs
train-gpt2-medium: RECIPE = recipes/gpt2/gpt2-medium.yaml
train-gpt2-medium: WRAP = GPT2Block
train-gpt2-medium: NUM_PROCESSES = 4
train-gpt2-xl: ## GPT-2 XL, TL;DR, 8 GPUs, single-node preset
train-gpt2-xl: RECIPE = recipes/gpt2/gpt2-xl.yaml
train-gpt2-xl: WRAP = GPT2Block
train-gpt2-xl: CONFIG = accelerate_configs/single_node.yaml
train-gpt2-xl: NUM_PROCESSES = 8
train-1b: ## Llama-3.2-1B-Instruct, No Robots, 8 GPUs, FSDP2 without activation checkpointing
train-1b: RECIPE = recipes/llama/llama-3.2-1b.yaml
train-1b: CONFIG = accelerate_configs/fsdp2_full_shard.yaml
train-1b: NUM_PROCESSES = 8
train-8b: ## Llama-3.1-8B-Instruct, UltraChat, 8 GPUs, single-node preset
train-8b: RECIPE = recipes/llama/llama-3.1-8b.yaml
train-8b: CONFIG = accelerate_configs/single_node.yaml
train-8b: NUM_PROCESSES = 8
train-70b: ## Llama-3.1-70B-Instruct, UltraChat, 2 nodes x 8 GPUs, multi-node preset
train-70b: RECIPE = recipes/llama/llama-3.1-70b.yaml
train-70b: CONFIG = accelerate_configs/multi_node.yaml
train-70b: NUM_PROCESSES = 16
train-70b: NUM_MACHINES = 2
train-qwen-7b: ## Qwen2.5-7B-Instruct, UltraChat, 8 GPUs, single-node preset
train-qwen-7b: RECIPE = recipes/qwen/qwen2.5-7b.yaml
train-qwen-7b: WRAP = Qwen2DecoderLayer
train-qwen-7b: CONFIG = accelerate_configs/single_node.yaml
train-qwen-7b: NUM_PROCESSES = 8
train-qwen3-8b: ## Qwen3-8B, reasoning traces (Mixture-of-Thoughts), 8 GPUs, single-node preset
train-qwen3-8b: RECIPE = recipes/qwen/qwen3-8b-reasoning.yaml
train-qwen3-8b: WRAP = Qwen3DecoderLayer
train-qwen3-8b: CONFIG = accelerate_configs/single_node.yaml
train-qwen3-8b: NUM_PROCESSES = 8
train-qwen3-8b-128k: ## Qwen3-8B, reasoning traces up to 131,072 tokens, rows split over 8 GPUs (sequence parallelism)
train-qwen3-8b-128k: RECIPE = recipes/qwen/qwen3-8b-reasoning-128k.yaml
train-qwen3-8b-128k: WRAP = Qwen3DecoderLayer
train-qwen3-8b-128k: CONFIG = accelerate_configs/sequence_parallel.yaml
train-qwen3-8b-128k: NUM_PROCESSES = 8
train-qwen3-8b-grpo: ## Qwen3-8B, online RL (GRPO) on DeepMath-103K, exact boxed answers rewarded, 8 GPUs
train-qwen3-8b-grpo: RECIPE = recipes/qwen/qwen3-8b-grpo-math.yaml
train-qwen3-8b-grpo: WRAP = Qwen3DecoderLayer
train-qwen3-8b-grpo: CONFIG = accelerate_configs/single_node.yaml
train-qwen3-8b-grpo: NUM_PROCESSES = 8
train-qwen3-8b-grpo-tools: ## Qwen3-8B, online RL over episodes that call a calculator, DeepMath-103K, 8 GPUs
train-qwen3-8b-grpo-tools: RECIPE = recipes/qwen/qwen3-8b-grpo-tools.yaml
train-qwen3-8b-grpo-tools: WRAP = Qwen3DecoderLayer
train-qwen3-8b-grpo-tools: CONFIG = accelerate_configs/single_node.yaml
train-qwen3-8b-grpo-tools: NUM_PROCESSES = 8
train-qwen3-8b-grpo-lora: ## Qwen3-8B LoRA, online RL (GRPO) on DeepMath-103K, 1 GPU, no FSDP
train-qwen3-8b-grpo-lora: RECIPE = recipes/qwen/qwen3-8b-grpo-math-lora.yaml
train-qwen3-8b-grpo-lora: WRAP = Qwen3DecoderLayer
train-qwen3-8b-grpo-lora: CONFIG = accelerate_configs/single_gpu.yaml
train-qwen3-8b-grpo-lora: NUM_PROCESSES = 1
train-qwen3-1.7b-distill: ## Qwen3-1.7B distilled from Qwen3-8B on math reasoning traces (forward KL), 8 GPUs
train-qwen3-1.7b-distill: RECIPE = recipes/qwen/qwen3-1.7b-distill.yaml
train-qwen3-1.7b-distill: WRAP = Qwen3DecoderLayer
train-qwen3-1.7b-distill: CONFIG = accelerate_configs/single_node.yaml
train-qwen3-1.7b-distill: NUM_PROCESSES = 8
train-qwen3-1.7b-distill-on-policy: ## Qwen3-1.7B distilled from Qwen3-8B on its own math solutions (reverse KL), 8 GPUs
train-qwen3-1.7b-distill-on-policy: RECIPE = recipes/qwen/qwen3-1.7b-distill-on-policy.yaml
train-qwen3-1.7b-distill-on-policy: WRAP = Qwen3DecoderLayer
train-qwen3-1.7b-distill-on-policy: CONFIG = accelerate_configs/single_node.yaml
train-qwen3-1.7b-distill-on-policy: NUM_PROCESSES = 8
train-qwen3-30b-a3b: ## Qwen3-30B-A3B (MoE, 128 experts, 8 per token), full, UltraChat, 8 GPUs, single-node preset
train-qwen3-30b-a3b: RECIPE = recipes/qwen/qwen3-30b-a3b.yaml
train-qwen3-30b-a3b: WRAP = Qwen3MoeDecoderLayer
train-qwen3-30b-a3b: CONFIG = accelerate_configs/single_node.yaml
train-qwen3-30b-a3b: NUM_PROCESSES = 8
train-qwen3-30b-a3b-64k: ## Qwen3-30B-A3B, reasoning traces up to 65,536 tokens, 2 nodes x 8 GPUs, rows split per node
train-qwen3-30b-a3b-64k: RECIPE = recipes/qwen/qwen3-30b-a3b-reasoning-64k.yaml
train-qwen3-30b-a3b-64k: WRAP = Qwen3MoeDecoderLayer
train-qwen3-30b-a3b-64k: CONFIG = accelerate_configs/sequence_parallel_multi_node.yaml
train-qwen3-30b-a3b-64k: NUM_PROCESSES = 16
train-qwen3-30b-a3b-64k: NUM_MACHINES = 2
train-mistral-7b: ## Mistral-7B-Instruct-v0.3, UltraChat, 8 GPUs, single-node preset
train-mistral-7b: RECIPE = recipes/mistral/mistral-7b.yaml
train-mistral-7b: WRAP = MistralDecoderLayer
train-mistral-7b: CONFIG = accelerate_configs/single_node.yaml
train-mistral-7b: NUM_PROCESSES = 8
train-8b-lora: ## Llama-3.1-8B-Instruct LoRA, UltraChat, 1 GPU, no FSDP
train-8b-lora: RECIPE = recipes/llama/llama-3.1-8b-lora.yaml
train-8b-lora: CONFIG = accelerate_configs/single_gpu.yaml
train-8b-lora: NUM_PROCESSES = 1
train-qwen-7b-lora: ## Qwen2.5-7B-Instruct LoRA, UltraChat, 1 GPU, no FSDP
train-qwen-7b-lora: RECIPE = recipes/qwen/qwen2.5-7b-lora.yaml
train-qwen-7b-lora: WRAP = Qwen2DecoderLayer
train-qwen-7b-lora: CONFIG = accelerate_configs/single_gpu.yaml
train-qwen-7b-lora: NUM_PROCESSES = 1
train-8b-dpo: ## Llama-3.1-8B-Instruct DPO (full), UltraFeedback, 8 GPUs, single-node preset
train-8b-dpo: RECIPE = recipes/llama/llama-3.1-8b-dpo.yaml
train-8b-dpo: CONFIG = accelerate_configs/single_node.yaml
train-8b-dpo: NUM_PROCESSES = 8
train-qwen-7b-dpo: ## Qwen2.5-7B-Instruct DPO with LoRA, UltraFeedback, 1 GPU, no FSDP
train-qwen-7b-dpo: RECIPE = recipes/qwen/qwen2.5-7b-dpo-lora.yaml
train-qwen-7b-dpo: WRAP = Qwen2DecoderLayer
train-qwen-7b-dpo: CONFIG = accelerate_configs/single_gpu.yaml
train-qwen-7b-dpo: NUM_PROCESSES = 1
train-qwen3-30b-a3b-lora: ## Qwen3-30B-A3B LoRA (attention and experts; routers left alone), UltraChat, 1 GPU, no FSDP
train-qwen3-30b-a3b-lora: RECIPE = recipes/qwen/qwen3-30b-a3b-lora.yaml
train-qwen3-30b-a3b-lora: WRAP = Qwen3MoeDecoderLayer
train-qwen3-30b-a3b-lora: CONFIG = accelerate_configs/single_gpu.yaml
train-qwen3-30b-a3b-lora: NUM_PROCESSES = 1
train-gpt-oss-20b-lora: ## gpt-oss-20b LoRA (attention; experts of layers 7, 15, 23), Multilingual-Thinking, 1 GPU, no FSDP
train-gpt-oss-20b-lora: RECIPE = recipes/gpt-oss/gpt-oss-20b-lora.yaml
train-gpt-oss-20b-lora: WRAP = GptOssDecoderLayer
train-gpt-oss-20b-lora: CONFIG = accelerate_configs/single_gpu.yaml
train-gpt-oss-20b-lora: NUM_PROCESSES = 1
train-mixtral-lora: ## Mixtral-8x7B-Instruct LoRA (attention and every expert), UltraChat, 2 GPUs, FSDP2
train-mixtral-lora: RECIPE = recipes/mistral/mixtral-8x7b-lora.yaml
train-mixtral-lora: WRAP = MixtralDecoderLayer
train-mixtral-lora: NUM_PROCESSES = 2
train-qwen-7b-tools: ## Qwen2.5-7B-Instruct LoRA, tool calling (Hermes function-calling data), 1 GPU, no FSDP
train-qwen-7b-tools: RECIPE = recipes/qwen/qwen2.5-7b-tools-lora.yaml
train-qwen-7b-tools: WRAP = Qwen2DecoderLayer
train-qwen-7b-tools: CONFIG = accelerate_configs/single_gpu.yaml
train-qwen-7b-tools: NUM_PROCESSES = 1
train-70b-qlora: ## Llama-3.1-70B-Instruct QLoRA (4-bit base), UltraChat, 2 x 48 GB GPUs, FSDP2
train-70b-qlora: RECIPE = recipes/llama/llama-3.1-70b-qlora.yaml
train-70b-qlora: NUM_PROCESSES = 2

LAUNCH_CHECK = --config $(CONFIG) --num-processes $(NUM_PROCESSES) --num-machines $(NUM_MACHINES) \
	--machine-rank $(MACHINE_RANK) $(if $(MAIN_PROCESS_IP),--main-process-ip $(MAIN_PROCESS_IP)) $(if $(WRAP),--wrap $(WRAP))
LAUNCH = --config_file $(CONFIG) --num_processes $(NUM_PROCESSES) --num_machines $(NUM_MACHINES) \
	--machine_rank $(MACHINE_RANK) $(if $(MAIN_PROCESS_IP),--main_process_ip $(MAIN_PROCESS_IP)) \
	--main_process_port $(MAIN_PROCESS_PORT) $(if $(WRAP),--fsdp_transformer_layer_cls_to_wrap $(WRAP)) \
	$(if $(MIXED_PRECISION),--mixed_precision $(MIXED_PRECISION))

# `finetune check` first: a launch that cannot work (sizes, rank-0 address, architecture, wrap
# class) stops here in seconds instead of hanging at the rendezvous on some machine.
train: ## train RECIPE=<yaml> [WRAP=<layer class>] with CONFIG on NUM_PROCESSES (the targets above, any recipe)
train $(TRAIN_TARGETS): $(STAMP)
	@test -n "$(RECIPE)" || { echo "make train needs RECIPE=recipes/<family>/<model>.yaml"; exit 2; }
	HF_HUB_OFFLINE=1 $(PY) -m finetune check $(RECIPE) $(ARGS) $(LAUNCH_CHECK)
	$(ACCELERATE) launch $(LAUNCH) -m finetune train $(RECIPE) $(ARGS)

# make check RECIPE=recipes/llama/llama-3.1-8b.yaml CONFIG=accelerate_configs/single_node.yaml NUM_PROCESSES=8
check: $(STAMP) ## validate RECIPE with CONFIG and the launch sizes, offline, without starting anything
	$(OFFLINE) $(PY) -m finetune check $(or $(RECIPE),$(DEMO_RECIPE)) $(ARGS) $(LAUNCH_CHECK)

# make export CKPT=outputs/demo/run/checkpoints/step_300 OUT=exported [DTYPE=bf16] [MAX_SHARD_SIZE=5GB]
export: $(STAMP) ## write checkpoint CKPT as a Hugging Face folder OUT (one process, no launcher)
	@test -n "$(CKPT)" -a -n "$(OUT)" || { echo "make export needs CKPT=<checkpoint or output dir> OUT=<folder>"; exit 2; }
	$(PY) -m finetune export $(CKPT) $(OUT) $(if $(DTYPE),--dtype $(DTYPE)) --max-shard-size $(or $(MAX_SHARD_SIZE),5GB)

# make plan RECIPE=recipes/demo/tiny_llama.yaml [CONFIG=...] [NUM_PROCESSES=8] [NUM_MACHINES=1] [GPU_MEMORY=80GB]
plan: $(STAMP) ## memory per device for RECIPE under CONFIG on NUM_PROCESSES devices, and a verdict
	$(OFFLINE) $(PY) -m finetune plan $(or $(RECIPE),$(DEMO_RECIPE)) $(ARGS) --config $(CONFIG) \
		--num-processes $(NUM_PROCESSES) --num-machines $(NUM_MACHINES) --gpu-memory $(or $(GPU_MEMORY),80GB)

# Ratios measured in one run, interleaved repetitions; results in bench/results/<date>-<commit>.{json,md,png}.
# ONLY=loss_path,loop_overhead (comma-separated) re-measures some comparisons; their files are named after them.
bench: $(STAMP) ## speed and memory vs hand-written FSDP2, Trainer, merge-weights, TRL, PEFT; LoRA; scaling (CPU, ~40 min)
	$(OFFLINE) $(PY) bench/run.py $(if $(REPEATS),--repeats $(REPEATS)) $(if $(ONLY),--only $(ONLY))

bench-gpu: $(STAMP) ## Llama-3.2-1B shape, bf16, seq 2048, all GPUs (one: no FSDP): tokens/s, MFU, peak memory
	$(OFFLINE) $(PY) bench/gpu.py $(if $(PROFILE),--profile $(PROFILE))

# Two pytest workers (TEST_WORKERS=1: one): a launch's ranks wait on each other and on imports, so a second test
# file beside it keeps 2 cores busy. A file runs whole on one worker (its module's runs are launched once; runs that
# several files read, once a session: tests/conftest.py's built_once); files in the order collected, not the most
# tests first, which left a long file alone at the end. The benchmark scripts' runs are test-bench's (CI runs both).
TEST_WORKERS ?= 2
test: lint ## lint, then the test suite (CPU only; multi-process tests use 2 processes over gloo)
	$(OFFLINE) $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations 15 -m "not bench"

test-bench: $(STAMP) ## the benchmark and GPU-check scripts end to end on tiny sizes (CPU, ~14 min; no timing asserted)
	$(OFFLINE) $(PY) -m pytest -m bench --durations 5 tests/test_bench.py

test-fast: lint ## the tests that start no distributed launch (seconds to minutes; a test that launches fails here)
	FINETUNE_FAST_TESTS=1 $(OFFLINE) $(PY) -m pytest -m "not multiprocess"

test-gpu: ## the CUDA tests, on a GPU machine (skipped with the reason elsewhere): make test-gpu PYTHON=python3 VENV=
	$(OFFLINE) $(PY) -m pytest -m cuda -rs

# The GPU machines have torch, accelerate, transformers and peft but no network: what finetune needs beyond
# them (the versions tested here) is downloaded here as Python 3.12 manylinux wheels into .whl/ (git ignores
# it), which travels with the tree; gpu-check installs them into a temporary path on PYTHONPATH.
gpu-wheels: $(STAMP) ## download the wheels a GPU machine lacks into .whl/ (run here, on a machine with pip access)
	$(PY) bench/gpu_check.py --download-wheels .whl

# On a GPU machine, in one command: make gpu-check VENV= PYTHON=python3 BUDGET=480 [OUT=folder] [STEPS=bench,...].
# Elsewhere the same steps run in their CPU form (a dry run). Everything lands in one folder of at most 8 files.
gpu-check: $(STAMP) ## the GPU check within BUDGET seconds: environment, test-gpu, the demo, bench-gpu, one profile
	$(OFFLINE) $(PY) bench/gpu_check.py --budget $(or $(BUDGET),480) --out $(or $(OUT),outputs/gpu-check) \
		$(if $(wildcard .whl/*.whl),--wheels .whl) $(if $(STEPS),--only $(STEPS))

lint: $(STAMP) ## ruff check and format check
	$(RUFF) check finetune tests bench
	$(RUFF) format --check finetune tests bench

format: $(STAMP) ## apply ruff fixes and formatting
	$(RUFF) check --fix finetune tests bench
	$(RUFF) format finetune tests bench

clean: ## remove outputs and the virtual environment
	rm -rf outputs $(VENV)
