"""A setting the user gave that does nothing in this run says so, in one line at start-up
(config.notes: the core's idle rules and each extension's); one that acts, or a default, says
nothing.

The table below is written by hand from what each option does in the code, not from the rules: for
each option a value, the other settings under which it does nothing, and settings under which it
acts. A rule added without its row fails the completeness test.
"""
import pytest

import config
import rollout
from extensions import evaluation, multiturn

DUMP = "--replay_rollouts=out/dump"  # (notes read the config alone: the dir need not exist)
GRPO = "--advantage_estimator=grpo"

# key, a non-default value, where it does nothing, where it acts
CASES = [
    ("critic_model", "out/critic", [GRPO], []),
    ("critic_lr", "0.0001", [GRPO], []),
    ("gamma", "0.9", [GRPO], []),
    ("lam", "0.9", ["--advantage_estimator=rloo"], []),
    ("value_clip", "0.3", [GRPO], []),
    ("whiten_advantages", "false", [GRPO], []),
    ("kl_estimator", "k3", ["--kl_coef=0"], []),
    ("grpo_norm_by_std", "false", ["--advantage_estimator=rloo"], [GRPO]),
    ("sft_batch_size", "16", ["--sft_steps=0"], ["--sft_steps=5"]),
    ("sft_lr", "0.01", ["--sft_steps=0"], ["--sft_steps=5"]),
    ("export_dtype", "fp32", ["--export_hf=false"], []),
    ("rollout_engine", "hf", [DUMP], []),
    ("rollout_tp_size", "2", [DUMP], []),
    ("refit_bucket_mb", "32", [DUMP], []),
    ("distill_form", "loss", [], ["--teacher=out/teacher"]),
    ("distill_estimator", "k3", [], ["--teacher=out/teacher"]),
    ("distill_coef", "0.5", [], ["--teacher=out/teacher"]),
    ("distill_task", "false", [], ["--teacher=out/teacher"]),
    ("distill_clamp", "5.0", [], ["--teacher=out/teacher"]),
    ("offpolicy_is_mode", "mask", [], ["--offpolicy_is=token"]),
    ("offpolicy_is_bound", "3.0", [], ["--offpolicy_is=sequence"]),
    ("offpolicy_is_lower", "0.3", ["--offpolicy_is=token"],
     ["--offpolicy_is=token", "--offpolicy_is_mode=mask"]),
    ("offpolicy_reject_bound", "0.01", [], ["--offpolicy_reject=token_k3"]),
    ("engine_dtype", "bf16", [DUMP], []),
    ("dynamic_sampling", "true", [DUMP], []),
    ("dynamic_max_rounds", "2", [], ["--dynamic_sampling=true"]),
    ("overlong_buffer", "2", [DUMP], []),
    ("overlong_penalty", "0.5", [], ["--overlong_buffer=2"]),
    ("eval_every", "3", [DUMP], []),
    ("val_pass_k", "2", ["--eval_every=2", DUMP], ["--eval_every=2"]),
    ("val_samples", "4", ["--eval_every=2"], ["--eval_every=2", "--val_pass_k=2"]),
    ("lora_alpha", "32.0", [], ["--lora_rank=8"]),
    ("lora_targets", "q_proj", [], ["--lora_rank=8"]),
    ("gspo_clip_ratio", "0.001", [], ["--policy_loss_mode=gspo"]),
    ("gspo_clip_ratio_high", "0.001", [], ["--policy_loss_mode=gspo"]),
    ("clip_ratio", "0.3", ["--policy_loss_mode=gspo"], []),
    ("clip_ratio_high", "0.3", ["--policy_loss_mode=gspo"], []),
    ("max_staleness", "1", [], ["--rollout_ranks=1"]),
]


def notes_about(key, args):
    return [line for line in config.notes(config.parse_args(args))
            if line.startswith(f"note: {key}=")]


