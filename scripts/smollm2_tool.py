"""The real tool demo (`make real-tool-demo`): a pretrained SmolLM2-135M-Instruct learns to answer
three-digit sums ("What is 347 + 589?"), which it cannot do alone, by calling a calculator, in
episodes of two turns.

    # train: the SFT warm-up on tool traces, then GRPO with max_turns=2 (2 processes, vLLM)
    torchrun --nproc_per_node=2 scripts/smollm2_tool.py train --config configs/smollm2_tool_cpu.toml
    # the same without the tool: a warm-up on direct answers, then GRPO with one turn
    torchrun --nproc_per_node=2 scripts/smollm2_tool.py train \\
        --config configs/smollm2_tool_cpu.toml --max_turns=1 --out_dir=out/smollm2-tool-notool/seed1
    # greedy held-out accuracy of checkpoint dirs under transformers' generate, in a turn loop of
    # its own (not multiturn.run_episodes); --max_turns=1: without the tool
    python scripts/smollm2_tool.py eval --config configs/smollm2_tool_cpu.toml [--key=value] DIR...

An episode with the tool, token for token (ChatML; <|im_end|> is SmolLM2's EOS and only stop id):

    <|im_start|>system\\nYou have a calculator: ...<|im_end|>\\n
    <|im_start|>user\\nWhat is 347 + 589? Answer with only the number.<|im_end|>\\n
    <|im_start|>assistant\\n                                            (the prompt)
    <calc>347 + 589</calc><|im_end|>                                turn 1, the model's: a call
    \\n<|im_start|>tool\\n936<|im_end|>\\n<|im_start|>assistant\\n        the tool's output (mask 0)
    936<|im_end|>                                                   turn 2, the model's: the answer

The calculator evaluates what the model wrote in the call (a + b, a - b or a * b), not the
prompt's sum: a call with a miscopied operand gets a wrong result. The tool's message is
multiturn.chat_tool_message: the template's own rendering of a `tool` message (SmolLM2's template
writes any role as `<|im_start|>role`). The reward reads the model's last turn, its answer (the
trainer cuts the observations and earlier turns off): 1 if the episode ended naturally ("stop": a
turn ended by <|im_end|> that was not a call) and the turn's last number is the sum, else 0. A
direct answer, with no call, counts the same: the tool is offered, not imposed.

The task is this file's `ToolSums` (the task contract of rollout.ToyTask); train_ppo.main(cfg, task)
runs it. `max_turns` in the config decides the tool: > 1 offers it (the system message names
it, the warm-up imitates call traces with the tool's output masked), 1 takes it away (no
calculator in the system message, the warm-up imitates direct answers, "936<|im_end|>"), so that
the no-tool run compares against a model taught to answer, not one taught to call a missing tool.
Data:
5,000 training and 128 held-out sums with operands 100..999, generated here (seeded, fixed: every
run holds out the same 128), disjoint by unordered operand pair.
"""
import os
import random
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import config  # noqa: E402  (after the path: the trainer's modules live in the repo root)
import rollout  # noqa: E402
from extensions import multiturn
from smollm2 import TEMPLATES  # noqa: E402  (the five phrasings of `make real-demo`)

# The held-out set is the same for every run seed: seeds differ in what they sample, not in what
# they are scored on.
DATA_SEED = 0
N_TRAIN, N_VAL = 5000, 128
# The system message names the tool (or none). It replaces the template's default one (~20 tokens
# longer): vLLM on CPU must not split a turn's prefill, see configs/smollm2_tool_cpu.toml.
TOOL_SYSTEM = "You have a calculator: write <calc>a + b</calc> and it replies with the result."
PLAIN_SYSTEM = "You are a helpful assistant."
INSTRUCTION = " Answer with only the number."
# A call: the whole turn, spaces allowed around the numbers (decode drops the turn's <|im_end|>);
# at most 12 digits an operand, so that no product is too large to print.
CALL = re.compile(r"\s*<calc>\s*(\d{1,12})\s*([-+*])\s*(\d{1,12})\s*</calc>\s*")
OPERATIONS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def sum_problems(seed: int) -> tuple:
    """(train, val) lists of (question, answer) pairs, answer "347 + 589 = 936" (the operands in
    the order asked: the warm-up's call copies them). No val sum is trained on, in either order
    or any phrasing: the split is by unordered operand pair."""
    rng = random.Random(seed)
    pairs = set()
    while len(pairs) < N_TRAIN + N_VAL:  # distinct unordered pairs, 810,900 to draw from
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        pairs.add((min(a, b), max(a, b)))
    pairs = sorted(pairs)  # a set's order is not seeded: sort, then shuffle with the rng
    rng.shuffle(pairs)

    def row(a, b):
        a, b = rng.sample((a, b), 2)  # either order
        return rng.choice(TEMPLATES).format(a=a, b=b), f"{a} + {b} = {a + b}"
    return [row(*p) for p in pairs[N_VAL:]], [row(*p) for p in pairs[:N_VAL]]


