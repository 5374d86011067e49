"""``erft eval``: Avg@K, unbiased Pass@k and Maj@K per dataset and per model or checkpoint.

Models come from ``--model`` (a built-in name, a local folder or a hub id) and from ``--run DIR`` (the run's
``final/`` policy, and with ``--checkpoints`` every saved checkpoint too), so that methods are compared on
the same benchmark, samples and seed. Each dataset is a task (``champ``, ``gsm_symbolic``, ``aime24``,
``aime25``, ``amc23``, ``math500``, ``dapo500``, ``math`` with ``--task-param source=FILE``, or
``pkg.mod:Class``); its validation examples are scored. Paper A's setting: ``--samples 32 --temperature 0.7``.

Writes ``eval.json``, ``eval.md`` (a markdown table) and ``pass_rate_hist.png`` into ``--out``. ``eval.json``
and ``eval.md`` are rewritten after each (model, dataset), so an interrupted eval keeps what finished
(``"complete": false`` in ``eval.json`` until the last).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from entropy_rft.common.errors import UserError

NAME = "eval"
HELP = "Evaluate models or run checkpoints on math benchmarks: Avg@K, Pass@k (unbiased), Maj@K, histograms."


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", action="append", default=[], help="Policy to evaluate (repeatable): 'default', "
                   "'smollm2-135m', a local HF folder or a hub id.")
    p.add_argument("--run", action="append", default=[], metavar="DIR",
                   help="Run directory (repeatable): evaluates DIR/final (and checkpoints with --checkpoints).")
    p.add_argument("--checkpoints", action="store_true", help="Also evaluate every checkpoint of each --run.")
    p.add_argument("--dataset", action="append", default=[], help="Task to evaluate on (repeatable; default: "
                   "the run's own task, or champ).")
    p.add_argument("--task-param", action="append", default=[], metavar="KEY=VALUE",
                   help="Parameter for every dataset's task, value read as YAML (repeatable).")
    p.add_argument("--samples", type=int, default=32, help="Samples per question, n (paper: 32).")
    p.add_argument("--temperature", type=float, default=0.7, help="Sampling temperature (paper: 0.7; 0 = greedy).")
    p.add_argument("--pass-k", default=None, help="Comma-separated k for Pass@k (default: 1, 8 and n where <= n).")
    p.add_argument("--max-new-tokens", type=int, default=1024, help="Maximum response length in tokens.")
    p.add_argument("--limit", type=int, default=None, help="Evaluate at most this many questions per dataset.")
    p.add_argument("--batch-size", type=int, default=64, help="Sequences sampled together.")
    p.add_argument("--seed", type=int, default=0, help="Sampling seed (the same for every model).")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N.")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="Weights' dtype while sampling.")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="Sample with the static decoder's GPU loop (rollout.cuda_graphs): each decode step a CUDA-"
                        "graph replay on CUDA; the same tokens as without it.")
    p.add_argument("--threads", type=int, default=0,
                   help="CPU threads (0: automatic, entropy_rft.common.threads: 1 for small models).")
    p.add_argument("--out", default="eval", help="Output folder for eval.json, eval.md, pass_rate_hist.png.")


# ----------------------------------------------------------------------------- what to evaluate


def parse_task_params(items: list[str]) -> dict[str, Any]:
    import yaml

    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise UserError(f"--task-param '{item}' must look like key=value, e.g. --task-param limit=50")
        k, v = item.split("=", 1)
        if not k.strip().isidentifier():
            raise UserError(f"--task-param '{item}': {k.strip()!r} is not a parameter name; use key=value, "
                            "e.g. --task-param limit=50")
        try:
            out[k.strip()] = yaml.safe_load(v) if v.strip() else ""
        except yaml.YAMLError:
            out[k.strip()] = v
    return out


def check_sampling_args(args: argparse.Namespace) -> None:
    """The flags eval and filter share: batch size, threads, seed, temperature, device, output folder."""
    import math

    from entropy_rft.training import preflight

    preflight.check_min("--batch-size", args.batch_size, 1)
    preflight.check_threads(args.threads)
    preflight.check_min("--seed", args.seed, 0)
    if not math.isfinite(args.temperature):
        raise UserError(f"--temperature must be a finite number, got {args.temperature}")
    preflight.check_device(args.device, "--device", "--device cpu")
    preflight.check_out(args.out, file_hint="")


def pass_ks(spec: str | None, n: int) -> list[int]:
    from entropy_rft.common.comma_lists import parse_int_list

    if spec is None:
        return sorted({k for k in (1, 8, n) if k <= n})
    ks = sorted(parse_int_list(spec, "--pass-k", "1,4"))
    if any(not 1 <= k <= n for k in ks):
        raise UserError(f"--pass-k values must be in 1..--samples ({n}); got {spec}")
    return ks


def run_models(run_dir: Path, checkpoints: bool) -> list[dict[str, Any]]:
    """The policies of a run directory: each checkpoint (if asked) and final/."""
    if not (run_dir / "config.yaml").is_file():
        raise UserError(f"--run {run_dir}: not a run directory (no config.yaml); pass a folder `erft train` wrote")
    out = []
    if checkpoints:
        from entropy_rft.rundir.checkpoints import checkpoint_dirs

        for ck in checkpoint_dirs(run_dir):
            out.append({"label": f"{run_dir.name}/{ck.name}", "run": run_dir, "checkpoint": ck})
    if (run_dir / "final").is_dir():
        out.append({"label": f"{run_dir.name}/final", "path": str(run_dir / "final"), "run": run_dir})
    if not out:
        raise UserError(f"--run {run_dir}: has no final/ policy" + ("" if checkpoints else
                        " (add --checkpoints to evaluate its checkpoints)") + "; let the run finish")
    return out


def _check_fits(model, tok, examples: list, max_new_tokens: int, what: str) -> None:
    """The trainer's rule (``preflight.check_prompt_lengths``): every prompt plus ``--max-new-tokens`` fits the
    model's context; otherwise the model would be scored on positions it has no embedding for."""
    from entropy_rft.tasks.prompts import encode_prompt
    from entropy_rft.training.preflight import check_prompt_lengths

    try:
        check_prompt_lengths([len(encode_prompt(tok, ex.prompt)) for ex in examples], max_new_tokens,
                             getattr(model.config, "max_position_embeddings", None), truncate=False,
                             budget="--max-new-tokens")
    except UserError as e:
        raise UserError(f"{what}: {e}; or pick a --dataset whose prompts fit this model") from None


