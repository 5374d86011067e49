"""``erft doctor``: ranked findings on runs, each with its evidence, the rule that fired and a prescription from
the method registry (``analysis.doctor``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from entropy_rft.cli.fit_law import SOURCES, say
from entropy_rft.common.errors import UserError

NAME = "doctor"
HELP = ("Diagnose runs: entropy collapse, entropy surge, plateau at the law's ceiling, advantage collapse, "
        "truncation, clip saturation, KL drift, a control method that barely acts; each finding with its "
        "evidence, rule and a prescription from the method registry. Reads what erft fit-law reads. Exit 0; "
        "1 with --fail-on LEVEL when a finding at or above LEVEL exists; 2 on bad input.")
LEVELS = ("info", "warn", "error")  # analysis.doctor.LEVELS (no torch)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("runs", metavar="RUN", nargs="+",
                   help="An erft run directory or another engine's log, as erft fit-law reads it.")
    p.add_argument("--source", choices=SOURCES, help="Read every RUN as this kind of log.")
    p.add_argument("--entropy-key", metavar="KEY", help="Another engine's run: the policy-entropy key.")
    p.add_argument("--metric", default=None,
                   help="The validation score: an erft run's eval/ key suffix (default pass@1), another engine's "
                        "validation key (default as erft fit-law).")
    p.add_argument("--json", metavar="FILE", help="Also write the findings as JSON.")
    p.add_argument("--fail-on", choices=LEVELS, default=None,
                   help="Exit 1 when a finding at or above this level exists (for CI).")


def run(args: argparse.Namespace) -> int:
    for raw in args.runs:
        if not raw.strip():
            raise UserError("RUN is empty; give a run directory or a log file")
        if not Path(raw).exists():
            raise UserError(f"{raw}: no such run directory or log file")
    if args.json is not None:
        from entropy_rft.training import preflight

        preflight.check_out_file(args.json, "--json")
    from entropy_rft.analysis.engine_logs import detect, is_erft_path

    for raw in args.runs:
        if args.source is None and not is_erft_path(Path(raw)):
            detect(Path(raw))  # an unrecognised file: its one line before the analysis loads
    from entropy_rft.analysis.doctor import diagnose, load_series
    from entropy_rft.rundir.files import atomic_write_json, forget_warnings

    forget_warnings()
    out, worst = [], -1
    for raw in args.runs:
        series = load_series(raw, source=args.source, entropy_key=args.entropy_key, metric=args.metric)
        found = diagnose(series)
        say(f"{raw}: method {series.method}; H = {series.keys['entropy']}, R = {series.keys['score']}; "
            f"{len(found)} finding(s)")
        for f in found:
            worst = max(worst, LEVELS.index(f.level))
            say(f"  [{f.level}] {f.id}: {f.title}")
            say(f"    evidence: {f.evidence} (keys: {', '.join(f.keys)})")
            say(f"    rule: {f.rule}")
            rx = f.prescription
            if rx is not None:
                via = f"{rx.method}: " if rx.method != "none" else ""
                say(f"    prescription: {via}{rx.direction}; expect {rx.expect}" + (f" [{rx.paper}]" if rx.paper
                                                                                      else ""))
        if not found:
            say("  no findings: healthy by every rule")
        out.append({"run": str(raw), "method": series.method, "keys": series.keys,
                    "findings": [f.to_dict() for f in found]})
    if args.json:
        atomic_write_json(args.json, {"runs": out})
        say(f"written to {args.json}")
    if args.fail_on is not None and worst >= LEVELS.index(args.fail_on):
        return 1
    return 0
