"""Rewards: the toy task's rule, and math answer extraction on tricky strings."""
import json

import pytest

import rollout
from rollout import ToyTask, extract_answer, math_reward

# (model output, the number a careful human grader would read as its final answer)
TRICKY = [
    ("The answer is 72.", "72"),                                    # trailing period
    ("Natalia sold 48 + 24 = 72 clips.\n#### 72", "72"),            # GSM8K reference form
    ("#### 1,234", "1234"),                                         # thousands separator
    ("She pays $1,200.00 in total.", "1200"),                       # dollar sign and cents
    ("So the total is \\boxed{18}.", "18"),                         # boxed
    ("First 3 then 4, so \\boxed{7} and not 9", "7"),               # boxed wins over a later number
    ("\\boxed{\\$42}", "42"),                                       # escaped dollar inside box
    ("\\boxed{\\frac{1}{2}}", "0.5"),                               # LaTeX fraction
    ("\\boxed{\\dfrac{6}{3}}", "2"),                                # dfrac that is an integer
    ("The temperature drops to -5 degrees.", "-5"),                 # negative, with unit
    ("It costs 3.50 dollars", "3.5"),                               # decimal with trailing zero
    ("It weighs 72.00 kg", "72"),                                   # integral decimal
    ("A 50% discount", "50"),                                       # percent
    ("He has 1, 2, 3 apples, total 6.", "6"),                       # a list, then the answer
    ("#### 18\nThat's it, 3 ways.", "18"),                          # the marker's number, not the last
    ("answer: .5", "0.5"),                                          # leading-dot decimal
    ("no number here", None),                                       # nothing to extract
    ("", None),                                                     # empty response
    ("12,5", "5"),                                                  # not a thousands group: last number
    ("In 2023 she had 10 cats and now 12", "12"),                   # a year earlier in the text
    ("\\boxed{1,000,000}", "1000000"),                              # big number in a box
    ("The result is 7.\n\n", "7"),                                  # trailing whitespace
]


@pytest.mark.parametrize("text, expected", TRICKY)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_math_reward_exact_match_and_format():
    reference = "Half of 144 is 72. #### 72"
    assert math_reward("so she has \\boxed{72}.", reference) == 1.0
    assert math_reward("72.0", reference) == 1.0
    assert math_reward("\\boxed{71}", reference) == 0.0
    assert math_reward("\\boxed{71}", reference, format_weight=0.1) == 0.1   # right form, wrong value
    assert math_reward("seventy-two", reference, format_weight=0.1) == 0.0   # neither
    assert math_reward("#### 1,000", "#### 1000") == 1.0


def test_toy_task():
    pairs = ToyTask(1).prompts(0, 50)  # two epochs of the 25 facts
    assert pairs == ToyTask(1).prompts(0, 50)        # same on every rank
    assert sorted(pairs[:25]) == sorted(pairs[25:]) and len(set(pairs[:25])) == 25  # each fact once an epoch
    assert pairs[:25] != pairs[25:]                            # each epoch shuffled anew
    assert ToyTask(1).prompts(20, 10) == pairs[20:30]  # a resumed position draws the same
    for prompt, answer in pairs:
        a, b = prompt.rstrip("=").split("+")
        assert int(answer) == int(a) + int(b)
    assert ToyTask(1).reward("7", "7", ended="stop") == 1.0
    assert ToyTask(1).reward("7", "7", ended="length") == 0.0       # did not stop
    assert ToyTask(1).reward("77", "7", ended="stop") == 0.0


def test_stop_tokens_without_generation_config_include_config_json_eos(tmp_path):
    """Issue 28: a checkpoint with no generation_config.json. vLLM then stops at config.json's
    eos_token_id; the trainer's set must hold it too, or a response that ended there is counted
    unfinished and scored 0. A generation_config.json adds its ids to config.json's (an id of its
    own, 9: config.json's 7 must stay in the set, which a generation_config that repeated 7 could
    not show)."""
    with open(tmp_path / "config.json", "w") as f:
        json.dump({"model_type": "llama", "eos_token_id": 7}, f)
    assert rollout.stop_token_ids(str(tmp_path), 3) == [3, 7]
    with open(tmp_path / "generation_config.json", "w") as f:
        json.dump({"eos_token_id": [9]}, f)
    assert rollout.stop_token_ids(str(tmp_path), 3) == [3, 7, 9]
    assert rollout.stop_token_ids(str(tmp_path), None) == []
