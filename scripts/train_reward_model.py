"""A reward model from preference pairs: the Bradley-Terry model that classic RLHF trains before PPO
(Stiennon et al., 2020; InstructGPT, Ouyang et al., 2022). The trainer then loads it with
reward_model=DIR (and, as OpenRLHF does by default, starts its critic from it: critic_model=DIR).

    # pairs for the toy task, from its rule: the right sum against a wrong or an unfinished one
    python scripts/train_reward_model.py toy-pairs OUT.jsonl [--n 8000] [--seed 1]
    # Bradley-Terry training of MODEL_DIR (+ a score head) on {prompt, chosen, rejected} lines
    python scripts/train_reward_model.py train --config RUN.toml --init MODEL_DIR \
        --pairs FILE.jsonl --out RM_DIR [--steps 600] [--lr 3e-4] [--batch 32] [--val 0.1]

The loss is -log sigmoid(r(prompt, chosen) - r(prompt, rejected)): the probability that a person
prefers the chosen response, under a model where each response has a scalar score r. The score is
the head's output at the sequence's last token (the EOS when the response ended), exactly what the
trainer reads in its no-grad phase, so that what is trained here is what PPO is scored by.

The prompts are encoded by the run's own task (--config: the same chat template and instruction as
the trainer), the responses by its tokenizer; a response that ends with the tokenizer's EOS text
("<|endoftext|>" for the toy task) ended by itself, any other was cut off. The output is an HF
`*ForSequenceClassification` checkpoint (num_labels 1): transformers, vLLM and this trainer read it.
The last line is `RESULT pairwise_accuracy=... val_pairs=... loss=...` (held-out pairs).
"""
import argparse
import json
import os
import random
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def toy_pairs(n: int, seed: int) -> list:
    """n {prompt, chosen, rejected} rows for the toy task ("a+b=" with operands 0..4): chosen is the
    sum then EOS; rejected is one of the ways a policy fails, the ones PPO's rule scores 0. A
    reward model only knows what its pairs showed it, and a policy finds whatever it rates high by
    mistake (a first version without the empty response was beaten by "<eos>" alone, which it had
    never seen): so every failure a sampling policy makes is here, weighted by how much there is
    to learn from it.
      45%  a wrong number, then EOS, half of them near misses (the sum +-1 or +-2): the reward
           model must learn every sum exactly
      15%  the empty response: EOS at once
      15%  the sum run on without an EOS (cut off by max_new_tokens)
      15%  the sum with a stray character, then EOS
      10%  two digits or more, then EOS (a number no sum of 0..4 reaches)"""
    import rollout
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        prompt, answer = rng.choice(rollout.TOY_FACTS)
        kind = rng.random()
        if kind < 0.45:
            # half of them a near miss (the sum +-1 or +-2): the hardest to tell from the answer
            near = [w for w in range(int(answer) - 2, int(answer) + 3) if 0 <= w != int(answer)]
            far = [w for w in range(10) if w != int(answer)]
            rejected = str(rng.choice(near if rng.random() < 0.5 else far)) + rollout.EOS
        elif kind < 0.60:
            rejected = rollout.EOS
        elif kind < 0.75:
            rejected = answer + "".join(rng.choices("0123456789+=", k=rng.randint(1, 4)))
        elif kind < 0.90:
            rejected = answer + rng.choice("0123456789+=") + rollout.EOS  # (a space: the rule strips it)
        else:
            rejected = str(rng.randint(10, 99)) + rollout.EOS
        rows.append({"prompt": prompt, "chosen": answer + rollout.EOS, "rejected": rejected})
    return rows


def encode_response(task, text: str) -> list:
    """Token ids of a response: its text, then the EOS id if the text ends with the EOS text."""
    hf = hasattr(task.tok, "eos_token")  # an HF tokenizer; else the toy task's tiktoken
    eos_text = task.tok.eos_token if hf else task.tok.decode([task.eos_id])
    ended = text.endswith(eos_text)
    body = text[: -len(eos_text)] if ended else text
    ids = task.tok.encode(body, add_special_tokens=False) if hf else task.tok.encode(body)
    return ids + [task.eos_id] if ended else ids


def scores(model, sequences: list, pad_id: int):
    """The head's output at each sequence's last token, (N,). The sequences are right-padded; the
    read is at len - 1 itself, not at "the last non-pad token" (HF's pooling), which would skip an
    EOS that equals the pad id."""
    import torch
    lens = torch.tensor([len(s) for s in sequences])
    ids = torch.full((len(sequences), int(lens.max())), pad_id, dtype=torch.long)  # (N, S)
    for i, s in enumerate(sequences):
        ids[i, : len(s)] = torch.tensor(s)
    attention = (torch.arange(ids.shape[1])[None] < lens[:, None]).long()  # (N, S)
    hidden = model.base_model(input_ids=ids, attention_mask=attention).last_hidden_state  # (N, S, H)
    return model.score(hidden)[torch.arange(len(sequences)), lens - 1, 0].float()  # (N,)


