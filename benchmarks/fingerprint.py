"""Fingerprints of training numbers, for refactors that must keep every number.

Trains the baseline configurations on the micro policy (``entropy_rft.models.micro``) and the dense-reward task
``entropy_rft.tasks.digits:OverlapTask`` (6 steps each, JVP and counterfactual probes every 3 steps) through the
``erft train`` command line, so the script does not depend on where modules live, and writes one SHA-256 per
configuration and file: ``metrics.jsonl`` without its volatile ``time/`` and ``perf/`` keys,
``token_records.jsonl`` and ``samples.jsonl``.

    python -m benchmarks.fingerprint --out /tmp/before.json        # on the old commit (before the package:
                                                                    # python benchmarks/fingerprint.py)
    python -m benchmarks.fingerprint --out /tmp/after.json --compare /tmp/before.json

``--compare`` exits 1 naming every configuration and file that differs, and the first differing metric.
``--new-key KEY`` (repeatable) names a metric the new commit adds on purpose (issue 74's
``eval/correct_per_question``): it is left out of both sides' ``metrics.jsonl`` rows before they are compared, so
everything else must still be identical, and the comparison fails when no new row holds it.

    python -m benchmarks.fingerprint --out /tmp/after.json --compare /tmp/before.json \
        --new-key eval/correct_per_question --new-key eval/question_ids

The runs go through ``erft``, so they compute under the CPU pin (issues 36 and 62: ATen on AVX2, MKL on COMPATIBLE)
unless ``ERFT_CPU_PIN=0``: a fingerprint taken under an earlier pin (none, or issue 36's ``MKL_CBWR=AVX2``) differs
from one taken after it, by design; compare two commits that have the same pin, or run the older one with this
pin's variables exported (``MKL_CBWR=COMPATIBLE`` for a commit of issue 36's pin).
The configurations are the seven of issue 14 (none, ClipV, Clip-Cov, KL-Cov with two minibatches, PPO +
ClipB over two epochs, the autopilot, gradient accumulation with the reference KL), issue 28's five
methods and five on the TRL engine (``trl_*``, issue 78). About 4 minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

VOLATILE = ("time/", "perf/")

CONFIGS: dict[str, dict[str, object]] = {
    "none": {"method.name": "none"},
    "clip_v": {"method.name": "clip_v"},
    "clip_cov": {"method.name": "clip_cov"},
    "kl_cov_2mb": {"method.name": "kl_cov", "algo.minibatches": 2},
    "ppo_clip_b_2ep": {"method.name": "clip_b", "algo.algorithm": "ppo", "algo.ppo_epochs": 2},
    "autopilot": {"method.name": "clip_v", "method.entropy_target": "0.8x"},
    "accum_refkl": {"method.name": "clip_v", "algo.grad_accum": 2, "algo.ref_kl_coef": 0.05},
    "entropy_adv": {"method.name": "entropy_adv"},
    "adaptive_entropy": {"method.name": "adaptive_entropy"},
    "ce_gppo": {"method.name": "ce_gppo"},
    "clip_low": {"method.name": "clip_low"},
    "entropic": {"method.name": "entropic"},
}
# The TRL engine (erft train --engine trl; issue 78's TrlPlan): TRL's own loss with a method composed into its inputs
# (none, Clip-Cov's zeroes, the entropy bonus as TRL's term), and erft's loss on TRL's forwards (KL-Cov over two
# minibatches, CE-GPPO with accumulation and the reference KL). TRL runs no evaluation or probe: off.
TRL = {"engine": "trl", "train.max_steps": 4, "eval.every": 0, "probe.enabled": "false", "probe.jvp_every": 0,
       "probe.counterfactual_every": 0, "probe.records_every": 0, "train.samples_every": 1}
CONFIGS.update({f"trl_{name}": {**TRL, **sets} for name, sets in {
    "none": {"method.name": "none"},
    "clip_cov": {"method.name": "clip_cov"},
    "entropy_bonus": {"method.name": "entropy_bonus"},
    "kl_cov_2mb": {"method.name": "kl_cov", "algo.minibatches": 2},
    "ce_gppo_accum_refkl": {"method.name": "ce_gppo", "algo.grad_accum": 2, "algo.ref_kl_coef": 0.05},
}.items()})

COMMON = {
    "task.name": "entropy_rft.tasks.digits:OverlapTask",
    "rollout.prompts_per_step": 8,
    "train.max_steps": 6,
    "train.checkpoint_every": 3,
    "probe.jvp_every": 3,
    "probe.counterfactual_every": 3,
    "probe.records_every": 2,
    "train.samples_every": 2,
    "eval.every": 3,
    "train.report_to": "[]",
}


def _policy(folder: Path) -> Path:
    code = ("import sys; from pathlib import Path; from entropy_rft.models.micro import make_micro_policy; "
            "make_micro_policy(Path(sys.argv[1]))")
    subprocess.run([sys.executable, "-c", code, str(folder)], check=True)
    return folder


def _rows_digest(rows: list[dict]) -> str:
    return hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()


def _digest_metrics(path: Path) -> tuple[str, list[dict]]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows]
    return _rows_digest(rows), rows


def _without(rows: list[dict], keys: set[str]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in keys} for r in rows]


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else "missing"


def fingerprint(workdir: Path) -> tuple[dict[str, dict[str, str]], dict[str, list[dict]]]:
    """Train every configuration under ``workdir`` and return the digests and the metric rows."""
    from entropy_rft.models.micro import micro_overrides

    policy = _policy(workdir / "policy")
    erft = Path(sys.executable).with_name("erft")
    digests, rows = {}, {}
    for i, (name, sets) in enumerate(CONFIGS.items(), 1):
        out = workdir / name
        args = [str(erft), "train", "--out", str(out)]
        for s in micro_overrides(policy, **{**COMMON, **sets}):
            args += ["--set", s]
        print(f"[{i}/{len(CONFIGS)}] {name}", flush=True)
        done = subprocess.run(args, capture_output=True, text=True)
        if done.returncode:
            sys.exit(f"fingerprint: {name} failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
        digests[name] = {"metrics.jsonl": "", "token_records.jsonl": _digest(out / "token_records.jsonl"),
                         "samples.jsonl": _digest(out / "samples.jsonl")}
        digests[name]["metrics.jsonl"], rows[name] = _digest_metrics(out / "metrics.jsonl")
    return digests, rows


def first_difference(a: list[dict], b: list[dict]) -> str:
    for x, y in zip(a, b):
        keys = sorted(k for k in x.keys() | y.keys() if x.get(k) != y.get(k))
        if keys:
            return f"step {x.get('step')}: {keys[0]} {x.get(keys[0])!r} != {y.get(keys[0])!r}"
    return f"{len(a)} rows against {len(b)}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="JSON file for the digests (and the rows)")
    ap.add_argument("--compare", type=Path, help="an earlier --out file: exit 1 when anything differs")
    ap.add_argument("--new-key", action="append", default=[], metavar="KEY",
                    help="a metric this commit adds on purpose: compared without it on both sides (repeatable)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="erft-fp-") as tmp:
        digests, rows = fingerprint(Path(tmp))
    args.out.write_text(json.dumps({"digests": digests, "rows": rows}, indent=1, sort_keys=True))
    print(f"wrote {args.out}")
    if args.compare is None:
        return 0
    old = json.loads(args.compare.read_text())
    added = set(args.new_key)
    bad = [f"--new-key {k}: no row of the new runs holds it" for k in sorted(added)
           if not any(k in r for rs in rows.values() for r in rs)]
    for name, files in old["digests"].items():
        for file, digest in files.items():
            new = digests.get(name, {}).get(file)
            if file == "metrics.jsonl" and added:
                new = _rows_digest(_without(rows.get(name, []), added))
                digest = _rows_digest(_without(old["rows"][name], added))
            if new != digest:
                why = (first_difference(_without(old["rows"][name], added), _without(rows.get(name, []), added))
                       if file == "metrics.jsonl" else "")
                bad.append(f"{name}/{file} differs {why}".rstrip())
    but = f" (without {', '.join(sorted(added))})" if added else ""
    print("\n".join(bad) if bad else f"all {len(old['digests'])} configurations bit-identical{but}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
