"""``erft eval``: Avg@K, unbiased Pass@k and Maj@K per dataset and per model or checkpoint.

Models come from ``--model`` (a built-in name, a local folder or a hub id) and from ``--run DIR`` (the run's
``final/`` policy, and with ``--checkpoints`` every saved checkpoint too), so that methods are compared on
the same benchmark, samples and seed. Each dataset is a task (``champ``, ``gsm_symbolic``, ``aime24``,
``aime25``, ``amc23``, ``math500``, ``dapo500``, ``math`` with ``--task-param source=FILE``, or
``pkg.mod:Class``); its validation examples are scored. Paper A's setting: ``--samples 32 --temperature 0.7``.

Writes ``eval.json``, ``eval.md`` (a markdown table) and ``pass_rate_hist.png`` into ``--out``. ``eval.json``
and ``eval.md`` are rewritten after each (model, dataset), so an interrupted eval keeps what finished
(``"complete": false`` in ``eval.json`` until the last).

The command parses and checks its flags; the evaluation is ``analysis.evaluate`` and the figure
``report.histograms.eval_histogram_png``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from entropy_rft.cli.flags import add_sampling_flags, check_sampling_args, parse_task_params
from entropy_rft.common.errors import UserError

NAME = "eval"
HELP = "Evaluate models or run checkpoints on math benchmarks: Avg@K, Pass@k (unbiased), Maj@K, histograms."


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", action="append", default=[], help="Policy to evaluate (repeatable): 'default', "
                   "'default-strong', 'smollm2-135m', a local HF folder or a hub id.")
    p.add_argument("--run", action="append", default=[], metavar="DIR",
                   help="Run directory (repeatable): evaluates DIR/final (and checkpoints with --checkpoints).")
    p.add_argument("--checkpoints", action="store_true", help="Also evaluate every checkpoint of each --run.")
    p.add_argument("--dataset", action="append", default=[], help="Task to evaluate on (repeatable; default: "
                   "the run's own task, or champ).")
    add_sampling_flags(p, "--task-param",
                       task_param={"help": "Parameter for every dataset's task, value read as YAML (repeatable)."})
    p.add_argument("--samples", type=int, default=32, help="Samples per question, n (paper: 32).")
    add_sampling_flags(p, "--temperature", temperature={
        "default": 0.7, "help": "Sampling temperature (paper: 0.7; 0 = greedy)."})
    p.add_argument("--pass-k", default=None, help="Comma-separated k for Pass@k (default: 1, 8 and n where <= n).")
    add_sampling_flags(p, "--max-new-tokens", "--limit", "--batch-size", "--seed", "--device", "--dtype",
                       "--cuda-graphs", "--threads",
                       limit={"help": "Evaluate at most this many questions per dataset."},
                       seed={"help": "Sampling seed (the same for every model)."})
    p.add_argument("--out", default="eval", help="Output folder for eval.json, eval.md, pass_rate_hist.png.")


def pass_ks(spec: str | None, n: int) -> list[int]:
    from entropy_rft.common.comma_lists import parse_int_list

    if spec is None:
        return sorted({k for k in (1, 8, n) if k <= n})
    ks = sorted(parse_int_list(spec, "--pass-k", "1,4"))
    if any(not 1 <= k <= n for k in ks):
        raise UserError(f"--pass-k values must be in 1..--samples ({n}); got {spec}")
    return ks


def sampling(args: argparse.Namespace):
    """The checked sampling flags as ``analysis.evaluate.Sampling``."""
    from entropy_rft.analysis.evaluate import Sampling

    return Sampling(samples=args.samples, temperature=args.temperature, max_new_tokens=args.max_new_tokens,
                    batch_size=args.batch_size, seed=args.seed, device=args.device, dtype=args.dtype,
                    cuda_graphs=args.cuda_graphs, threads=args.threads)


def run(args: argparse.Namespace) -> int:
    from entropy_rft.training import preflight

    if args.checkpoints and not args.run:
        raise UserError("--checkpoints needs --run RUN_DIR (it also evaluates the saved checkpoints of each --run); "
                        "add --run RUN_DIR or drop --checkpoints")
    preflight.check_min("--samples", args.samples, 1)
    preflight.check_min("--temperature", args.temperature, 0)
    preflight.check_min("--max-new-tokens", args.max_new_tokens, 1)
    preflight.check_min("--limit", args.limit, 1)
    ks = pass_ks(args.pass_k, args.samples)
    check_sampling_args(args)
    from entropy_rft.analysis import evaluate as ev

    specs, tasks = ev.plan(args.model, [Path(r) for r in args.run], args.checkpoints, args.dataset,
                           parse_task_params(args.task_param), args.seed, args.limit)
    s, out = sampling(args), Path(args.out)
    results = ev.evaluate(specs, tasks, s, ks, on_result=lambda so_far: ev.write_results(out, so_far, s, ks,
                                                                                          complete=False))
    ev.write_results(out, results, s, ks, complete=True)
    from entropy_rft.report.histograms import eval_histogram_png
    from entropy_rft.rundir import files as rundir

    rundir.atomic_write_bytes(out / "pass_rate_hist.png", eval_histogram_png(results))
    print(f"wrote {out / 'eval.json'}, {out / 'eval.md'}, {out / 'pass_rate_hist.png'}")
    return 0
