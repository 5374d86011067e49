"""The statistics kernel's machine code for a Hopper GPU, read on the CPU: no GPU needed.

Triton compiles a kernel for sm_90 on any machine (its wheel carries ptxas, nvdisasm and cuobjdump). This tool
compiles ``core.kernels.stats``'s row kernel and TRL 1.16's ``selective_log_softmax_and_entropy`` forward kernel
with the argument specialisation Triton's launcher gives a contiguous [rows, V] bf16 logits tensor (pointers
and multiples of 16 marked divisible by 16, ones made constants), disassembles them, and counts the machine
instructions of the hot loop (the column sweep, without the branch taken only when a block raises the row's
max) per logit and thread. On the H200 lease of 2026-11-27 the statistics kernel read the logits 1.9x slower
than TRL's (benchmarks/results/nvidia-h200-2026-11-27.md) with 36.3 instructions a logit against TRL's 25.0:
a sweep over bf16 logits at these sizes is bound by instruction issue before memory, so this count is the
figure to lower between leases, and the lease's timings say how far it carries.

    python -m benchmarks.gpu.sass                      # ours at the default and other blocks, and TRL's
    python -m benchmarks.gpu.sass --block 2048 --warps 8 --dump /tmp/stats.sass
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # real kernels, compiled, never run

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
V_FULL = 151936
ROWS = 16384
HOPPER = GPUTarget("cuda", 90, 32)
_BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
_BRANCH = re.compile(r"BRA `?\(?(\.L_x_\d+)")


@dataclass(frozen=True)
class LoopCount:
    """One kernel's hot loop: instructions per iteration, logits a thread reads per iteration, registers."""

    name: str
    block: int
    warps: int
    instructions: int
    per_thread: int
    registers: int
    opcodes: dict[str, int]

    @property
    def per_logit(self) -> float:
        return self.instructions / self.per_thread


def compile_sm90(fn, spec: dict[str, tuple], warps: int) -> tuple[str, int]:
    """(SASS text, registers per thread) of the Triton kernel ``fn`` compiled for sm_90.

    spec: argument name -> ("ptr", dtype) | ("int", value) | ("fp32",) | ("const", value). Integer arguments
    are specialised as Triton's launcher does: 1 becomes a constant, a multiple of 16 is marked divisible."""
    sig, consts, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        kind, *v = spec[name]
        if kind == "const" or (kind == "int" and v[0] == 1):
            sig[name], consts[name] = "constexpr", v[0]
        elif kind == "ptr":
            sig[name], attrs[(i,)] = "*" + v[0], [["tt.divisibility", 16]]
        elif kind == "int":
            sig[name] = "i64" if abs(v[0]) >= 2**31 else "i32"
            if v[0] % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = kind
    kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs), target=HOPPER,
                            options={"num_warps": warps})
    cubin = Path(os.environ.get("TMPDIR", "/tmp")) / f"erft-{fn.__name__}-{os.getpid()}.cubin"
    cubin.write_bytes(kernel.asm["cubin"])
    try:
        sass = subprocess.run([str(_BIN / "nvdisasm"), "-c", str(cubin)], capture_output=True, text=True,
                              check=True).stdout
        usage = subprocess.run([str(_BIN / "cuobjdump"), "--dump-resource-usage", str(cubin)], capture_output=True,
                               text=True, check=True).stdout
    finally:
        cubin.unlink(missing_ok=True)
    return sass, int(re.search(r"REG:(\d+)", usage).group(1))


def hot_loop(sass: str) -> list[str]:
    """The instructions of the longest loop (a backward branch to a label), less the bodies of its predicated
    forward branches (code skipped on the common path: the statistics kernel's rescale)."""
    labels: dict[str, int] = {}
    instr: list[str] = []
    for line in sass.splitlines():
        label = re.match(r"^\s*(\.L_x_\d+):", line)
        if label:
            labels[label.group(1)] = len(instr)
            continue
        op = re.search(r"/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", line)
        if op:
            instr.append(op.group(1))
    loops = [(labels[m.group(1)], i) for i, ins in enumerate(instr)
             if (m := _BRANCH.search(ins)) and labels.get(m.group(1), len(instr)) < i]
    if not loops:
        raise ValueError("no loop in this kernel's SASS")
    a, b = max(loops, key=lambda ab: ab[1] - ab[0])
    skipped: set[int] = set()
    for i in range(a, b + 1):
        m = _BRANCH.search(instr[i])
        if m and instr[i].startswith("@") and a < labels.get(m.group(1), -1) <= b:
            skipped.update(range(i + 1, labels[m.group(1)]))
    return [instr[i] for i in range(a, b + 1) if i not in skipped]


