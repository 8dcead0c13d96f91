"""The off-policy correction against verl 0.9.1 itself: offpolicy.importance_weights and
rejection_mask beside verl's compute_rollout_correction_weights and
compute_rollout_rejection_mask, run from verl's wheel, on random episodes with gapped masks.

    pip download --no-deps verl==0.9.1 -d /tmp/verl     # PyPI only: the wheel, not its stack
    python scripts/verl_parity.py /tmp/verl/verl-0.9.1-py3-none-any.whl

verl's module imports its whole stack (ray, tensordict, its configs); only three names of it
reach these two functions: verl.utils.torch_functional's masked_sum and masked_mean, which this
script takes from the wheel too (their source, cut out of torch_functional.py), and two config
classes used in type hints, stood in by empty classes. Prints the largest difference of each
level, mode and option; the last line: RESULT max_weight_diff=... rejection_mismatches=...
tests/test_offpolicy.py checks the same against verl's formulas re-derived, on every run of the
suite (which cannot download verl)."""
import ast
import os
import sys
import types
import zipfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import config  # noqa: E402
from extensions import offpolicy  # noqa: E402


def verl_functions(wheel):
    """verl's rollout_corr_helper module, imported from the wheel with stand-ins for its imports."""
    with zipfile.ZipFile(wheel) as z:
        helper = z.read("verl/trainer/ppo/rollout_corr_helper.py").decode()
        functional = z.read("verl/utils/torch_functional.py").decode()
    tf = types.ModuleType("verl.utils.torch_functional")
    tf.torch = torch
    for node in ast.parse(functional).body:  # verl's own masked_sum and masked_mean
        if isinstance(node, ast.FunctionDef) and node.name in ("masked_sum", "masked_mean"):
            exec(compile(ast.Module([node], []), "torch_functional.py", "exec"), tf.__dict__)
    stubs = {"verl": types.ModuleType("verl"), "verl.utils": types.ModuleType("verl.utils"),
             "verl.utils.torch_functional": tf, "verl.protocol": types.ModuleType("verl.protocol"),
             "verl.trainer.config.algorithm": types.ModuleType("a"),
             "verl.workers.config.actor": types.ModuleType("b")}
    stubs["verl.utils"].torch_functional = tf
    stubs["verl.protocol"].DataProto = type("DataProto", (), {})
    stubs["verl.trainer.config.algorithm"].RolloutCorrectionConfig = type("C", (), {})
    stubs["verl.workers.config.actor"].PolicyLossConfig = type("P", (), {})
    sys.modules.update(stubs)
    module = types.ModuleType("rollout_corr_helper")
    exec(compile(helper, "rollout_corr_helper.py", "exec"), module.__dict__)
    return module


def cases(n=20):
    """Random (log_ratio, mask) pairs: 6 rows of 24 positions, a prompt, model turns with
    observations between them, padding; log ratios of several scales (bf16's ~1e-2 to 2)."""
    g = torch.Generator().manual_seed(0)
    for i in range(n):
        mask = torch.zeros(6, 24)
        for b in range(6):
            start = int(torch.randint(1, 6, (1,), generator=g))
            end = int(torch.randint(start + 1, 25, (1,), generator=g))
            mask[b, start:end] = 1
            gap = int(torch.randint(start, end, (1,), generator=g))
            mask[b, gap:gap + 3] = 0  # an observation
            mask[b, end - 1] = 1  # the last token is the model's
        scale = [0.01, 0.1, 0.5, 2.0][i % 4]
        yield torch.randn(6, 24, generator=g) * scale * mask, mask


def main(wheel):
    verl = verl_functions(wheel)
    worst = 0.0
    for level in ("token", "sequence"):
        for threshold in (2.0, "0.5_2.0", 1.2, "0.8_1.25"):
            diff, raised = 0.0, 0
            for log_ratio, mask in cases():
                try:
                    want, _ = verl.compute_rollout_correction_weights(log_ratio, mask, level,
                                                                      threshold)
                except ZeroDivisionError:  # verl's ESS metric when every weight is masked to 0
                    raised += 1
                    continue
                lower, _, upper = str(threshold).partition("_")
                cfg = config.Config(offpolicy_is=level, offpolicy_is_mode="mask" if upper else
                                    "truncate", offpolicy_is_bound=float(upper or lower),
                                    offpolicy_is_lower=float(lower) if upper else 0.5)
                got = offpolicy.importance_weights(log_ratio, mask, cfg)
                diff = max(diff, (got - want).abs().max().item())
            print(f"weights {level:9s} {threshold!s:9s} max |diff| {diff:.2e}"
                  + (f" ({raised} of 20 cases: verl raised ZeroDivisionError)" if raised else ""))
            worst = max(worst, diff)
    mismatches = 0
    for option in sorted(verl.SUPPORTED_ROLLOUT_RS_OPTIONS):
        for bound in (1.5, 4.0) if option.endswith("k1") else (0.001, 0.05, 1.0):
            wrong = 0
            for log_ratio, mask in cases():
                want, _ = verl.compute_rollout_rejection_mask(log_ratio, mask, option, bound)
                cfg = config.Config(offpolicy_reject=option, offpolicy_reject_bound=bound)
                wrong += int((offpolicy.rejection_mask(log_ratio, mask, cfg) != want).sum())
            print(f"rejection {option:11s} bound {bound:<6g} tokens that differ: {wrong}")
            mismatches += wrong
    print(f"RESULT max_weight_diff={worst:.2e} rejection_mismatches={mismatches}")


if __name__ == "__main__":
    if len(sys.argv) != 2 or not os.path.isfile(sys.argv[1]):
        sys.exit("usage: python scripts/verl_parity.py VERL_WHEEL (pip download --no-deps "
                 "verl==0.9.1 -d DIR)")
    main(sys.argv[1])
