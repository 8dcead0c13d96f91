"""Our PPO step against Hugging Face TRL's PPOTrainer (trl 1.12.0, the last release with it, in
trl.experimental.ppo): the same work on CPU, at 1 and 2 processes, timed phase by phase.

    .venv/bin/python bench/peer_trl.py              # 135M model, 4 steps x 6 runs (~22 min on a
                                                    # quiet 2-core machine)
    .venv/bin/python bench/peer_trl.py --size tiny  # 2-layer model, 1 step x 6 runs: does
                                                    # everything run (~2 min)
    .venv/bin/python bench/peer_trl.py --steps 5 --runs trl_1p,ours_1p   # a subset of the runs
    .venv/bin/python bench/peer_trl.py --smoke      # ours_1p only, tiny, 2 steps, no TRL venv
                                                    # (seconds)

TRL runs from its own venv, bench/.venv-trl (git-ignored), made on first use (~1 minute) from
bench/peer_trl_requirements.txt.

Same inputs: one fp32 checkpoint of SmolLM-135M's shape (random weights from a fixed seed cost what
trained ones do), one pool of prompts (16 per step of 65 token ids), responses of exactly 64 tokens
(nothing can end one early); temperature 1, kl_coef 0.05, lr 1e-5, 1 PPO epoch, 2 minibatches of 8,
no activation checkpointing. The runs, each in fresh processes, compared ones back to back:
  *_1p   one process, 2 threads; ours with the HF engine
  *_2p   torchrun, 2 ranks of 1 thread; TRL with accelerate's DDP over gloo, ours with vLLM
  *_elp  ours with old_logprobs=engine
Both keep whole replicas (ours: data_parallel=ddp; --layout fsdp: FSDP2). The medians leave out
each run's first step (warm-up). Phases are rank 0's, under our trainer's metric names (TRL logs
none: run_trl marks them from outside).

Same work, and where it is not:
  - Three 135M no-grad forwards over 16 x 129 tokens on each side. TRL: reference, value and a
    reward model (the backbone + a random score head), the old logprobs from generate's scores.
    Ours: old policy (+ entropy), reference, critic, and a rule reward. Ours runs the LM head from
    the last prompt position on, TRL everywhere: ~1% more FLOPs for ours there, ~6% fewer in the
    update. This is speedup_1p and speedup_2p.
  - *_elp takes the old logprobs from the engine, as TRL does: two forwards to TRL's three (the
    missing one is TRL's reward model). The step a rule-reward user gets, not the same work.
  - Ours pays a refit every step. TRL's no-grad forwards take the whole local batch, ours the
    per-rank minibatch; the update runs 8 rows per forward on both (4 per rank at 2 processes).
    TRL steps policy and value in one backward and AdamW, ours in two (same FLOPs), both with the
    fused AdamW; ours clips the grad norm. GAE, whitening and the clipped losses are the same math.
Each run's line gives its CPU pressure (/proc/pressure/cpu): high on a shared machine = inflated.

Last line: RESULT trl_1p_step_s=... trl_2p_step_s=... ours_1p_step_s=... ours_2p_step_s=...
ours_1p_elp_step_s=... ours_2p_elp_step_s=... speedup_1p=... speedup_2p=... speedup_1p_elp=...
speedup_2p_elp=... (median seconds per step; speedup = TRL's over ours at the same process count;
a run that failed or was not asked for is left out). Figures: docs/performance.md.
"""
import argparse
import hashlib
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEER_VENV = os.path.join(ROOT, "bench", ".venv-trl")
PEER_REQUIREMENTS = os.path.join(ROOT, "bench", "peer_trl_requirements.txt")
MODEL_135M = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                  num_key_value_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True,
                  max_position_embeddings=2048)
SIZES = {"135m": dict(model=MODEL_135M, prompt_len=65, response_len=64, steps=4),
         "tiny": dict(model=dict(MODEL_135M, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                 num_attention_heads=2, num_key_value_heads=1, vocab_size=1024,
                                 max_position_embeddings=512), prompt_len=16, response_len=8, steps=1)}
