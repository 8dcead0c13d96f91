"""The trainer's CLI with a pause inside each checkpoint save, between the last file written and
the rename of step_N.tmp to step_N: test_checkpoint.py kills the run right there. A stand-in for
a machine that dies mid-save, kept out of train_ppo.py (no test hook in the main path):

    torchrun ... tests/_paused_save.py SECONDS --config ... (the trainer's own arguments)
"""
import os
import re
import runpy
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pause = float(sys.argv.pop(1))
replace = os.replace


def paused_replace(src, dst, *args, **kwargs):
    if re.fullmatch(r"step_\d+\.tmp", os.path.basename(str(src))):  # a checkpoint's dir, not a dump's file
        time.sleep(pause)  # every rank's files are written (save_checkpoint's barrier came first)
    return replace(src, dst, *args, **kwargs)


os.replace = paused_replace
sys.path.insert(0, ROOT)
runpy.run_path(os.path.join(ROOT, "train_ppo.py"), run_name="__main__")
