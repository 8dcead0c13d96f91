"""When a run's reward reached a level: for each out_dir, the first step whose reward_mean is at
least LEVEL, the first step that ends a 5-step window whose mean is, and the seconds of steps
before the first (time_step_s summed). Steps count from 1, as the console's `step N/M` does.

    python scripts/reward_reached.py 0.85 out/demo out/distill-demo

What docs/distillation.md's toy table reads; `make distill-demo` prints it last.
"""
import json
import os
import sys


def reached(rows, level):
    """(first step >= level, first step ending a 5-step mean >= level, seconds before the first);
    None where it never does."""
    rewards = [row["reward_mean"] for row in rows]
    first = next((i + 1 for i, r in enumerate(rewards) if r >= level), None)
    window = next((i + 5 for i in range(len(rewards) - 4) if sum(rewards[i:i + 5]) / 5 >= level),
                  None)
    seconds = sum(row["time_step_s"] for row in rows[:first - 1]) if first else None
    return first, window, seconds


def main(argv):
    level = float(argv[0])
    for out_dir in argv[1:]:
        with open(os.path.join(out_dir, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f]
        first, window, seconds = reached(rows, level)
        said = (f"step {first} ({seconds:.0f} s of steps before it)" if first else "never")
        print(f"{out_dir}: reward >= {level:g} first at {said}; a 5-step mean >= {level:g} first "
              f"ending at step {window or 'never'} (of {len(rows)})")


if __name__ == "__main__":
    main(sys.argv[1:])