# -----------------------------------------------------------------------------
# The task: the contract of rollout.ToyTask (prompts, encode, target, decode, reward, observe,
# val, eos_id, pad_id), on SmolLM2's own tokenizer and chat template.

class ToolSums:
    """Three-digit sums with a calculator (max_turns > 1) or without (max_turns=1)."""

    def __init__(self, cfg):
        from transformers import AutoTokenizer
        self.tok = AutoTokenizer.from_pretrained(cfg.model)
        self.seed = cfg.seed
        self.tool = cfg.max_turns > 1
        self.system = TOOL_SYSTEM if self.tool else PLAIN_SYSTEM
        self.train, self.val = sum_problems(DATA_SEED)
        self.eos_id = self.tok.eos_token_id  # <|im_end|>: ends every turn (generation_config's too)
        self.pad_id = self.tok.pad_token_id  # <|im_end|> as well: padding is never a loss token
        # every prompt is one of the five phrasings with two three-digit numbers (a token a digit)
        longest = max(len(self.encode(t.format(a=999, b=999))) for t in TEMPLATES)
        # prompt, a call, the tool's message (13 tokens), the answer: all in one packed row
        if longest + 2 * cfg.max_new_tokens + 16 > cfg.max_model_len:
            raise rollout.TaskError(f"a prompt of {longest} tokens, two turns of max_new_tokens="
                                    f"{cfg.max_new_tokens} and a tool message exceed max_model_len="
                                    f"{cfg.max_model_len}: raise max_model_len")

    def prompts(self, start, n):
        return [self.train[i] for i in rollout.epoch_order(self.seed, len(self.train), start, n)]

    def encode(self, question):
        chat = [{"role": "system", "content": self.system},
                {"role": "user", "content": question + INSTRUCTION}]
        return list(self.tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True,
                                                 return_dict=False))

    def target(self, answer):
        """The warm-up's response. With the tool, the trace of a call and the answer, the tool's
        message masked (0: the model is not trained to predict it); without, the direct answer."""
        a, b, total = re.fullmatch(r"(\d+) \+ (\d+) = (\d+)", answer).groups()
        final = self.tok.encode(total) + [self.eos_id]
        if not self.tool:
            return final
        call = self.tok.encode(f"<calc>{a} + {b}</calc>") + [self.eos_id]
        observation = multiturn.chat_tool_message(self.tok, total)
        return call + observation + final, [1] * len(call) + [0] * len(observation) + [1] * len(final)

    def decode(self, ids):
        return self.tok.decode(ids, skip_special_tokens=True)

    def observe(self, turn, episode):
        """The calculator: a turn that is a call gets its result as a tool message; anything else
        is an answer (None: the episode is over). A malformed call gets an error message."""
        text = self.decode(turn)
        if "<calc>" not in text:
            return None
        call = CALL.fullmatch(text)
        if call is None:
            return multiturn.chat_tool_message(self.tok, "error: write <calc>a + b</calc>")
        a, op, b = call.groups()
        return multiturn.chat_tool_message(self.tok, str(OPERATIONS[op](int(a), int(b))))

    def reward(self, text, answer, ended):
        """text: the model's last turn (the trainer cuts the rest off). 1 for the sum as its last
        number, in an episode that ended naturally. (After a call's end tag: given the model's
        whole text, the same score.)"""
        final = text.rsplit("</calc>", 1)[-1]
        return float(ended == "stop" and rollout.extract_answer(final) == answer.rsplit(" ", 1)[-1])


def load_task(cfg):
    if not os.path.isfile(os.path.join(cfg.model, "config.json")):
        sys.exit(f"no checkpoint at {cfg.model}: make checkpoints/SmolLM2-135M-Instruct/config.json")
    try:
        return ToolSums(cfg)
    except rollout.TaskError as e:
        sys.exit(f"input error: {e}")


# -----------------------------------------------------------------------------
# The evaluation: transformers' generate in a turn loop of its own, with the trainer's stop ids,
# budgets, observations and reward, but none of its episode code (multiturn.run_episodes).

