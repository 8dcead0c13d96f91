"""Issue 34's review of the code as an 8-GPU user would run it: each defect it found, shown on CPU
by a test that failed on the code before the fix. (The host reads of an update, the offloaded
optimizer state and the warm-up checkpoint are in test_train_loop.py and
test_refit_and_critic.py; the packing budget and a checkpoint without a tokenizer in
test_config.py and test_failures.py.) Two spawns check several defects each, to keep the suite
short."""
import dataclasses
import json
import os
import pickle
import time
import weakref

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

import config
import model_parallel
import rollout
import train_ppo
from _dist import run_ranks
from extensions import distill
from conftest import ROOT, HostReads


class LongAnswers(rollout.ToyTask):
    """The toy task with reference answers of 40 tokens: longer than a 16-token row."""

    def target(self, answer):
        return self.tok.encode(answer * 40)[:40] + [self.eos_id]


def _offloaded(model):
    """Whether every FSDP2 unit of `model` keeps its shards in host memory (FSDP2's CPU offload)."""
    units = [m for m in model.modules()
             if isinstance(m, FSDPModule) and m._get_fsdp_state()._fsdp_param_group]
    return bool(units) and all(unit._get_fsdp_state()._fsdp_param_group.fsdp_params[0].offload_to_cpu
                               for unit in units)


def _one_rank_body(rank, world_size, tmp):
    mesh = model_parallel.make_mesh(world_size, 1, 1, "cpu")
    path = model_parallel.materialize_tiny_model("tiny-llama", tmp, seed=1)

    # 1. The SFT warm-up's rows were not bounded: a reference answer longer than the packed row
    # raised in model_parallel.microbatches. Now each row is cut to max_model_len tokens.
    cfg = config.Config(out_dir=tmp, packing=True, max_model_len=16, max_tokens_per_microbatch=16,
                        sft_steps=2, sft_batch_size=4, prompts_per_step=2, samples_per_prompt=2)
    config.validate(cfg, world_size)
    lengths, make_batch = [], train_ppo.make_batch
    train_ppo.make_batch = lambda *args, **kwargs: lengths.extend(make_batch(*args, **kwargs).lens) or \
        make_batch(*args, **kwargs)
    sft_dir = train_ppo.sft_warmup(path, LongAnswers(1), cfg, mesh)
    train_ppo.make_batch = make_batch
    assert os.path.isfile(os.path.join(sft_dir, "config.json"))

    # 5. The frozen reward model stayed on the GPU in fp32 all run. Now it is stored in the compute
    # dtype (bf16 under the bf16 recipe, its value head fp32) and kept in host memory by FSDP2's
    # CPU offload; the trainable models only with cpu_offload=true (applied on CPU as on a GPU)
    reward_dir = os.path.join(tmp, "rm")
    from transformers import AutoConfig, AutoModelForSequenceClassification
    fields = dict(model_parallel.TINY_PRESETS["tiny-llama"], num_labels=1)
    rm_config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    AutoModelForSequenceClassification.from_config(rm_config).save_pretrained(reward_dir)
    bf16 = config.Config(dtype="bf16")
    reward_model = model_parallel.load_reward_model(reward_dir, mesh, bf16)
    dtypes = {name: p.dtype for name, p in reward_model.named_parameters()}
    head = [dtypes.pop("lm_head.weight"), dtypes.pop("lm_head.bias")]
    assert head == [torch.float32] * 2 and set(dtypes.values()) == {torch.bfloat16}, dtypes
    assert _offloaded(reward_model)
    # and it is resharded after its pass: with reshard_after_forward=false FSDP2 keeps every unit
    # gathered after a forward, a full copy on the GPU through generation and the update
    keep = config.Config(dtype="bf16", reshard_after_forward=False)
    reward_model = model_parallel.load_reward_model(reward_dir, mesh, keep)
    policy = model_parallel.load_policy(path, mesh, bf16)
    batch = train_ppo.make_batch([[1, 2, 3], [4, 5]], [[6, 7], [8]], pad_id=257)
    batch.task_score = batch.reward = torch.zeros(2)
    with torch.no_grad():  # as ppo_step calls it
        train_ppo.reward_model_scores(reward_model, batch, keep, mesh)
    gathered = [n for n, p in reward_model.named_parameters() if not isinstance(p, DTensor)]
    assert not gathered, f"the reward model was left gathered: {gathered}"
    assert not _offloaded(policy)
    assert _offloaded(model_parallel.load_policy(path, mesh, config.Config(cpu_offload=True)))
    # a distillation teacher is frozen as the reward model is: bf16, no adapter even under LoRA, no
    # gradient, in host memory, and resharded after its pass
    teacher = model_parallel.load_policy(path, mesh, dataclasses.replace(keep, lora_rank=8),
                                         frozen=True)
    assert {p.dtype for p in teacher.parameters()} == {torch.bfloat16}
    assert not any(p.requires_grad for p in teacher.parameters())
    assert not any("lora" in n for n, _ in teacher.named_parameters()) and _offloaded(teacher)
    with torch.no_grad():
        distill.teacher_logprobs(teacher, batch, keep, mesh)
    gathered = [n for n, p in teacher.named_parameters() if not isinstance(p, DTensor)]
    assert not gathered, f"the teacher was left gathered: {gathered}"
    return lengths


