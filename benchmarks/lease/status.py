"""Which plans have run: read off what is committed (benchmarks/results/, results/smollm2-gpu/), so the next
session with a GPU runs the next plan that has not."""

from __future__ import annotations

import sys
from pathlib import Path

from benchmarks.lease.checks import LeaseDataError, check_lease_file, visible
from benchmarks.lease.plans import KERNEL_RESULTS, PLANS, REALM_CONFIG, REALM_RESULTS, ROOT, Plan, realm_run_names
from entropy_rft.rundir.finished import finished  # one definition of a finished run


def missing_runs(root: Path = ROOT) -> list[str]:
    """The comparison's runs not committed finished in results/smollm2-gpu/, in the order a wave trains them
    (seeds first)."""
    return [n for n in realm_run_names() if not finished(root / REALM_RESULTS / n)]


KERNEL_TRIES = 2  # after two leases with a failed section, the kernels plan gives way to the realm plans


def lease_records(plan: str, root: Path = ROOT) -> list[tuple[Path, list[dict]]]:
    """The committed records of ``plan``'s leases (``lease-<plan>-<time>.json``), oldest first, each with its
    calls (checked: ``checks.check_lease_file``). A damaged record is data too: it is named on stderr and left
    out, so the next plan is still offered."""
    out = []
    for p in sorted((root / KERNEL_RESULTS).glob(f"lease-{plan}-2*.json")):
        try:
            out.append((p, check_lease_file(p)))
        except LeaseDataError as e:
            print(f"warning: {e}: left out of the leases that ran", file=sys.stderr)
    return out


def kernel_leases(root: Path = ROOT) -> dict[Path, list[str]]:
    """The committed records of kernels leases (``lease-kernels-*.json``), each with its sections that did not
    end ``ok``."""
    return {p: [s["name"] for c in calls for s in c["sections"] if s.get("status") != "ok"] or
            ([] if calls else ["no call"]) for p, calls in lease_records("kernels", root)}


def plan_done(plan: Plan, root: Path = ROOT) -> bool:
    """The realm plan has run when its 15 runs are committed finished; the kernels plan when one lease ran every
    section, or after ``KERNEL_TRIES`` leases (what failed twice needs mending here, not a third lease)."""
    if plan.realm:
        return not missing_runs(root)
    leases = kernel_leases(root)
    return any(not failed for failed in leases.values()) or len(leases) >= KERNEL_TRIES


def next_plan(root: Path = ROOT) -> Plan | None:
    """The plan a lease runs next (None: every plan has run): ``kernels`` while no lease of it is committed; then
    the realm plan until its 15 runs are committed (the comparison is the larger missing result, and the kernels
    have figures already: issue 64); then the ``kernels`` plan's second try, if it needs one."""
    kernels = PLANS["kernels"]
    if not kernel_leases(root):
        return kernels
    realm = next((p for p in PLANS.values() if p.realm and not plan_done(p, root)), None)
    if realm is not None:
        return realm
    return None if plan_done(kernels, root) else kernels


def last_wave(plan: Plan, root: Path = ROOT) -> tuple[Path, dict] | None:
    """The newest committed lease record of the realm plan (``lease-realm-<time>.json``) and its wave's record
    (the train section's ``wave`` in the last call's lease.json); None when no lease of the plan recorded a wave."""
    for p, calls in reversed(lease_records(plan.name, root)):
        waves = [c["wave"] for c in calls if "wave" in c]
        if waves:
            return p, waves[-1]
    return None


def config_settings(root: Path = ROOT) -> dict:
    """The four settings a wave's pace depends on, as configs/smollm2-gpu.yaml has them now."""
    import yaml

    cfg = yaml.safe_load((root / REALM_CONFIG).read_text())
    return {"train.max_steps": cfg["train"]["max_steps"], "eval.every": cfg["eval"]["every"],
            "eval.prompts": cfg["eval"]["prompts"], "rollout.max_new_tokens": cfg["rollout"]["max_new_tokens"]}


def wave_advice(plan: Plan, wave: dict, settings_now: dict | None, committed: list[str]) -> list[str]:
    """What a holder reads of a wave's record (checked: ``checks.check_wave``), each line shown, never obeyed
    (control characters escaped)."""
    return [visible(line) for line in _advice(plan, wave, settings_now, committed)]