def greedy_episodes(model, task, cfg, stop_ids, questions) -> list:
    """(the model's last turn, as text: what the trainer's reward reads; how the episode ended;
    its calls) of each question's greedy episode. Each turn is one left-padded generate call for
    the episodes still running. A turn's budget is
    min(max_new_tokens, max_model_len - its context); an episode ends at a turn that is not a call
    ("stop"), a turn cut off by its budget ("length"), a call on the last allowed turn
    ("max_turns"), or a call whose output leaves no room for another turn ("context")."""
    import torch
    contexts = [task.encode(q) for q in questions]
    last = [[] for _ in questions]  # each episode's latest model turn
    ended, calls = ["stop"] * len(questions), [0] * len(questions)
    running = list(range(len(questions)))
    for turn in range(cfg.max_turns):
        if not running:
            break
        width = max(len(contexts[k]) for k in running)  # left-pad: each row ends where it generates
        ids = torch.tensor([[task.pad_id] * (width - len(contexts[k])) + contexts[k] for k in running])
        mask = torch.tensor([[0] * (width - len(contexts[k])) + [1] * len(contexts[k]) for k in running])
        budgets = [min(cfg.max_new_tokens, cfg.max_model_len - len(contexts[k])) for k in running]
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(budgets),
                                 do_sample=False, eos_token_id=stop_ids, pad_token_id=task.pad_id)
        still = []
        # greedy: a row's first `budget` tokens are what a call with its own budget would give
        for k, row, budget in zip(running, out[:, width:].tolist(), budgets):
            stops = [j for j, t in enumerate(row[:budget]) if t in stop_ids]
            new = row[:stops[0] + 1] if stops else row[:budget]  # generate pads rows that stopped
            last[k] = new
            contexts[k] += new
            if not stops:
                ended[k] = "length"
                continue
            observation = task.observe(new, contexts[k])
            if observation is None:
                continue  # an answer: "stop"
            calls[k] += 1
            if turn + 1 == cfg.max_turns:
                ended[k] = "max_turns"
            elif len(contexts[k]) + len(observation) >= cfg.max_model_len:
                ended[k] = "context"
            else:
                contexts[k] += observation
                still.append(k)
        running = still
    return [(task.decode(t), e, c) for t, e, c in zip(last, ended, calls)]


def evaluate(model_dir: str, cfg, batch_size: int = 32) -> dict:
    """Greedy accuracy on the held-out sums, the rate of episodes with a call and of each
    ending."""
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    task = load_task(cfg)
    stop_ids = rollout.stop_token_ids(model_dir, task.eos_id)
    results = []
    for i in range(0, len(task.val), batch_size):
        batch = task.val[i:i + batch_size]
        episodes = greedy_episodes(model, task, cfg, stop_ids, [q for q, _ in batch])
        results += [(task.reward(text, a, ended), ended, calls) for (text, ended, calls), (_, a) in
                    zip(episodes, batch)]
    n = len(results)
    scores = dict(accuracy=sum(r for r, _, _ in results) / n, called=sum(c > 0 for _, _, c in results) / n)
    scores.update({f"ended_{e}": sum(x == e for _, x, _ in results) / n for e in rollout.ENDINGS})
    return scores


def main(argv: list) -> None:
    if not argv or argv[0] not in ("train", "eval"):
        sys.exit("usage: scripts/smollm2_tool.py train|eval --config FILE [--key=value ...] [DIR ...]")
    command, rest = argv[0], argv[1:]
    if command == "train":  # under torchrun: every rank parses the config and builds the task
        import train_ppo
        cfg = config.load(rest, world_size=int(os.environ.get("WORLD_SIZE", "1")))
        train_ppo.main(cfg, task=load_task(cfg))
        return
    # eval: options as the trainer's (--config FILE, --key=value), then the model dirs
    options, dirs = [], []
    for i, arg in enumerate(rest):
        is_option = arg.startswith("--") or (i > 0 and rest[i - 1] == "--config")
        (options if is_option else dirs).append(arg)
    cfg = config.load(options, world_size=1)
    scores = {d: evaluate(d, cfg) for d in dirs}
    for d, s in scores.items():
        ends = " ".join(f"{k[6:]} {v:.2f}" for k, v in s.items() if k.startswith("ended_"))
        print(f"{d}: greedy val accuracy {s['accuracy']:.3f} (max_turns={cfg.max_turns}), episodes with "
              f"a call {s['called']:.2f}, ended: {ends}")
    print("RESULT " + " ".join(f"{os.path.basename(d.rstrip('/'))}={s['accuracy']:.3f}"
                               for d, s in scores.items()))


if __name__ == "__main__":
    main(sys.argv[1:])
