"""``kit.py shrink PLAN``: the smaller setting the last lease of a realm plan proposed (no run fitted its budget;
status.wave_advice), written once into configs/smollm2-gpu.yaml, for all 15 runs (issue 49). The file's other
lines and its comments stay as they are; each changed line gets a comment naming the lease that measured it.
Refused, in one line, while any run is committed: the 15 runs share one setting."""

from __future__ import annotations

import re
from pathlib import Path

from benchmarks.gpu.pace import SETTING_KEYS  # the settings a wave measures and may shrink
from benchmarks.lease.checks import RECORD_NAME, visible
from benchmarks.lease.plans import REALM_CONFIG, ROOT, Plan
from benchmarks.lease.status import committed_runs, config_settings, last_wave


def set_values(text: str, sets: dict, note: str) -> str:
    """``text`` (a YAML file of two-level ``section:`` / ``  key: value`` lines) with each ``section.key`` of
    ``sets`` given its value; the rest of each line (a comment) is replaced by ``note``. A key not found is an
    error naming it."""
    lines = text.splitlines(keepends=True)
    for dotted, value in sets.items():
        section, key = dotted.split(".", 1)
        inside, done = False, False
        for i, line in enumerate(lines):
            if re.match(r"^\S", line):
                inside = line.split("#")[0].strip() == f"{section}:"
                continue
            m = re.match(rf"^(\s+){re.escape(key)}:\s", line) if inside else None
            if m:
                lines[i] = f"{m.group(1)}{key}: {value}".ljust(30) + f"# {note}\n"
                done = True
                break
        if not done:
            raise SystemExit(f"shrink: {dotted} is not in {REALM_CONFIG}: set it by hand")
    return "".join(lines)


def shrink(plan: Plan, root: Path = ROOT) -> dict:
    """Apply the proposal of ``plan``'s last lease to the config; returns the settings written."""
    last = last_wave(plan, root)
    if last is None or last[1].get("verdict") != "nothing fits":
        raise SystemExit(f"shrink: the last lease of {plan.name} did not report that nothing fits: nothing to change")
    path, wave = last
    sets = (wave.get("proposal") or {}).get("sets")
    if not sets:
        raise SystemExit(f"shrink: {path.name} proposes no setting that fits (even the smallest does not): mend here")
    check_sets(sets, config_settings(root), path)
    if config_settings(root) != wave["settings"]:
        raise SystemExit(f"shrink: {REALM_CONFIG} has changed since {path.name}: run {plan.name} again first")
    runs = committed_runs(root)
    if runs:
        raise SystemExit(f"shrink: {len(runs)} run(s) are committed under the current setting ({', '.join(runs)}); "
                         "git rm -r them first, so that all 15 runs share the new one")
    cfg = root / REALM_CONFIG
    text = set_values(cfg.read_text(), sets, f"issue 49: {path.name} (nothing fitted the lease)")
    check_config(text, cfg)
    cfg.write_text(text)
    return sets


def check_sets(sets: object, now: dict, record: Path) -> None:
    """A proposal is data (issue 65): only the keys a wave may shrink (``pace.SETTING_KEYS``: the evaluation
    prompts, the steps and how often they evaluate, the response length), each a whole number no larger than
    the config's value now and at least 1 (``eval.every`` at least 0), from a record the kit named."""
    if not RECORD_NAME.match(record.name):
        raise SystemExit(f"shrink: {visible(record.name)} is not a name the kit gives a lease record")
    if not isinstance(sets, dict):
        raise SystemExit(f"shrink: {record.name}: proposal.sets is not an object")
    for key, value in sets.items():
        if key not in SETTING_KEYS:
            raise SystemExit(f"shrink: {record.name}: proposal.sets names {visible(key)!s}, which a lease may not "
                             f"change (only {', '.join(SETTING_KEYS)})")
        low = 0 if key == "eval.every" else 1
        if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= int(now[key]):
            raise SystemExit(f"shrink: {record.name}: proposal.sets {key} is {visible(repr(value))}, not a whole "
                             f"number from {low} to {now[key]} (the config's value now: a proposal only shrinks)")


def check_config(text: str, cfg: Path) -> None:
    """The new config as erft reads it (the schema's own validation), before it is written."""
    import tempfile

    from entropy_rft.common.errors import UserError
    from entropy_rft.config.loading import load_config

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / cfg.name
        path.write_text(text)
        try:
            load_config(str(path), [], check_method=False)
        except UserError as e:
            raise SystemExit(f"shrink: the proposed {cfg.name} is refused: {visible(e)}") from None