def _advice(plan: Plan, wave: dict, settings_now: dict | None, committed: list[str]) -> list[str]:
    """The runs a partial wave left; for a wave where nothing fits, the pace, the budget one run needs and the
    smaller setting (while ``settings_now`` still equals the wave's)."""
    verdict = wave.get("verdict")
    if verdict == "partial":
        return [f"the last lease of {plan.name} finished {', '.join(wave.get('finished', []))}; "
                f"stopped or not started: " + "; ".join(f"{k} ({v})" for k, v in wave.get("stopped", {}).items())]
    if verdict == "failed":
        return [f"the last lease of {plan.name}: {', '.join(wave.get('failed', []))} failed (the record's log has "
                "the end of each one's log): mend here, rehearse, then run the plan again"]
    if verdict != "nothing fits":
        return []
    pace = wave.get("pace")
    if not pace:
        return [f"the last lease of {plan.name} finished no run, and no run logged a training step "
                f"({wave.get('why', '')}): no pace was read; look at the record's log"]
    lines = [f"the last lease of {plan.name} finished no run: {wave['pace_run']} needs {wave['needed_s']:.0f} s "
             f"({pace['startup_s']:.0f} s to start, {pace['step_s']:.2f} s a step, {pace['eval_s']:.2f} s an "
             f"evaluation, measured with {wave['pace_share']} run(s) on the device); the budget was "
             f"{wave['budget_s']:.0f} s"]
    if settings_now is not None and settings_now != wave.get("settings"):
        return lines + ["configs/smollm2-gpu.yaml has changed since that lease: run the plan again"]
    prop = wave.get("proposal") or {}
    if not prop.get("sets"):
        return lines + [f"even the smallest setting ({prop.get('smallest')}) needs {prop.get('predicted_s')} s: "
                        "this plan cannot run in a lease on that device; train fewer methods per call, or mend here"]
    was = wave["settings"]
    lines.append("proposal, once for all 15 runs (configs/smollm2-gpu.yaml; say so in docs/results-smollm2-gpu.md): "
                 + ", ".join(f"{k} {was[k]} -> {v}" for k, v in prop["sets"].items() if was.get(k) != v)
                 + f" (one run {prop['predicted_s']:.0f} s of {prop['budget_s']:.0f} s): "
                 f".venv/bin/python -m benchmarks.lease.kit shrink {plan.name}")
    if committed:
        lines.append(f"{len(committed)} run(s) are committed under the old settings ({', '.join(committed)}): "
                     "shrink refuses until they are removed, so that all 15 runs share one setting")
    return lines


def committed_runs(root: Path = ROOT) -> list[str]:
    """Every run folder committed in results/smollm2-gpu/ (any seed)."""
    folder = root / REALM_RESULTS
    return sorted(p.name for p in folder.iterdir() if (p / "run.json").is_file()) if folder.is_dir() else []


def known_peak_mib(plan: Plan, root: Path = ROOT) -> float | None:
    """One run's peak device memory as the last lease of the realm plan measured it (its wave's ``memory``), so
    the next wave starts its first runs together; None when no lease measured it."""
    last = last_wave(plan, root)
    peak = (last[1].get("memory") or {}).get("peak_mib") if last else None
    return float(peak) if isinstance(peak, (int, float)) and peak > 0 else None


def plan_state(plan: Plan, root: Path = ROOT) -> list[str]:
    """``kit.py next``'s lines about the realm plan partly done, or whose last lease finished nothing."""
    if not plan.realm:
        return []
    missing = missing_runs(root)
    done = [n for n in realm_run_names() if n not in missing]
    lines = [f"{len(done)} of {len(missing) + len(done)} runs of {plan.name} are committed ({', '.join(done)}): "
             f"this lease trains the others, seeds first, as many as fit ({', '.join(missing)})"] \
        if done and missing else []
    last = last_wave(plan, root)
    if last is not None:
        path, wave = last
        advice = wave_advice(plan, wave, config_settings(root), committed_runs(root))
        lines += [f"{line} [{path.relative_to(root)}]" if i == 0 else line for i, line in enumerate(advice)]
    return lines
