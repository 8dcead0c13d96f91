"""The real-model path on CPU: a tiny Qwen2 saved with a real tokenizer and chat template
(a byte-level BPE trained here with the `tokenizers` library, nothing downloaded), a small
GSM8K-format JSONL, 2 PPO steps through the CLI with the vLLM engine and validation."""
import dataclasses
import json
import os
import re
import types

import pytest
import torch.distributed as dist
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

import config
import model_parallel
import rollout
from conftest import ROOT, read_metrics, run_cli
from extensions import multiturn

# Qwen's ChatML layout
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
PROBLEMS = [(f"Tom has {a} apples and buys {b} more. How many apples does he have?",
             f"He has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} apples.\n#### {a + b}")
            for a, b in [(3, 4), (10, 5), (7, 8), (12, 30), (1, 1), (6, 9), (20, 22), (2, 40)]]
GSM8K_TEXT = rollout.GSM8K_INSTRUCTION + " user assistant"  # so the BPE has merges for these too


def save_tokenizer(path, vocab_size=400):
    corpus = [q + " " + a for q, a in PROBLEMS] * 20 + [GSM8K_TEXT]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE)
    fast.save_pretrained(path)
    return fast


def write_jsonl(path, pairs):
    with open(path, "w") as f:
        for q, a in pairs:
            f.write(json.dumps({"question": q, "answer": a}) + "\n")


@pytest.fixture(scope="module")
def real_model(tmp_path_factory):
    """A tiny Qwen2 checkpoint dir with tokenizer files, as a hub download would have."""
    root = tmp_path_factory.mktemp("real")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29617")
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        path = model_parallel.materialize_tiny_model("tiny-qwen2", str(root), seed=0, vocab_size=448,
                                              bos_token_id=0, eos_token_id=2, pad_token_id=0)
    finally:
        dist.destroy_process_group()
    save_tokenizer(path)
    write_jsonl(root / "train.jsonl", PROBLEMS[:6])
    write_jsonl(root / "val.jsonl", PROBLEMS[6:])
    return root, path


def test_task_applies_chat_template_and_checks_inputs(real_model):
    root, path = real_model
    cfg = types.SimpleNamespace(task="gsm8k", prompts=str(root / "train.jsonl"), val_prompts="",
                                max_new_tokens=8, max_model_len=256, seed=0, format_reward=0.0,
                                instruction="")
    task = rollout.make_task(cfg, path, model_vocab_size=448)
    tok = AutoTokenizer.from_pretrained(path)
    ids = task.encode(PROBLEMS[0][0])
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>user\nTom has 3 apples") and text.endswith("<|im_start|>assistant\n")
    assert task.eos_id == tok.convert_tokens_to_ids("<|im_end|>")
    assert task.reward("3 + 4 = 7 #### 7", PROBLEMS[0][1], "stop") == 1.0
    stream = task.prompts(0, 2 * len(task.train))  # two epochs, each a permutation of the prompts file
    assert sorted(stream[:len(task.train)]) == sorted(stream[len(task.train):]) == sorted(task.train)
    assert task.prompts(3, 4) == stream[3:7]  # a resumed position draws what the straight run drew
    # (malformed and empty lines of the prompts file: test_failures.py, beside the other bad inputs)
    with pytest.raises(rollout.TaskError, match="tokenizer"):  # tokenizer larger than the model
        rollout.make_task(cfg, path, model_vocab_size=100)
    cfg.max_model_len = 20
    with pytest.raises(rollout.TaskError, match="max_model_len"):  # prompt longer than context
        rollout.make_task(cfg, path, model_vocab_size=448)


class ScriptedChat:
    """An engine that samples the script's k-th assistant turn (its text's ids, then the tokenizer's
    EOS: ChatML's <|im_end|>, Llama 3's <|eot_id|>) for a context holding k earlier turns: what a
    model would sample, made certain."""

    def __init__(self, tok, turns):
        self.tok, self.turns = tok, turns
        self.stop_ids, self.vocab_size = [tok.eos_token_id], 448

    def generate(self, contexts, seeds, budgets, temperature):
        out = []
        for ids in contexts:
            # the system's and the user's messages end so too, and each turn and tool message
            k = (ids.count(self.stop_ids[0]) - 2) // 2
            out.append((self.tok.encode(self.turns[k]) + self.stop_ids, [-1.0] * 99))
        return [(ids, lps[:len(ids)]) for ids, lps in out]