def train(args) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification
    import config as config_module
    import rollout
    config_module.quiet_third_party_output()  # transformers' progress bars
    cfg = config_module.parse_args(["--config", args.config] if args.config else [])
    task = rollout.make_task(cfg, args.init, AutoConfig.from_pretrained(args.init).vocab_size)
    with open(args.pairs) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if not rows or not all({"prompt", "chosen", "rejected"} <= set(r) for r in rows):
        sys.exit(f"{args.pairs}: every line must be a JSON object with prompt, chosen, rejected")
    pairs = []
    for r in rows:
        prompt = task.encode(r["prompt"])
        pairs.append((prompt + encode_response(task, r["chosen"]),
                      prompt + encode_response(task, r["rejected"])))
    # Held-out pairs must be unseen, and a rule's pairs repeat: the split is over distinct pairs.
    # Training then samples every row whose pair is not held out, repeats included: deduplicated,
    # the few distinct wrong-number pairs (the hard ones) would drown among the many distinct
    # garbage strings, and the model would never learn the near misses.
    pairs = [(tuple(c), tuple(rj)) for c, rj in pairs]
    distinct = list(dict.fromkeys(pairs))
    rng = random.Random(args.seed)
    rng.shuffle(distinct)
    val = distinct[:max(1, int(len(distinct) * args.val))]
    held_out = set(val)
    trainset = [pair for pair in pairs if pair not in held_out]
    torch.manual_seed(args.seed)
    # the backbone from --init; the score head Linear(hidden, 1, bias=False) is new (HF's init)
    model = AutoModelForSequenceClassification.from_pretrained(args.init, num_labels=1, dtype=torch.float32)
    model.config.pad_token_id = task.pad_id
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    model.train()
    for step in range(args.steps):
        batch = rng.sample(trainset, min(args.batch, len(trainset)))
        r = scores(model, [c for c, _ in batch] + [rj for _, rj in batch], task.pad_id)  # (2n,)
        chosen, rejected = r[: len(batch)], r[len(batch):]
        # Bradley-Terry: -log P(chosen preferred) = -log sigmoid(r_chosen - r_rejected)
        loss = -torch.nn.functional.logsigmoid(chosen - rejected).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 50 == 0 or step == args.steps - 1:
            print(f"rm step {step + 1}/{args.steps} | loss {loss.item():.4f}", flush=True)
    model.eval()
    with torch.no_grad():
        r = scores(model, [c for c, _ in val] + [rj for _, rj in val], task.pad_id)
        margin = r[: len(val)] - r[len(val):]  # (n_val,)
        accuracy = (margin > 0).float().mean().item()
        val_loss = -torch.nn.functional.logsigmoid(margin).mean().item()
    model.save_pretrained(args.out + ".tmp")
    # the tokenizer files and generation_config (stop ids) of the dir it started from
    import model_parallel
    import shutil
    for name in model_parallel.TOKENIZER_FILES:
        if os.path.isfile(os.path.join(args.init, name)):
            shutil.copy(os.path.join(args.init, name), args.out + ".tmp")
    shutil.rmtree(args.out, ignore_errors=True)
    os.replace(args.out + ".tmp", args.out)
    print(f"wrote {args.out}")
    print(f"RESULT pairwise_accuracy={accuracy:.4f} val_pairs={len(val)} loss={val_loss:.4f}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("toy-pairs", help="preference pairs for the toy task, from its rule")
    p.add_argument("out")
    p.add_argument("--n", type=int, default=8000)
    p.add_argument("--seed", type=int, default=1)
    p = sub.add_parser("train", help="Bradley-Terry training into an HF sequence-classification dir")
    p.add_argument("--config", default="", help="the PPO run's config (its task encodes the prompts)")
    p.add_argument("--init", required=True, help="HF checkpoint dir to start from (e.g. the SFT policy)")
    p.add_argument("--pairs", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--batch", type=int, default=32, help="pairs per step")
    p.add_argument("--val", type=float, default=0.1, help="fraction of pairs held out")
    p.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    if args.command == "toy-pairs":
        rows = toy_pairs(args.n, args.seed)
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out + ".tmp", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        os.replace(args.out + ".tmp", args.out)
        print(f"wrote {len(rows)} pairs to {args.out}")
    else:
        train(args)


if __name__ == "__main__":
    main()
