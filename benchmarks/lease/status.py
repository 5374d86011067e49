"""Which plans have run: read off what is committed (benchmarks/results/, results/smollm2-gpu/), so the next
session with a GPU runs the next plan that has not."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from plans import KERNEL_RESULTS, PLANS, REALM_RESULTS, ROOT, Plan, realm_run_names

sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))
from realm import _finished  # noqa: E402  (one definition of a finished run)


def missing_runs(seed: int, root: Path = ROOT) -> list[str]:
    """This wave's runs that are not committed finished in results/smollm2-gpu/."""
    return [n for n in realm_run_names(seed) if not _finished(root / REALM_RESULTS / n)]


KERNEL_TRIES = 2  # after two leases with a failed section, the kernels plan gives way to the realm plans


def kernel_leases(root: Path = ROOT) -> dict[Path, list[str]]:
    """The committed records of kernels leases (``lease-kernels-*.json``), each with its sections that did not
    end ``ok``."""
    out = {}
    for p in sorted((root / KERNEL_RESULTS).glob("lease-kernels-*.json")):
        try:
            calls = json.loads(p.read_text())["calls"]
        except (OSError, ValueError, KeyError):
            continue
        out[p] = [s["name"] for c in calls for s in c["sections"] if s.get("status") != "ok"] or ([] if calls else
                                                                                               ["no call"])
    return out


def plan_done(plan: Plan, root: Path = ROOT) -> bool:
    """A realm wave has run when its five runs are committed finished; the kernels plan when one lease ran every
    section, or after ``KERNEL_TRIES`` leases (what failed twice needs mending here, not a third lease)."""
    if plan.realm:
        return not missing_runs(plan.seed, root)
    leases = kernel_leases(root)
    return any(not failed for failed in leases.values()) or len(leases) >= KERNEL_TRIES


def next_plan(root: Path = ROOT) -> Plan | None:
    """The first plan, in order, that has not run (None: all have)."""
    return next((p for p in PLANS.values() if not plan_done(p, root)), None)
