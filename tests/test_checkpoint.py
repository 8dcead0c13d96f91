"""Checkpoints and HF export through the real CLI (torchrun, 2 CPU ranks, the HF engine).

Four runs share the work (each CLI launch costs ~30 s of imports on 2 cores), and the multi-node
test compares with the first:
  straight: 4 steps at dp=2, a checkpoint every 2 steps, the HF export at the end;
  stopped:  2 steps at dp=2 and stop; then resumed for 2 more on the same mesh, and that
            process is SIGKILLed inside its final save, after writing and before the rename;
  then the same out_dir resumed at tp=2: the killed save is ignored and step_2 loads.
The export is compared with the trainer's own logprobs in transformers and in vLLM.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoTokenizer

import config
import model_parallel
import rollout
import train_ppo
from _dist import _free_port
from conftest import (ROOT, close, cpu_env, kill_torchrun, plain_logprobs, read_metrics, run_cli,
                      torchrun_cmd, torchrun_workers)

pytestmark = pytest.mark.slow  # four CLI runs under torchrun, and a vLLM engine

# every run samples under dynamic sampling: a step may draw rounds of prompts, so the
# prompt stream's position after it depends on what it drew, and a resume must go on from there
ARGS = ("--config", "configs/test_tiny.toml", "--rollout_engine=hf", "--sft_steps=30",
        "--dynamic_sampling=true")
VOLATILE = ("tokens_per_s", "mem_used_gb")  # and every time_* key: wall clock and memory, not training
COMPARED = ("policy_loss", "value_loss", "kl", "grad_norm", "reward_mean")


def training_numbers(row):
    return {k: v for k, v in row.items() if k not in VOLATILE and not k.startswith("time_")}


def tokenizer_model_dir(root):
    """A tiny-llama checkpoint dir with tokenizer files beside it, as a hub download has: the
    export must carry them over. (The toy task itself uses its own byte tokenizer.)"""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    path = model_parallel.materialize_tiny_model("tiny-llama", str(root), seed=1)
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "3": 1, "+": 2, "4": 3, "=": 4}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()  # "3+4=" -> 3, +, 4, =
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    root = tmp_path_factory.mktemp("straight")
    model = tokenizer_model_dir(root)
    out = str(root / "out")
    run_cli(2, *ARGS, f"--model={model}", "--steps=4", "--save_every=2", f"--out_dir={out}")
    return out, model


@pytest.fixture(scope="module")
def resumed(straight, tmp_path_factory):
    """2 steps and stop; resume for 2 (killed in its last save); resume again at tp=2."""
    _, model = straight
    out = str(tmp_path_factory.mktemp("resumed") / "out")
    run_cli(2, *ARGS, f"--model={model}", "--steps=2", "--save_every=2", f"--out_dir={out}")
    after_stop = read_metrics(out)

    # resume on the same mesh; the save of step 4 pauses between writing and renaming (the CLI
    # through tests/_paused_save.py), and we SIGKILL torchrun and both ranks right there
    cmd = torchrun_cmd(2, "300", *ARGS, f"--model={model}", "--steps=4", "--save_every=2", "--resume=auto",
                       f"--out_dir={out}", script="tests/_paused_save.py")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=cpu_env())
    tmp_dir = os.path.join(out, "ckpt", "step_4.tmp")
    written = os.path.join(tmp_dir, "trainer_state_rank0.pt")  # the last file a rank writes
    deadline = time.time() + 400
    while not os.path.isfile(written) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    kill_torchrun(proc.pid)  # every file written, the rename not done
    log = proc.communicate()[0]
    assert os.path.isfile(written), f"the run never reached its step-4 save:\n{log[-3000:]}"
    assert os.path.isfile(os.path.join(tmp_dir, ".metadata"))  # complete content, yet not renamed
    killed_rows = read_metrics(out)  # rows are written before the step's checkpoint
    killed_listing = sorted(os.listdir(os.path.join(out, "ckpt")))

    stdout = run_cli(2, *ARGS, f"--model={model}", "--steps=4", "--save_every=2", "--resume=auto",
                     "--tp_size=2", f"--out_dir={out}").stdout
    return dict(out=out, after_stop=after_stop, killed_rows=killed_rows, killed_listing=killed_listing,
                log=log, stdout=stdout)


def test_resume_same_mesh_is_identical(straight, resumed):
    """Rows 3-4 after a stop at step 2 and a resume equal the straight run's, bit for bit."""
    full = read_metrics(straight[0])
    assert [r["step"] for r in resumed["after_stop"]] == [0, 1]
    assert "resumed from" in resumed["log"] and "step_2" in resumed["log"]
    rows = resumed["killed_rows"]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert any(r["reward_mean"] > 0 for r in full), "a run with no reward compares too little"
    for a, b in zip(full, rows):
        assert training_numbers(a) == training_numbers(b), a["step"]


