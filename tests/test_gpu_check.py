"""bench/gpu_check.py keeps every figure it learns (a GPU is lent for minutes): a stage that fails
is recorded and the next one runs, figures.json holds each stage's figures as soon as it ends (and
keeps them when the run is killed), a rerun of some stages keeps the others', a cap stops a stage's
whole process tree, --stages refuses an unknown name, and the preflight installs the carried
wheels. The stages are stand-ins (seconds in all), but for the kill's, where the first two real
ones run at their --smoke size; all of them run so in tests/test_benches.py."""
import json
import os
import signal
import subprocess
import sys
import time
import types
import zipfile

import pytest

from conftest import ROOT, cpu_env

sys.path.insert(0, os.path.join(ROOT, "bench"))  # bench/ holds no package: its modules by name
import gpu_check
import gpu_step


def result_line(stdout):
    """The last line's key=value pairs, every value a number (tests/test_benches.py's rule)."""
    last = stdout.strip().splitlines()[-1]
    assert last.startswith("RESULT "), last
    return {key: float(value) for key, value in (pair.split("=") for pair in last.split()[1:])}


def test_a_failing_stage_is_recorded_and_the_next_one_runs(tmp_path, monkeypatch, capsys):
    at_masked = {}

    def test_cuda(run, cap):  # what an empty pytest log did: splitlines()[-1]
        return "".splitlines()[-1]

    def masked(run, cap):  # figures.json as it stands when the stage after the failure starts
        at_masked.update(json.loads((tmp_path / "figures.json").read_text()))
        return {"masked_finished": 1, "masked_step_s": 2.5}
    monkeypatch.setitem(gpu_check.STAGES, "lora", lambda run, cap: {"lora_finished": 1,
                                                                    "lora_steps": 7})
    monkeypatch.setitem(gpu_check.STAGES, "test_cuda", test_cuda)
    monkeypatch.setitem(gpu_check.STAGES, "masked", masked)
    gpu_check.main(["--smoke", "--out", str(tmp_path), "--stages", "lora,test_cuda,masked"])
    figures = json.loads((tmp_path / "figures.json").read_text())
    assert figures["lora_steps"] == 7 and figures["masked_step_s"] == 2.5
    assert figures["test_cuda_finished"] == 0
    assert figures["test_cuda_error"].startswith("IndexError")
    assert at_masked["lora_steps"] == 7 and at_masked["test_cuda_finished"] == 0
    stdout = capsys.readouterr().out
    assert "test_cuda_error" in stdout  # printed as the stage ended
    result = result_line(stdout)
    assert result["test_cuda_finished"] == 0 and result["masked_finished"] == 1
    assert "total_s" in result

    # a rerun of two stages: their figures replaced (the error gone), lora's kept
    monkeypatch.setitem(gpu_check.STAGES, "test_cuda", lambda run, cap: {"test_cuda_finished": 1})
    monkeypatch.setitem(gpu_check.STAGES, "masked", lambda run, cap: {"masked_finished": 1})
    gpu_check.main(["--smoke", "--out", str(tmp_path), "--stages", "masked,test_cuda"])
    figures = json.loads((tmp_path / "figures.json").read_text())
    assert figures["lora_steps"] == 7 and figures["test_cuda_finished"] == 1
    assert "test_cuda_error" not in figures and "masked_step_s" not in figures
    assert "lora_steps" not in result_line(capsys.readouterr().out)  # this run's stages only


