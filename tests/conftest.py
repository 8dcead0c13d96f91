"""Helpers shared by the test modules, imported as `from conftest import run_cli, read_metrics`
(pytest puts tests/ on sys.path; so does running a script in tests/). No test module imports
another: what two of them need lives here. Plain functions, no fixtures, no hooks.

The `slow` marker (pytest.ini) tags the tier that `make test-fast` leaves out: CLI runs under
torchrun, vLLM engines, the demo."""
import json
import math
import os
import signal
import subprocess
import sys
import traceback

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")


def cpu_env(**extra):
    """The environment for a child process: one OpenMP thread per process (the ranks share
    a couple of cores), no GPU (on a GPU machine the trainer would pick it: these tests are the
    CPU suite; tests/test_cuda.py is the GPU one), plus extra variables."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", **extra}


def torchrun_cmd(nproc, *args, script="train_ppo.py"):
    return [TORCHRUN, f"--nproc_per_node={nproc}", "--standalone", script, *args]


def run_cli(nproc, *args, timeout=600, env=None):
    """torchrun the trainer; fail the test with its output if it fails. Returns the finished
    process: .stdout and .stderr as text."""
    cmd = torchrun_cmd(nproc, *args)
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=cpu_env() if env is None else env)
    first = proc.stderr.find("Traceback")  # the first rank's traceback, not torchrun's summary
    assert proc.returncode == 0, (f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n"
                                  f"{proc.stderr[max(first, 0):][:6000]}")
    return proc


def python_block(path, heading):
    """The first ```python block after `heading` in the Markdown file ROOT/path: a recipe the docs
    show, to be run as written."""
    text = open(os.path.join(ROOT, path)).read()
    section = text[text.index(heading):]
    start = section.index("```python\n") + len("```python\n")
    return section[start:section.index("```\n", start)]


def read_metrics(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def close(a, b, rel=1e-4, abs_=1e-6):
    return abs(a - b) <= max(rel * max(abs(a), abs(b)), abs_)


def torchrun_workers(pid):
    """pids of the worker processes torchrun `pid` started: they run in sessions of their own, so
    killing torchrun's process group does not reach them."""
    workers = []
    for child in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{child}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:  # the parent pid field
                    workers.append(int(child))
        except OSError:
            continue
    return workers


def kill_torchrun(pid):
    """SIGKILL torchrun `pid` and its workers (workers first: torchrun's death does not reach
    them)."""
    for p in torchrun_workers(pid) + [pid]:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:  # already gone
            pass


# ---- the independent reference for per-token logprobs

def at_positions(scores, seq_starts=()):
    """(B, S-1) scores of tokens 1..S-1 -> (B, S) with token i's score at position i; 0 at
    position 0 and at each packed sequence's start (nothing before it predicts it)."""
    out = torch.cat([torch.zeros_like(scores[:, :1]), scores], dim=1)
    keep = torch.ones(out.shape[1])
    keep[list(seq_starts)] = 0.0
    return out * keep


def plain_logprobs(logits, ids, seq_starts=()):
    """out[:, i] = log_softmax(logits[:, i-1])[ids[:, i]] on the full, unsharded (B, S, V)
    logits: the single-process computation every sharded path is compared with."""
    scores = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None])[..., 0]  # (B, S-1)
    return at_positions(scores, seq_starts)


# ---- the independent reference for whole models: plain HF in fp32, one sequence at a time

def toy_batch(lens, prompt_len):
    """A global batch of right-padded rows with `lens` tokens: toy-tokenizer ids (B, S), the
    response mask (positions prompt_len .. len-1), and random stand-ins for advantages (B, S)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 258, (len(lens), max(lens)), generator=g)  # (B, S)
    pos, ends = torch.arange(max(lens))[None], torch.tensor(lens)[:, None]  # (1, S), (B, 1)
    ids = ids.masked_fill(pos >= ends, 257)  # right padding with the pad id
    mask = ((pos >= prompt_len) & (pos < ends)).float()  # (B, S)
    return ids, mask, torch.randn(ids.shape, generator=g)


LORA = dict(lora_rank=4, lora_alpha=8.0)  # the LoRA cases' config (scale 2)


def lora_adapters(path, seed):
    """Non-zero adapters {our parameter name: full tensor} for every LoRA target of the checkpoint
    at `path` (a trained state: B = 0, the initial one, would leave A without a gradient)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from extensions import lora  # (here: the core's tests import conftest without extensions)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    g = torch.Generator().manual_seed(seed)
    adapters = {}
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in lora.Options.TARGETS:
            rank = LORA["lora_rank"]
            adapters[name + ".lora_A"] = torch.randn(rank, module.in_features, generator=g) * 0.05
            adapters[name + ".lora_B"] = torch.randn(module.out_features, rank, generator=g) * 0.05
    return adapters


