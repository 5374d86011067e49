"""The Triton kernels compiled for a Hopper GPU (sm_90) on this CPU, as the lease's GPU compiles them: the
interpreter (tests/test_kernels.py) runs the maths but never the compiler, whose type and layout rules are
stricter. And the statistics kernel's hot loop against TRL 1.16's own kernel, machine instruction by
instruction (benchmarks/gpu/sass.py): the H200 lease of 2026-11-27 found the sweep issue-bound, 1.9x TRL's
time at 36.3 instructions a logit against TRL's 25.0."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Each kernel is compiled in a child without TRITON_INTERPRET (conftest sets it for this process), at the
# shapes a lease launches: bf16 logits, V 151,936, one temperature and per-row temperatures.
_COMPILE_ALL = r"""
import os, sys
os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, sys.argv[1])
from benchmarks.gpu import sass
from entropy_rft.core.kernels import head, stats

V, B = sass.V_FULL, 2048
SPAN = -(-V // B) * B
p = lambda dt: ("ptr", dt)
common = {"t_scalar": ("fp32",), "BLOCK": ("const", B), "SPAN": ("const", SPAN)}
for per_row in (False, True):
    t = p("fp32") if per_row else p("i32")
    kernels = {
        "rows": (stats._stats_rows_kernel, {"x_ptr": p("bf16"), "ids_ptr": p("i64"), "t_ptr": t,
                 "out_ptr": p("fp32"), "flags_ptr": p("i32"), "out_stride": ("int", 16384), "inner": ("int", 1),
                 "stride_outer": ("int", V), "stride_inner": ("int", 0), "V": ("const", V)}),
        "split": (stats._stats_split_kernel, {"x_ptr": p("bf16"), "ids_ptr": p("i64"), "t_ptr": t,
                  "part_ptr": p("fp32"), "flags_ptr": p("i32"), "inner": ("int", 5), "stride_outer": ("int", 5 * V),
                  "stride_inner": ("int", V), "V": ("const", V), "SPLITS": ("const", 8)}),
        "block": (stats._stats_block_kernel, {"x_ptr": p("bf16"), "stride_x": ("int", 32768), "ids_ptr": p("i64"),
                  "col0": ("int", 32768), "t_ptr": t, "part_ptr": p("fp32"), "j": ("int", 3),
                  "NCOLS": ("const", 32768), "SPLITS": ("const", 5)}),
        "merge": (stats._merge_kernel, {"part_ptr": p("fp32"), "ids_ptr": p("i64"), "t_ptr": t,
                  "out_ptr": p("fp32"), "flags_ptr": p("i32"), "out_stride": ("int", 16384), "V": ("const", V),
                  "SPLITS": ("const", 8)}),
        "logit_grad": (head._logit_grad_kernel, {"z_ptr": p("bf16"), "stride_z": ("int", 32768),
                       "ids_ptr": p("i64"), "col0": ("int", 0), "t_ptr": t, "lse_ptr": p("fp32"),
                       "ent_ptr": p("fp32"), "gl_ptr": p("fp32"), "ge_ptr": p("fp32"), "V": ("const", 32768),
                       "HAS_LOGP": ("const", True), "HAS_ENT": ("const", True)}),
    }
    for name, (fn, spec) in kernels.items():
        spec = {**common, **spec, "PER_ROW": ("const", per_row)}
        spec = {k: v for k, v in spec.items() if k in fn.arg_names}
        text, regs = sass.compile_sm90(fn, spec, 1 if name == "merge" else 8)
        assert "EXIT" in text and regs > 0, name
        print(name, per_row, regs, flush=True)
"""


def test_every_kernel_compiles_for_sm90():
    r = subprocess.run([sys.executable, "-c", _COMPILE_ALL, str(ROOT)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(r.stdout.split("\n")) - 1 == 10, r.stdout  # five kernels, each with one and per-row temperatures


_COUNT = r"""
import sys
sys.path.insert(0, sys.argv[1])
from benchmarks.gpu import sass
from entropy_rft.core.kernels.stats import default_block, default_warps
b = default_block(sass.V_FULL)
ours, trl = sass.ours(b, default_warps(b, 2)), sass.trl()
print(ours.per_logit, trl.per_logit, ours.opcodes.get("MUFU", 0) / ours.per_thread)
"""


def test_statistics_sweep_issues_fewer_instructions_a_logit_than_trls_kernel():
    """Five statistics for fewer machine instructions a logit than TRL's two (log p and H), one exp a logit:
    the measure that separated the two kernels on the H200 (36.3 against 25.0 instructions, 1.9x the time)."""
    r = subprocess.run([sys.executable, "-c", _COUNT, str(ROOT)], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    ours, trl, exps = map(float, r.stdout.split())
    assert 20 <= trl <= 30, trl  # TRL 1.16's kernel as measured when this test was written (25.0)
    assert ours <= 0.8 * trl, (ours, trl)
    assert exps == 1.0, exps