BATCH, MINIBATCHES, SEED, LR, KL_COEF = 16, 2, 1, 1e-5, 0.05
RUNS = ("trl_1p", "ours_1p", "ours_1p_elp", "trl_2p", "ours_2p", "ours_2p_elp")  # the order they run in
# the phases, as our trainer's metrics.jsonl names them; TRL's run writes its own under the same
# names
PHASES = dict(time_step_s="step", time_rollout_s="generation", time_logprobs_s="no-grad",
              time_update_s="update")
QUIET = dict(HF_HUB_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1", TRL_EXPERIMENTAL_SILENCE="1",
             TOKENIZERS_PARALLELISM="false", PYTHONWARNINGS="ignore")


def peer_python():
    """bench/.venv-trl/bin/python, (re)installed when the requirements file changed since."""
    python, stamp = os.path.join(PEER_VENV, "bin", "python"), os.path.join(PEER_VENV, ".installed")
    with open(PEER_REQUIREMENTS, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    if not (os.path.isfile(stamp) and open(stamp).read() == digest):
        print(f"installing {PEER_REQUIREMENTS} into {PEER_VENV} (about 1 minute, once)", flush=True)
        subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", PEER_VENV],
                       check=True)
        subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "-r", PEER_REQUIREMENTS],
                       check=True)
        with open(stamp, "w") as f:
            f.write(digest)
    return python


def write_checkpoint(path, fields):
    """Random weights from SEED as an HF checkpoint dir (written aside, then renamed: a dir with
    config.json is complete). No bos/eos/pad id, so nothing can end a response early."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        import torch
        from transformers import AutoModelForCausalLM, LlamaConfig
        torch.manual_seed(SEED)
        model = AutoModelForCausalLM.from_config(
            LlamaConfig(**fields, bos_token_id=None, eos_token_id=None, pad_token_id=None),
            dtype=torch.float32)
        model.generation_config.bos_token_id = model.generation_config.eos_token_id = None
        model.save_pretrained(path + ".tmp")
        os.replace(path + ".tmp", path)
    return path


# ---- Ours (the project's venv)
class FixedPromptsTask:
    """A rollout.Task over the shared pool (token ids as text; step s reads its s-th block), with no
    EOS (every response is max_new_tokens long) and a rule reward as cheap as the toy task's."""
    eos_id, pad_id, val = None, 0, []

    def __init__(self, pool):
        self.pool = pool

    def prompts(self, start, n):
        return [(self.decode(p), "") for p in self.pool[start:start + n]]

    def encode(self, text):
        return [int(t) for t in text.split()]

    def decode(self, ids):
        return " ".join(map(str, ids))

    def target(self, answer):
        return []

    def reward(self, text, answer, finished):  # the fraction of even token ids
        ids = self.encode(text)
        return sum(t % 2 == 0 for t in ids) / max(len(ids), 1)


def run_ours(spec):
    sys.path.insert(0, ROOT)
    import config
    import train_ppo
    world = int(os.environ.get("WORLD_SIZE", "1"))
    overrides = dict(out_dir=spec["out_dir"], seed=SEED, steps=spec["steps"], plot_every=0, save_every=0,
                     export_hf=False, model=spec["model_dir"], rollout_engine=spec["engine"],
                     prompts_per_step=BATCH, samples_per_prompt=1, max_new_tokens=spec["response_len"],
                     temperature=1.0, ppo_epochs=1, num_minibatches=MINIBATCHES,
                     micro_batch_size=BATCH // MINIBATCHES // world,  # the most allowed
                     dtype="fp32", lr=LR, critic_lr=LR, kl_coef=KL_COEF,
                     max_model_len=256, vllm_kv_cache_gb=1,
                     data_parallel=spec["layout"], reshard_after_forward=False,  # (fsdp only)
                     old_logprobs=spec["old_logprobs"])
    cfg = config.load([f"--{k}={v}" for k, v in overrides.items()], world_size=world)
    with open(spec["prompts"]) as f:
        task = FixedPromptsTask(json.load(f))
    train_ppo.main(cfg, task=task)  # its out_dir/metrics.jsonl has the phases


