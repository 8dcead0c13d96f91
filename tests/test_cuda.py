"""The GPU recipe on a real GPU: skipped without CUDA (CI and the CPU box), run where a GPU is.

tests/test_gpu_paths.py runs the same recipe on CPU; this file runs it on a CUDA device, at world
size 1 (NCCL cannot put two ranks on one GPU), with the one thing CPU cannot show: the CUDA
kernels (cuBLAS bf16 and fp32 matmuls, SDPA's CUDA kernels, NCCL, pinned copies).

- The trainer's passes (logprobs, values, every gradient) on the GPU, against the plain HF model
  in fp32 on CPU, one sequence at a time (conftest.hf_reference): fp32 to 1e-5, bf16 within the
  bf16 tolerance of test_gpu_paths.py; FSDP2 and DDP, masked and varlen attention (+ packing).
- The varlen kernel (flash-attn's, else torch's own) against the CPU stand-in, forward and backward.
- The trainer's CLI on the GPU: two PPO steps with the HF engine, resumed for a third from its
  checkpoint, and the exported HF model loaded back.
- The HF engine's sampler (rollout.sample) at Qwen's size: the same draws in any batch of 1 to 512
  rows, the CPU's draws on all but a few rows, at most 3 new (B, V) tensors a token, and at least
  twice as fast as the Gumbel-max step it replaced.
"""
import json
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp

import config
import model_parallel as mp
import rollout
from _dist import _free_port
from conftest import NewTensors, gumbel_step, hf_reference, read_metrics, run_cli, toy_batch, varlen_case

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

TEMPERATURE, LENS, PROMPT_LEN, SEED = 0.8, [14, 12, 6, 5], 4, 3
# (dtype, data_parallel, attention, packing) -> (logprob, value, grad relative) tolerances; bf16's
# are test_gpu_paths.py's (about 3x what bf16 on CPU measured), fp32's allow cuBLAS's summation
# order (measured on an H100: 9.5e-7, 1.2e-6, 1.2e-6)
CASES = {("fp32", "fsdp", "masked", False): (1e-5, 1e-5, 1e-5),
         ("fp32", "ddp", "masked", False): (1e-5, 1e-5, 1e-5),
         ("bf16", "fsdp", "masked", False): (0.03, 0.05, 0.05),
         ("bf16", "fsdp", "varlen", True): (0.03, 0.05, 0.05)}


