"""Multi-turn episodes (docs/multiturn.md): a response that is several model turns, with an
observation (a tool's output) appended between them. The core samples one turn a prompt
(rollout.generate); with a task that has `observe()` and max_turns > 1, the core's
rollout.episode_runner hands generation to run_episodes here, which calls rollout.generate once a
turn for the episodes still running.

What the core already does for any response, and so for an episode: the action mask (1 on the
model's tokens, 0 on an observation's: in no loss or statistic), GAE stepping over the
observations (train_ppo.compute_gae), the reward read from the model's last turn
(rollout.last_turn), the supervised warm-up trained on a trace's model tokens (rollout.sft_examples
takes a target's (ids, mask)), and the endings and turn counts in the metrics
(rollout.episode_metrics).

Where the core calls it: rollout.episode_runner (generation, training and validation alike),
rollout.make_task (task=toy_tool: ToyToolTask), train_ppo.start_run (setup: Dr. GRPO's constant;
task_notes: max_turns given to a task without turns).
Peers: none; scripts/smollm2_tool.py's real tool uses chat_tool_message.
"""
import dataclasses
import re

import torch.distributed as dist

import config
import rollout
from config import ConfigError
from rollout import TaskError, ToyTask


@dataclasses.dataclass
class Options:
    """This file's options, a part of config.Config: config.py runs this class and `check` alone,
    from this file's text, before torch loads (README, "Extensions")."""

    # ---- multi-turn episodes (multiturn.py) ----
    # model turns per episode at most, for a task with observations (a tool's output) between
    # them; the episode (prompt + turns + observations) stays within max_model_len, which bounds
    # it anyway (docs/multiturn.md). Many by default, as TRL (no limit) and NeMo-RL (999,999): 1
    # would end every episode at its first tool call, silently. A task without observe() is
    # single-turn whatever this says; max_turns=1 takes a task's tool away
    max_turns: int = 1000


def check(cfg):
    """This file's refusals, one line each (config.validate runs it, before torch loads: it may
    use ConfigError, os and json alone)."""
    if cfg.max_turns < 1:
        raise ConfigError(f"max_turns={cfg.max_turns} must be > 0")


def setup(cfg):
    """Dr. GRPO's constant (seq-mean-token-sum-norm) is the longest response (verl: its response
    length): in an episode of turns, up to max_model_len tokens, not one turn's max_new_tokens
    (docs/losses.md). Set here, at the start, for a run of episodes whose config leaves it 0, and
    recorded in config.json; train_ppo.train_minibatch reads it."""
    if not cfg.loss_agg_norm:
        cfg.loss_agg_norm = cfg.max_model_len


def task_notes(task, cfg):
    """Rank 0 prints a note if the user gave max_turns and the task cannot take turns: it has no
    `observe` (toy_add, gsm8k, a fork's single-turn task), so each episode is one turn."""
    if not hasattr(task, "observe") and dist.get_rank() == 0:
        print(config.note_line(cfg, "max_turns", "does nothing: the task has no observe(), so "
                                                 "an episode is one turn"), flush=True)


def run_episodes(engine, task, cfg, prompt_ids, keys, temperature):
    """Collective over each vLLM group (its ranks pass identical requests, and `observe` must be
    deterministic). The episode of each prompt (token ids), sampled with seeds from its key
    ((step, prompt, sample), then the turn: rollout.sample_seed). One engine call a turn for the
    episodes still running (rollout.generate), each on its ids so far: token ids in and out,
    nothing re-tokenized (vLLM's prefix cache keeps the earlier turns). After a model turn that
    ended by a stop token, the task's `observe` gives the ids to append (a tool call's output), or
    None: the episode is over. It also ends at a turn cut off by its token budget (max_new_tokens,
    and prompt + episode <= max_model_len), or at a call on the last of max_turns turns, or at a
    call whose output would leave no room for another turn: appended whole, never cut. Returns
    rollout.generate's tuple per prompt (response ids, engine logprobs, action mask, tool calls,
    how it ended: rollout.ENDINGS): the turns and observations in order; an observation's tokens
    have logprob 0 and mask 0 (context, not actions), and the last token is always the model's. A
    task without `observe` is single-turn."""
    observe = getattr(task, "observe", None)
    turns = cfg.max_turns if observe else 1  # a task without `observe` is single-turn
    episodes = [dict(ids=[], logprobs=[], mask=[], calls=0, ended=None) for _ in prompt_ids]
    running = list(range(len(prompt_ids)))
    for turn in range(turns):
        contexts = [prompt_ids[k] + episodes[k]["ids"] for k in running]
        outs = rollout.generate(engine, task, cfg, contexts,
                                [(*keys[k], turn) for k in running], temperature)
        for k, context, (ids, lps, _, _, ended) in zip(running, contexts, outs):
            episode = episodes[k]
            for part, new in zip(("ids", "logprobs", "mask"),
                                 (ids, lps, [1] * len(ids))):  # the model's turn
                episode[part] += new
            if ended == "length":  # cut off by its budget: no call to answer
                episode["ended"] = "length"
                continue
            observation = observe(ids, context + ids) if observe else None
            if observation is None:  # the model's answer: a natural end
                episode["ended"] = "stop"
                continue
            # an empty list would merge two turns into one run of 1s: a turn the metrics lose
            if not (isinstance(observation, list) and len(observation) > 0 and all(
                    isinstance(i, int) and 0 <= i < engine.vocab_size for i in observation)):
                raise TaskError(f"observe() must return a list of token ids in "
                                f"[0, {engine.vocab_size}), not empty, or None, "
                                f"not {str(observation)[:60]}")
            episode["calls"] += 1  # a call, answered or not
            room = len(context) + len(ids) + len(observation) < cfg.max_model_len
            if turn + 1 == turns or not room:
                episode["ended"] = "max_turns" if turn + 1 == turns else "context"
                continue
            n = len(observation)
            for part, new in zip(("ids", "logprobs", "mask"),
                                 (observation, [0.0] * n, [0] * n)):  # context
                episode[part] += new
        running = [k for k in running if episodes[k]["ended"] is None]  # the episodes that go on
    return [(e["ids"], e["logprobs"], e["mask"], e["calls"], e["ended"]) for e in episodes]


