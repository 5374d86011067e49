"""``erft report``: one self-contained HTML report (figures embedded) for run directories or a compare folder."""

from __future__ import annotations

import argparse
from pathlib import Path

from entropy_rft.cli.fit_law import SOURCES
from entropy_rft.common.errors import UserError

NAME = "report"
HELP = ("Write a self-contained report.html (entropy, accuracy, probe, S_c, lens, Pass@K, pass-rate "
        "histograms, entropy-performance law, and a computed summary) for runs or an erft compare folder.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                   help="Run directories, folders of run directories (erft compare --out), or other engines' runs "
                        "(verl console log or file-logger JSONL, TRL output_dir, TensorBoard event files, CSV/JSONL "
                        "table), as erft fit-law reads them.")
    p.add_argument("--source", choices=SOURCES,
                   help="Read every RUN_DIR as this kind of log instead of detecting it.")
    p.add_argument("--entropy-key", metavar="KEY", help="Other engines' runs: the policy-entropy key.")
    p.add_argument("--metric", metavar="KEY", help="Other engines' runs: the validation-score key.")
    p.add_argument("--out", required=True, help="Folder for report.html and report.json.")


def run(args: argparse.Namespace) -> int:
    from entropy_rft.analysis.engine_logs import detect, is_erft_path

    for d in args.run_dirs:  # torch-free: a bad path gets its one line before torch loads
        if not d.strip():
            raise UserError("a RUN_DIR is empty; give run directories or an erft compare --out folder")
        if not Path(d).exists():
            raise UserError(f"{d}: no such directory; give a run directory or an erft compare --out folder")
        if args.source is None and not is_erft_path(Path(d)):
            detect(Path(d))  # an unrecognised file or folder
    from entropy_rft.rundir import files as rundir
    from entropy_rft.training import preflight

    rundir.forget_warnings()  # each damaged line of the runs read: one warning in this command
    preflight.check_out(args.out, file_hint="")
    from entropy_rft.report.page import build_report

    numbers = build_report(args.run_dirs, args.out, source=args.source, entropy_key=args.entropy_key,
                           metric=args.metric)
    from entropy_rft.cli.fit_law import say

    for line in str(numbers["summary"]).splitlines():
        say(line)
    say(f"report written to {Path(args.out) / 'report.html'} ({len(numbers['runs'])} runs in "
          f"{len(numbers['series'])} series: {'; '.join(x['label'] for x in numbers['series'])}; "
          f"figures: {', '.join(numbers['figures'])})")
    for note in numbers["incomplete"]:  # a torn last line, no run.json or config.yaml, fewer steps than siblings
        say(f"  incomplete: {note}")
    for note in numbers["settings"]:  # runs of one method that erft compare would not put in one table
        say(f"  settings: {note}")
    for note in numbers["read"]:
        say(f"  read {note}")
    for o in numbers["omitted"]:
        say(f"  left out: {o['title']} ({o['reason']})")
    for f in numbers["law"]:
        if f.get("warning"):
            say(f"  law, {f['run']}: {f['warning']}")
    return 0