def _passes_on_gpu(rank, path, reference, case, port):
    """One process, cuda:0, NCCL: the trainer's forward_policy/forward_critic and a backward."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")
    _, _, device = mp.init_distributed()
    assert device.type == "cuda"
    dtype, data_parallel, attention, packing = case
    lp_tol, value_tol, grad_tol = CASES[case]
    mesh = mp.make_mesh(1, 1, 1, "cuda")
    if attention == "varlen":  # the GPU kernel must run, not the CPU stand-in
        mp.varlen_attention_reference = None
    cfg = config.Config(dtype=dtype, data_parallel=data_parallel, attention=attention, packing=packing,
                        seed=SEED, max_tokens_per_microbatch=48)
    policy, critic = mp.load_policy(path, mesh, cfg), mp.load_critic(path, mesh, cfg)
    assert all(p.is_cuda and p.dtype == torch.float32 for p in policy.parameters()), \
        "fp32 master weights on GPU"
    ids, mask, weights = toy_batch(LENS, PROMPT_LEN)
    lp, _ = mp.forward_policy(policy, ids, LENS, mesh, cfg, TEMPERATURE, unscored=PROMPT_LEN)
    values = mp.forward_critic(critic, ids, LENS, mesh, cfg)
    scored = mask.bool()
    lp_err = (lp.detach() - reference["lp"])[scored].abs().max().item()
    value_err = (values.detach() - reference["values"])[scored].abs().max().item()
    ((lp * weights * mask).sum() + (values ** 2 * mask).sum()).div(mask.sum()).backward()
    worst = 0.0
    for prefix, model in (("", policy), ("critic.", critic)):
        for name, param in model.named_parameters():
            grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
            assert grad.is_cuda and grad.dtype == torch.float32, f"{name}: grad {grad.device} {grad.dtype}"
            want = reference["grads"][prefix + name]
            worst = max(worst, ((grad.cpu() - want).norm() / want.norm().clamp(min=1e-12)).item())
    print(f"{case}: logprobs {lp_err:.1e}, values {value_err:.1e}, grads {worst:.1e} (relative)", flush=True)
    assert lp_err <= lp_tol and value_err <= value_tol and worst <= grad_tol, (case, lp_err, value_err, worst)
    if dtype == "bf16":
        assert lp_err > 1e-4, "no bf16 rounding seen: is the mixed-precision policy in effect?"
    dist.destroy_process_group()
    mp.release_mesh(mesh)


def test_gpu_varlen_kernels_match_the_reference_kernel(monkeypatch):
    """Each varlen kernel this GPU has (flash-attn's, torch's) against the CPU stand-in, forward
    and backward, on segments with q shorter than k (how a CP rank holds them: causal must align
    bottom-right), with and without a sliding window, GQA (4 query heads, 2 KV heads)."""
    kernels = [mp.flash_attn_varlen_func]
    with monkeypatch.context() as m:  # and the kernel the trainer picks without flash-attn
        m.setattr(mp, "flash_attn_varlen_func", None)
        kernels.append(mp.gpu_varlen_kernel())
    assert any(kernels), "no varlen kernel on this GPU: install flash-attn, or torch >= 2.11"
    q, k, v, cu_q, cu_k = varlen_case()
    g = torch.Generator().manual_seed(1)
    grad_out = torch.randn(q.shape, generator=g)
    for kernel in filter(None, kernels):
        for window in (-1, 3):
            want_in = [x.clone().requires_grad_() for x in (q, k, v)]
            want = mp.varlen_attention_reference(*want_in, cu_q, cu_k, 10, 10, softmax_scale=0.2,
                                                 window_size=(window, 0))
            want.backward(grad_out)
            got_in = [x.to("cuda", torch.bfloat16).requires_grad_() for x in (q, k, v)]
            got = kernel(*got_in, cu_q.cuda(), cu_k.cuda(), 10, 10, softmax_scale=0.2, causal=True,
                         window_size=(window, 0))
            got.backward(grad_out.to("cuda", torch.bfloat16))
            label = f"{kernel.__name__}, window {window}"
            assert (got.float().cpu() - want).abs().max() < 3e-2, f"{label}: output"
            for name, a, b in zip("qkv", got_in, want_in):
                err = (a.grad.float().cpu() - b.grad).abs().max() / b.grad.abs().max()
                assert err < 3e-2, f"{label}: d{name} off by {err:.1e} (relative to its largest)"


@pytest.mark.parametrize("case", list(CASES), ids=["-".join(map(str, c)) for c in CASES])
def test_trainer_on_gpu_matches_the_fp32_hf_model(tmp_path, case):
    path = mp.materialize_tiny_model("tiny-llama", str(tmp_path), SEED)
    reference = hf_reference(path, LENS, PROMPT_LEN, TEMPERATURE, SEED)
    torch_mp.spawn(_passes_on_gpu, args=(path, reference, case, _free_port()), nprocs=1)


@pytest.mark.slow
def test_ppo_cli_on_gpu_trains_resumes_and_exports(tmp_path):
    """dtype/attention "auto" resolve to the GPU recipe; 2 steps, then resumed for step 3."""
    out = str(tmp_path / "run")
    args = ["--config", "configs/test_tiny.toml", "--rollout_engine=hf", "--save_every=2", f"--out_dir={out}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run_cli(1, *args, env=env)
    with open(os.path.join(out, "config.json")) as f:
        resolved = json.load(f)
    assert resolved["dtype"] == "bf16", "dtype=auto on CUDA must pick the bf16 recipe"
    assert resolved["attention"] == ("varlen" if mp.gpu_varlen_kernel() else "masked")
    proc = run_cli(1, *args, "--steps=3", "--resume=auto", env=env)
    assert "resumed from" in proc.stdout, "no checkpoint was resumed (a fresh start also writes steps 0-2)"
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(torch.isfinite(torch.tensor([r["policy_loss"], r["value_loss"], r["kl"]])).all() for r in rows)
    from transformers import AutoModelForCausalLM
    exported = AutoModelForCausalLM.from_pretrained(os.path.join(out, "hf"), dtype=torch.float32)
    assert torch.isfinite(exported(torch.tensor([[1, 2, 3]])).logits).all()


def _offload_on_gpu(rank, path, port):
    """One GPU: after an AdamW step, move_optimizer_state(opt, "host") frees the two moments' GPU
    bytes (8 a parameter) into pinned host memory; moved back they are the same numbers."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")
    _, _, device = mp.init_distributed()
    mesh = mp.make_mesh(1, 1, 1, "cuda")
    policy = mp.load_policy(path, mesh, config.Config(dtype="bf16"))
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3, fused=True)
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    mp.forward_policy(policy, ids, [5], mesh, config.Config(dtype="bf16"))[0].sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    saved = {id(s): {k: mp._local(s[k]).clone() for k in ("exp_avg", "exp_avg_sq")}
             for s in optimizer.state.values()}
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    mp.move_optimizer_state(optimizer, "host")
    torch.cuda.synchronize()
    moments = 8 * sum(mp._local(p).numel() for p in policy.parameters())
    assert before - torch.cuda.memory_allocated() >= 0.99 * moments, \
        (before, torch.cuda.memory_allocated(), moments)
    assert all(mp._local(s[k]).is_pinned()
               for s in optimizer.state.values() for k in ("exp_avg", "exp_avg_sq"))
    mp.move_optimizer_state(optimizer, device)
    for s in optimizer.state.values():
        for k in ("exp_avg", "exp_avg_sq"):
            assert mp._local(s[k]).is_cuda and torch.equal(mp._local(s[k]), saved[id(s)][k])
    optimizer.step()  # fused AdamW takes the states back
    dist.destroy_process_group()
    mp.release_mesh(mesh)