# Multi-turn episodes: a task may define
#     observe(self, turn: list, episode: list) -> Optional[list]
# called after each model turn that ended by a stop token (the last allowed one too: a call there
# is counted, and ends the episode as "max_turns"), with that turn's ids and the whole episode so
# far (prompt + response, ending with the turn). It returns the ids to append (a tool's output,
# formatted as its chat template formats a tool message: chat_tool_message), or None: the episode
# is over. A task without it is single-turn. It must be deterministic (the ranks of a vLLM group
# each run it on the same turn). ToyToolTask below has one.

class ToyToolTask(ToyTask):
    """A task where a tool is the difference (docs/multiturn.md): sums of two-digit numbers,
    "23+45=", which the toy model cannot learn to add in minutes, and a calculator it can call.
    A turn "?" (then EOS) calls it on the prompt's sum; the observation is its result in brackets,
    "[68]", and the model's next turn should copy it: "?<eos>[68]68<eos>". The reward (ToyTask's)
    reads the last turn: 1 for the exact sum, if the model stopped. Its SFT target is that whole
    trace, the tool's output masked. With tool=False (max_turns=1: the tool taken away) the target
    is the direct answer instead, "68<eos>", so that the comparison is against a model taught to
    answer, not one taught to call a missing tool."""

    facts = [(f"{a}+{b}=", str(a + b)) for a in range(10, 100) for b in range(10, 100)]

    def __init__(self, seed: int, tool: bool = True):
        super().__init__(seed)
        self.tool = tool

    def observe(self, turn, episode):
        if self.decode(turn) != "?":  # an answer: the episode is over
            return None
        a, b = re.match(r"(\d+)\+(\d+)=", self.decode(episode)).groups()  # the prompt
        return self.tok.encode(f"[{int(a) + int(b)}]")

    def target(self, answer):
        if not self.tool:
            return super().target(answer)
        call, observation = self.tok.encode("?") + [self.eos_id], self.tok.encode(f"[{answer}]")
        ids = call + observation + self.tok.encode(answer) + [self.eos_id]
        return ids, [1] * len(call) + [0] * len(observation) + [1] * (len(answer) + 1)


def chat_tool_message(tok, content: str, role: str = "tool", stop_ids=None, name: str = "tool",
                      max_tokens=None) -> list:
    """The ids to append after a model turn (ended by a stop token: `stop_ids`, default the
    tokenizer's EOS; Llama 3 ends a turn with <|eot_id|>, or <|eom_id|> after a call) for a tool
    message `content`, up to the opening of the assistant's next turn, as the tokenizer's chat
    template writes them: the difference of two renderings of one conversation, without and with
    the message (TRL's way). The conversation's assistant turn carries a call of the tool `name`,
    as a real one would: some templates write the tool message's header from the call (TRL notes
    it), or refuse a tool message that answers none. What the template puts after the turn's stop
    token (ChatML's "\n") comes with it, so the episode's ids are the template's rendering of the
    whole conversation. The role is the template's: "tool"
    (Qwen2.5 wraps it in <tool_response> tags inside a user turn), "ipython" (Llama 3.1). Refused
    (TaskError) where the template writes the earlier turns differently once the message follows
    (e.g. one that drops past reasoning): no appended ids could match it.

    max_tokens: a bound on the content, in tokens, of the task's choosing: a longer content is cut
    to it and marked "...(truncated)" (verl's max_tool_response_length does the same). Without a
    bound, an output that leaves no room for another turn ends the episode instead ("context");
    a message is never cut mid-template."""
    words = tok.encode(content, add_special_tokens=False)  # the content's tokens
    if max_tokens is not None and len(words) > max_tokens:
        content = tok.decode(words[:max_tokens]) + "...(truncated)"
    call = {"type": "function", "function": {"name": name, "arguments": {}}}
    chat = [{"role": "user", "content": "1"},
            {"role": "assistant", "content": "2", "tool_calls": [call]}]
    before = list(tok.apply_chat_template(chat, tokenize=True, return_dict=False))
    after = list(tok.apply_chat_template(chat + [{"role": role, "content": content, "name": name}],
                                         tokenize=True, add_generation_prompt=True,
                                         return_dict=False))
    stops = [tok.eos_token_id] if stop_ids is None else stop_ids
    ends = [i + 1 for i, t in enumerate(before) if t in stops]  # after a turn's stop token
    if not ends or after[:ends[-1]] != before[:ends[-1]]:
        raise TaskError(f"the chat template does not end an assistant turn with a stop token "
                        f"({stops}: pass the turn's stop_ids), or writes it differently once a "
                        f"{role} message follows: observations cannot be appended to the sampled "
                        "ids (render the episode yourself in observe)")
    return after[ends[-1]:]