def _run_one_rank(rank, world_size, tmp):
    lengths = _one_rank_body(rank, world_size, tmp)
    with open(os.path.join(tmp, "sft_rows.json"), "w") as f:
        json.dump(lengths, f)


def test_sft_rows_fit_a_packed_row_and_the_reward_model_lives_on_the_host(tmp_path):
    """1: SFT rows of 4-token prompts and 41-token answers, packed rows of 16 tokens: cut to 16,
    where they raised before. 5: the reward model in bf16 (head fp32) under FSDP2's CPU offload."""
    run_ranks(_run_one_rank, 1, str(tmp_path))
    with open(tmp_path / "sft_rows.json") as f:
        lengths = json.load(f)
    assert len(lengths) == 8 and max(lengths) == 16, lengths


class RecordingEngine:
    """An engine that keeps a weak reference to every tensor it is handed, and counts, when its KV
    cache is woken, how many are still alive."""

    dtype = torch.float32

    def __init__(self):
        self.handed, self.alive_at_kv_wake = [], None

    def load_weights(self, bucket):
        self.handed += [weakref.ref(tensor) for _, tensor in bucket]

    def wake_up(self, tags):
        if tags == ["kv_cache"]:
            self.alive_at_kv_wake = sum(ref() is not None for ref in self.handed)

    def finish_refit(self):
        pass


def test_refit_lets_the_last_bucket_go_before_waking_the_kv_cache():
    """2: refit woke the KV cache while its last bucket (and last tensor) were still referenced:
    with vllm_gpu_memory_utilization set high the wake could run out of memory. 6 tensors of 1 MB
    in buckets of 2 MB: none may be alive when the KV cache wakes."""
    engine = RecordingEngine()
    tensors = ((f"w{i}", torch.zeros(2**18)) for i in range(6))  # nothing else holds them
    stats = rollout.refit(engine, tensors, bucket_mb=2)
    assert len(engine.handed) == 6 and stats["refit_largest_bucket_bytes"] == 2 * 2**20
    alive = engine.alive_at_kv_wake
    assert alive == 0, f"{alive} of 6 tensors alive when the KV cache wakes"


