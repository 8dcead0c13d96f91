"""Every extension can be removed by deleting it (extensions/__init__.py): in copies of the tree,
its file, its name in config.EXTENSIONS, and every statement of the five modules that names the
module or reads one of its options go (a compound statement whose header does goes whole, and one
left with an empty body goes too). What is left must be a working trainer:

  - each extension alone removed: the trainer imports and prints --help (fast tier; every copy
    in one process, so torch loads once);
  - every extension removed: the trainer imports, --help works and lists no extension's option,
    a default step runs in one process, and the core's own unit tests pass there (slow tier).

The rule is written here once (`strip`), so that it is the rule extensions/__init__.py states,
and the count of core statements that name each extension is printed (`core_lines`: the few
lines a fork deletes).
"""
import ast
import builtins
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

import config
from conftest import ROOT, cpu_env

CORE = ("train_ppo.py", "model_parallel.py", "logprobs.py", "rollout.py", "config.py")
# the core's own unit tests, run in the copy without extensions: none of them names one
CORE_TESTS = ("test_ppo_math.py", "test_logprobs.py", "test_rewards.py", "test_math_answers.py",
              "test_sampling.py", "test_shape.py")


def _options(name):
    """The option names extensions/NAME.py declares (config.OPTIONS)."""
    options, *_ = config.OPTIONS[name]
    return set(options.__dataclass_fields__)


