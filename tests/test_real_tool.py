"""The real tool demo's task (scripts/smollm2_tool.py, `make real-tool-demo`) on a small ChatML
tokenizer trained here with SmolLM2's own chat template (nothing downloaded): the data split, the
warm-up's trace and its mask against the template's rendering of the conversation, the
calculator, the reward, and the evaluation's own turn loop against the trainer's
(multiturn.run_episodes) on a scripted model."""
import importlib.util
import os
import re
import types

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

import config
import rollout
from conftest import ROOT
from extensions import multiturn

# SmolLM2-135M-Instruct's template, as its checkpoint ships it
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}")


def load_script():
    path = os.path.join(ROOT, "scripts", "smollm2_tool.py")
    spec = importlib.util.spec_from_file_location("smollm2_tool", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(the script, a task with the tool, one without, the tokenizer)."""
    script = load_script()
    path = str(tmp_path_factory.mktemp("chatml"))
    corpus = [q + script.INSTRUCTION + " <calc>347 + 589</calc> error: write" for q, _ in
              script.sum_problems(0)[1]]
    corpus += [script.TOOL_SYSTEM, script.PLAIN_SYSTEM]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=500, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|im_end|>",
                                  chat_template=SMOLLM2_TEMPLATE)
    tok.save_pretrained(path)

    def cfg(max_turns):
        return types.SimpleNamespace(model=path, seed=1, max_turns=max_turns, max_new_tokens=24,
                                     max_model_len=400)
    return script, script.ToolSums(cfg(2)), script.ToolSums(cfg(1)), tok


def test_sums_are_three_digit_seeded_and_disjoint(setup):
    script = setup[0]
    train, val = script.sum_problems(0)
    assert (train, val) == script.sum_problems(0) and val != script.sum_problems(1)[1]
    assert len(train) == 5000 and len(val) == 128

    def pair(question, answer):
        a, b, total = map(int, answer.replace("+", "=").split("="))
        assert 100 <= a <= 999 and 100 <= b <= 999 and total == a + b
        assert re.findall(r"\d+", question) == [str(a), str(b)]  # the call copies the order asked
        return frozenset((a, b))
    assert not {pair(*r) for r in val} & {pair(*r) for r in train}  # no val sum trained on, either order


def test_target_is_the_templates_conversation_with_the_tool_output_masked(setup):
    script, task, plain, tok = setup
    ids, mask = task.target("347 + 589 = 936")
    model_part = [t for t, m in zip(ids, mask) if m]
    tool_part = [t for t, m in zip(ids, mask) if not m]
    assert tok.decode(model_part) == "<calc>347 + 589</calc><|im_end|>936<|im_end|>"
    assert tok.decode(tool_part) == "\n<|im_start|>tool\n936<|im_end|>\n<|im_start|>assistant\n"
    call, answer = len(tok.encode("<calc>347 + 589</calc>")) + 1, len(tok.encode("936")) + 1
    assert mask == [1] * call + [0] * (len(ids) - call - answer) + [1] * answer
    # prompt + trace = the template's rendering of the conversation: system, user, assistant (the
    # call), tool, assistant (the answer); the template ends with a "\n" that no turn samples
    question = "What is 347 + 589?"
    conversation = [{"role": "system", "content": script.TOOL_SYSTEM},
                    {"role": "user", "content": question + script.INSTRUCTION},
                    {"role": "assistant", "content": "<calc>347 + 589</calc>"},
                    {"role": "tool", "content": "936"}, {"role": "assistant", "content": "936"}]
    rendered = list(tok.apply_chat_template(conversation, tokenize=True, return_dict=False))
    assert task.encode(question) + ids + tok.encode("\n") == rendered
    assert tok.decode(task.encode(question)).startswith("<|im_start|>system\nYou have a calculator")
    # without the tool: the direct answer, all the model's, and no calculator in the prompt
    assert tok.decode(plain.target("347 + 589 = 936")) == "936<|im_end|>"
    assert "calc" not in tok.decode(plain.encode(question)) and "calc" in tok.decode(task.encode(question))


def test_calculator_evaluates_the_models_call(setup):
    _, task, _, tok = setup
    eos = [tok.eos_token_id]

    def tool_says(turn_text):
        observation = task.observe(tok.encode(turn_text) + eos, [])
        return None if observation is None else tok.decode(observation)
    assert tool_says("<calc>347 + 589</calc>") == "\n<|im_start|>tool\n936<|im_end|>\n<|im_start|>assistant\n"
    assert "\n588<|im_end|>" in tool_says(" <calc> 347+241 </calc>")  # the model's operands, not the prompt's
    assert "\n-242<|im_end|>" in tool_says("<calc>347 - 589</calc>")
    assert "\n204<|im_end|>" in tool_says("<calc>12 * 17</calc>")
    assert "error: write <calc>a + b</calc>" in tool_says("<calc>347 +</calc>")
    assert tool_says("936") is None and tool_says("The answer is 936.") is None  # answers end the episode


def test_reward_reads_the_models_answer_after_its_call(setup):
    _, task, _, _ = setup
    answer = "347 + 589 = 936"
    assert task.reward("<calc>347 + 589</calc>936", answer, "stop") == 1.0
    assert task.reward("936", answer, "stop") == 1.0  # a direct answer counts the same
    assert task.reward("347 + 589 = 936", answer, "stop") == 1.0
    assert task.reward("<calc>347 + 589</calc>935", answer, "stop") == 0.0
    # only a natural end scores: cut off, or a call whose output never came
    for ended in ("length", "max_turns", "context"):
        assert task.reward("<calc>347 + 589</calc>936", answer, ended) == 0.0
    # the numbers of the call are not an answer
    assert task.reward("<calc>936 + 0</calc>", answer, "stop") == 0.0


class ScriptedModel:
    """A stand-in for a transformers model: generate() appends, to each left-padded row, the k-th
    turn of its script (k: the tool messages in the row so far), cut at max_new_tokens, then pads.
    Also an engine for multiturn.run_episodes, with the same script."""

    def __init__(self, tok, scripts):
        self.tok, self.scripts = tok, scripts  # {question's first token ids: [turn ids, ...]}
        self.stop_ids, self.vocab_size = [tok.eos_token_id], len(tok)
        self.tool = tok.convert_tokens_to_ids("<|im_start|>")

    def turn(self, context):
        script = next(s for key, s in self.scripts.items() if key in self.tok.decode(context))
        # <|im_start|> opens the system, user and assistant messages, then 2 more a tool message
        return script[(context.count(self.tool) - 3) // 2]

    def generate(self, input_ids=None, attention_mask=None, max_new_tokens=0, pad_token_id=0, **_):
        if isinstance(input_ids, list):  # as the engine: generate(contexts, seeds, budgets, temperature)
            turns = [self.turn(c)[:budget] for c, budget in zip(input_ids, max_new_tokens)]
            return [(t, [-1.0] * len(t)) for t in turns]
        rows = [self.turn(row[mask.bool()].tolist())[:max_new_tokens]  # the padding left out
                for row, mask in zip(input_ids, attention_mask)]
        width = max(map(len, rows))
        new = torch.tensor([r + [pad_token_id] * (width - len(r)) for r in rows])  # (B, new tokens)
        return torch.cat([input_ids, new], dim=1)


def test_eval_turn_loop_agrees_with_the_trainers_episodes(setup):
    """Four scripted episodes: call then answer (stop), an answer cut off by the budget (length), a
    direct answer (stop), a call then a second call (max_turns). The evaluation's loop gives the
    last turn, ending and calls that multiturn.run_episodes gives, and the rewards 1, 0, 1, 0; with
    max_turns=1, a call ends as "max_turns"."""
    script, task, _, tok = setup
    eos = [tok.eos_token_id]
    call = tok.encode("<calc>347 + 589</calc>") + eos
    too_long = tok.encode("3 " * 30) + eos
    assert len(too_long) > 24
    scripts = {"101 + 202": [call, tok.encode("303") + eos], "111 + 222": [too_long],
               "121 + 232": [tok.encode("353") + eos], "131 + 242": [call, call]}
    questions = [f"What is {k}?" for k in scripts]
    answers = ["101 + 202 = 303", "111 + 222 = 333", "121 + 232 = 353", "131 + 242 = 373"]
    model = ScriptedModel(tok, scripts)
    for turns in (2, 1):
        cfg = config.Config(max_turns=turns, max_new_tokens=24, max_model_len=400)
        mine = script.greedy_episodes(model, task, cfg, model.stop_ids, questions)
        prompts = [task.encode(q) for q in questions]
        outs = multiturn.run_episodes(model, task, cfg, prompts, [(0, 0, 0)] * 4, 0.0)
        # the trainer's reward reads the model's last turn (rollout.generate_share)
        trainers_ = [(task.decode(rollout.last_turn(ids, mask)), ended, calls)
                     for ids, _, mask, calls, ended in outs]
        assert mine == trainers_
        assert [ended for _, ended, _ in mine] == (["stop", "length", "stop", "max_turns"] if turns == 2 else
                                                   ["max_turns", "length", "stop", "max_turns"])
        rewards = [task.reward(text, a, ended) for (text, ended, _), a in zip(mine, answers)]
        assert rewards == ([1.0, 0.0, 1.0, 0.0] if turns == 2 else [0.0, 0.0, 1.0, 0.0])
