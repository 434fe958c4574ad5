"""Run a script with kernels/moe_gluon.py's pairs gate-up set to a form (or "triton": the Triton kernel).

python3 scripts/gpu_pairs_variant.py FORM SCRIPT [ARGS...]   # FORM as gpu_pairs_gate_up.py names them
"""

import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "scripts"), str(ROOT)]

from gpu_pairs_gate_up import set_form  # noqa: E402

from kernels import moe_gluon  # noqa: E402

form, script = sys.argv[1], sys.argv[2]
if form == "triton":
    moe_gluon.gate_up_pairs = lambda *args: False
else:
    set_form(form)
sys.argv = [script, *sys.argv[3:]]
runpy.run_path(script, run_name="__main__")
