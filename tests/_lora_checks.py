"""LoRA's guarantees on 2 CPU ranks (FSDP over dp=2), measured; tests/test_lora.py makes the
assertions. By hand:

    torchrun --standalone --nproc_per_node=2 tests/_lora_checks.py --dtype=fp32 --dir=/tmp/l1

In the order a run meets them:
1. two rounds of: sample with the engines, one AdamW step of the adapters, refit (vLLM: the
   adapters alone, train_ppo.refit's LoRA path; the HF engine: merged weights), sample again with
   the same seeds. Each engine's logprobs of its new samples are compared with the trainer's
   forward_policy on the same ids (they must match), and the trainer's logprobs with the
   adapters it had before the step (they must differ by far more: a stale refit would match
   those instead). The second round catches an engine that kept its first adapters.
2. the merged HF export and the PEFT adapter dir, each loaded by its own library (transformers;
   peft over the base): the same logits.
3. a checkpoint saved at dp=2 and loaded into a freshly built policy at tp=2 (a resume on
   another mesh); then every base weight, of the trained and of the resumed policy, is what the
   checkpoint file holds, bit for bit (in the stored dtype), the resumed adapters are the
   trained ones, and the two give the same logprobs.

A script, not a run_ranks body: vLLM's shutdown destroys the default process group.
"""
import argparse
import json
import os
import sys
from dataclasses import replace

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
import model_parallel
import rollout
import train_ppo
from config import Config
from extensions import lora

parser = argparse.ArgumentParser()
parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
parser.add_argument("--dir", required=True, help="for the tiny checkpoint, exports and results.json")
args = parser.parse_args()

TEMPERATURE, MAX_NEW_TOKENS = 0.7, 12
rank, world_size, device = model_parallel.init_distributed()
cfg = Config(out_dir=args.dir, rollout_engine="vllm", seed=7, max_model_len=64, vllm_kv_cache_gb=1,
             temperature=TEMPERATURE, max_new_tokens=MAX_NEW_TOKENS, dtype=args.dtype, lora_rank=8,
             lora_alpha=16.0, micro_batch_size=6)
mesh = model_parallel.make_mesh(world_size, 1, 1, "cpu")  # the trainer: FSDP over dp=2
path = model_parallel.materialize_tiny_model("tiny-llama", args.dir, seed=3)
policy = model_parallel.load_policy(path, mesh, cfg, adapt=lora.add_adapters)
stored = torch.bfloat16 if args.dtype == "bf16" else torch.float32  # the frozen base's dtype
loaded = {name: t.to(stored) for name, t in load_file(os.path.join(path, "model.safetensors")).items()}


def part(model, lr=2e-2):
    """A Part as train_ppo.build_models makes it: AdamW over the trained parameters alone."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    return train_ppo.Part(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0))


parts = {"policy": part(policy)}
optimizer = parts["policy"].optimizer
measured = {"rank": rank, "trained_tensors": len(optimizer.param_groups[0]["params"])}

tok = rollout.toy_tokenizer()
engine = rollout.make_engine(cfg, path, device, tok.encode_single_token(rollout.EOS))  # vLLM, LoRA on
hf_engine = rollout.HFEngine(path, device, engine.stop_ids, engine.dtype)  # no LoRA: merged refits
prompts = [tok.encode(p) for p, _ in rollout.ToyTask(cfg.seed).prompts(6 * rank, 6)]
seeds = [rollout.sample_seed(cfg.seed, rank, i, 0) for i in range(len(prompts))]


def rows(outs):
    """Right-padded (b, S) prompt+response ids, lengths, response mask, engine logprobs."""
    full = [p + r for p, (r, _) in zip(prompts, outs)]
    ids = torch.zeros(len(full), max(map(len, full)), dtype=torch.long)  # (b, S)
    mask, engine_lp = torch.zeros(ids.shape, dtype=torch.bool), torch.zeros(ids.shape)  # (b, S)
    for b, (p, (r, lps)) in enumerate(zip(prompts, outs)):
        ids[b, :len(p) + len(r)] = torch.tensor(p + r)
        mask[b, len(p):len(p) + len(r)] = True
        engine_lp[b, len(p):len(p) + len(r)] = torch.tensor(lps)
    return ids, [len(f) for f in full], mask, engine_lp


def adapters():
    """This rank's adapter shards, copied."""
    return {n: model_parallel._local(p).detach().clone()
            for n, p in policy.named_parameters() if p.requires_grad}


def trainer_logprobs(ids, lens, shards=None):
    """forward_policy's logprobs, with this rank's adapter shards swapped for `shards` if given."""
    live = adapters()
    with torch.no_grad():
        for n, p in policy.named_parameters():
            if shards and n in shards:
                model_parallel._local(p).copy_(shards[n])
        lp, _ = model_parallel.forward_policy(policy, ids, lens, mesh, cfg)
        for n, p in policy.named_parameters():
            if n in live:
                model_parallel._local(p).copy_(live[n])
    return lp