def test_episode_ids_are_the_chat_templates_rendering_of_the_conversation(real_model):
    """system, user, assistant (a tool call), tool, assistant: the prompt's ids, then each turn's
    sampled ids with the tool message between them (multiturn.chat_tool_message in the task's
    observe), are exactly the chat template's rendering of the same conversation, the separators
    included: ChatML's "\n" after each <|im_end|>, which no turn samples, comes with the tool
    message. Then a template that writes earlier turns differently once a tool message follows
    is refused in one line."""
    _, path = real_model
    tok = AutoTokenizer.from_pretrained(path)
    chat = [{"role": "system", "content": "You may call calc(a+b)."},
            {"role": "user", "content": "What is 3 + 4?"}]
    turns = ["calc(3+4)", "He has 3 + 4 = 7 apples. #### 7"]

    class CalcTask:
        def observe(self, turn, episode):
            call = re.fullmatch(r"calc\((\d+)\+(\d+)\)<\|im_end\|>", tok.decode(turn))
            if call is None:  # the answer: the episode is over
                return None
            return multiturn.chat_tool_message(tok, str(int(call[1]) + int(call[2])))

    prompt = list(tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False))
    cfg = config.Config(max_turns=2, max_new_tokens=32, max_model_len=256)
    (response, lps, mask, calls, ended), = multiturn.run_episodes(ScriptedChat(tok, turns), CalcTask(), cfg,
                                                                [prompt], [(0, 0, 0)], 1.0)
    assert (calls, ended) == (1, "stop")
    conversation = chat + [{"role": "assistant", "content": turns[0]}, {"role": "tool", "content": "7"},
                           {"role": "assistant", "content": turns[1]}]
    rendered = list(tok.apply_chat_template(conversation, tokenize=True, return_dict=False))
    episode = prompt + response
    assert rendered[:len(episode)] == episode
    assert tok.decode(rendered[len(episode):]) == "\n"  # the template's separator after the last turn
    observation = [t for t, m in zip(response, mask) if m == 0]
    assert tok.decode(observation) == "\n<|im_start|>tool\n7<|im_end|>\n<|im_start|>assistant\n"
    assert sum(mask) == len(tok.encode(turns[0])) + len(tok.encode(turns[1])) + 2
    # a template that numbers the messages renders every earlier token anew once one is added
    tok.chat_template = "{{ messages | length }}" + CHAT_TEMPLATE
    with pytest.raises(rollout.TaskError, match="writes it differently once a tool message follows"):
        multiturn.chat_tool_message(tok, "7")


# Templates written here that render tool calls and tool messages as Qwen2.5's and Llama 3.1's
# do (not their text: the same layout, on the tiny tokenizer). Qwen2.5-like: ChatML, a tool
# message is a *user* turn holding <tool_response> blocks (consecutive tool messages share one),
# an assistant's tool calls are <tool_call> blocks of JSON after its content.
QWEN_LIKE_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}"
    "{% if loop.first or loop.previtem['role'] != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\\n<tool_response>\\n' + m['content'] + '\\n</tool_response>' }}"
    "{% if loop.last or loop.nextitem['role'] != 'tool' %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{% else %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + (m['content'] or '') }}"
    "{% for c in m['tool_calls'] or [] %}"
    "{% if m['content'] or not loop.first %}{{ '\\n' }}{% endif %}"
    "{% set call = {'name': c['function']['name'], 'arguments': c['function']['arguments']} %}"
    "{{ '<tool_call>\\n' + (call | tojson) + '\\n</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
# Llama 3.1-like: the BOS once, each message under a header and ended by <|eot_id|> (the EOS), no
# separator between turns, a tool's output under the role "ipython", an assistant's tool call
# as its whole content: one JSON object of the name and "parameters".
LLAMA_LIKE_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{% set role = 'ipython' if m['role'] in ['tool', 'ipython'] else m['role'] %}"
    "{{ '<|start_header_id|>' + role + '<|end_header_id|>\\n\\n' }}"
    "{% if m['tool_calls'] %}"
    "{% set c = m['tool_calls'][0]['function'] %}"
    "{{ {'name': c['name'], 'parameters': c['arguments']} | tojson }}"
    "{% else %}{{ m['content'] }}{% endif %}"
    "{{ '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")
CALC_CALL = {"type": "function", "function": {"name": "calc", "arguments": {"a": 3, "b": 4}}}


