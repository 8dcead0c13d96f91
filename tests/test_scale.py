"""What breaks or wastes only at scale, shown on CPU: the tensors handed to collectives, the
generation split inside a tp x cp group, and the one set of stop tokens.

- Collectives. On a GPU every collective must get a tensor on the trainer's device (NCCL takes no
  CPU tensor). On CPU every tensor is on that device, so the check also fails on any tensor that a
  factory call (torch.tensor, torch.zeros, ...) made without device=: on a GPU that is the tensor
  that would sit on the CPU. The whole trainer (SFT, validation, rollouts, the update, metrics, the
  stop flag, a checkpoint, the export) runs under the check on the 6 meshes. Not seen by it: the
  functional collectives inside DTensor (full_tensor), and CPU-offloaded shards (GPU only).
- Generation split. Those runs generate their own rollouts with the HF engine from one seed: each
  engine of a tp x cp group draws its share of the dp slice (`rollout_samples`), and every mesh
  trains on the same samples and gets the numbers of the single-process run.
- Stop tokens. A checkpoint whose generation_config.json lists two EOS ids: both engines stop at
  the second (the vLLM half is in tests/_vllm_checks.py), the trainer counts a response ending in
  it as finished and rewards it, and the SFT dir and the HF export carry the set.
"""
import json
import os

import pytest
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors

import config
import model_parallel as mp
import rollout
import train_ppo
from _dist import run_ranks
from conftest import close, read_metrics

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
               "reduce_scatter_tensor", "broadcast", "reduce", "gather", "scatter", "all_to_all_single")
# world size -> its meshes, each (dp, cp, tp)
MESHES = {1: [(1, 1, 1)], 2: [(2, 1, 1), (1, 1, 2), (1, 2, 1)], 4: [(2, 1, 2), (1, 2, 2)]}
EOS, SECOND_EOS = 256, 258  # the toy EOS, and an id the toy tokenizer does not decode (a special token)