# ---- 1. two rounds of sample, train, refit, sample again --------------------------------------
for round_ in range(2):
    ids, lens, mask, _ = rows(engine.generate(prompts, seeds, [MAX_NEW_TOKENS] * len(prompts), TEMPERATURE))
    before = adapters()
    lp, _ = model_parallel.forward_policy(policy, ids, lens, mesh, replace(cfg, temperature=1.0))
    (-lp[mask].sum() / mask.sum()).backward()  # make these samples likelier
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for name, eng in (("vllm", engine), ("hf", hf_engine)):
        measured[f"{name}_refit_{round_}"] = train_ppo.refit(eng, policy, cfg)
        ids, lens, mask, engine_lp = rows(eng.generate(prompts, seeds, [MAX_NEW_TOKENS] * len(prompts),
                                                       TEMPERATURE))
        now, old = trainer_logprobs(ids, lens), trainer_logprobs(ids, lens, before)
        measured[f"{name}_mismatch_{round_}"] = (engine_lp - now)[mask].abs().mean().item()
        measured[f"{name}_moved_{round_}"] = (now - old)[mask].abs().mean().item()
measured["adapter_files"] = sorted(os.listdir(os.path.join(args.dir, "refit_adapter")))

# ---- 2. the merged export and the PEFT adapter dir, each loaded by its own library -------------
model_parallel.save_hf(policy, os.path.join(args.dir, "hf"), torch.float32, copy_from=path)
lora.save_adapter(policy, os.path.join(args.dir, "adapter"), cfg, path)
if rank == 0:
    from peft import PeftModel
    x = torch.tensor([prompts[0] + [5, 9, 11, 2]])
    merged = AutoModelForCausalLM.from_pretrained(os.path.join(args.dir, "hf"), dtype=torch.float32)
    # the base as the run stored it (bf16 under the bf16 recipe), in fp32 as the export is
    base = AutoModelForCausalLM.from_pretrained(path, dtype=stored).float()
    peft = PeftModel.from_pretrained(base, os.path.join(args.dir, "adapter"))
    with torch.no_grad():
        a, b = merged(x).logits, peft(x).logits
        measured["export_logit_diff"] = (a - b).abs().max().item()
        measured["export_logit_scale"] = a.abs().max().item()
        with peft.disable_adapter():  # and the adapters do something
            measured["export_adapter_effect"] = (peft(x).logits - a).abs().max().item()


# ---- 3. a resume on another mesh (tp=2): every base weight bit for bit, the adapters too --------
ckpt = train_ppo.save_checkpoint(os.path.join(args.dir, "ckpt"), parts, keep=1, progress={"step": 2})
measured["checkpoint_bytes"] = sum(os.path.getsize(os.path.join(ckpt, f)) for f in os.listdir(ckpt)
                                   if f.endswith(".distcp"))
tp_mesh = model_parallel.make_mesh(world_size, 2, 1, "cpu")  # (dp, cp, tp) = (1, 1, 2)
resumed = model_parallel.load_policy(path, tp_mesh, cfg, adapt=lora.add_adapters)
train_ppo.load_checkpoint(ckpt, {"policy": part(resumed)})
first = tok.encode(rollout.ToyTask(cfg.seed).prompts(0, 1)[0][0])  # not this rank's own prompts:
shared = torch.tensor([first + [5, 9, 11, 2]] * 2)  # the same rows on both ranks (tp needs it)
with torch.no_grad():
    lens = [shared.shape[1]] * 2
    before = model_parallel.forward_policy(policy, shared, lens, mesh, cfg)[0]
    after = model_parallel.forward_policy(resumed, shared, lens, tp_mesh, cfg)[0]
measured["resumed_logprob_diff"] = (before - after).abs().max().item()
for label, model in (("trained", policy), ("resumed", resumed)):
    model_parallel.reshard(model)
    base_diffs = []
    for name, param in model_parallel._hf_params(model):
        full = model_parallel._gathered(param)
        base_diffs += [name] if not (full.dtype == stored and torch.equal(full, loaded[name])) else []
    measured[f"{label}_base_not_bit_equal"] = base_diffs
    measured[f"{label}_base_tensors"] = len(model_parallel._hf_params(model))
trained_adapters = dict(lora.iter_adapters(policy))
measured["resumed_adapters_equal"] = all(  # gathered: the two meshes split them differently
    torch.equal(trained_adapters[n], full) for n, full in lora.iter_adapters(resumed))

gathered = [None] * world_size
dist.all_gather_object(gathered, measured)
if rank == 0:
    with open(os.path.join(args.dir, "results.json"), "w") as f:
        json.dump(gathered, f, indent=1)
    print(json.dumps(gathered), flush=True)
dist.barrier()
engine.shutdown()