def opcode_counts(body: list[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for ins in body:
        op = re.sub(r"^@!?U?P\w+\s+", "", ins).split()[0].split(".")[0]
        out[op] = out.get(op, 0) + 1
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def count(name: str, fn, spec: dict, block: int, warps: int, dump: Path | None = None) -> LoopCount:
    sass, regs = compile_sm90(fn, spec, warps)
    if dump is not None:
        dump.write_text(sass)
    body = hot_loop(sass)
    return LoopCount(name, block, warps, len(body), block // (32 * warps), regs, opcode_counts(body))


def ours(block: int, warps: int, dump: Path | None = None, vocab: int = V_FULL) -> LoopCount:
    """``core.kernels.stats._stats_rows_kernel`` on contiguous bf16 [16384, vocab] logits, one temperature."""
    from entropy_rft.core.kernels import stats

    spec = {"x_ptr": ("ptr", "bf16"), "ids_ptr": ("ptr", "i64"), "t_ptr": ("ptr", "i32"), "t_scalar": ("fp32",),
            "out_ptr": ("ptr", "fp32"), "flags_ptr": ("ptr", "i32"), "out_stride": ("int", ROWS),
            "inner": ("int", 1), "stride_outer": ("int", vocab), "stride_inner": ("int", 0),
            "V": ("const", vocab), "SPAN": ("const", triton.cdiv(vocab, block) * block), "BLOCK": ("const", block),
            "PER_ROW": ("const", False)}
    return count("erft token_stats", stats._stats_rows_kernel, spec, block, warps, dump)


def trl(temperature: float = 0.7, vocab: int = V_FULL) -> LoopCount:
    """TRL 1.16's ``_forward_kernel`` (``trl.kernels.logprob_entropy``) on the same logits, as TRL launches it."""
    from trl.kernels import logprob_entropy

    block = 1024  # TRL's _BLOCK_SIZE, launched with Triton's default 4 warps
    spec = {"logits_ptr": ("ptr", "bf16"), "index_ptr": ("ptr", "i64"), "row_mask_ptr": ("ptr", "i64"),
            "logprobs_ptr": ("ptr", "fp32"), "entropy_ptr": ("ptr", "fp32"), "log_z_ptr": ("ptr", "fp32"),
            "expected_logit_ptr": ("ptr", "fp32"), "logits_batch_stride": ("int", 0),
            "logits_row_stride": ("int", vocab), "index_batch_stride": ("int", 0), "index_row_stride": ("int", 1),
            "mask_batch_stride": ("int", 0), "mask_row_stride": ("int", 0), "n_cols": ("const", vocab),
            "rows_per_batch": ("int", ROWS), "TEMPERATURE": ("const", temperature), "HAS_MASK": ("const", False),
            "BLOCK_SIZE": ("const", block)}
    return count("TRL selective_log_softmax_and_entropy", logprob_entropy._forward_kernel, spec, block, 4)


def line(c: LoopCount) -> str:
    top = ", ".join(f"{k} {v}" for k, v in list(c.opcodes.items())[:8])
    return (f"{c.name:40s} block {c.block:5d} x {c.warps:2d} warps: {c.per_logit:5.2f} instructions a logit "
            f"({c.instructions} a loop of {c.per_thread} logits a thread), {c.registers} registers; {top}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--block", type=int, default=None, help="one block size (default: the default and others)")
    p.add_argument("--warps", type=int, default=None, help="warps per program (default: bf16's default_warps)")
    p.add_argument("--dump", type=Path, default=None, help="write the SASS of the one --block kernel here")
    a = p.parse_args(argv)
    from entropy_rft.core.kernels.stats import default_block, default_warps

    blocks = [a.block] if a.block else [default_block(V_FULL), 1024, 4096]
    for b in blocks:
        print(line(ours(b, a.warps or default_warps(b, 2), a.dump if a.block else None)))
    print(line(trl()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
