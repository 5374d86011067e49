"""The policy loss's time per micro-batch: this tree's typed loss against an earlier commit's ``policy_loss``, side by
side in one process.

The micro-batch is the default job's (``configs/default.yaml``: 16 prompts × 8 samples in two minibatches, so 64
responses of up to 12 tokens; ClipV's keep mask dropping ~2% of the tokens; token-mean), or ``--rows``/``--tokens``.
Each call is what the native step does per micro-batch: the loss from log-probs with grad, ``backward``, and the
metrics as numbers. Three variants run in turn, ``--rounds`` times ``--calls`` calls each:

- ``before``: the earlier commit's ``core/loss.py`` (``git show REF:src/entropy_rft/core/loss.py``, loaded as a module)
  called with keywords, as the step called it;
- ``typed``: ``LossSettings`` built once, ``compute_policy_loss(LossInputs(...), settings)``, then ``metrics()``
  (the native step now);
- ``keywords``: today's ``policy_loss`` keyword wrapper (TRL's and verl's path).

The variants alternate in blocks of 10 calls, in a rotating order, so that the machine's drift hits all three
alike. Printed: the median over blocks of the seconds per call of each, and the ratios to ``before`` (below 1:
faster). On a quiet machine: other processes on the cores move these times more than the refactor does.

Usage: ``.venv/bin/python -m benchmarks.cpu.loss_time [--ref a08266c] [--rounds 7] [--calls 300] [--threads 1]``
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from entropy_rft.core.loss import compute_policy_loss, policy_loss
from entropy_rft.core.loss_types import LossInputs, LossSettings, Masks

ROOT = Path(__file__).resolve().parents[2]
BLOCK = 10  # calls per timed block


def load_old(ref: str):
    """The ``core/loss.py`` of commit ``ref`` as a module (it imports only leaves that still exist)."""
    text = subprocess.run(["git", "-C", str(ROOT), "show", f"{ref}:src/entropy_rft/core/loss.py"], check=True,
                          capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp(prefix="erft-loss-")) / "old_loss.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("old_loss", path)
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


def batch(rows: int, tokens: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, tokens + 1, (rows,), generator=g)
    mask = torch.arange(tokens)[None, :] < lengths[:, None]
    old = -torch.rand(rows, tokens, generator=g) * 3
    return {"old": old, "new": old + 0.05 * torch.randn(rows, tokens, generator=g),
            "adv": torch.randn(rows, generator=g), "mask": mask,
            "keep": torch.rand(rows, tokens, generator=g) > 0.02}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ref", default="a08266c", help="the commit whose policy_loss is the baseline")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    old_mod, b = load_old(args.ref), batch(args.rows, args.tokens)
    kw = dict(eps_low=0.2, eps_high=0.2, agg="token-mean")
    settings = LossSettings(**kw)  # type: ignore[arg-type]

    def leaf() -> torch.Tensor:
        return b["new"].clone().requires_grad_(True)

    def before() -> object:
        loss, met = old_mod.policy_loss(leaf(), b["old"], b["adv"], b["mask"], keep=b["keep"], **kw)
        loss.backward()
        return met

    def typed() -> object:
        out = compute_policy_loss(LossInputs(leaf(), b["old"], b["adv"], b["mask"], Masks(keep=b["keep"])), settings)
        out.loss.backward()
        return out.metrics()

    def keywords() -> object:
        loss, met = policy_loss(leaf(), b["old"], b["adv"], b["mask"], keep=b["keep"], **kw)
        loss.backward()
        return met

    variants = {"before": before, "typed": typed, "keywords": keywords}
    assert before() == typed() == keywords(), "the variants disagree on the metrics"
    for fn in variants.values():  # warm
        for _ in range(20):
            fn()
    times: dict[str, list[float]] = {k: [] for k in variants}
    names = list(variants)
    for r in range(args.rounds * args.calls // BLOCK):  # short blocks in a rotating order: drift hits all alike
        for name in names[r % 3:] + names[: r % 3]:
            fn = variants[name]
            t = time.perf_counter()
            for _ in range(BLOCK):
                fn()
            times[name].append((time.perf_counter() - t) / BLOCK)
    med = {k: statistics.median(v) for k, v in times.items()}
    out = {"ref": args.ref, "rows": args.rows, "tokens": args.tokens, "threads": args.threads,
           "median_s_per_call": med, "ratio_to_before": {k: med[k] / med["before"] for k in med}}
    for k in variants:
        print(f"{k:9s} {med[k] * 1e6:8.1f} us/call   ratio to before {med[k] / med['before']:.3f}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