def pruned(spec: dict[str, Any]) -> bool:
    """Whether the checkpoint of ``spec`` is gone since it was listed: a live run pruned it (the folder, or its
    manifest, which pruning removes with the rest), as opposed to a damaged one, whose manifest stays."""
    from entropy_rft.rundir.checkpoints import checkpoint_dirs

    return "checkpoint" in spec and spec["checkpoint"] not in checkpoint_dirs(spec["run"])


def load_model(spec: dict[str, Any], device: str, dtype: str):
    from entropy_rft.training.policies import load_policy

    if "checkpoint" in spec:
        from entropy_rft.rundir.checkpoints import load_checkpoint, load_run_config

        cfg = load_run_config(spec["run"])
        model, tok = load_policy(cfg.model.name, device=device, dtype=dtype)
        state = load_checkpoint(spec["checkpoint"], required=("model",), only=("model",), map_location=device)
        model.load_state_dict(state["model"])
        model.eval()
        return model, tok
    try:
        return load_policy(spec["path"], device=device, dtype=dtype)
    except (OSError, FileNotFoundError, ValueError) as e:
        first = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        raise UserError(f"--model {spec['path']}: cannot load it ({first}); pass a built-in name, "
                        "an existing folder or a reachable hub id") from None


def default_datasets(runs: list[Path]) -> list[tuple[str, dict]]:
    from entropy_rft.rundir.checkpoints import load_run_config

    if runs:
        cfg = load_run_config(runs[0])
        return [(cfg.task.name, dict(cfg.task.params))]
    return [("champ", {})]


# ----------------------------------------------------------------------------- outputs


def markdown_table(results: list[dict[str, Any]], ks: list[int], n: int) -> str:
    datasets = list(dict.fromkeys(r["dataset"] for r in results))
    models = list(dict.fromkeys(r["model"] for r in results))
    cols = [f"avg@{n}"] + [f"pass@{k}" for k in ks] + [f"maj@{n}"]
    head = "| model | " + " | ".join(f"{d} {c}" for d in datasets for c in cols) + " |"
    lines = [head, "|" + "---|" * (1 + len(datasets) * len(cols))]
    by = {(r["model"], r["dataset"]): r for r in results}
    for m in models:
        cells = []
        for d in datasets:
            r = by.get((m, d))
            cells += [f"{100 * r['metrics'][c]:.2f}" if r else "" for c in cols]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    qs = ", ".join(f"{d}: {next(r['questions'] for r in results if r['dataset'] == d)}" for d in datasets)
    lines.append("")
    lines.append(f"Percentages. n = {n} samples per question; questions per dataset: {qs}.")
    return "\n".join(lines) + "\n"


def histogram_png(results: list[dict[str, Any]]) -> bytes:
    """One panel per dataset: the share of questions with c of n samples right, one bar group per model."""
    import numpy as np

    from entropy_rft.report.plots import figure_png, plt

    datasets = list(dict.fromkeys(r["dataset"] for r in results))
    models = list(dict.fromkeys(r["model"] for r in results))
    fig, axes = plt.subplots(1, len(datasets), figsize=(max(5.5, 4.5 * len(datasets)), 3.6), squeeze=False)
    width = 0.8 / max(1, len(models))
    for ax, d in zip(axes[0], datasets):
        for j, m in enumerate(models):
            r = next((r for r in results if r["dataset"] == d and r["model"] == m), None)
            if r is None:
                continue
            h = np.asarray(r["pass_rate_hist"], dtype=float)
            x = np.arange(len(h))
            ax.bar(x + (j - (len(models) - 1) / 2) * width, h / max(1.0, h.sum()), width=width, label=m)
        ax.set_title(d)
        ax.set_xlabel("correct samples per question (c of n)")
        ax.set_ylabel("share of questions")
    axes[0][0].legend(fontsize=7)
    fig.suptitle("Pass-rate histograms")
    return figure_png(fig)


