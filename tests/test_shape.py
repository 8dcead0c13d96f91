"""The five modules and each extension stay readable: code lines are budgeted, comments and
docstrings are free.

A code line is a line with at least one Python token that is not a comment and not part of a
docstring (a string literal standing first in a module, class or function body). Blank lines,
comment lines and docstrings cost nothing: the users asked for heavily commented code, and a cap
on all lines taxed exactly that (lines got denser instead of the code simpler). Width is checked
by ruff (`make lint`, pyproject.toml), not here.
"""
import ast
import io
import os
import tokenize

from conftest import ROOT

MODULES = ("train_ppo.py", "model_parallel.py", "logprobs.py", "rollout.py", "config.py")
# The budgets grew with each capability (700 a module and 2,450 together with LoRA, to 820 and
# 2,950 with the off-policy correction and DAPO) until the capabilities beyond PPO's core left for
# extensions/: the five modules then 2,493, each extension at most 300, all together 3,128 (the
# core's target was 2,400 and the whole's 3,000: docs/testing.md, "Code lines", says what holds
# each above it); runs that outlive a lost worker or node added 22 (train_ppo.py's 745: the
# restart count every rank agrees on and the checkpoint a restarted run goes on from; config.py's
# refusals of a launch that cannot work); a note for each setting given that does nothing in the
# run added 40 (config.py's idle rules and notes, train_ppo.py's calls for the task's, rollout.py's
# RNG state kept as a tensor for a weights-only load), and 57 in the extensions (their idle rules);
# vLLM's prefix-cache reset checked, not assumed, 4 (rollout.py); asynchronous rollouts, an
# extension of their own, 26 (the 24 statements of the core that name async_rollout, which the
# issue held to 30, 9 of them in train_ppo.py, and config.py's rollout_tp_size check, now of the
# ranks that generate), and their file; config.load's refused launch, its other ranks 3 s behind
# rank 0 so that torchrun's teardown does not cut rank 0's line off, 3; main kept under 50 code
# lines (its engine and its saves each a function of their own: run_engine, save_after_step), 7
BUDGET_EACH, BUDGET_TOTAL = 770, 2600
EXTENSION_EACH, ALL_TOTAL = 300, 3525
NOT_CODE = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
            tokenize.ENDMARKER, tokenize.ENCODING}


def docstring_lines(tree):
    """Line numbers covered by docstrings, found by the AST (not by how a line starts)."""
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                lines.update(range(body[0].lineno, body[0].end_lineno + 1))
    return lines


def code_lines(source):
    """The number of lines that hold code (see the module docstring)."""
    docs = docstring_lines(ast.parse(source))
    code = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in NOT_CODE:
            continue
        # a multi-line token (a string) makes each of its lines a code line, unless a docstring
        code.update(n for n in range(tok.start[0], tok.end[0] + 1) if n not in docs)
    return len(code)


def test_counter_on_a_hand_counted_case():
    source = ('"""Module doc,\non two lines."""\n'
              "import os  # a trailing comment: still a code line\n"
              "\n"
              "# a comment line\n"
              "def f(x):\n"
              '    """Function doc."""\n'
              "    y = ('a multi-line'\n"
              "         'string')\n"
              "    return x + y\n")
    # import, def, the two lines of the expression, return
    assert code_lines(source) == 5


def _counts(paths):
    return {p: code_lines(open(os.path.join(ROOT, p), encoding="utf-8").read()) for p in paths}


def test_code_line_budget():
    counts = _counts(MODULES)
    total = sum(counts.values())
    print("code lines: " + ", ".join(f"{m} {n}" for m, n in counts.items()) + f"; together {total}")
    over = {m: n for m, n in counts.items() if n > BUDGET_EACH}
    assert not over, f"over {BUDGET_EACH} code lines: {over}: simplify or split, never densify"
    assert total <= BUDGET_TOTAL, f"{total} code lines together, over the budget of {BUDGET_TOTAL}"
    extensions = _counts(os.path.join("extensions", name) for name in
                         sorted(os.listdir(os.path.join(ROOT, "extensions"))) if name.endswith(".py"))
    print("extensions: " + ", ".join(f"{m} {n}" for m, n in extensions.items()))
    over = {m: n for m, n in extensions.items() if n > EXTENSION_EACH}
    assert not over, f"over {EXTENSION_EACH} code lines: {over}"
    everything = total + sum(extensions.values())
    assert everything <= ALL_TOTAL, f"{everything} code lines in all, over the budget of {ALL_TOTAL}"