# ---- TRL (the peer's venv; nothing of the project is imported here)
def run_trl(spec):
    import torch
    from datasets import Dataset
    from tokenizers import Tokenizer, models
    from transformers import (AutoModelForCausalLM, AutoModelForSequenceClassification,
                              PreTrainedTokenizerFast, TrainerCallback)
    from transformers.utils import logging as hf_logging
    import trl.experimental.ppo.ppo_trainer as ppo_trainer
    from trl.experimental.ppo import PPOConfig, PPOTrainer
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    world, model_dir, vocab = int(os.environ.get("WORLD_SIZE", "1")), spec["model_dir"], spec["vocab"]
    # word-level over the model's ids; pad and eos ids V and V+1 lie outside the model's vocabulary,
    # so no sampled token is taken for padding or an end (TRL maps pad to id 0 before any embedding
    # lookup)
    word_ids = {**{f"t{i}": i for i in range(vocab)}, "<pad>": vocab, "<eos>": vocab + 1}
    words = Tokenizer(models.WordLevel(word_ids, unk_token="<eos>"))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>", eos_token="<eos>",
                                        unk_token="<eos>")
    torch.manual_seed(SEED)  # the score heads' random init, the same on every rank
    policy, ref = (AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32) for _ in range(2))
    value, reward = (
        AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1, dtype=torch.float32)
        for _ in range(2))
    args = PPOConfig(
        output_dir=spec["out_dir"], seed=SEED, use_cpu=True, bf16=False, fp16=False,
        gradient_checkpointing=False, per_device_train_batch_size=BATCH // world,
        gradient_accumulation_steps=1, num_mini_batches=MINIBATCHES, num_ppo_epochs=1,
        total_episodes=spec["steps"] * BATCH, response_length=spec["response_len"], temperature=1.0,
        stop_token=None, stop_token_id=None, missing_eos_penalty=None, num_sample_generations=0,
        kl_coef=KL_COEF, learning_rate=LR, report_to="none", save_strategy="no", disable_tqdm=True,
        logging_steps=1, dataloader_num_workers=0)

    # The phases, marked from outside (TRL's trainer looks these module functions up at each call,
    # so replacing them here needs no edit to TRL): generation = inside batch_generation; no-grad =
    # from its end to the first forward with grad (reference, value and reward forwards, GAE);
    # update = from there to the next gather_for_metrics; step = between on_step_end callbacks.
    steps, cur, clock = [], {}, time.perf_counter  # cur: the current step's marks
    batch_generation, forward = ppo_trainer.batch_generation, ppo_trainer.forward

    def timed_generation(model, queries, *a, **k):
        start = clock()
        out = batch_generation(model, queries, *a, **k)
        cur["gen_end"] = clock()
        cur["gen"] = cur.get("gen", 0.0) + cur["gen_end"] - start
        responses = out[0][:, queries.shape[1]:]  # (b, response_length); its non-pad count shows 64 tokens
        cur["response_len"] = float((responses != tokenizer.pad_token_id).sum(1).float().mean())
        return out

    def marked_forward(model, *a, **k):
        if torch.is_grad_enabled():  # the update's forward of policy + value: the no-grad phase is over
            cur.setdefault("update_start", clock())
        return forward(model, *a, **k)

    ppo_trainer.batch_generation, ppo_trainer.forward = timed_generation, marked_forward

    class StepClock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):  # the first step starts here
            cur["step_start"] = clock()

        def on_step_end(self, args, state, control, **kw):
            end = clock()
            steps.append(dict(time_step_s=end - cur["step_start"], time_rollout_s=cur.get("gen", 0.0),
                              time_logprobs_s=cur.get("update_start", end) - cur.get("gen_end", end),
                              time_update_s=cur.get("update_end", end) - cur.get("update_start", end),
                              response_len_mean=cur.get("response_len", 0.0)))
            cur.clear()
            cur["step_start"] = end

    with open(spec["prompts"]) as f:
        dataset = Dataset.from_dict({"input_ids": json.load(f)})
    trainer = PPOTrainer(args=args, processing_class=tokenizer, model=policy, ref_model=ref,
                         reward_model=reward, value_model=value, train_dataset=dataset,
                         callbacks=[StepClock()])
    gather_for_metrics = trainer.accelerator.gather_for_metrics

    def timed_gather(*a, **k):  # the first one after the PPO loop ends the update
        if "update_start" in cur:
            cur.setdefault("update_end", clock())
        return gather_for_metrics(*a, **k)

    trainer.accelerator.gather_for_metrics = timed_gather
    print(f"trl: rank {trainer.accelerator.process_index} of {world}, {torch.get_num_threads()} threads, "
          f"distributed={trainer.accelerator.distributed_type}", flush=True)
    trainer.train()
    if trainer.accelerator.is_main_process:  # rank 0's clock, as ours
        os.makedirs(spec["out_dir"], exist_ok=True)
        with open(os.path.join(spec["out_dir"], "metrics.jsonl"), "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in steps)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


# ---- The orchestrator
def cpu_stall_s():
    """Seconds that runnable tasks have waited for a CPU since boot (Linux PSI), 0 where there is
    none."""
    if not os.path.exists("/proc/pressure/cpu"):
        return 0.0
    with open("/proc/pressure/cpu") as f:  # "some avg10=... total=MICROSECONDS"
        return int(f.readline().split("total=")[1]) / 1e6


def launch(run, spec, python, timeout, log_path):
    """One of RUNS in fresh process(es), its output in log_path; returns the exit code."""
    with socket.socket() as s:  # a free port
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env, me = {**os.environ, **QUIET}, [os.path.abspath(__file__), "--worker", json.dumps(spec)]
    if "_2p" in run:  # torchrun sets OMP_NUM_THREADS=1 per rank
        cmd = [os.path.join(os.path.dirname(python), "torchrun"), "--nproc_per_node=2",
               f"--master_port={port}", *me]
    else:  # a plain process; ours initializes a world of one on this port
        cmd, env = [python, *me], dict(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    start, stall = time.time(), cpu_stall_s()
    with open(log_path, "w") as log:
        try:
            code = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                  timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    wall = time.time() - start
    print(f"{run}: {'ok' if code == 0 else f'FAILED ({code})'} in {wall:.0f}s "
          f"(load average {os.getloadavg()[0]:.1f}, "
          f"CPU pressure {100 * (cpu_stall_s() - stall) / wall:.0f}%; log: {log_path})", flush=True)
    return code


def medians(rows):
    """Each phase's median over the timed steps: all but the first (a warm-up), or the only one."""
    return {key: statistics.median(r[key] for r in rows[1:] or rows) for key in PHASES}


def report(results, steps):
    """Print each run's phases and ours / TRL per phase; return the RESULT line."""
    print(f"\nmedian seconds over steps 2..{steps} (step 1 warms up)" if steps > 1
          else "\nseconds of the one step")
    for run in (name for name in RUNS if name in results):
        rows, m = results[run], medians(results[run])
        # ours: how far the engine's logprobs are from the trainer's (0 with old_logprobs=engine)
        mismatch = f" | engine - trainer logprob {max(r['logprob_mismatch'] for r in rows):.1e}" \
            if "logprob_mismatch" in rows[0] else ""
        each = ", ".join(f"{r['time_step_s']:.1f}" for r in rows[1:] or rows)
        print(f"{run:12s} step {m['time_step_s']:.1f} (each: {each}) | "
              f"generation {m['time_rollout_s']:.1f} | "
              f"no-grad {m['time_logprobs_s']:.1f} | update {m['time_update_s']:.1f}"
              f" | response {statistics.mean(r['response_len_mean'] for r in rows):.1f} tokens{mismatch}")
    # the RESULT line's order
    order = ("trl_1p", "trl_2p", "ours_1p", "ours_2p", "ours_1p_elp", "ours_2p_elp")
    figures = {f"{run}_step_s": medians(results[run])["time_step_s"] for run in order if run in results}
    for n in ("1p", "2p", "1p_elp", "2p_elp"):  # ours (with or without engine logprobs) against TRL
        if f"trl_{n[:2]}" in results and f"ours_{n}" in results:
            t, o = medians(results[f"trl_{n[:2]}"]), medians(results[f"ours_{n}"])
            print(f"ours / TRL at {n}: " + ", ".join(f"{name} {o[key] / t[key]:.2f}x"
                                                     for key, name in PHASES.items()))
            figures[f"speedup_{n}"] = t["time_step_s"] / o["time_step_s"]
    return "RESULT " + " ".join(f"{k}={v:.3f}" if k.startswith("speedup") else f"{k}={v:.1f}"
                                for k, v in figures.items())


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=SIZES, default="135m")
    p.add_argument("--steps", type=int, help="PPO steps per run; the first is warm-up (default: 4, tiny: 1)")
    p.add_argument("--runs", default=",".join(RUNS), help="comma-separated subset of " + ",".join(RUNS))
    p.add_argument("--out", help="work dir (default out/peer_trl_SIZE; --smoke: a temp dir)")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per run before it is stopped")
    p.add_argument("--layout", choices=("ddp", "fsdp"), default="ddp",
                   help="ours' data_parallel (default ddp: whole replicas, as TRL's DDP)")
    p.add_argument("--smoke", action="store_true", help="ours_1p only, tiny, 2 steps (a fast test runs this)")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # internal: one side's run, from its spec (JSON)
    args = p.parse_args()
    if args.worker:
        spec = json.loads(args.worker)
        return run_trl(spec) if spec["side"] == "trl" else run_ours(spec)
    if args.smoke:  # our side end to end at the smallest size: TRL's venv is neither needed nor made
        args.size, args.runs, args.steps = "tiny", "ours_1p", args.steps or 2
        scratch = tempfile.TemporaryDirectory(prefix="peer_trl_smoke_")  # removed when this process exits
        args.out = args.out or scratch.name
    size, runs = SIZES[args.size], [r.strip() for r in args.runs.split(",") if r.strip()]
    steps = args.steps or size["steps"]
    if unknown := [r for r in runs if r not in RUNS]:
        p.error(f"unknown run {unknown[0]!r}: choose from {','.join(RUNS)}")
    out = os.path.abspath(args.out or os.path.join(ROOT, "out", f"peer_trl_{args.size}"))
    os.makedirs(out, exist_ok=True)
    trl_python = peer_python() if any(r.startswith("trl") for r in runs) else None
    model_dir = write_checkpoint(os.path.join(out, "model"), size["model"])
    prompts, rng = os.path.join(out, "prompts.json"), random.Random(f"{SEED}/peer_trl/prompts")
    # one pool for both sides (TRL's dataloader shuffles it, ours reads it in order)
    with open(prompts, "w") as f:
        json.dump([[rng.randrange(size["model"]["vocab_size"]) for _ in range(size["prompt_len"])]
                   for _ in range(steps * BATCH)], f)
    print(f"{args.size}: {BATCH} x ({size['prompt_len']} + {size['response_len']}) tokens per step, "
          f"{steps} steps per run, ours with data_parallel={args.layout}; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    results = {}
    for run in runs:
        side = run.split("_")[0]
        spec = dict(side=side, model_dir=model_dir, vocab=size["model"]["vocab_size"], prompts=prompts,
                    steps=steps, response_len=size["response_len"],
                    engine="hf" if "_1p" in run else "vllm", layout=args.layout,
                    old_logprobs="engine" if run.endswith("_elp") else "trainer",
                    out_dir=os.path.join(out, run))
        shutil.rmtree(spec["out_dir"], ignore_errors=True)  # an earlier run's
        metrics = os.path.join(spec["out_dir"], "metrics.jsonl")
        python = trl_python if side == "trl" else sys.executable
        log = os.path.join(out, f"{run}.log")
        if launch(run, spec, python, args.timeout, log) == 0 and os.path.isfile(metrics):
            with open(metrics) as f:
                results[run] = [json.loads(line) for line in f]
    print(report(results, steps))
    return 0 if len(results) == len(runs) else 1


if __name__ == "__main__":
    sys.exit(main())