def _two_rank_body(rank, world_size, out_dir):
    # 4. Multi-node resume was decided on every rank: a node with a stale directory listing picked
    # another checkpoint (then mismatched collectives). Rank 1 sees a stale shared file system here:
    # step_2 only, and no finished SFT dir. It must follow rank 0.
    for step in (2, 4):
        ckpt = os.path.join(out_dir, "ckpt", f"step_{step}")
        os.makedirs(ckpt, exist_ok=True)
        # complete as is_checkpoint sees it; DCP's metadata of an empty state dict (start_run
        # reads it: a LoRA run's checkpoint must be resumed with LoRA)
        with open(os.path.join(ckpt, ".metadata"), "wb") as f:
            pickle.dump(Metadata(state_dict_metadata={}), f)
        open(os.path.join(ckpt, "trainer_state_rank0.pt"), "w").close()
    os.makedirs(os.path.join(out_dir, "sft"), exist_ok=True)
    open(os.path.join(out_dir, "sft", "config.json"), "w").close()
    dist.barrier()
    load_policy = model_parallel.load_policy
    if rank == 1:
        train_ppo._complete_steps = lambda root: [2]
        isfile = os.path.isfile
        os.path.isfile = lambda p: False if p.endswith(os.path.join("sft", "config.json")) else isfile(p)

        def no_sft(*args):
            raise AssertionError("rank 1 runs an SFT warm-up that rank 0 skips")
        model_parallel.load_policy = no_sft
    cfg = config.Config(out_dir=out_dir, resume="auto", sft_steps=1, sft_batch_size=2)
    _, mesh, model_dir, resume_dir, task = train_ppo.start_run(cfg, None)
    sft_dir = train_ppo.sft_warmup(model_dir, task, cfg, mesh)
    both = [None] * world_size
    dist.all_gather_object(both, (resume_dir, sft_dir))
    assert both[0] == both[1] == (os.path.join(out_dir, "ckpt", "step_4"), os.path.join(out_dir, "sft")), both
    model_parallel.load_policy = load_policy

    # 8. "No rank ever holds full-vocab logits" held only with tp > 1: the LM head's output each
    # rank holds is V (262) wide at tp=1 and V/tp (131) at tp=2
    widths = []

    def width(module, args, out):  # what this rank holds of the LM head's output
        widths.append((out.to_local() if hasattr(out, "to_local") else out).shape[-1])
    for tp in (1, 2):
        mesh = model_parallel.make_mesh(world_size, tp, 1, "cpu")
        policy = model_parallel.load_policy(model_dir, mesh, config.Config())
        policy.lm_head.register_forward_hook(width)
        model_parallel.forward_policy(policy, torch.tensor([[1, 2, 3, 4]]), [4], mesh, config.Config())
    assert widths == [262, 131], widths


def test_resume_and_sft_reuse_are_rank_0s_decisions_and_logits_are_full_vocab_at_tp1(tmp_path):
    """4 and 8, in one 2-rank spawn."""
    run_ranks(_two_rank_body, 2, str(tmp_path))
    # and the docs say so (they said "no rank holds full-vocab logits", without the condition)
    readme = open(os.path.join(ROOT, "README.md")).read()
    tp_row = next(line for line in readme.splitlines() if line.startswith("| tp (+ SP)"))
    import logprobs
    for text in (tp_row, logprobs.__doc__):
        assert "with tp > 1 no rank holds full-vocab logits" in text and "at tp=1" in text, text


def test_the_rollout_dump_is_written_while_the_step_goes_on(tmp_path, monkeypatch):
    """7: rank 0 wrote the whole dump while every other rank waited, with one float() per
    sample (a GPU sync each). Now the write runs in the background (a disk that takes 1 s to take
    it holds nothing up) and the scores are read back once."""
    write = rollout._write_jsonl

    def slow_write(path, samples):
        time.sleep(1.0)
        write(path, samples)
    monkeypatch.setattr(rollout, "_write_jsonl", slow_write)
    monkeypatch.setattr(train_ppo.dist, "get_rank", lambda: 0)
    every = {j: dict(index=j, task_score=float(j % 2), response_ids=[1, 2]) for j in range(8)}
    cfg = config.Config(out_dir=str(tmp_path), reward_model="rm")
    start = time.time()
    with HostReads() as reads:
        rollout.dump_rollouts(every, torch.arange(8.0) / 10, cfg, step=3)
    assert time.time() - start < 0.5 and reads.count == 1, reads.where
    rollout.wait_for_dumps()
    with open(tmp_path / "rollouts" / "step_3.jsonl") as f:
        dumped = [json.loads(line) for line in f]
    assert [s["reward"] for s in dumped] == (torch.arange(8.0) / 10).tolist()
    assert [s["task_score"] for s in dumped] == [float(j % 2) for j in range(8)]