def test_optimizer_state_offload_frees_its_gpu_memory(tmp_path):
    path = mp.materialize_tiny_model("tiny-llama", str(tmp_path), SEED)
    torch_mp.spawn(_offload_on_gpu, args=(path, _free_port()), nprocs=1)


def test_sampler_on_gpu_is_batch_invariant_lean_and_faster_than_gumbel_max():
    """rollout.sample on the GPU at Qwen's size (B=512, V=151,936, bf16 logits, T=0.7).

    Rows drawn in batches of 512, 64 and 1 rows, in any order, give the same tokens exactly: the
    cumulative sum is of integers, exact in whatever order CUDA's scan adds them (a float cumsum's
    order changes with the batch's shape: ScanUtils.cuh, cub's scan for a row alone). The
    logprobs agree to fp32 rounding (their normalizer is a float sum). The CPU's exp may round
    another way: its draws agree on all but a few rows, and where they agree, the logprobs too. At
    most 3 new (B, V) tensors a token; at least twice as fast as the Gumbel-max step it replaced
    (21 tensors, 12 of them int64: 6-7 ms a token on an H100 by the review's count)."""
    B, V = 512, 151936
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(B, V, generator=g) * 3).bfloat16()  # (B, V) on the host
    seeds = torch.arange(B) * 7919  # (B,)
    on_gpu, gpu_seeds = logits.cuda(), seeds.cuda()
    tokens, logprobs = rollout.sample(on_gpu, gpu_seeds, 5, 0.7)  # (B,), (B,)
    order = torch.randperm(B, generator=g).cuda()
    for rows in (order, order[:64], order[:1]):
        some_tokens, some_logprobs = rollout.sample(on_gpu[rows], gpu_seeds[rows], 5, 0.7)
        assert torch.equal(tokens[rows], some_tokens)
        torch.testing.assert_close(logprobs[rows], some_logprobs, atol=1e-5, rtol=0)
    cpu_tokens, cpu_logprobs = rollout.sample(logits, seeds, 5, 0.7)
    same = cpu_tokens == tokens.cpu()  # (B,)
    assert same.float().mean() > 0.98, f"{(~same).sum().item()} of {B} rows drew another token on the CPU"
    torch.testing.assert_close(cpu_logprobs[same], logprobs.cpu()[same], atol=1e-4, rtol=0)
    with NewTensors(B * V) as new:
        rollout.sample(on_gpu, gpu_seeds, 5, 0.7)
    assert new.count <= 3, new.ops

    def ms_a_token(step):
        for t in range(3):  # warm-up
            step(on_gpu, gpu_seeds, t, 0.7)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for t in range(20):
            step(on_gpu, gpu_seeds, t, 0.7)
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / 20 * 1e3

    ours, gumbel = ms_a_token(rollout.sample), ms_a_token(gumbel_step)
    print(f"B={B}, V={V}, bf16 logits: rollout.sample {ours:.2f} ms a token, Gumbel-max {gumbel:.2f} ms")
    assert ours < gumbel / 2, (ours, gumbel)