def _names(node, name, options):
    """Whether an AST node names the module `name` or reads cfg.<one of its options>."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name) and sub.id == name:
            return True
        if (isinstance(sub, ast.Attribute) and sub.attr in options
                and isinstance(sub.value, ast.Name) and sub.value.id == "cfg"):
            return True
        if isinstance(sub, ast.alias) and sub.name == name:  # from extensions import NAME
            return True
    return False


def _header(node):
    """The parts of a compound statement that decide whether its body runs."""
    if isinstance(node, (ast.If, ast.While)):
        return [node.test]
    if isinstance(node, ast.For):
        return [node.target, node.iter]
    if isinstance(node, ast.With):
        return [item.context_expr for item in node.items]
    return []


def _doomed(body, name, options):
    """The (first line, last line) ranges of the statements of `body` (a list) to delete,
    recursively: a statement that names the extension; a compound one whose header does, whole;
    one whose body would be left empty, whole."""
    ranges = []
    for node in body:
        first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        if any(_names(part, name, options) for part in _header(node)):
            # a guarded block goes whole: the rule allows no else beside an extension's block
            assert not getattr(node, "orelse", None), f"line {node.lineno}: an else beside it"
            ranges.append((first, node.end_lineno))
        elif isinstance(getattr(node, "body", None), list):  # a compound statement: look inside
            blocks = [getattr(node, block, None) or [] for block in ("body", "orelse", "finalbody")]
            blocks += [handler.body for handler in getattr(node, "handlers", [])]
            inner = [r for block in blocks for r in _doomed(block, name, options)]
            gone = {n for a, b in inner for n in range(a, b + 1)}
            if all(stmt.lineno in gone for stmt in node.body):
                ranges.append((first, node.end_lineno))
            else:
                ranges += inner
        elif _names(node, name, options):
            ranges.append((first, node.end_lineno))
    return ranges


def strip(tree_dir, name):
    """Remove extension `name` from the copy at tree_dir (the module docstring's rule). Returns the
    number of code lines deleted from the core."""
    os.remove(os.path.join(tree_dir, "extensions", f"{name}.py"))
    options, deleted = _options(name), 0
    for module in CORE:
        path = os.path.join(tree_dir, module)
        lines = open(path).read().split("\n")
        doomed = set()
        for a, b in _doomed(ast.parse("\n".join(lines)).body, name, options):
            doomed.update(range(a, b + 1))
        deleted += sum(1 for n in doomed if lines[n - 1].strip() and
                       not lines[n - 1].strip().startswith("#"))
        kept = [line for i, line in enumerate(lines, 1) if i not in doomed]
        # config.EXTENSIONS holds the name as a string: it goes from the list
        for node in ast.parse("\n".join(kept)).body:
            if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "EXTENSIONS":
                text = "\n".join(kept[node.lineno - 1:node.end_lineno])
                text = re.sub(rf'"{name}",\s*|,\s*"{name}"|"{name}"', "", text)
                kept[node.lineno - 1:node.end_lineno] = text.split("\n")
        with open(path, "w") as f:
            f.write("\n".join(kept))
    return deleted


def copy_tree(dest, with_tests=True):
    """The trainer's files (the five modules, extensions/, and with_tests configs/ and tests/)
    copied to dest."""
    os.makedirs(dest, exist_ok=True)
    for module in CORE:
        shutil.copy(os.path.join(ROOT, module), dest)
    folders = ("extensions", "configs", "tests") if with_tests else ("extensions",)
    for folder in folders:
        shutil.copytree(os.path.join(ROOT, folder), os.path.join(dest, folder),
                        ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(os.path.join(ROOT, "pytest.ini"), dest)


def run(dest, *args, timeout=300):
    proc = subprocess.run([sys.executable, *args], cwd=dest, capture_output=True, text=True,
                          timeout=timeout, env=cpu_env(PYTHONPATH=dest))
    assert proc.returncode == 0, f"{args}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc


def _free_names(node):
    """The names a definition reads that it does not bind itself (arguments, assignments, its
    own imports): what it takes from the namespace it runs in."""
    bound = {sub.arg for sub in ast.walk(node) if isinstance(sub, ast.arg)}
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store):
            bound.add(sub.id)
        if isinstance(sub, ast.alias):
            bound.add((sub.asname or sub.name).split(".")[0])
    loads = {sub.id for sub in ast.walk(node)
             if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Load)}
    return loads - bound


@pytest.mark.parametrize("name", config.EXTENSIONS)
def test_options_and_check_read_alone(name):
    """config.py runs an extension's Options and check alone, in a namespace of a few names: a
    name outside it would fail with a NameError only when that line runs (a refusal never tried
    in a test). Its fields must be new ones, each with a plain default, which is all
    config.Config keeps of them (dataclasses.make_dataclass: a reused name would silently replace
    the core's default)."""
    path = os.path.join(ROOT, "extensions", f"{name}.py")
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    read_alone = ("Options", "check", "idle")
    allowed = {"dataclasses", "Literal", "ConfigError", "os", "json", *read_alone}
    allowed |= set(dir(builtins))
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and node.name in read_alone:
            assert _free_names(node) <= allowed, (name, node.name, _free_names(node) - allowed)
    options, *_ = config.OPTIONS[name]
    core = {f.name for f in dataclasses.fields(config.CoreConfig)}
    for field in dataclasses.fields(options):
        assert field.name not in core, f"{name}.{field.name} is CoreConfig's"
        assert field.default is not dataclasses.MISSING, f"{name}.{field.name} has no default"
        assert not field.metadata, f"{name}.{field.name}: Config keeps no metadata"


# Run in one process for every copy (torch and transformers imported once, ~4 s a copy saved):
# for each tree, the trainer's own modules are dropped from sys.modules and imported afresh from
# it, and --help's text (config.print_help, what `train_ppo.py --help` prints) is kept.
IMPORT_EACH = """
import contextlib, io, json, sys
OWN = ("config", "train_ppo", "model_parallel", "logprobs", "rollout", "extensions")
helps = {}
for tree in sys.argv[1:]:
    for name in [name for name in sys.modules if name.split(".")[0] in OWN]:
        del sys.modules[name]
    sys.path.insert(0, tree)
    import train_ppo, config
    assert train_ppo.__file__.startswith(tree) and config.__file__.startswith(tree)
    sys.path.remove(tree)
    with contextlib.redirect_stdout(io.StringIO()) as text:
        config.print_help()
    helps[tree] = text.getvalue()
print(json.dumps(helps))
"""


def test_each_extension_alone_can_be_deleted(tmp_path):
    """For each extension, a copy without it: the trainer imports and --help lists none of its
    options (and still the core's)."""
    trees = {name: tmp_path / name for name in config.EXTENSIONS}
    for name, tree in trees.items():
        copy_tree(tree, with_tests=False)
        print(f"{name}: {strip(tree, name)} core code lines name it")
    helps = json.loads(run(tmp_path, "-c", IMPORT_EACH, *map(str, trees.values())).stdout)
    for name, tree in trees.items():
        out = helps[str(tree)]
        assert "--lr=" in out, name
        assert not any(f"--{option}=" in out for option in _options(name)), name


@pytest.mark.slow  # a step in one process, and the core's unit tests, in the stripped copy
def test_the_core_alone_trains_a_step_and_passes_its_tests(tmp_path):
    copy_tree(tmp_path)
    deleted = {name: strip(tmp_path, name) for name in config.EXTENSIONS}
    print(f"core code lines naming each extension: {deleted}, together {sum(deleted.values())}")
    assert not os.listdir(tmp_path / "extensions") or os.listdir(tmp_path / "extensions") == \
        ["__init__.py"]
    out = run(tmp_path, "train_ppo.py", "--help").stdout
    assert "--lr=" in out and "--lora_rank" not in out
    run(tmp_path, "train_ppo.py", "--config", "configs/demo_cpu.toml", "--steps=1",
        f"--out_dir={tmp_path / 'out'}", "--sft_steps=0", "--rollout_engine=hf",
        "--export_hf=false", "--plot_every=0")
    rows = open(tmp_path / "out" / "metrics.jsonl").read().splitlines()
    assert len(rows) == 1
    run(tmp_path, "-m", "pytest", "-q", "-p", "no:cacheprovider",
        *[os.path.join("tests", t) for t in CORE_TESTS], timeout=900)