def calc_episode(tok, turns, read_call, role):
    """The episode of the scripted `turns` (a call to calc, then an answer) after a system and a
    user message, rendered by `tok`'s chat template: the task's observe reads the call's operands
    from the first turn's text (`read_call`) and answers their sum in a `role` message with
    multiturn.chat_tool_message. Returns the conversation before the turns, the prompt's ids, and
    the response's ids and action mask."""
    chat = [{"role": "system", "content": "You may call calc(a, b)."},
            {"role": "user", "content": "What is 3 + 4?"}]

    class CalcTask:
        def observe(self, turn, episode):
            text = tok.decode(turn, skip_special_tokens=True)
            if text == turns[-1]:  # the answer: the episode is over
                return None
            a, b = read_call(text)
            return multiturn.chat_tool_message(tok, str(a + b), role=role)

    prompt = list(tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False))
    cfg = config.Config(max_turns=2, max_new_tokens=64, max_model_len=256)
    (response, _, mask, calls, ended), = multiturn.run_episodes(ScriptedChat(tok, turns), CalcTask(), cfg,
                                                              [prompt], [(0, 0, 0)], 1.0)
    assert (calls, ended) == (1, "stop")
    assert sum(mask) == sum(len(tok.encode(t)) + 1 for t in turns)  # both turns, each with its EOS
    return chat, prompt, response, mask


