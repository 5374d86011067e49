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
    p.add_argument("--level", type=float, default=0.9,
                   help="The nominal level of the prediction intervals of the score at H = 0 (where the run is "
                        "heading if entropy keeps falling), by the law and by a baseline linear in H (default 0.9).")
    p.add_argument("--follow", action="store_true",
                   help="Watch one verl or TRL log that another process is writing: reread it as it grows and print "
                        "each new or worse finding with its step, until Ctrl-C (or --idle-exit-s). With --fail-on, "
                        "stop at once with exit 1 on a finding at or above that level.")
    p.add_argument("--poll-s", type=float, default=2.0, metavar="S",
                   help="--follow: look at the log every S seconds (default 2).")
    p.add_argument("--idle-exit-s", type=float, default=None, metavar="S",
                   help="--follow: stop when the log has not grown for S seconds (default: never).")


def run(args: argparse.Namespace) -> int:
    if not 0 < args.level < 1:  # also NaN
        raise UserError(f"--level must be in (0, 1), got {args.level}")
    if args.follow and len(args.runs) != 1:
        raise UserError(f"--follow watches one log; got {len(args.runs)} RUN arguments")
    if not (args.poll_s > 0 and args.poll_s < 3600):  # also NaN
        raise UserError(f"--poll-s must be in (0, 3600) seconds, got {args.poll_s}")
    if args.idle_exit_s is not None and not args.idle_exit_s > 0:
        raise UserError(f"--idle-exit-s must be > 0 seconds, got {args.idle_exit_s}")
    if not args.follow and args.idle_exit_s is not None:
        raise UserError("--idle-exit-s is for --follow; add --follow or leave it out")
    for raw in args.runs:
        if not raw.strip():
            raise UserError("RUN is empty; give a run directory or a log file")
        if not Path(raw).exists():
            raise UserError(f"{raw}: no such run directory or log file")
    if args.json is not None:
        from entropy_rft.training import preflight

        preflight.check_out_file(args.json, "--json")
    if args.follow:
        return _follow(args)
    from entropy_rft.analysis.engine_logs import detect, is_erft_path

    for raw in args.runs:
        if args.source is None and not is_erft_path(Path(raw)):
            detect(Path(raw))  # an unrecognised file: its one line before the analysis loads
    from entropy_rft.analysis.doctor import describe, diagnose, heading, load_series
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
            for line in describe(f):
                say(f"  {line}")
        if not found:
            say("  no findings: healthy by every rule")
        ahead = heading(series, args.level)
        say("  " + heading_line(ahead))
        out.append({"run": str(raw), "method": series.method, "keys": series.keys,
                    "findings": [f.to_dict() for f in found], "heading": ahead})
    if args.json:
        atomic_write_json(args.json, {"runs": out})
        say(f"written to {args.json}")
    if args.fail_on is not None and worst >= LEVELS.index(args.fail_on):
        return 1
    return 0


def _follow(args: argparse.Namespace) -> int:
    """--follow: a log being written (``analysis.live_doctor.follow``); the findings as they come."""
    from entropy_rft.analysis.doctor import describe
    from entropy_rft.analysis.engine_logs import is_erft_path
    from entropy_rft.analysis.live_doctor import follow, reaches

    raw = args.runs[0]
    if args.source is None and is_erft_path(Path(raw)):
        raise UserError(f"{raw}: an erft run directory; erft train prints its findings as they arise (and keeps "
                        "them in doctor.jsonl): --follow is for a verl or TRL log another process writes")
    if args.json is not None:
        raise UserError("--json is not written with --follow; run erft doctor on the log without --follow for it")
    import entropy_rft.analysis.law  # noqa: F401  (numpy, before the first check: a check keeps pace with the log)

    say(f"following {raw} (every {args.poll_s:g} s" + (f", until {args.idle_exit_s:g} s without growth)"
                                                        if args.idle_exit_s else "; Ctrl-C to stop)"))
    worst = -1
    try:
        for step, news in follow(raw, source=args.source, entropy_key=args.entropy_key, metric=args.metric,
                                 poll_s=args.poll_s, idle_exit_s=args.idle_exit_s):
            for f in news:
                worst = max(worst, LEVELS.index(f.level))
                lines = describe(f)
                say(f"step {step}: {lines[0]}")
                for line in lines[1:]:
                    say(f"  {line}")
            if reaches(news, args.fail_on) is not None:
                say(f"a finding at or above --fail-on {args.fail_on}: stopping")
                return 1
    except KeyboardInterrupt:
        say("stopped")
    say("no findings" if worst < 0 else f"worst level seen: {LEVELS[worst]}")
    return 0


def heading_line(ahead: dict) -> str:
    """The score at H = 0 by both forms with their intervals, in one line (``analysis.doctor.heading``)."""
    if "error" in ahead:
        return f"heading: no forecast at H = 0: {ahead['error']}"
    law, lin = ahead["law"], ahead["linear"]
    return (f"heading, if entropy keeps falling: the score at H = 0 by the law {law['predicted']:.4f} "
            f"[{law['low']:.4f}, {law['high']:.4f}], by a line in H {lin['predicted']:.4f} [{lin['low']:.4f}, "
            f"{lin['high']:.4f}] ({ahead['level']:.0%} prediction intervals from {ahead['n']} scored steps, "
            "extrapolated: on the project's runs such intervals held the final score less often than they say; "
            "docs/your-own-run.md)")