def _peft_name(name):
    """PEFT's parameter name -> ours: base_model.model.X.lora_A.default.weight -> X.lora_A."""
    return name.removeprefix("base_model.model.").removesuffix(".default.weight")


def hf_reference(path, lens, prompt_len, temperature, seed, adapters=None):
    """Per-sequence HF forward/backward (eager attention, no padding, no packing) of a PPO-shaped
    loss on the whole toy_batch:  loss = sum over response tokens of (logprob * weight + value^2)
    / response tokens. The value head follows load_critic: N(0, 1/(hidden+1)) seeded with `seed`,
    bias 0. Returns logprobs, entropies, values (B, S) and every gradient ("critic." for the
    critic). `adapters` (lora_adapters): the policy is PEFT's LoRA (its own layers, an independent
    implementation) over the checkpoint with these adapters, and its gradients are theirs alone."""
    from transformers import AutoModelForCausalLM
    ids, mask, weights = toy_batch(lens, prompt_len)
    policy = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    if adapters:
        from peft import LoraConfig, get_peft_model

        from extensions import lora  # (here: the core's tests import conftest without extensions)
        peft_config = LoraConfig(r=LORA["lora_rank"], lora_alpha=LORA["lora_alpha"], lora_dropout=0.0,
                                 target_modules=list(lora.Options.TARGETS))
        policy = get_peft_model(policy, peft_config)
        with torch.no_grad():
            for name, param in policy.named_parameters():
                if "lora_" in name:
                    param.copy_(adapters[_peft_name(name)])
    backbone = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").model
    hidden = policy.config.hidden_size
    g = torch.Generator().manual_seed(seed)
    head_w = torch.randn(1, hidden, generator=g) / math.sqrt(hidden + 1)
    head_w.requires_grad_()
    head_b = torch.zeros(1, requires_grad=True)
    # (B, S) each; position i comes from the logits / hidden state at i-1
    lp, ent, values = (torch.zeros(ids.shape) for _ in range(3))
    for k, n in enumerate(lens):
        x = ids[k:k + 1, :n]  # (1, n) one sequence alone
        logp = torch.log_softmax(policy(x).logits[0] / temperature, -1)  # (n, V)
        lp[k, 1:n] = logp[:-1].gather(1, x[0, 1:, None])[:, 0]
        ent[k, 1:n] = -(logp.exp() * logp).sum(-1)[:-1].detach()
        # values[i] = head(h[i-1])
        values[k, 1:n] = (backbone(x).last_hidden_state[0] @ head_w.T + head_b)[:-1, 0]
    ((lp * weights * mask).sum() + (values ** 2 * mask).sum()).div(mask.sum()).backward()
    grads = {_peft_name(n): p.grad for n, p in policy.named_parameters() if p.requires_grad}
    grads.update({"critic." + n: p.grad for n, p in backbone.named_parameters(prefix="model")})
    grads.update({"critic.lm_head.weight": head_w.grad, "critic.lm_head.bias": head_b.grad})
    return dict(lp=lp.detach(), ent=ent, values=values.detach(), grads=grads)


