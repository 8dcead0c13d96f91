"""Edges of multi-turn episodes that a review against verl, TRL and NeMo-RL found (issue 43): a tool
task gets turns by default, an empty observation is refused, and GSPO stays finite where a
trainer logprob on an observation is -inf. Each test fails with its fix reverted."""
import pytest
import torch

import config
import rollout
import train_ppo
from test_multiturn import EOS, Echo, ScriptedEngine


def test_a_tool_task_gets_turns_by_default():
    """max_turns defaulted to 1, which ended every episode at its first tool call, silently. With
    the default config, an episode whose task keeps observing runs until the context is full
    (max_model_len 16: prompt 1 + (turn 2 + observation 1) x 5)."""
    cfg = config.Config(max_new_tokens=4, max_model_len=16)
    (ids, _, mask), = rollout.run_episodes(ScriptedEngine(lambda ids: [7, EOS]), Echo([40]), cfg, [[1]],
                                           [(0, 0, 0)], 1.0)
    assert mask == [1, 1, 0] * 4 + [1, 1]  # 5 turns: a 6th would start at 16, max_model_len
    # a task without observe() is single-turn whatever max_turns says
    engine = ScriptedEngine(lambda ids: [7, EOS])
    rollout.run_episodes(engine, rollout.ToyTask(0), cfg, [[1]], [(0, 0, 0)], 1.0)
    assert len(engine.calls) == 1


def test_an_empty_observation_is_refused():
    """[] would merge the turns before and after it into one run of 1s (one turn fewer counted)."""
    with pytest.raises(rollout.TaskError, match=r"not empty, or None, not \[\]"):
        rollout.run_episodes(ScriptedEngine(lambda ids: [7, EOS]), Echo([]), config.Config(), [[1]],
                             [(0, 0, 0)], 1.0)


def test_gspo_is_finite_where_a_logprob_on_an_observation_is_minus_inf():
    """GSPO's token value log s_b + log pi_t - (log pi_t).detach() is -inf - -inf = NaN on an
    observation token whose trainer logprob is -inf; the mask must select it away (NaN * 0 is
    NaN). The loss and its gradient equal those of the same row with the observation cut out."""
    mask = torch.tensor([[0.0, 1, 1, 0, 0, 1, 1]])  # prompt, turn, observation, turn
    old = torch.tensor([[0.0, -1.0, -2.0, 0.0, 0.0, -0.5, -1.5]])
    adv = torch.tensor([[0.0, 0.7, 0.7, 5.0, 5.0, 0.7, 0.7]])
    new = torch.tensor([[0.0, -0.9, -2.2, float("-inf"), -3.0, -0.4, -1.1]], requires_grad=True)
    keep = [1, 2, 5, 6]  # the model's tokens
    cut = new.detach()[:, keep].clone().requires_grad_(True)

    def loss(lp, old_lp, advantages, m):
        per_token, _ = train_ppo.policy_loss(lp, old_lp, advantages, 0.2, sequence_mask=m)
        return train_ppo.aggregate_loss(per_token, m, mode="seq-mean-token-mean")
    with_gaps, plain = loss(new, old, adv, mask), loss(cut, old[:, keep], adv[:, keep], torch.ones(1, 4))
    with_gaps.backward()
    plain.backward()
    assert torch.isfinite(with_gaps) and torch.isfinite(new.grad).all()
    torch.testing.assert_close(with_gaps, plain)
    torch.testing.assert_close(new.grad[:, keep], cut.grad)
    assert (new.grad[0, [0, 3, 4]] == 0).all()


def test_a_value_of_the_wrong_type_reads_as_english():
    with pytest.raises(config.ConfigError, match=r"max_turns='x' is not of type int: write it like "
                                                 r"--max_turns=1000"):
        config.parse_args(["--max_turns=x"])