def test_tool_message_as_qwen25s_template_renders_it(real_model):
    """Qwen2.5's layout: the model's tool call is a <tool_call> block of JSON, the tool's answer a
    user turn of <tool_response>. The episode's ids (prompt, call, tool message, answer) are the
    template's rendering of the conversation with the call as the assistant's `tool_calls` and the
    answer as a `tool` message, up to ChatML's "\n" after the last turn, which no turn samples; and
    the appended ids are that user turn and the next assistant turn's opening, as text."""
    _, path = real_model
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = QWEN_LIKE_TEMPLATE
    call_text = '<tool_call>\n{"name": "calc", "arguments": {"a": 3, "b": 4}}\n</tool_call>'
    turns = [call_text, "3 + 4 = 7. #### 7"]

    def read_call(text):
        args = json.loads(re.fullmatch(r"<tool_call>\n(.*)\n</tool_call>", text).group(1))["arguments"]
        return args["a"], args["b"]

    chat, prompt, response, mask = calc_episode(tok, turns, read_call, role="tool")
    conversation = chat + [{"role": "assistant", "content": "", "tool_calls": [CALC_CALL]},
                           {"role": "tool", "content": "7"}, {"role": "assistant", "content": turns[1]}]
    rendered = list(tok.apply_chat_template(conversation, tokenize=True, return_dict=False))
    assert tok.decode(rendered) == (
        "<|im_start|>system\nYou may call calc(a, b).<|im_end|>\n<|im_start|>user\nWhat is 3 + 4?<|im_end|>\n"
        f"<|im_start|>assistant\n{call_text}<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n7\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n3 + 4 = 7. #### 7<|im_end|>\n")
    episode = prompt + response
    assert rendered[:len(episode)] == episode
    assert tok.decode(rendered[len(episode):]) == "\n"  # the template's separator after the last turn
    observation = [t for t, m in zip(response, mask) if m == 0]
    assert tok.decode(observation) == (
        "\n<|im_start|>user\n<tool_response>\n7\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    # the template is Qwen2.5's in this too: consecutive tool messages (answers to one turn's
    # calls) share one user turn
    two = [{"role": "tool", "content": "7"}, {"role": "tool", "content": "8"}]
    assert tok.apply_chat_template(two, tokenize=False) == (
        "<|im_start|>user\n<tool_response>\n7\n</tool_response>\n<tool_response>\n8\n</tool_response>"
        "<|im_end|>\n")


def test_tool_message_as_llama31s_template_renders_it(real_model):
    """Llama 3.1's layout, on a copy of the tiny tokenizer given its special tokens (<|eot_id|> the
    EOS, ids 400 to 403: under the model's 448): the model's tool call is a JSON object ended by
    <|eot_id|>, the tool's answer an `ipython` message. The episode's ids are the template's
    rendering of the conversation, all of it (no separator after <|eot_id|>), and the appended
    ids are the ipython message and the next assistant header, as text."""
    _, path = real_model
    tok = AutoTokenizer.from_pretrained(path)
    specials = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    tok.add_special_tokens({"additional_special_tokens": specials, "bos_token": "<|begin_of_text|>",
                           "eos_token": "<|eot_id|>"})
    tok.chat_template = LLAMA_LIKE_TEMPLATE
    assert tok.eos_token_id == tok.convert_tokens_to_ids("<|eot_id|>") and max(
        tok.convert_tokens_to_ids(specials)) < ScriptedChat(tok, []).vocab_size
    call_text = '{"name": "calc", "parameters": {"a": 3, "b": 4}}'
    turns = [call_text, "3 + 4 = 7. #### 7"]

    def read_call(text):
        args = json.loads(text)["parameters"]
        return args["a"], args["b"]

    chat, prompt, response, mask = calc_episode(tok, turns, read_call, role="ipython")
    conversation = chat + [{"role": "assistant", "content": "", "tool_calls": [CALC_CALL]},
                           {"role": "ipython", "content": "7"}, {"role": "assistant", "content": turns[1]}]
    rendered = list(tok.apply_chat_template(conversation, tokenize=True, return_dict=False))
    header = "<|start_header_id|>{}<|end_header_id|>\n\n"
    assert tok.decode(rendered) == (
        "<|begin_of_text|>" + header.format("system") + "You may call calc(a, b).<|eot_id|>"
        + header.format("user") + "What is 3 + 4?<|eot_id|>" + header.format("assistant") + call_text
        + "<|eot_id|>" + header.format("ipython") + "7<|eot_id|>" + header.format("assistant")
        + "3 + 4 = 7. #### 7<|eot_id|>")
    assert prompt + response == rendered
    observation = [t for t, m in zip(response, mask) if m == 0]
    assert tok.decode(observation) == header.format("ipython") + "7<|eot_id|>" + header.format("assistant")


@pytest.mark.slow
def test_two_ppo_steps_with_vllm_and_validation(real_model, tmp_path):
    root, path = real_model
    run_cli(2, "--task=gsm8k", f"--model={path}", f"--prompts={root}/train.jsonl",
            f"--val_prompts={root}/val.jsonl", "--eval_every=1", "--rollout_engine=vllm",
            "--steps=2", "--prompts_per_step=4", "--samples_per_prompt=2", "--max_new_tokens=8",
            "--micro_batch_size=2", "--max_model_len=256", f"--out_dir={tmp_path}")
    rows = read_metrics(tmp_path)
    assert len(rows) == 2
    for r in rows:
        assert 0.0 <= r["val_accuracy"] <= 1.0 and 0.0 <= r["reward_mean"] <= 1.0
        assert r["logprob_mismatch"] <= 1e-3
    with open(tmp_path / "rollouts" / "step_1.jsonl") as f:
        sample = json.loads(f.readline())
    assert sample["prompt"].startswith("Tom has") and "####" in sample["answer"]


# The real-model demo's task (scripts/smollm2.py and configs/smollm2_cpu.toml), on the tiny model:
# `make test` never downloads or builds SmolLM2.
def load_smollm2_script():
    import importlib.util
    spec = importlib.util.spec_from_file_location("smollm2", os.path.join(ROOT, "scripts", "smollm2.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_sum_problems_are_seeded_right_and_disjoint():
    import re
    smollm2 = load_smollm2_script()
    train, val = smollm2.sum_problems(seed=0)
    assert (train, val) == smollm2.sum_problems(seed=0) and val != smollm2.sum_problems(seed=1)[1]
    assert len(val) >= 64 and len(train) >= 10 * len(val) // 2

    def operands(row):  # read back from the text, then checked against the reference answer
        a, b = map(int, re.findall(r"\d+", row["question"]))
        assert rollout.extract_answer(row["answer"]) == str(a + b), row
        return frozenset((a, b))
    val_pairs = {operands(r) for r in val}
    assert len(val_pairs) == len(val)  # one problem per pair
    assert not val_pairs & {operands(r) for r in train}  # no val sum, in either order, is trained on


def test_sums_task_rewards_only_a_finished_right_answer(real_model, tmp_path):
    """With the demo's config: a right answer cut off by max_new_tokens earns 0, a finished one 1, a
    wrong one 0."""
    root, path = real_model
    smollm2 = load_smollm2_script()
    train, val = smollm2.sum_problems(seed=0)
    smollm2.write_jsonl(str(tmp_path / "train.jsonl"), train)
    smollm2.write_jsonl(str(tmp_path / "val.jsonl"), val)
    demo = config.parse_args(["--config", os.path.join(ROOT, "configs", "smollm2_cpu.toml")])
    cfg = dataclasses.replace(demo, prompts=str(tmp_path / "train.jsonl"),
                              val_prompts=str(tmp_path / "val.jsonl"))
    # every prompt fits max_model_len (checked there)
    task = rollout.make_task(cfg, path, model_vocab_size=448)
    assert AutoTokenizer.from_pretrained(path).decode(task.encode("What is 3 + 4?")).endswith(
        "What is 3 + 4? Answer with only the number.<|im_end|>\n<|im_start|>assistant\n")
    stop_ids = rollout.stop_token_ids(path, task.eos_id)
    cut_off, ended = task.tok.encode("3 + 4 = 7"), task.tok.encode("3 + 4 = 7") + [task.eos_id]
    assert not rollout.finished(cut_off, stop_ids) and rollout.finished(ended, stop_ids)
    assert task.reward(task.decode(cut_off), "#### 7", "length") == 0.0
    assert task.reward(task.decode(ended), "#### 7", "stop") == 1.0
    assert task.reward("3 + 4 = 8", "#### 7", "stop") == 0.0


# A template whose tool message is headed by the name of the tool the assistant called (and which
# refuses a tool message that answers no call), and whose assistant turns end with <|im_end|>
# while the tokenizer's EOS is <|endoftext|>, as a base model's tokenizer under a chat template.
NAMED_TOOL_TEMPLATE = (
    "{% set ns = namespace(name='') %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}"
    "{% if not ns.name %}{{ raise_exception('a tool message must answer a call') }}{% endif %}"
    "{{ '<|im_start|>tool ' + ns.name + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% else %}"
    "{% if m['tool_calls'] %}{% set ns.name = m['tool_calls'][0]['function']['name'] %}{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + (m['content'] or '') }}"
    "{% for c in m['tool_calls'] or [] %}{{ 'call ' + c['function']['name'] }}{% endfor %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def test_tool_message_headed_by_the_call_after_a_stop_token_other_than_eos(real_model):
    """chat_tool_message renders its conversation with a call of the named tool (a template may
    write the tool message's header from the call, or refuse a message that answers none), and
    finds the turn's end by the stop ids it is given: here <|im_end|>, not the tokenizer's EOS.
    The episode's ids are then the template's rendering of the conversation."""
    _, path = real_model
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = NAMED_TOOL_TEMPLATE
    tok.eos_token = "<|endoftext|>"
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    with pytest.raises(rollout.TaskError, match=r"does not end an assistant turn with a stop token"):
        multiturn.chat_tool_message(tok, "7", name="calc")  # <|endoftext|> ends no turn
    chat = [{"role": "system", "content": "You may call calc."},
            {"role": "user", "content": "What is 3 + 4?"}]
    prompt = list(tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False))
    call, answer = tok.encode("call calc") + [im_end], tok.encode("7") + [im_end]
    episode = prompt + call + multiturn.chat_tool_message(tok, "7", stop_ids=[im_end], name="calc") + answer
    conversation = chat + [{"role": "assistant", "content": "", "tool_calls": [CALC_CALL]},
                           {"role": "tool", "content": "7"}, {"role": "assistant", "content": "7"}]
    rendered = list(tok.apply_chat_template(conversation, tokenize=True, return_dict=False))
    assert tok.decode(rendered).endswith("call calc<|im_end|>\n<|im_start|>tool calc\n7<|im_end|>\n"
                                         "<|im_start|>assistant\n7<|im_end|>\n")
    assert rendered[:len(episode)] == episode and tok.decode(rendered[len(episode):]) == "\n"


def test_a_tool_output_is_cut_to_the_tasks_bound(real_model):
    """chat_tool_message(max_tokens=n): a content of more than n tokens keeps its first n, marked,
    inside the template's frame; a shorter one is unchanged."""
    _, path = real_model
    tok = AutoTokenizer.from_pretrained(path)
    long = "Tom has 3 apples and 4 pears. " * 20
    first = tok.decode(tok.encode(long, add_special_tokens=False)[:5])
    assert len(tok.encode(long)) > 100 and len(first) < 40
    assert multiturn.chat_tool_message(tok, long, max_tokens=5) == (
        tok.encode("\n<|im_start|>tool\n" + first + "...(truncated)<|im_end|>\n<|im_start|>assistant\n"))
    assert multiturn.chat_tool_message(tok, "7", max_tokens=5) == multiturn.chat_tool_message(tok, "7")
