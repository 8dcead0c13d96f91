"""Failures: bad input refused with one line before any heavy work, NaN/inf updates skipped,
SIGTERM (finish the step, save, exit 0), a dead rank (the others stop, no hang), and a
collective that would wait forever (it times out).

The bad-input checks call the functions the trainer calls, in-process (fast); one CLI run shows
the one line and the exit code. README's table of bad inputs lists the same cases."""
import ast
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

import config
import model_parallel
import rollout
import train_ppo
from _dist import _free_port
from conftest import ROOT, cpu_env, kill_torchrun, read_metrics, torchrun_cmd, torchrun_workers
from extensions import lora


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return model_parallel.materialize_tiny_model("tiny-llama", str(tmp_path_factory.mktemp("m")), seed=0)


def broken_copy(model_dir, tmp_path, name):
    path = tmp_path / name
    shutil.copytree(model_dir, path)
    return path


def gsm8k_cfg(tmp_path, lines, **kw):
    prompts = tmp_path / "train.jsonl"
    prompts.write_text("".join(line + "\n" for line in lines))
    return config.Config(task="gsm8k", prompts=str(prompts), out_dir=str(tmp_path), **kw)


def save_tokenizer(path, n_tokens):
    """A word-level tokenizer of n_tokens entries (tokenizers library, nothing downloaded)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"[UNK]": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, n_tokens)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="<eos>").save_pretrained(path)


# ---- bad inputs: (what is wrong) -> the one line that says it (README's table, in that order)

def test_model_dir_missing(tmp_path):
    with pytest.raises(model_parallel.CheckpointError, match="is not an HF checkpoint dir .no config.json."):
        model_parallel.check_hf_dir(str(tmp_path / "nowhere"), 1)


def test_model_config_unreadable(model_dir, tmp_path):
    path = broken_copy(model_dir, tmp_path, "bad_config")
    (path / "config.json").write_text("{not json")
    with pytest.raises(model_parallel.CheckpointError, match="config.json cannot be read"):
        model_parallel.check_hf_dir(str(path), 1)


def test_model_family_unsupported(model_dir, tmp_path):
    path = broken_copy(model_dir, tmp_path, "gpt2")
    (path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(model_parallel.CheckpointError, match="model_type 'gpt2' is not supported"):
        model_parallel.check_hf_dir(str(path), 1)


def test_model_weights_missing(model_dir, tmp_path):
    path = broken_copy(model_dir, tmp_path, "no_weights")
    os.remove(path / "model.safetensors")
    with pytest.raises(model_parallel.CheckpointError, match=r"has no \*.safetensors weights"):
        model_parallel.check_hf_dir(str(path), 1)


def test_model_weights_truncated(model_dir, tmp_path):
    path = broken_copy(model_dir, tmp_path, "truncated")
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[:len(data) // 2])  # an interrupted download
    with pytest.raises(model_parallel.CheckpointError, match="model.safetensors is corrupt"):
        model_parallel.check_hf_dir(str(path), 1)


def test_tp_does_not_divide_heads(model_dir):
    model_parallel.check_hf_dir(model_dir, 2)  # 4 heads, 2 KV heads: tp=2 is fine
    with pytest.raises(model_parallel.CheckpointError, match="tp_size=4 must divide num_key_value_heads=2"):
        model_parallel.check_hf_dir(model_dir, 4)


def test_prompts_file_missing(tmp_path):
    with pytest.raises(config.ConfigError, match="task=gsm8k needs prompts=FILE .* is not a file"):
        config.validate(config.parse_args(["--task=gsm8k", f"--prompts={tmp_path}/missing.jsonl",
                                           f"--out_dir={tmp_path}"]), 1)


def test_prompts_malformed_line_names_its_number(tmp_path):
    cfg = gsm8k_cfg(tmp_path, ['{"question": "1+1?", "answer": "#### 2"}', '{"question": "2+2?"'])
    with pytest.raises(rollout.TaskError, match=r"train.jsonl:2: not a JSON object"):
        rollout.read_gsm8k(cfg.prompts)


def test_prompt_answer_without_a_final_number(tmp_path):
    cfg = gsm8k_cfg(tmp_path, ['{"question": "1+1?", "answer": "two"}'])
    with pytest.raises(rollout.TaskError, match=r"train.jsonl:1: the answer has no final number"):
        rollout.read_gsm8k(cfg.prompts)


def test_prompt_empty(tmp_path):
    cfg = gsm8k_cfg(tmp_path, ['{"question": "  ", "answer": "#### 2"}'])
    with pytest.raises(rollout.TaskError, match=r"train.jsonl:1: empty question"):
        rollout.read_gsm8k(cfg.prompts)


def test_prompt_longer_than_the_context(model_dir, tmp_path):
    path = broken_copy(model_dir, tmp_path, "tok")
    save_tokenizer(path, 100)
    cfg = gsm8k_cfg(tmp_path, ['{"question": "' + " w5" * 300 + '", "answer": "#### 2"}'], max_model_len=64)
    with pytest.raises(rollout.TaskError, match="prompts line 1: prompt of .* exceeds max_model_len=64"):
        rollout.make_task(cfg, str(path), 262)


def test_tokenizer_larger_than_the_model_vocab(model_dir, tmp_path):
    path = broken_copy(model_dir, tmp_path, "tok")
    save_tokenizer(path, 300)
    cfg = gsm8k_cfg(tmp_path, ['{"question": "w2 w3", "answer": "#### 2"}'])
    with pytest.raises(rollout.TaskError, match="has 300 tokens but the model's vocab is 262"):
        rollout.make_task(cfg, str(path), 262)


def test_gsm8k_with_a_checkpoint_without_a_tokenizer(model_dir, tmp_path):
    """Found by the scale review (2026-11-26): --task=gsm8k --model=tiny-llama (a checkpoint with
    no tokenizer files) ended in a 32-line transformers traceback about slow tokenizers."""
    cfg = gsm8k_cfg(tmp_path, ['{"question": "1+1?", "answer": "#### 2"}'])
    with pytest.raises(rollout.TaskError, match="needs the checkpoint's own tokenizer, and .* has none"):
        rollout.make_task(cfg, model_dir, 262)


def test_out_dir_not_writable(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(config.ConfigError, match="out_dir=.* is not writable"):
        config.validate(config.parse_args([f"--out_dir={tmp_path}/file/sub"]), 1)


def test_resume_points_at_nothing_complete(tmp_path):
    half = tmp_path / "ckpt" / "step_7.tmp"  # a save that was killed before its rename
    half.mkdir(parents=True)
    (half / ".metadata").write_text("")
    (half / "trainer_state_rank0.pt").write_text("")
    # nothing there; the killed save; the root, not a step_N: refused before torch loads
    for path in (tmp_path / "ckpt" / "step_7", half, tmp_path / "ckpt"):
        with pytest.raises(config.ConfigError, match="resume=.* is not a complete checkpoint"):
            config.validate(config.parse_args([f"--out_dir={tmp_path}", f"--resume={path}"]), 1)
    assert train_ppo.find_checkpoint("auto", str(tmp_path)) is None  # auto: nothing yet, fresh start


def test_cli_bad_model_dir_one_line_exit_2(model_dir, tmp_path):
    path = broken_copy(model_dir, tmp_path, "truncated")
    (path / "model.safetensors").write_bytes(b"\0" * 16)
    env = cpu_env(WORLD_SIZE="1", MASTER_PORT=str(_free_port()))
    proc = subprocess.run([sys.executable, "train_ppo.py", f"--model={path}", "--rollout_engine=hf",
                           f"--out_dir={tmp_path / 'out'}"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("input error: ") and "model.safetensors is corrupt" in last, proc.stdout
    assert "Traceback" not in proc.stderr
    assert not os.path.exists(tmp_path / "out" / "metrics.jsonl")


def fake_checkpoint(path, lora_rank):
    """A step_N dir as DCP writes it, holding one policy tensor: a LoRA run's lora_A (rank, in),
    or a full run's weight."""
    import torch.distributed.checkpoint as dcp
    name = "model.layers.0.self_attn.q_proj." + ("lora_A" if lora_rank else "weight")
    shape = (lora_rank, 64) if lora_rank else (64, 64)
    dcp.save({"policy": {name: torch.zeros(shape)}}, checkpoint_id=str(path))
    (path / "trainer_state_rank0.pt").write_bytes(b"")
    return path