def test_resume_draws_the_prompts_the_straight_run_drew(straight, resumed):
    """Prompts come as shuffled epochs over the task's 25 facts, each fact once an epoch: the
    warm-up draws the first 30 x 8 = 240, PPO rounds of 4 from there under dynamic sampling (a
    step draws rounds until 4 of its groups vary, at most 4 rounds: rollout_prompts). The
    checkpoint saves the position the steps' draws reached, and the resumed runs go on from it:
    each step keeps the groups the straight run kept, from the prompts of the stream at those
    positions (a sample's `drawn` index: its position among the step's draws)."""
    rows = read_metrics(straight[0])
    drawn = [r["rollout_prompts"] for r in rows]
    assert max(drawn[:2]) > 4, f"no step before the resume drew a second round: {drawn}"
    state = torch.load(os.path.join(resumed["out"], "ckpt", "step_2", "trainer_state_rank0.pt"),
                       weights_only=True)
    assert state["progress"] == {"step": 2, "prompts_drawn": 240 + drawn[0] + drawn[1]}
    stream = [prompt for prompt, _ in rollout.ToyTask(1).prompts(240, sum(drawn))]
    for out in (straight[0], resumed["out"]):
        kept = []
        for step in range(4):
            with open(os.path.join(out, "rollouts", f"step_{step}.jsonl")) as f:
                samples = [json.loads(line) for line in f]
            start = 240 + sum(drawn[:step])
            # 2 samples a prompt: sample `drawn` d answers the step's (d // 2)-th prompt drawn
            assert all(s["prompt"] == stream[start - 240 + s["drawn"] // 2] for s in samples), out
            kept.append([(s["drawn"], s["response"]) for s in samples])
        if out == straight[0]:
            want = kept
        assert kept == want, out  # the same groups, the same responses: on dp=2, then tp=2


def test_killed_save_is_ignored_and_resume_on_another_mesh_matches(straight, resumed):
    """The step-4 save was killed before its rename: resume=auto takes step_2 instead, on tp=2,
    and the run goes on to match the straight run (dp=2) to fp32 reduction noise."""
    assert resumed["killed_listing"] == ["step_2", "step_4.tmp"]
    assert f"resumed from {resumed['out']}/ckpt/step_2" in resumed["stdout"]
    full, rows = read_metrics(straight[0]), read_metrics(resumed["out"])
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for a, b in zip(full[2:], rows[2:]):
        for k in COMPARED:
            assert close(a[k], b[k]), (a["step"], k, a[k], b[k])
    # the new step-4 save replaced the killed one; keep_checkpoints=2 keeps both
    assert sorted(os.listdir(os.path.join(resumed["out"], "ckpt"))) == ["step_2", "step_4"]


def test_resume_under_ddp_matches_fsdp_and_its_checkpoint_loads_under_fsdp(straight, tmp_path):
    """straight's step_2 (FSDP2 shards) resumed with data_parallel=ddp (whole replicas, dp=2):
    steps 3-4 match the straight FSDP2 run to fp32 reduction noise, and so do the exported
    weights. Then DDP's own step_4 (plain tensors) loaded under FSDP2 exports the same weights."""
    from safetensors.torch import load_file
    full_out = straight[0]
    out = str(tmp_path / "out")
    os.makedirs(os.path.join(out, "ckpt"))
    shutil.copytree(os.path.join(full_out, "sft"), os.path.join(out, "sft"))  # the warm-up is reused
    shutil.copytree(os.path.join(full_out, "ckpt", "step_2"), os.path.join(out, "ckpt", "step_2"))
    run_cli(2, *ARGS, f"--model={straight[1]}", "--steps=4", "--save_every=2", "--resume=auto",
            "--data_parallel=ddp", f"--out_dir={out}")
    assert json.load(open(os.path.join(out, "config.json")))["data_parallel"] == "ddp"
    full, rows = read_metrics(full_out), read_metrics(out)
    assert [r["step"] for r in rows] == [2, 3]
    for a, b in zip(full[2:], rows):
        for k in COMPARED:
            assert close(a[k], b[k]), (a["step"], k, a[k], b[k])
    want, ddp = (load_file(os.path.join(d, "hf", "model.safetensors")) for d in (full_out, out))
    assert max((want[n] - ddp[n]).abs().max().item() for n in want) <= 1e-5
    # data_parallel=fsdp (the default), no step left to run
    run_cli(2, *ARGS, f"--model={straight[1]}", "--steps=4", "--resume=auto", f"--out_dir={out}")
    again = load_file(os.path.join(out, "hf", "model.safetensors"))
    assert all(torch.equal(again[n], ddp[n]) for n in ddp), \
        "DDP's checkpoint did not load exactly under FSDP2"


def test_keep_checkpoints_and_complete_only(straight, tmp_path):
    out, _ = straight
    assert sorted(os.listdir(os.path.join(out, "ckpt"))) == ["step_2", "step_4"]
    assert train_ppo.find_checkpoint("auto", out) == os.path.join(out, "ckpt", "step_4")
    assert train_ppo.find_checkpoint("auto", str(tmp_path)) is None  # nothing yet: a fresh run
    half = tmp_path / "ckpt" / "step_9"  # as if renamed without rank 0's files: not complete
    shutil.copytree(os.path.join(out, "ckpt", "step_4"), half)
    os.remove(half / "trainer_state_rank0.pt")
    assert train_ppo.find_checkpoint("auto", str(tmp_path)) is None


# Two torchrun agents on one host stand for two nodes of one process each: the c10d rendezvous,
# short timeouts (a lost node's keep-alive expires in ~2 s; a round waits 5 s for late nodes).
RDZV = ("--rdzv_backend=c10d", "--rdzv_id=elastic", "--rdzv_conf=join_timeout=120,"
        "last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=2")


def node(port, *args):
    """One torchrun agent, a node of one process, in the rendezvous at 127.0.0.1:port, as
    docs/nodes.md launches it: between 1 and 2 nodes, 2 restarts, the store fix in torchrun's
    environment."""
    cmd = [torchrun_cmd(1)[0], "--nnodes=1:2", "--nproc_per_node=1", "--max-restarts=2", *RDZV,
           f"--rdzv_endpoint=127.0.0.1:{port}", "train_ppo.py", *args]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=cpu_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"))


def wait_for(path, nodes, deadline):
    """Until `path` exists; fails if a node ends first or the deadline passes."""
    while not os.path.exists(path):
        ended = [n.args[-1] for n in nodes if n.poll() is not None]
        assert not ended and time.time() < deadline, f"{path} never came"
        time.sleep(0.05)


def test_a_run_outlives_a_lost_worker_then_a_lost_node(straight, tmp_path):
    """The straight run's config (4 steps, dp=2) on two nodes of one process, a checkpoint a step:
      1. after step_1's checkpoint the second node's worker is SIGKILLed. Both nodes restart in
         place (the first node's agent may count no restart: a change of nodes is not one) and go
         on from the newest checkpoint. Every step on two nodes equals the straight run's (one
         node of two processes), bit for bit.
      2. after step_3's checkpoint, saved after that restart, the second node is lost for good
         (its agent and worker SIGKILLed). The first goes on alone, at dp=1, from step_3: its step
         4 equals that of step_3 resumed on one process by hand, bit for bit, and the straight
         run's to the mesh tests' tolerance. The host node, which holds the rendezvous store, is
         the one that must stay (README)."""
    model = straight[1]
    out = str(tmp_path / "out")
    args = (*ARGS, f"--model={model}", "--steps=4", "--save_every=1", "--keep_checkpoints=4",
            "--collective_timeout_s=60", f"--out_dir={out}")
    port = _free_port()
    host = node(port, *args)  # binds the rendezvous endpoint first: the store's host
    time.sleep(1)
    other = node(port, *args)
    deadline = time.time() + 600
    try:
        wait_for(os.path.join(out, "ckpt", "step_1"), (host, other), deadline)
        os.kill(torchrun_workers(other.pid)[0], signal.SIGKILL)  # a worker lost
        wait_for(os.path.join(out, "ckpt", "step_3"), (host, other), deadline)
        kill_torchrun(other.pid)  # a node lost: its agent and its worker
        log = host.communicate(timeout=max(deadline - time.time(), 1))[0]
    finally:
        for agent in (host, other):
            kill_torchrun(agent.pid)
    errors = "\n".join(line for line in log.splitlines() if "Error" in line)  # not the tracebacks
    assert host.returncode == 0, errors[-6000:]
    assert log.count("torchrun restarted the workers: going on from") == 2, log[-6000:]
    assert "mesh dp=1 " in log and f"resumed from {out}/ckpt/step_3" in log, log[-6000:]
    rows, full = read_metrics(out), read_metrics(straight[0])
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for a, b in zip(full[:3], rows[:3]):  # two nodes, as one node: bit for bit
        assert training_numbers(a) == training_numbers(b), a["step"]
    # by hand: step_3 resumed on one process
    hand = str(tmp_path / "hand")
    shutil.copytree(os.path.join(out, "sft"), os.path.join(hand, "sft"))
    shutil.copytree(os.path.join(out, "ckpt", "step_3"), os.path.join(hand, "ckpt", "step_3"))
    run_cli(1, *ARGS, f"--model={model}", "--steps=4", "--resume=auto", "--export_hf=false",
            f"--out_dir={hand}")
    (by_hand,) = read_metrics(hand)
    assert training_numbers(rows[3]) == training_numbers(by_hand)
    for k in COMPARED:
        assert close(full[3][k], rows[3][k]), (k, full[3][k], rows[3][k])
    print("step 4 on dp=1 after the lost node, against the straight run (dp=2): "
          + ", ".join(f"{k} {rows[3][k] - full[3][k]:+.2e}" for k in COMPARED))


VLLM_SCRIPT = """
import json, os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
path, seqs = sys.argv[1], json.loads(sys.argv[2])
llm = LLM(model=path, dtype="float32", enforce_eager=True, kv_cache_memory_bytes=2**28,
          skip_tokenizer_init=True, max_model_len=64, seed=0)
outs = llm.generate([TokensPrompt(prompt_token_ids=s) for s in seqs],
                    SamplingParams(prompt_logprobs=0, max_tokens=1, detokenize=False), use_tqdm=False)
print("LOGPROBS " + json.dumps([[0.0] + [lp[t].logprob for t, lp in zip(s[1:], o.prompt_logprobs[1:])]
                                for s, o in zip(seqs, outs)]))
"""


def test_export_loads_in_transformers_and_vllm_with_the_trainers_logprobs(straight, monkeypatch):
    out, model = straight
    export = os.path.join(out, "hf")
    with open(os.path.join(out, "rollouts", "step_3.jsonl")) as f:
        seqs = [s["prompt_ids"] + s["response_ids"] for s in map(json.loads, f)]
    lens = [len(s) for s in seqs]
    ids = torch.tensor([s + [0] * (max(lens) - len(s)) for s in seqs])  # (b, S) right-padded

    # the trainer: a fresh policy (1 rank) with the final checkpoint's weights, its forward path
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        mesh = model_parallel.make_mesh(1, 1, 1, "cpu")
        policy = model_parallel.load_policy(os.path.join(out, "sft"), mesh, config.Config())
        opt = torch.optim.AdamW(policy.parameters())
        parts = {"policy": train_ppo.Part(policy, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0))}
        assert train_ppo.load_checkpoint(os.path.join(out, "ckpt", "step_4"), parts)["step"] == 4
        with torch.no_grad():
            trainer, _ = model_parallel.forward_policy(policy, ids, lens, mesh, config.Config())  # (b, S)
        # the same weights in 1 MB files, as a large model's 5 GB ones
        sharded = os.path.join(out, "hf-sharded")
        model_parallel.save_hf(policy, sharded, shard_gb=1 / 1024)
    finally:
        dist.destroy_process_group()
    assert os.path.isfile(os.path.join(sharded, "model.safetensors.index.json"))

    hf = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(input_ids=ids).logits  # (b, S, V)
    plain = plain_logprobs(logits, ids)  # (b, S), 0 at position 0 as the trainer's

    def vllm_logprobs(path):
        proc = subprocess.run([sys.executable, "-c", VLLM_SCRIPT, path, json.dumps(seqs)],
                              capture_output=True, text=True, timeout=300, env=cpu_env())
        line = [x for x in proc.stdout.splitlines() if x.startswith("LOGPROBS ")]
        assert proc.returncode == 0 and line, proc.stderr[-3000:]
        return json.loads(line[0][len("LOGPROBS "):])

    worst_hf = worst_vllm = 0.0
    for vllm in (vllm_logprobs(export), vllm_logprobs(sharded)):
        for b, n in enumerate(lens):
            assert trainer[b, n - 1] != 0  # the checkpointed policy was actually run
            worst_hf = max(worst_hf, (trainer[b, 1:n] - plain[b, 1:n]).abs().max().item())
            worst_vllm = max(worst_vllm, (trainer[b, :n] - torch.tensor(vllm[b])).abs().max().item())
    print(f"max |trainer - transformers| {worst_hf:.2e}, "
          f"max |trainer - vLLM| {worst_vllm:.2e} (both exports)")
    assert worst_hf <= 1e-4 and worst_vllm <= 1e-4, (worst_hf, worst_vllm)

    # the model dir's tokenizer files came along and load
    assert os.path.isfile(os.path.join(export, "tokenizer.json"))
    assert AutoTokenizer.from_pretrained(export)("3+4=")["input_ids"] == \
        AutoTokenizer.from_pretrained(model)("3+4=")["input_ids"] == [1, 2, 3, 4]
