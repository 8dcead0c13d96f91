"""Every bench runs at its --smoke size (seconds, tiny models, CPU) and ends with its RESULT line,
so that none can rot unnoticed; the figures themselves come from the full-size runs
(docs/testing.md). Every bench/*.py is found by glob: a new bench needs a --smoke flag to pass
here.

The smokes run two at a time (each child has one OpenMP thread, and most of a smoke is one
process starting Python and importing torch: on 2 cores the 15 took 183 s one after another),
the three longest first so that no core idles at the end. Each gets its own MASTER_PORT: a
trainer of one process (train_ppo.py run by python) binds its store there, 29500 otherwise."""
import concurrent.futures
import glob
import os
import subprocess
import sys

import pytest

from _dist import _free_port
from conftest import ROOT, cpu_env

BENCHES = sorted(os.path.basename(path) for path in glob.glob(os.path.join(ROOT, "bench", "*.py")))
LONGEST = ("gpu_check.py", "scale_memory.py", "refit.py")  # ~51, 26, 23 s on 2 cores (2026-11-29)
PEER_VENV = os.path.join(ROOT, "bench", ".venv-trl")


def _smoke(script):
    return subprocess.run([sys.executable, os.path.join("bench", script), "--smoke"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600,
                          env=cpu_env(MASTER_PORT=str(_free_port())))


@pytest.fixture(scope="module")
def smokes():
    """{script: its finished --smoke process}, every bench's, two running at a time; and whether
    TRL's venv existed before them."""
    had_peer_venv = os.path.exists(PEER_VENV)
    order = [s for s in LONGEST if s in BENCHES] + [s for s in BENCHES if s not in LONGEST]
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        futures = {script: pool.submit(_smoke, script) for script in order}
        return {script: f.result() for script, f in futures.items()}, had_peer_venv


def test_every_bench_is_found():
    assert len(BENCHES) >= 10 and "peer_trl.py" in BENCHES and "gpu_step.py" in BENCHES, BENCHES


@pytest.mark.parametrize("script", BENCHES)
def test_bench_smoke_prints_its_result_line(script, smokes):
    procs, had_peer_venv = smokes
    proc = procs[script]
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("RESULT ") and len(last.split()) > 1, last
    for pair in last.split()[1:]:  # key=number
        key, value = pair.split("=")
        float(value)
    assert had_peer_venv or not os.path.exists(PEER_VENV), "a smoke run must not install TRL's venv"
