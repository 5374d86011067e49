"""The GPU lease kit: the GPU work as named plans of one or two device calls (docs/lease.md).

Here (the checkout's .venv):
    python -m benchmarks.lease.kit next                   # the next plan that has not run, and its exact calls
    python -m benchmarks.lease.kit show PLAN              # one plan's calls: carry, command, timeout_s, returns
    python -m benchmarks.lease.kit pack PLAN              # build its carry in .lease/ (wheels, GGUF parts); sizes
    python -m benchmarks.lease.kit collect PLAN DIR [DIR] # what the calls returned -> benchmarks/results/, results/
    python -m benchmarks.lease.kit shrink PLAN            # the smaller setting a lease proposed -> the config
    python -m benchmarks.lease.kit rehearse [PLAN ...]    # every plan on the CPU under the device's conditions
On the GPU machine (the call's command; the image's python3, which finds the checkout's src/ through
benchmarks/__init__.py):
    PYTHONUNBUFFERED=1 python3 -m benchmarks.lease.kit call PLAN N

Plans: kernels (issue 33), realm (issue 34); `next` offers kernels first, then realm until its 15 runs are
committed (each lease trains as many of the missing ones as fit, seeds first), then a second try of kernels if
its first lease left a section unfinished.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from benchmarks.lease.plans import CALL_DEADLINE_S, CALL_TIMEOUT_S, CARRY_LIMIT, MIB, PLANS, ROOT, Plan, get_plan


def describe(plan: Plan) -> str:
    """The plan's calls as whoever holds the lease makes them."""
    lines = [f"plan {plan.name} (issue {plan.issue}): {plan.purpose}",
             f"  here first: .venv/bin/python -m benchmarks.lease.kit pack {plan.name}"]
    for i, call in enumerate(plan.calls, 1):
        lines += [f"  call {i} of {len(plan.calls)}:",
                  f"    carry:     {list(call.carry)}",
                  f"    command:   {call.command(plan.name, i)}",
                  f"    timeout_s: {CALL_TIMEOUT_S}   (the command ends by itself within {CALL_DEADLINE_S} s)",
                  "    returns:   " + ", ".join(["lease.json", "log.txt", *(f for s in call.sections
                                                                        for f in s.files)])]
        lines += [f"      - {s.name}: {s.what}" for s in call.sections]
    if len(plan.calls) > 1:
        lines.append(f"  make each call at once after the one before, 1 to {len(plan.calls)} (a machine is given back "
                     "30 s after a call)")
    folders = " ".join(f"FILES_AT_OF_CALL_{i}" for i in range(1, len(plan.calls) + 1))
    lines.append(f"  then here: .venv/bin/python -m benchmarks.lease.kit collect {plan.name} {folders}; commit")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("next", help="the next plan that has not run, and its calls")
    sub.add_parser("list", help="every plan, in order, and whether it has run")
    sp = sub.add_parser("show", help="one plan's calls")
    sp.add_argument("plan")
    sp = sub.add_parser("pack", help="build a plan's carry in .lease/")
    sp.add_argument("plan")
    sp = sub.add_parser("call", help="on the device: run one call of a plan, writing to $OUT")
    sp.add_argument("plan")
    sp.add_argument("number", type=int)
    sp = sub.add_parser("collect", help="put what a lease returned where it is committed")
    sp.add_argument("plan")
    sp.add_argument("folders", nargs="+", type=Path, help="each call's returned files (the tool's files_at)")
    sp.add_argument("--force", action="store_true", help="realm, the first lease that trains: commit the runs even "
                    "if the task misses issue 34's wants")
    sp = sub.add_parser("shrink", help="write the smaller setting a realm lease proposed into the config, once")
    sp.add_argument("plan")
    sp = sub.add_parser("rehearse", help="every plan (or those named) on the CPU, as on the device")
    sp.add_argument("plans", nargs="*")
    sp.add_argument("--work", type=Path, default=ROOT / ".lease" / "rehearsal")
    a = p.parse_args(argv)
    from benchmarks.lease.checks import LeaseDataError

    try:
        return dispatch(a)
    except LeaseDataError as e:  # a returned file or a committed record that is not what the kit writes
        print(f"{a.cmd}: {e}" + ("; nothing was written" if a.cmd in ("collect", "shrink") else ""),
              file=sys.stderr)
        return 2


def dispatch(a: argparse.Namespace) -> int:
    """Run the subcommand ``a.cmd``."""
    if a.cmd == "call":
        from benchmarks.lease.device import run_call

        out = os.environ.get("OUT")
        if not out:
            print("call: $OUT is not set: this runs on the device machine, where the tool sets it", file=sys.stderr)
            return 2
        state = Path(os.environ.get("ERFT_LEASE_STATE", "/tmp/erft-lease"))
        deadline = float(os.environ.get("ERFT_LEASE_DEADLINE_S", CALL_DEADLINE_S))
        return run_call(get_plan(a.plan), a.number, Path(out), state, os.environ.get("ERFT_LEASE_REHEARSAL") == "1",
                        deadline)
    if a.cmd in ("next", "list"):
        from benchmarks.lease.status import next_plan, plan_done

        if a.cmd == "list":
            from benchmarks.lease.status import kernel_leases

            for plan in PLANS.values():
                print(f"{plan.name:8s} {'ran' if plan_done(plan) else 'to run':6s}  {plan.purpose}")
            for rec, failed in kernel_leases().items():
                said = f"failed: {', '.join(failed)}" if failed else "every section ok"
                print(f"  {rec.relative_to(ROOT)}: {said}")
            return 0
        from benchmarks.lease.status import plan_state

        plan = next_plan()
        print(describe(plan) if plan else "every plan has run: nothing needs a GPU lease")
        for line in plan_state(plan) if plan else []:
            print(f"  NOTE: {line}")
        return 0
    if a.cmd == "show":
        print(describe(get_plan(a.plan)))
        return 0
    if a.cmd == "pack":
        from benchmarks.lease.carry import pack

        sizes = pack(get_plan(a.plan))
        for k, v in sizes.items():
            print(f"{a.plan} {k}: {v / MIB:.1f} MiB with the working tree (limit {CARRY_LIMIT / MIB:.0f} MiB)")
        print(describe(get_plan(a.plan)))
        return 0
    if a.cmd == "shrink":
        from benchmarks.lease.shrink import shrink

        plan = get_plan(a.plan)
        if not plan.realm:
            print(f"shrink: {plan.name} is not a realm plan", file=sys.stderr)
            return 2
        sets = shrink(plan)
        print(f"configs/smollm2-gpu.yaml: {sets}; say so in docs/results-smollm2-gpu.md, commit, and run "
              f"{plan.name} at the next lease")
        return 0
    if a.cmd == "collect":
        from benchmarks.lease.collect import collect

        bad = [str(f) for f in a.folders if not f.is_dir()]
        if bad:
            print(f"collect: not a folder: {', '.join(bad)}", file=sys.stderr)
            return 2
        for path in collect(get_plan(a.plan), a.folders, force=a.force):
            print(f"wrote {path.relative_to(ROOT)}")
        return 0
    if a.cmd == "rehearse":
        from benchmarks.lease.rehearse import rehearse

        names = a.plans or list(PLANS)
        for n in names:
            get_plan(n)
        failures = rehearse(names, a.work)
        for f in failures:
            print(f"REHEARSAL FAILED: {f}", file=sys.stderr)
        print("rehearsal: " + ("every plan passed" if not failures else f"{len(failures)} failure(s)"))
        return 1 if failures else 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
