"""Runs that outlive a lost worker or a lost node (docs/nodes.md).

Fast: what the launch must give the run, refused in one line (a tensor-parallel group that would
cross nodes; restarts without a fresh store each round); and every rank deciding it was restarted
when any rank's agent counted a restart.
"""
import os
import subprocess

import pytest
import torch

import config
import train_ppo
from _dist import _free_port, run_ranks
from conftest import ROOT, TORCHRUN, cpu_env


@pytest.mark.parametrize("environ, key", [
    # 4 nodes of 1 process: a tp group of 2 would straddle two nodes
    ({"LOCAL_WORLD_SIZE": "1"},
     r"tp_size=2 does not divide the processes of a node \(--nproc_per_node=1\)"),
    ({"LOCAL_WORLD_SIZE": "2", "TORCHELASTIC_MAX_RESTARTS": "1",
      "TORCHELASTIC_USE_AGENT_STORE": "True"},
     "--max-restarts=1 needs TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"),
])
def test_a_launch_that_cannot_work_is_refused_in_one_line(environ, key, monkeypatch, tmp_path):
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    cfg = config.parse_args(["--tp_size=2", f"--out_dir={tmp_path}"])
    with pytest.raises(config.ConfigError, match=key):
        config.validate(cfg, 4)


def test_a_launch_that_works_is_not_refused(monkeypatch, tmp_path):
    """tp within a node of 4; restarts with a fresh store a round (the variable set: torchrun
    then tells its workers not to use its store)."""
    for name, value in {"LOCAL_WORLD_SIZE": "4", "TORCHELASTIC_MAX_RESTARTS": "3",
                        "TORCHELASTIC_USE_AGENT_STORE": "False"}.items():
        monkeypatch.setenv(name, value)
    config.validate(config.parse_args(["--tp_size=2", f"--out_dir={tmp_path}"]), 8)


def _restarted(rank, world_size, cases):
    for counts, want in cases:
        os.environ["TORCHELASTIC_RESTART_COUNT"] = str(counts[rank])
        assert train_ppo.torchrun_restarted(torch.device("cpu")) is want, (rank, counts)


def test_every_rank_knows_of_a_restart_any_agent_counted():
    """An agent that restarts its workers for a node that left or joined counts no restart: rank
    0's count may be 0 while another node's is 1. Every rank must decide alike (rank 0 decides
    where the run resumes from)."""
    run_ranks(_restarted, 2, [((0, 1), True), ((1, 0), True), ((0, 0), False), ((2, 2), True)])


def test_a_tp_group_across_two_nodes_is_refused_at_launch():
    """Two torchrun agents of two processes each, as two nodes: tp_size=4 would put each tensor-
    parallel group on both. Every worker refuses before torch loads; rank 0 says why, in one line;
    both agents end non-zero. (On one host the agents share memory: vLLM's own same-node check
    could not fail here, the project's must.)"""
    port = _free_port()
    cmd = [TORCHRUN, "--nnodes=2", "--nproc_per_node=2", "--rdzv_backend=c10d",
           f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=tp", "train_ppo.py",
           "--config", "configs/test_tiny.toml", "--tp_size=4"]
    agents = [subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, env=cpu_env()) for _ in range(2)]
    logs = [agent.communicate(timeout=120)[0] for agent in agents]
    assert all(agent.returncode != 0 for agent in agents), logs
    said = [line for log in logs for line in log.splitlines() if line.startswith("config error")]
    assert said == ["config error: tp_size=4 does not divide the processes of a node "
                    "(--nproc_per_node=2): a tensor-parallel group must lie within one node, or "
                    "every layer's collectives cross the network"], logs
