"""Every bench runs at its --smoke size (seconds, tiny models, CPU) and ends with its RESULT line,
so that none can rot unnoticed; the figures themselves come from the full-size runs
(docs/testing.md). Every bench/*.py is found by glob: a new bench needs a --smoke flag to pass
here."""
import glob
import os
import subprocess
import sys

import pytest

from conftest import ROOT, cpu_env

BENCHES = sorted(os.path.basename(path) for path in glob.glob(os.path.join(ROOT, "bench", "*.py")))


def test_every_bench_is_found():
    assert len(BENCHES) >= 10 and "peer_trl.py" in BENCHES and "gpu_step.py" in BENCHES, BENCHES


@pytest.mark.parametrize("script", BENCHES)
def test_bench_smoke_prints_its_result_line(script):
    peer_venv = os.path.join(ROOT, "bench", ".venv-trl")
    had_peer_venv = os.path.exists(peer_venv)
    proc = subprocess.run([sys.executable, os.path.join("bench", script), "--smoke"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, env=cpu_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("RESULT ") and len(last.split()) > 1, last
    for pair in last.split()[1:]:  # key=number
        key, value = pair.split("=")
        float(value)
    assert had_peer_venv or not os.path.exists(peer_venv), "a smoke run must not install TRL's venv"