class ImplicitDevice(TorchFunctionMode):
    """Marks every tensor a factory function made without device= (it landed on the default
    device)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # and not one of the arguments: as_tensor(t) returns t itself
        if (func in _device_constructors() and (kwargs or {}).get("device") is None
                and isinstance(out, torch.Tensor) and not any(out is a for a in args)):
            out.made_without_device = True
        return out


def checked_collectives(device, seen):
    """Wrap torch.distributed's collectives: each call fails on a tensor not on `device`, or made
    without device=."""
    originals = {name: getattr(dist, name) for name in COLLECTIVES}

    def wrap(name, original):
        def collective(*args, **kwargs):
            tensors = [t for a in list(args) + list(kwargs.values())
                       for t in (a if isinstance(a, (list, tuple)) else [a]) if isinstance(t, torch.Tensor)]
            for t in tensors:
                assert t.device == device, \
                    f"{name} got a tensor on {t.device}, the trainer's device is {device}"
                assert not getattr(t, "made_without_device", False), \
                    f"{name} got a tensor made without device= (on a GPU: a CPU tensor)"
            seen[name] = seen.get(name, 0) + 1
            return original(*args, **kwargs)
        return collective

    for name, original in originals.items():
        setattr(dist, name, wrap(name, original))
    return originals


def _meshes_body(rank, world_size, model, root):
    rollout.HFEngine.shutdown = lambda self: None  # keep the process group for the next run
    seen = {}
    originals = checked_collectives(torch.device("cpu"), seen)
    try:
        with ImplicitDevice():  # the wrapper catches what it should: a CPU-default tensor is refused
            with pytest.raises(AssertionError, match="without device="):
                dist.all_reduce(torch.zeros(1))
            for dp, cp, tp in MESHES[world_size]:
                cfg = config.Config(out_dir=os.path.join(root, f"dp{dp}cp{cp}tp{tp}"), model=model,
                                    tp_size=tp, cp_size=cp, packing=cp > 1,
                                    steps=2, prompts_per_step=4, samples_per_prompt=2, max_new_tokens=4,
                                    micro_batch_size=2, ppo_epochs=2, lr=1e-4, critic_lr=1e-4,
                                    sft_steps=10, sft_batch_size=8,
                                    save_every=2, eval_every=2, plot_every=0, rollout_engine="hf")
                config.validate(cfg, world_size)
                task = rollout.ToyTask(cfg.seed)
                # greedy validation at step 0: its count is summed over ranks
                task.val = rollout.TOY_FACTS[:6]
                train_ppo.main(cfg, task)
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
    # what ran under the check: the dp sums; FSDP2's gathers and reductions and the CP all-gathers
    # (K/V, logprobs and values) once there are several ranks (loading reads files: no collective)
    expected = {"all_reduce"} | ({"all_gather_into_tensor", "reduce_scatter_tensor", "all_gather"}
                                              if world_size > 1 else set())
    assert expected <= set(seen), seen


@pytest.mark.slow  # 6 trainer runs (2 steps each, after a 20-step SFT) on 1, 2 and 4 ranks
def test_every_mesh_hands_collectives_device_tensors_and_splits_generation(tmp_path):
    model = mp.materialize_tiny_model("tiny-llama", str(tmp_path), seed=1)
    for world_size in MESHES:
        run_ranks(_meshes_body, world_size, model, str(tmp_path))
    single = read_metrics(tmp_path / "dp1cp1tp1")
    with open(tmp_path / "dp1cp1tp1" / "rollouts" / "step_1.jsonl") as f:
        samples = [json.loads(line)["response_ids"] for line in f]
    assert any(r["reward_mean"] > 0 for r in single), "a run with no reward compares too little"
    for dp, cp, tp in sum(MESHES.values(), []):
        out = tmp_path / f"dp{dp}cp{cp}tp{tp}"
        rows = read_metrics(out)
        # 8 samples a step: a dp slice of 8 / dp, split over its cp * tp ranks
        assert [r["rollout_samples"] for r in rows] == [8 // (dp * cp * tp)] * 2, (dp, cp, tp)
        with open(out / "rollouts" / "step_1.jsonl") as f:
            assert [json.loads(line)["response_ids"] for line in f] == samples, (dp, cp, tp)
        assert rows[0]["val_accuracy"] == single[0]["val_accuracy"]
        for a, b in zip(single, rows):
            assert a["reward_mean"] == b["reward_mean"]
            for k in ("policy_loss", "value_loss", "kl", "grad_norm", "critic_grad_norm"):
                assert close(a[k], b[k]), ((dp, cp, tp), a["step"], k, a[k], b[k])


# ---- stop tokens

def two_eos_checkpoint(root):
    """tiny-llama whose generation_config.json ends a response at EOS or at SECOND_EOS
    (Qwen2.5-Instruct has two such ids, Llama 3 three)."""
    path = mp.materialize_tiny_model("tiny-llama", str(root), seed=1)
    with open(os.path.join(path, "generation_config.json")) as f:
        generation_config = json.load(f)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump(dict(generation_config, eos_token_id=[EOS, SECOND_EOS]), f)
    return path


def test_the_hf_engine_stops_at_every_stop_token(tmp_path):
    """The greedy response with EOS alone as stop token, then with its k-th token added to the set:
    the response ends right there, the token kept."""
    path = two_eos_checkpoint(tmp_path)
    assert rollout.stop_token_ids(path, EOS) == [EOS, SECOND_EOS] and rollout.stop_token_ids(path, None) == []
    prompt = [[ord(c) for c in "3+4="]]
    free, _ = rollout.HFEngine(path, torch.device("cpu"), [EOS]).generate(prompt, [0], [8], 0.0)[0]
    # a token seen there first
    k = next((i for i in range(1, len(free)) if free[i] not in free[:i] + [EOS]), 0)
    assert free[k] != EOS, free
    engine = rollout.HFEngine(path, torch.device("cpu"), [EOS, free[k]])
    stopped, _ = engine.generate(prompt, [0], [8], 0.0)[0]
    assert stopped == free[:k + 1] and rollout.finished(stopped, [EOS, free[k]])


class ScriptedEngine:
    """Answers every prompt with "7" and the second EOS."""
    stop_ids = [EOS, SECOND_EOS]

    def generate(self, prompt_ids, seeds, budgets, temperature):
        return [([ord("7"), SECOND_EOS], [-0.1, -0.2]) for _ in prompt_ids]


def _stop_set_body(rank, world_size, model, out_dir):
    rollout.HFEngine.shutdown = lambda self: None  # keep the process group: the spawn helper ends it
    made = []
    make_engine = rollout.make_engine
    rollout.make_engine = lambda *args: made.append(make_engine(*args)) or made[-1]
    cfg = config.Config(out_dir=out_dir, model=model, steps=1, prompts_per_step=2, samples_per_prompt=2,
                        micro_batch_size=4, sft_steps=1, sft_batch_size=4, rollout_engine="hf", plot_every=0)
    config.validate(cfg, world_size)
    train_ppo.main(cfg)  # SFT from the two-EOS checkpoint, one step, the HF export
    assert made[0].stop_ids == [EOS, SECOND_EOS], "the engine built from the SFT dir must know both"
    task = rollout.ToyTask(cfg.seed)
    one = config.Config(prompts_per_step=1, samples_per_prompt=1)
    hit = next(p for p in range(25) if task.prompts(p, 1)[0][1] == "7")  # a prompt whose answer is 7
    miss = next(p for p in range(25) if task.prompts(p, 1)[0][1] != "7")
    for position, reward in ((hit, 1.0), (miss, 0.0)):
        (sample,), _ = rollout.generate_share(ScriptedEngine(), task, one, 0, position)
        assert sample["finished"] and sample["response"] == "7" and sample["task_score"] == reward, sample


def test_a_response_ending_in_the_second_eos_is_finished_rewarded_and_the_set_is_kept(tmp_path):
    model = two_eos_checkpoint(tmp_path / "model")
    out = str(tmp_path / "out")
    run_ranks(_stop_set_body, 1, model, out)
    # both: so the stop set does not depend on sft_steps, and vLLM serving the export agrees
    for saved in ("sft", "hf"):
        with open(os.path.join(out, saved, "generation_config.json")) as f:
            assert json.load(f)["eos_token_id"] == [EOS, SECOND_EOS], saved