def test_resume_across_lora_and_full_training_names_both_settings(model_dir, tmp_path):
    """A LoRA checkpoint holds the adapters alone, a full one every weight: resumed with the other
    setting, dcp.load died on a missing key (three tracebacks). Refused before any model loads,
    naming both ranks; the rank is read from the checkpoint's metadata."""
    adapted = fake_checkpoint(tmp_path / "lora" / "step_4", 16)
    full = fake_checkpoint(tmp_path / "full" / "step_4", 0)
    assert (lora.saved_rank(str(adapted)), lora.saved_rank(str(full))) == (16, 0)
    env = cpu_env(WORLD_SIZE="1", MASTER_PORT=str(_free_port()))
    proc = subprocess.run([sys.executable, "train_ppo.py", f"--model={model_dir}", "--rollout_engine=hf",
                           f"--resume={adapted}", f"--out_dir={tmp_path / 'out'}"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last == (f"input error: {adapted} was saved with lora_rank=16, this run has lora_rank=0: "
                    f"resume it with --lora_rank=16, or give a fresh out_dir"), proc.stdout
    assert "Traceback" not in proc.stderr


@pytest.mark.slow  # a torchrun launch
def test_a_make_recipe_checks_its_command_line_first_and_says_how_to_resume(tmp_path):
    """The Makefile's long recipes (make real-demo here, with a stand-in checkpoint dir): a bad
    command line is refused by config.py before torchrun starts (its one line, not followed by
    torchrun's report of children that exited 2); a run that dies under torchrun ends with the
    line that says how to go on from its checkpoints (the same make command: --resume=auto)."""
    smol = tmp_path / "smol"
    smol.mkdir()
    (smol / "config.json").write_text("{}")  # the prerequisite, present: nothing is built
    make = ["make", "--no-print-directory", "real-demo", f"SMOL={smol}", f"REAL_OUT={tmp_path / 'out'}"]
    bad = subprocess.run(make + ["LORA=1", "LORA_ARGS=--lora_rank=8 --lora_alpha=0"], cwd=ROOT,
                         env=cpu_env(), capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "torchrun" not in bad.stdout, bad.stdout
    # (make's own line: "make: ***", or "make[1]: ***" under `make test`)
    ours = [line for line in bad.stderr.splitlines() if not re.match(r"make(\[\d+\])?: ", line)]
    assert ours == [
        "config error: lora_alpha=0 scales the adapters by lora_alpha / lora_rank = 0: they would "
        "train nothing; use lora_alpha > 0 (often 2 * lora_rank = 16)"], bad.stderr
    # the config is good; the ranks then find no model (input error, exit 2): torchrun fails
    dead = subprocess.run(make + [f"REAL_LORA=--model={tmp_path / 'none'}"], cwd=ROOT, env=cpu_env(),
                          capture_output=True, text=True, timeout=300)
    assert dead.returncode != 0
    assert dead.stdout.strip().splitlines()[-1] == (
        # (make names the command line's variables in its own order)
        f"the run stopped before its end: `make real-demo REAL_LORA=--model={tmp_path / 'none'} "
        f"REAL_OUT={tmp_path / 'out'} SMOL={smol}` goes on from its newest checkpoint in "
        f"{tmp_path / 'out'}/ckpt (remove {tmp_path / 'out'} to start over)"), dead.stdout[-2000:]


# ---- NaN/inf: the update is skipped, counted, and the run goes on; too many in a row stop it

def write_rollouts(path, steps, nan_steps, prompts_per_step=4, samples_per_prompt=2):
    """Rollout dumps in the trainer's format; one reward is NaN at nan_steps (a broken reward
    function): the whole step's advantages and both losses become NaN (global whitening)."""
    tok = rollout.toy_tokenizer()
    for step in range(steps):
        samples = []
        pairs = rollout.ToyTask(1).prompts(step * prompts_per_step, prompts_per_step)
        for j in range(prompts_per_step * samples_per_prompt):
            prompt, answer = pairs[j // samples_per_prompt]
            response = tok.encode(answer if j % 3 else "9") + [256]  # some right, some wrong
            reward = float("nan") if step in nan_steps and j == 0 else float(j % 3 != 0)
            samples.append(dict(index=j, prompt=prompt, answer=answer, response=answer, reward=reward,
                                prompt_ids=tok.encode(prompt), response_ids=response,
                                engine_logprobs=[-1.0] * len(response), action_mask=[1] * len(response),
                                calls=0, ended="stop"))
        rollout._write_jsonl(os.path.join(path, f"step_{step}.jsonl"), samples)


@pytest.mark.slow  # a CLI run under torchrun
def test_nan_update_is_skipped_and_too_many_in_a_row_stop_the_run(tmp_path):
    write_rollouts(tmp_path / "rollouts", 6, nan_steps={1, 3, 4})
    # 2 ranks (dp 2): every rank skips together, and the skips are counted once, not once a rank
    cmd = torchrun_cmd(2, "--config", "configs/test_tiny.toml", "--sft_steps=0", "--steps=6",
                       "--max_skipped_steps=2", "--export_hf=false",
                       f"--replay_rollouts={tmp_path / 'rollouts'}", f"--out_dir={tmp_path / 'out'}")
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=cpu_env())
    assert proc.returncode != 0
    stop = "stopping: 2 steps in a row skipped updates (NaN/inf loss or grad norm)"
    assert stop in proc.stdout, proc.stdout
    rows = read_metrics(tmp_path / "out")
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]  # stopped after the 2nd bad step in a row
    # per step 2 epochs x 2 minibatches for each model: the policy skips all 4 (its advantages are
    # whitened over the whole batch, all NaN), the critic only the 2 of the minibatch with the
    # NaN return (sample 0); the other minibatch's critic updates are finite and applied
    assert [r["skipped_updates"] for r in rows] == [0, 6, 0, 6, 6]
    assert math.isnan(rows[1]["policy_loss"]) and math.isnan(rows[1]["grad_norm"])
    # had step 1's NaN gradients been applied, every weight would be NaN from then on
    for k in ("policy_loss", "value_loss", "kl", "grad_norm", "critic_grad_norm"):
        assert math.isfinite(rows[2][k]), (k, rows[2])


# ---- signals and dead ranks (torchrun, 2 CPU ranks)

@pytest.fixture
def start_run():
    """Launch a 50-step run on 2 ranks; whatever is still running at teardown is killed."""
    procs = []

    def start(out_dir):
        cmd = torchrun_cmd(2, "--config", "configs/test_tiny.toml", "--rollout_engine=hf", "--sft_steps=0",
                           "--steps=50", f"--out_dir={out_dir}")
        procs.append(subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, env=cpu_env()))
        return procs[-1]
    yield start
    for proc in procs:
        kill_torchrun(proc.pid)


def workers_after_first_step(proc, out_dir):
    """Wait for the first metrics row; return the pids of torchrun's worker processes."""
    metrics, deadline = os.path.join(out_dir, "metrics.jsonl"), time.time() + 400
    while not (os.path.isfile(metrics) and os.path.getsize(metrics)) and time.time() < deadline:
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        time.sleep(0.1)
    workers = torchrun_workers(proc.pid)
    assert len(workers) == 2, workers
    return workers


@pytest.mark.slow  # a CLI run under torchrun
def test_sigterm_to_one_rank_finishes_the_step_saves_and_exits_0(start_run, tmp_path):
    out = tmp_path / "out"
    proc = start_run(out)
    os.kill(workers_after_first_step(proc, out)[1], signal.SIGTERM)  # one rank only
    log = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, log[-3000:]
    done = len(read_metrics(out))
    assert 1 <= done < 50
    assert f"stopped by a signal after step {done}: checkpoint saved" in log
    assert sorted(os.listdir(out / "ckpt")) == [f"step_{done}"]  # save_every=0: only the signal's
    assert train_ppo.find_checkpoint("auto", str(out)).endswith(f"step_{done}")


@pytest.mark.slow  # a CLI run under torchrun
def test_a_dead_rank_stops_the_others_without_hanging(start_run, tmp_path):
    out = tmp_path / "out"
    proc = start_run(out)
    os.kill(workers_after_first_step(proc, out)[1], signal.SIGKILL)
    t0 = time.time()
    log = proc.communicate(timeout=300)[0]
    elapsed = time.time() - t0
    print(f"torchrun exited {proc.returncode} {elapsed:.1f} s after a rank was killed")
    assert proc.returncode != 0 and elapsed < 60, log[-3000:]


CHILD = "import sys, time, torch.distributed as dist; print('up', flush=True); " \
        "dist.init_process_group('gloo'); time.sleep(60)"  # joins the group, never the collective


def test_a_collective_times_out_instead_of_hanging(monkeypatch):
    port = str(_free_port())
    env = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, WORLD_SIZE="2")
    child = subprocess.Popen([sys.executable, "-c", CHILD], env={**os.environ, **env, "RANK": "1"},
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "up"
        for key, value in dict(env, RANK="0").items():
            monkeypatch.setenv(key, value)
        # gloo, as the child (also on a GPU machine)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        model_parallel.init_distributed(timeout_s=3)
        t0 = time.time()
        with pytest.raises(RuntimeError, match="[Tt]imed out"):
            dist.all_reduce(torch.ones(1))
        elapsed = time.time() - t0
        assert elapsed < 20, elapsed
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        child.kill()
        child.wait()


def _refusal_patterns(path):
    """(line, regex) for each `raise ConfigError(...)` in a file: the message's literal text, with
    each formatted value free (`.+?`)."""
    found = []
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if not (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)
                and getattr(node.exc.func, "id", None) == "ConfigError"):
            continue
        message = node.exc.args[0]
        pieces = message.values if isinstance(message, ast.JoinedStr) else [message]
        found.append((node.lineno, "".join(re.escape(piece.value) if isinstance(piece, ast.Constant)
                                           else ".+?" for piece in pieces)))
    return found


def test_failures_md_lists_every_refusal_config_can_give():
    """Every `config error` config.py and the extensions' checks can print has a row in
    docs/failures.md whose example line it matches: a refusal added without its row fails here."""
    doc = open(os.path.join(ROOT, "docs", "failures.md"), encoding="utf-8").read()
    files = ["config.py"] + [os.path.join("extensions", name) for name in
                             sorted(os.listdir(os.path.join(ROOT, "extensions")))
                             if name.endswith(".py")]
    missing = [f"{path}:{line}" for path in files
               for line, pattern in _refusal_patterns(os.path.join(ROOT, path))
               if not re.search("`config error: " + pattern + "`", doc)]
    assert not missing, f"refusals with no row in docs/failures.md: {missing}"
