"""Extensions: every capability beyond PPO's core, one file each. The core (train_ppo.py,
model_parallel.py, logprobs.py, rollout.py, config.py) is PPO as the README's tour walks it; each
file here adds one capability and nothing else:

    lora.py        LoRA adapters, the frozen base as the reference, refit of the adapters alone
    distill.py     on-policy distillation from a frozen teacher
    offpolicy.py   the off-policy correction (importance weights, rejection) and engine_dtype
    dapo.py        DAPO's dynamic sampling and overlong shaping
    gspo.py        GSPO's sequence-level ratio
    evaluation.py  held-out accuracy during a run, and pass@k
    multiturn.py   episodes of several model turns with a tool's output between them
    optimizer_offload.py   the optimizer's state in host memory between updates
    tensorboard.py         metrics to TensorBoard as well as metrics.jsonl
    async_rollout.py       rollout ranks that only generate, ahead of the trainer by a bound

How an extension is joined to the core:
  - its options are declared at the top of its file, in `class Options` (fields as in
    config.Config: a type, a default, a doc in comments). config.py reads that class from the
    file's text, without importing the file, which imports torch and the core, and so does the
    extension's own refusals (`def check(cfg)`, run by config.validate): a bad option is refused
    before either loads. So does `def idle(cfg)`, if the file has one: when each of its options
    does nothing (or less than its name says), as (key, why) pairs, from which config.notes
    prints a line for each option the user gave. These definitions run alone, so they may use
    only dataclasses, Literal, ConfigError, os, json, builtins and what they import inside
    themselves (a test checks this);
  - the core calls it by name where its work happens, guarded by its switch, in the manner of
    torchtitan's parallelize_llama (`if cfg.teacher: ...distill.teacher_pass(...)`). No
    registry, no hooks: grep the module's name to find every place it acts;
  - an extension knows the core; no extension knows another.

Removing one: delete its file, and every statement of the core that names the module or reads one
of its options (a guarded block goes whole). tests/test_extensions.py does exactly that in copies
of the tree and checks the trainer still imports, prints --help and (with every extension gone)
trains a step.
"""
