"""Every bench runs at its --smoke size (seconds, tiny models, CPU) and ends with its RESULT line,
so that none can rot unnoticed; the figures themselves come from the full-size runs (docs/testing.md)."""
import os
import subprocess
import sys

import pytest

from conftest import ROOT, cpu_env

BENCHES = ["memory_model.py", "scale_memory.py"]


@pytest.mark.parametrize("script", BENCHES)
def test_bench_smoke_prints_its_result_line(script):
    proc = subprocess.run([sys.executable, os.path.join("bench", script), "--smoke"], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env=cpu_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("RESULT ") and len(last.split()) > 1, last
    for pair in last.split()[1:]:  # key=number
        key, value = pair.split("=")
        float(value)