# ----------------------------------------------------------------------------- the command


def evaluate(args: argparse.Namespace, on_result: Callable[[list[dict[str, Any]]], None] | None = None
             ) -> list[dict[str, Any]]:
    """Every (model, dataset) result; ``on_result(results so far)`` after each."""
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
    runs = [Path(r) for r in args.run]
    models = [{"label": m, "path": m} for m in args.model]
    for r in runs:
        models += run_models(r, args.checkpoints)
    if not models:
        raise UserError("nothing to evaluate: pass --model NAME_OR_PATH and/or --run DIR")
    extra = parse_task_params(args.task_param)
    datasets = [(d, {}) for d in args.dataset] or default_datasets(runs)

    tasks = []
    for name, params in datasets:
        task = preflight.build_task(name, {**params, **extra}, flag="--dataset", params_flag="--task-param")
        examples = task.split(args.seed)[1]
        if not examples:
            raise UserError(f"--dataset {name}: has no evaluation questions (its validation split is empty)")
        tasks.append((name, task, examples[: args.limit] if args.limit else examples))
    for m in args.model:  # every policy is found before the first is evaluated
        preflight.check_model(m)

    import torch

    from entropy_rft.common.threads import apply_threads
    from entropy_rft.policy import evaluation
    from entropy_rft.training.step_log import prompt_progress

    results: list[dict[str, Any]] = []
    for spec in models:
        try:
            model, tok = load_model(spec, args.device, args.dtype)
        except UserError:
            if not pruned(spec):
                raise
            from entropy_rft.rundir.files import warn

            warn(f"{spec['checkpoint']} was removed while erft eval ran (the live run keeps only its newest "
                 "checkpoints); skipped")
            continue
        apply_threads(args.threads, model, args.device)
        for name, task, examples in tasks:
            _check_fits(model, tok, examples, args.max_new_tokens, f"{spec['label']} on {name}")
            gen = torch.Generator(device=args.device).manual_seed(args.seed)
            t0 = time.perf_counter()
            with prompt_progress(f"{spec['label']} on {name}", len(examples)) as on_progress:
                m = evaluation.evaluate_policy(model, tok, task, examples, n_samples=args.samples,
                                               temperature=args.temperature, max_new_tokens=args.max_new_tokens,
                                               generator=gen, batch_size=args.batch_size, prefix="",
                                               on_progress=on_progress, cuda_graphs=args.cuda_graphs)
            n = args.samples
            hist = m["pass_rate_hist"]
            metrics = {f"avg@{n}": m[f"avg@{n}"], f"maj@{n}": m[f"maj@{n}"]}
            metrics.update({f"pass@{k}": v for k, v in evaluation.pass_at_k_from_hist(hist, ks).items()})
            res = {"model": spec["label"], "dataset": name, "questions": len(examples), "samples": n,
                   "temperature": args.temperature, "metrics": metrics, "pass_rate_hist": hist,
                   "entropy": m["entropy"], "response_tokens": m["response_tokens"],
                   "distinct_correct": m["distinct_correct"], "seconds": time.perf_counter() - t0,
                   "examples": m["samples"][:3]}
            results.append(res)
            print(f"{spec['label']} on {name}: " + ", ".join(f"{k} {100 * v:.2f}" for k, v in metrics.items())
                  + f" ({len(examples)} questions, {res['seconds']:.1f} s)", flush=True)
            if on_result is not None:
                on_result(results)
        del model
    return results


def write_results(args: argparse.Namespace, results: list[dict[str, Any]], *, complete: bool) -> Path:
    """``eval.json`` and ``eval.md`` with the results so far (each file replaced atomically); ``complete``
    false while models or datasets are still to come, so an interrupted eval keeps what finished."""
    from entropy_rft.rundir import files as rundir

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ks = pass_ks(args.pass_k, args.samples)
    summary = {"samples": args.samples, "temperature": args.temperature, "pass_k": ks, "seed": args.seed,
               "max_new_tokens": args.max_new_tokens, "complete": complete, "results": results}
    rundir.atomic_write_text(out / "eval.json", json.dumps(rundir.json_safe(summary), indent=1))
    rundir.atomic_write_text(out / "eval.md", markdown_table(results, ks, args.samples))
    return out


def run(args: argparse.Namespace) -> int:
    results = evaluate(args, on_result=lambda so_far: write_results(args, so_far, complete=False))
    from entropy_rft.rundir import files as rundir

    out = write_results(args, results, complete=True)
    rundir.atomic_write_bytes(out / "pass_rate_hist.png", histogram_png(results))
    print(f"wrote {out / 'eval.json'}, {out / 'eval.md'}, {out / 'pass_rate_hist.png'}")
    return 0