@pytest.mark.parametrize("key, value, idle, acting", CASES, ids=[case[0] for case in CASES])
def test_a_given_setting_that_does_nothing_says_so(key, value, idle, acting):
    said = notes_about(key, [f"--{key}={value}", *idle])  # (the value as the note prints it)
    assert len(said) == 1 and said[0].startswith(f"note: {key}={value} "), said
    assert notes_about(key, [f"--{key}={value}", *acting]) == []  # where it acts: nothing
    assert notes_about(key, idle) == []  # its default, not given: nothing


def test_every_rule_has_its_row():
    """Every key a rule can name (the rules run on settings that leave as much idle as can be, and
    on their opposites) has a row above."""
    keys = {case[0] for case in CASES}
    probes = [[GRPO, "--kl_coef=0", "--export_hf=false", DUMP, "--policy_loss_mode=gspo"],
              ["--offpolicy_is=token", "--advantage_estimator=rloo"],
              ["--engine_dtype=bf16", "--old_logprobs=engine"]]
    rules = [config.idle, *(extension[3] for extension in config.OPTIONS.values())]
    named = {key for args in probes for rule in rules
             for key, _ in rule(config.parse_args(args))}
    assert named <= keys, named - keys


def test_written_out_default_counts_as_given_and_a_contradiction_is_explained(capsys, monkeypatch):
    """gamma=1.0 is gamma's default: written out, it was given. engine_dtype=bf16 with
    old_logprobs=engine: a note says why nothing can weigh the bf16 engine's mismatch. The notes
    print at config.load, on rank 0 alone."""
    monkeypatch.setenv("RANK", "0")
    config.load([GRPO, "--gamma=1.0", "--engine_dtype=bf16", "--old_logprobs=engine"], 1)
    assert capsys.readouterr().out.splitlines() == [
        "note: gamma=1.0 does nothing with advantage_estimator=grpo: no critic",
        "note: engine_dtype=bf16 with old_logprobs=engine: the bf16 engine's logprobs are pi_old, "
        "so its mismatch stays in the ratio, and no correction can weigh it (offpolicy_is needs "
        "old_logprobs=trainer)"]
    monkeypatch.setenv("RANK", "1")
    config.load([GRPO, "--gamma=1.0"], 1)
    assert capsys.readouterr().out == ""
    # under grpo the loss's KL is k3 whatever kl_estimator says: less than its name says
    assert notes_about("kl_estimator", [GRPO, "--kl_estimator=k3"]) == [
        "note: kl_estimator=k3 sets only the logged kl with advantage_estimator=grpo: the KL loss "
        "term is k3"]


def test_evaluation_on_a_task_without_held_out_prompts_says_so(capsys, monkeypatch):
    """What only the task tells: the toy task has no held-out prompts, so --eval_every=7
    --val_pass_k=4 would make no validation (the trainer calls task_notes once the task is
    built); a task with some says nothing."""
    monkeypatch.setattr(evaluation.dist, "get_rank", lambda: 0)
    cfg = config.parse_args(["--eval_every=7", "--val_pass_k=4"])
    task = rollout.ToyTask(cfg.seed)
    evaluation.task_notes(task, cfg)
    assert capsys.readouterr().out.splitlines() == [
        "note: eval_every=7 does nothing: the task has no held-out prompts (gsm8k takes "
        "val_prompts=FILE)",
        "note: val_pass_k=4 does nothing: the task has no held-out prompts (gsm8k takes "
        "val_prompts=FILE)"]
    task.val = [("1+1=", "2")]
    evaluation.task_notes(task, cfg)
    assert capsys.readouterr().out == ""


def test_max_turns_on_a_task_without_turns_says_so(capsys, monkeypatch):
    """A task without observe() (the toy sums) runs one turn an episode whatever max_turns says;
    the toy tool task takes turns, and says nothing."""
    monkeypatch.setattr(multiturn.dist, "get_rank", lambda: 0)
    cfg = config.parse_args(["--max_turns=3"])
    multiturn.task_notes(rollout.ToyTask(cfg.seed), cfg)
    assert capsys.readouterr().out.splitlines() == [
        "note: max_turns=3 does nothing: the task has no observe(), so an episode is one turn"]
    multiturn.task_notes(multiturn.ToyToolTask(cfg.seed), cfg)
    assert capsys.readouterr().out == ""