def varlen_case():
    """Varlen arguments of three segments with GQA (4 query heads, 2 KV heads): a whole document
    of 10 tokens, then the last 4 queries of a 9-token document (as a CP rank holds them: q
    shorter than k), then 5. Returns q (19, 4, 32), k, v (24, 2, 32), cu_seqlens_q, cu_seqlens_k."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(19, 4, 32, generator=g)  # (total_q, Hq, D)
    k, v = (torch.randn(24, 2, 32, generator=g) for _ in range(2))  # (total_k, Hkv, D)
    cu_seqlens_q = torch.tensor([0, 10, 14, 19], dtype=torch.int32)
    cu_seqlens_k = torch.tensor([0, 10, 19, 24], dtype=torch.int32)
    return q, k, v, cu_seqlens_q, cu_seqlens_k


# ---- host reads: where the CPU would wait for a GPU

# Tensor -> Python conversions: on a GPU each one waits until every queued kernel has run.
HOST_READ_NAMES = ("item", "__float__", "__int__", "__bool__", "tolist", "cpu")


class HostReads(TorchFunctionMode):
    """Counts host reads of tensors inside the block (any device: on CPU every tensor is a host
    tensor, so it is the count that tells), and indexing with a Python list, whose index tensor a
    GPU copies from pageable memory, synchronously. `where` keeps (kind, the caller's file:line)
    of each, to show what to fix."""

    def __init__(self):
        super().__init__()
        self.where = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        listed = name in ("__getitem__", "__setitem__") and _holds_list(args[1])
        if name in HOST_READ_NAMES or listed:
            caller = next(f for f in traceback.extract_stack()[::-1] if f.filename != __file__)
            # DeviceMesh reads its own rank layout, a CPU tensor on every machine: not a sync
            if not caller.filename.endswith(os.path.join("distributed", "device_mesh.py")):
                self.where.append((name, f"{os.path.basename(caller.filename)}:{caller.lineno}"))
        return func(*args, **(kwargs or {}))

    @property
    def count(self):
        return len(self.where)


def _holds_list(index):
    return isinstance(index, list) or (isinstance(index, tuple) and any(isinstance(i, list) for i in index))


# ---- new full-size tensors: the memory traffic of a step that is bound by it (the sampler)

class NewTensors(TorchDispatchMode):
    """Counts the tensors of `numel` elements that the ops inside the block allocate: op outputs
    whose storage is not an input's (a view, or an in-place or out= result, allocates nothing).
    Seen at the dispatcher, after autograd and composite ops are broken down, so `x / t` and
    `x.float()` count and `x.div_(t)` does not. `ops` keeps the op of each, to show what to fix.
    (bench/hf_generate.py counts rollout.sample's (B, V) tensors with it; tests/test_sampling.py
    bounds them.)"""

    def __init__(self, numel):
        super().__init__()
        self.numel = numel
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        leaves = tree_leaves((args, kwargs))
        inputs = {t.untyped_storage().data_ptr() for t in leaves if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.numel() == self.numel \
                    and t.untyped_storage().data_ptr() not in inputs:
                self.ops.append(str(func))
        return out

    @property
    def count(self):
        return len(self.ops)


def gumbel_step(logits, seeds, position, temperature):
    """The sampling step rollout.sample replaced (rollout.py at 48acdf0: log-softmax, then
    gumbel_sample's Gumbel-max over a hash of every (row, id)), kept as the reference that
    NewTensors must catch (21 (B, V) tensors with fp32 logits, 19 of them in gumbel_sample) and
    that bench/gpu_check.py's sampler stage times."""
    import rollout

    logp = torch.log_softmax(logits.float() / (temperature or 1.0), -1)  # (B, V)
    vocab = torch.arange(logp.shape[-1], device=logp.device)  # (V,)
    row = rollout._mix32(rollout._mix32(seeds) ^ position)  # (B,)
    bits = rollout._mix32(row[:, None] ^ rollout._mix32(vocab + 0x9E3779B9)[None])  # (B, V)
    u = ((bits >> 9).float() + 0.5) / 2**23  # (B, V) uniform in (0, 1)
    token = (logp - torch.log(-torch.log(u))).argmax(-1)  # (B,)
    return token, logp.gather(1, token[:, None])[:, 0]


def paired(a, b, n):
    """zip(a, b) after checking that both hold n rows: a loop over the pairs of two runs' metrics
    must not pass because a run wrote none."""
    assert len(a) == len(b) == n, (len(a), len(b), n)
    return zip(a, b)