def write_wheel(folder):
    """A wheel of one pure-Python module, gpu_check_probe, as pip builds one: the module, METADATA,
    WHEEL and RECORD."""
    info = "gpu_check_probe-1.0.dist-info"
    files = {"gpu_check_probe.py": "ANSWER = 42\n",
             f"{info}/METADATA": "Metadata-Version: 2.1\nName: gpu-check-probe\nVersion: 1.0\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\n"
                              "Tag: py3-none-any\n"}
    files[f"{info}/RECORD"] = "".join(f"{path},,\n" for path in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(folder / "gpu_check_probe-1.0-py3-none-any.whl", "w") as wheel:
        for path, text in files.items():
            wheel.writestr(path, text)


def test_a_kill_keeps_the_finished_stages_figures(tmp_path):
    """The real script at its --smoke size, SIGTERMed (as a wrapper's time limit stops it) once its
    first stage has ended: figures.json keeps that stage's figures, whole, and the second stage's
    processes are gone. The first stage, the preflight, installed the carried wheel into OUT/site,
    where every later stage imports from."""
    wheels, out = tmp_path / "whl", tmp_path / "out"
    wheels.mkdir()
    write_wheel(wheels)
    cmd = [sys.executable, "bench/gpu_check.py", "--smoke", "--out", str(out), "--stages",
           "preflight,sampler", "--wheels", str(wheels)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=cpu_env(), stdout=subprocess.PIPE, text=True)
    figures = out / "figures.json"
    deadline = time.monotonic() + 120
    while not figures.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    stdout = proc.communicate(timeout=30)[0]
    kept = json.loads(figures.read_text())
    assert proc.returncode == 128 + signal.SIGTERM and "RESULT" not in stdout, stdout
    assert kept["preflight_finished"] == 1 and kept["preflight_wheels"] == 1, kept
    assert not any(key.startswith("sampler_") for key in kept), kept  # stopped before it ended
    assert (out / "site" / "gpu_check_probe.py").is_file()
    left = []  # the sampler's body: this file run with --out OUT
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if str(out).encode() in f.read() and gpu_step.alive(int(pid)):
                    left.append(int(pid))
        except OSError:  # it ended meanwhile
            continue
    assert not left, left


def test_unknown_stage_exits_2_with_one_line(capsys):
    with pytest.raises(SystemExit) as stop:
        gpu_check.main(["--smoke", "--stages", "masked,bogus"])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "bogus" in err[0] and "real_vocab" in err[0], err


# a stage's process as pytest running tests/test_cuda.py is one: a child in its process group
# (mp.spawn's) and one in a session of its own (torchrun's worker); then it runs on or exits
TREE = """import subprocess, sys, time
own = subprocess.Popen(["sleep", "60"], start_new_session=True)
group = subprocess.Popen(["sleep", "60"])
open(sys.argv[1] + ".tmp", "w").write(f"{own.pid} {group.pid}")
__import__("os").replace(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(60 if sys.argv[2] == "run" else 0)
"""


@pytest.mark.parametrize("then", ["run", "exit"])
def test_a_cap_stops_the_whole_process_tree(tmp_path, then):
    """At the cap, the whole tree; after an exit, what is left in its process group (an orphan in
    a session of its own is out of reach by then: torchrun, exiting, has stopped its workers)."""
    pids = tmp_path / "pids"
    start = time.monotonic()
    code = gpu_step.run_capped([sys.executable, "-c", TREE, str(pids), then], timeout=3, grace=1)
    own, group = map(int, pids.read_text().split())
    try:
        assert code == (None if then == "run" else 0)  # None: the cap stopped it
        assert time.monotonic() - start < 10
        gone = [own, group] if then == "run" else [group]
        deadline = time.monotonic() + 5  # init reaps the orphans
        while any(map(gpu_step.alive, gone)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(map(gpu_step.alive, gone)), gone
    finally:
        for pid in (own, group):
            if gpu_step.alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_cap_is_recorded_as_unfinished(tmp_path, monkeypatch):
    """A stage's own process under a cap it overruns: finished=0, its tree stopped."""
    pids = tmp_path / "pids"
    monkeypatch.setattr(gpu_check, "run_capped", lambda cmd, cap, grace, **popen: gpu_step.run_capped(
        [sys.executable, "-c", TREE, str(pids), "run"], cap, grace, **popen))
    monkeypatch.setattr(gpu_check, "GRACE_S", 1)
    run = types.SimpleNamespace(out=str(tmp_path), env=dict(os.environ), smoke=True)
    assert gpu_check.real_vocab(run, cap=3) == {"real_vocab_finished": 0,
                                                "real_vocab_error": "stopped at the cap"}
    assert not any(map(gpu_step.alive, map(int, pids.read_text().split())))


def test_pytest_counts_survive_an_empty_or_cut_off_log():
    assert gpu_check.pytest_counts("") == dict(passed=0, failed=0, skipped=0, errors=0)
    cut = ("tests/test_cuda.py::test_a PASSED [ 14%]\ntests/test_cuda.py::test_b[bf16] FAILED [ 28%]\n"
           "tests/test_cuda.py::test_c SKIPPED (needs CUDA) [ 42%]\ntests/test_cuda.py::test_d ")
    assert gpu_check.pytest_counts(cut) == dict(passed=1, failed=1, skipped=1, errors=0)
    whole = cut + "PASSED [ 57%]\n=== 5 passed, 1 failed, 1 error in 125.31s (0:02:05) ==="
    assert gpu_check.pytest_counts(whole) == dict(passed=5, failed=1, skipped=0, errors=1)


def test_step_figures_skip_a_cut_off_last_row(tmp_path):
    """A run stopped while writing metrics.jsonl: its last row is cut off, the rows before count."""
    from transformers import AutoConfig
    import model_parallel
    fields = dict(model_parallel.TINY_PRESETS["tiny-qwen2"])
    AutoConfig.for_model(fields.pop("model_type"), **fields).save_pretrained(tmp_path / "tiny-qwen2")
    (tmp_path / "config.json").write_text(json.dumps(dict(
        model="tiny-qwen2", sft_steps=0, ppo_epochs=1, advantage_estimator="gae", attention="masked",
        dtype="bf16", rollout_engine="hf")))
    row = dict(time_step_s=2.0, time_rollout_s=1.0, time_logprobs_s=0.5, time_update_s=0.4,
               time_refit_s=0.1, tokens_per_s=100.0, tokens=200, mem_used_gb=1.0)
    rows = [json.dumps(dict(row, time_step_s=s)) for s in (9.0, 2.0, 3.0)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(rows)[:-5])
    figures = gpu_step.step_figures(str(tmp_path), 1, 989.0)
    assert figures["first_step_s"] == 9.0 and figures["steps"] == 1 and figures["step_s"] == 2.0
