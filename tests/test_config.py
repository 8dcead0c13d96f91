"""config.py: parsing, precedence, and bad input refused with one line naming the key."""
import dataclasses
import os
import subprocess
import sys
import json
import time

import pytest

import config
from conftest import ROOT
from extensions import lora


def test_precedence_default_then_file_then_command_line(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('steps = 7\nlr = 3e-4\npacking = true\nmodel = "tiny-qwen2"\n')
    cfg = config.parse_args(["--config", str(f), "--steps=9"])
    assert (cfg.steps, cfg.lr, cfg.packing, cfg.model) == (9, 3e-4, True, "tiny-qwen2")
    assert cfg.kl_coef == config.Config().kl_coef  # untouched fields keep their default


def test_every_field_has_a_doc_and_sizes_say_per_rank_or_global():
    docs = config.field_docs()
    for name in config.Config.__dataclass_fields__:
        assert docs.get(name), f"{name} has no doc comment"
    for name in ("micro_batch_size", "max_tokens_per_microbatch", "prompts_per_step", "sft_batch_size"):
        assert "per rank" in docs[name] or "global" in docs[name], name


@pytest.mark.parametrize("argv, world, key", [
    (["--stepz=3"], 1, "stepz"),                           # unknown key
    (["--steps=three"], 1, "steps"),                       # wrong type
    (["--packing=maybe"], 1, "packing"),                   # wrong type (bool)
    (["--tp_size=2"], 3, "tp_size"),                       # world not divisible by tp*cp
    (["--num_minibatches=5"], 1, "num_minibatches"),       # 64 sequences do not split in 5
    (["--micro_batch_size=5"], 2, "micro_batch_size"),     # 32 per rank do not split in 5
    (["--prompts_per_step=3", "--samples_per_prompt=1"], 2, "dp=2"),  # 3 over 2 ranks
    (["--kl_estimator=k2"], 1, "kl_estimator"),
    (["--lam=1.5"], 1, "lam"),
    (["--sequence_parallel=true"], 1, "sequence_parallel"),
    (["--rollout_tp_size=2"], 3, "rollout_tp_size"),
    # issue 53: a correction of pi_old / pi_engine, with pi_old the engine's, weighs nothing
    (["--old_logprobs=engine", "--offpolicy_is=token"], 1, "old_logprobs=trainer"),
    (["--old_logprobs=engine", "--offpolicy_reject=token_k3", "--offpolicy_reject_bound=0.1"], 1,
     "old_logprobs=engine makes 1"),
    # issue 53: the key of an earlier version names its replacement
    (["--tis_cap=2"], 1, "tis_cap .in the command line. was replaced: use offpolicy_is=token"),
    (["--offpolicy_reject=seq_mean_k3"], 1, "needs offpolicy_reject_bound > 0"),
    (["--offpolicy_reject=token_k1", "--offpolicy_reject_bound=0.5"], 1, "needs offpolicy_reject_bound > 1"),
    (["--offpolicy_is=token", "--offpolicy_is_mode=mask", "--offpolicy_is_lower=3"], 1,
     "offpolicy_is_lower=3 must be below offpolicy_is_bound=2"),
    (["--offpolicy_is=sentence"], 1, "offpolicy_is"),
    (["--dynamic_sampling=true", "--samples_per_prompt=1"], 1, "use samples_per_prompt >= 2"),
    (["--overlong_buffer=8"], 1, "overlong_buffer=8 is longer than max_new_tokens=6"),
    (["--val_pass_k=4", "--val_samples=2"], 1, "val_pass_k=4 needs at least as many val_samples"),
    (["--val_pass_k=4"], 1, "eval_every=0 makes none"),
    (["--old_logprobs=policy"], 1, "old_logprobs"),
    (["--data_parallel=ddp", "--tp_size=2"], 2, "data_parallel=ddp"),  # DDP replicas are plain tensors
    (["--data_parallel=ddp", "--dtype=bf16"], 2, "data_parallel=ddp"),  # bf16 is FSDP2's mixed precision
    (["--data_parallel=ddp", "--cpu_offload=true"], 2, "data_parallel=ddp"),  # offload is FSDP2's
    (["--data_parallel=zero3"], 1, "data_parallel"),
    # one sample per prompt: its group's std is 0, the advantages NaN
    (["--advantage_estimator=grpo", "--samples_per_prompt=1"], 1, "samples_per_prompt >= 2"),
    (["--clip_ratio_c=0.5"], 1, "clip_ratio_c"),            # a dual clip below 1 would cap every ratio
    (["--attention=masked", "--packing=true", "--max_tokens_per_microbatch=8192"], 1, "attention=varlen"),
    # issue 28: unpacked rows are max_model_len long at most, micro_batch_size of them at a time:
    # refused at start, not at the first long rollout (one 8192-token row; 16 rows of 2048)
    (["--attention=masked", "--max_model_len=8192", "--micro_batch_size=1",
      "--prompts_per_step=1", "--samples_per_prompt=1"], 1, "attention=varlen"),
    (["--attention=masked", "--max_model_len=2048", "--micro_batch_size=16"], 1, "attention=varlen"),
    # issue 28: cpu_offload keeps AdamW's state on the host; moving it to the GPU crashed the update
    (["--offload_optimizer=true", "--cpu_offload=true"], 1, "offload_optimizer"),
    # issue 29
    (["--advantage_estimator=rloo", "--samples_per_prompt=1"], 1, "samples_per_prompt >= 2"),
    (["--loss_agg_mode=seq-mean"], 1, "loss_agg_mode"),
    (["--clip_ratio_high=-0.1"], 1, "clip_ratio_high"),
    # issue 34: a packed row shorter than the longest sequence crashed at the first long response
    (["--packing=true", "--max_tokens_per_microbatch=512", "--max_model_len=2048"], 8,
     "max_tokens_per_microbatch=512 cannot hold a sequence of max_model_len=2048"),
    # issue 44: an adapter target no supported family has (OpenRLHF #1349: names that matched
    # nothing in the engine), and a negative rank
    (["--lora_rank=8", "--lora_targets=q_proj,qkv_proj"], 1, "lora_targets='q_proj,qkv_proj'"),
    (["--lora_rank=-1"], 1, "lora_rank"),
    # issue 50: a scale of 0 trained nothing; a rank above vLLM's largest died in min() of nothing
    (["--lora_rank=8", "--lora_alpha=0"], 1, "lora_alpha=0 scales the adapters by"),
    (["--lora_rank=4096", "--rollout_engine=vllm"], 1, "lora_rank=4096 is above the largest"),
    # 2*cp*tp = 8 leaves 512 // 8 * 8 = 512 of 519: not 513 tokens
    (["--packing=true", "--max_tokens_per_microbatch=519", "--max_model_len=513", "--tp_size=2",
      "--cp_size=2"], 4, "raise it to 520"),
])
def test_bad_config_names_the_key(argv, world, key, tmp_path):
    with pytest.raises(config.ConfigError, match=key):
        config.validate(config.parse_args(argv + [f"--out_dir={tmp_path}"]), world)


@pytest.mark.parametrize("argv, key", [
    (["--micro_batch_size=5"], "micro_batch_size"),
    (["--advantage_estimator=grpo", "--samples_per_prompt=1"], "samples_per_prompt"),
])
def test_cli_bad_config_exits_nonzero_fast_with_one_line(argv, key, tmp_path):
    t0 = time.time()
    proc = subprocess.run([sys.executable, "train_ppo.py", *argv, f"--out_dir={tmp_path}"], cwd=ROOT,
                          env={**os.environ, "WORLD_SIZE": "2"}, capture_output=True, text=True, timeout=60)
    elapsed = time.time() - t0
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and key in lines[0], proc.stderr
    assert elapsed < 10, f"took {elapsed:.1f}s"
    assert not os.path.exists(tmp_path / "metrics.jsonl")


def test_tensorboard_without_its_package_is_refused_naming_it(monkeypatch, tmp_path):
    find_spec = config.importlib.util.find_spec
    monkeypatch.setattr(config.importlib.util, "find_spec",
                        lambda name: None if name == "tensorboard" else find_spec(name))
    message = r"tensorboard=true needs the tensorboard package: pip install tensorboard"
    with pytest.raises(config.ConfigError, match=message):
        config.validate(config.parse_args(["--tensorboard=true", f"--out_dir={tmp_path}"]), 1)
    # off: nothing needed
    config.validate(config.parse_args(["--tensorboard=false", f"--out_dir={tmp_path}"]), 1)


def test_every_config_comment_says_what_its_values_give():
    """A config file's "N prompts x K samples = M sequences" comment must match its values."""
    import glob
    import re
    import tomllib
    checked = 0
    for path in glob.glob(os.path.join(ROOT, "configs", "*.toml")):
        text = open(path).read()
        values = tomllib.loads(text)
        for n, k, total in re.findall(r"(\d+) prompts x (\d+) samples = (\d+)", text):
            assert (int(n), int(k)) == (values["prompts_per_step"], values["samples_per_prompt"]), path
            assert int(n) * int(k) == int(total), path
            checked += 1
    assert checked >= 3  # the demo and both GSM8K recipes say it


def _help_text():
    return subprocess.run([sys.executable, "train_ppo.py", "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60).stdout


def test_cli_help_lists_every_field_with_a_doc_under_it():
    lines = _help_text().splitlines()
    for name in config.Config.__dataclass_fields__:
        at = [i for i, line in enumerate(lines) if line.startswith(f"  --{name}=")]
        assert len(at) == 1, name
        # the doc: the indented lines under the field, up to the next field
        doc = []
        for line in lines[at[0] + 1:]:
            if not line.startswith("      "):
                break
            doc.append(line.strip())
        assert " ".join(doc).strip(), f"--help shows no doc for {name}"


def _comment_lines_above(name):
    """The comment lines directly above a field in config.py, read here with plain string
    handling (not with config.field_docs)."""
    lines = open(os.path.join(ROOT, "config.py"), encoding="utf-8").read().splitlines()
    row = next(i for i, line in enumerate(lines) if line.startswith(f"    {name}: "))
    above = []
    while lines[row - 1].strip().startswith("# "):
        row -= 1
        above.insert(0, lines[row].strip()[2:])
    return above


@pytest.mark.parametrize("name", ["reshard_after_forward", "old_logprobs", "vllm_gpu_memory_utilization"])
def test_cli_help_prints_a_multi_line_doc_whole(name):
    above = _comment_lines_above(name)
    assert len(above) >= 3, f"{name}'s doc is no longer multi-line: pick another field"
    words = " ".join(" ".join(above).split())
    assert words in " ".join(_help_text().split()), f"--help cuts {name}'s doc"


def test_field_docs_on_a_hand_written_class():
    """Headings (banners) and group notes (a comment, then a blank line) are no field's doc."""

    @dataclasses.dataclass
    class Fake:
        # ---- first group ----
        a: int = 1  # a's trailing doc
        # b's doc, first line
        # b's doc, second line
        b: int = 2
        # ---- second group ----
        # a note on the second group

        # c's doc above
        c: str = "#"  # and after
        d: int = 4

    assert config.field_docs(Fake) == {"a": "a's trailing doc",
                                       "b": "b's doc, first line b's doc, second line",
                                       "c": "c's doc above and after",
                                       "d": ""}


def test_config_headings_are_not_field_docs():
    docs = config.field_docs()
    assert not any("----" in doc for doc in docs.values())
    # the fields right under a heading with a group note
    assert "worth improving" not in docs["sft_steps"]
    assert "verl" not in docs["advantage_estimator"]


def test_every_shipped_config_parses():
    """A config file with a renamed or mistyped key would fail only on a GPU node: catch it here."""
    import glob
    files = glob.glob(os.path.join(ROOT, "configs", "*.toml"))
    assert len(files) >= 4
    for path in files:
        config.parse_args(["--config", path])


def test_vllm_max_lora_rank_is_vllms():
    """config refuses a rank vLLM cannot serve with its own largest, without importing vLLM."""
    import typing
    from vllm.config.lora import MaxLoRARanks
    assert lora.Options.VLLM_MAX_RANK == max(typing.get_args(MaxLoRARanks))


@pytest.mark.parametrize("argv, refused", [
    (["--dtype=fp32"], True),
    (["--data_parallel=ddp"], True),  # auto: fp32 under ddp
    ([], False),  # auto: bf16 under fsdp
    (["--dtype=fp32", "--rollout_engine=hf"], False),  # the HF engine merges: any dtype
])
def test_lora_with_vllm_in_fp32_on_cuda_is_refused(argv, refused):
    """vLLM's GPU LoRA kernels take fp16/bf16 adapters only (its CPU kernels take fp32): a LoRA run
    with the vLLM engine on CUDA in fp32 is refused when the device resolves "auto"."""
    cfg = config.parse_args(["--lora_rank=8", "--rollout_engine=vllm", *argv])
    config.resolve_auto(cfg, "cuda", None)
    if refused:  # (lora.py's check once the device is known: train_ppo.start_run)
        with pytest.raises(config.ConfigError, match="needs dtype=bf16"):
            lora.check_device(cfg, "cuda")
    else:
        lora.check_device(cfg, "cuda")
    cpu = config.parse_args(["--lora_rank=8", *argv])
    config.resolve_auto(cpu, "cpu", None)
    lora.check_device(cpu, "cpu")  # CPU: any dtype


def test_a_resumed_run_that_had_tis_cap_is_refused_naming_the_new_keys(tmp_path):
    """issue 53: tis_cap left the config. A run that trained with it, resumed with the same command
    line less that key, would silently train without its correction: its saved config.json
    names it, and the resume is refused, naming the keys that replace it."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.json").write_text(json.dumps({"tis_cap": 2.0, "steps": 5}))
    with pytest.raises(config.ConfigError,
                       match=r"tis_cap=2, which was replaced: resume with offpolicy_is=token "
                             r"offpolicy_is_bound=2"):
        config.validate(config.parse_args([f"--out_dir={out}", "--resume=auto"]), 1)
    # with the correction named it goes on; a fresh run in that dir is not a resume
    config.validate(config.parse_args([f"--out_dir={out}", "--resume=auto",
                                       "--offpolicy_is=token"]), 1)
    config.validate(config.parse_args([f"--out_dir={out}"]), 1)
    # resume=OUT/ckpt/step_N into another out_dir: the config.json read is the checkpoint's run's
    step = out / "ckpt" / "step_4"
    step.mkdir(parents=True)
    (step / ".metadata").write_text("")
    (step / "trainer_state_rank0.pt").write_text("")
    with pytest.raises(config.ConfigError, match=r"run/config.json ran with tis_cap=2"):
        config.validate(config.parse_args([f"--out_dir={tmp_path / 'next'}", f"--resume={step}"]), 1)

