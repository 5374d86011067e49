"""Evaluating policies on benchmark tasks (``erft eval``): which policies (a model, a run's ``final/`` and its
checkpoints), loading them, the (policy, dataset) loop with Avg@K, unbiased Pass@k and Maj@K
(``policy.evaluation``), and the outputs ``eval.json`` and ``eval.md``. The histogram figure is
``report.histograms.eval_histogram_png``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from entropy_rft.common.errors import UserError
from entropy_rft.common.text import visible


@dataclass(frozen=True)
class Sampling:
    """How every policy is sampled: the same samples, temperature, length and seed for each."""

    samples: int  # n per question
    temperature: float  # 0: greedy
    max_new_tokens: int
    batch_size: int  # sequences sampled together
    seed: int
    device: str = "cpu"
    dtype: str = "float32"
    cuda_graphs: bool = False
    threads: int = 0  # 0: automatic (common.threads)


# ----------------------------------------------------------------------------- what to evaluate


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


def check_fits(model, tok, examples: list, max_new_tokens: int, what: str) -> None:
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
        model, tok = load_policy(cfg.model.name, device=device, dtype=dtype, cpu_gemm=cfg.model.cpu_gemm)
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


def default_datasets(runs: list[Path], task_params: dict[str, Any] | None = None) -> list[tuple[str, dict]]:
    """The first run's own task (or champ). A recorded import path (the task's, a reward function's) is refused
    in one line unless ``task_params`` (the command line's ``--task-param``) names the same path again: code is
    named by the person who runs erft, never by a run folder (``--dataset PATH`` names a task again)."""
    from entropy_rft.rundir.checkpoints import load_run_config
    from entropy_rft.tasks import untrusted_code

    if runs:
        cfg = load_run_config(runs[0])
        given = {f"task.params.{k}": v for k, v in (task_params or {}).items()}
        bad = untrusted_code(cfg.task.name, cfg.task.params, given)
        if bad:
            field, path = bad[0]
            again = (f"--dataset {path}" if field == "task.name" else
                     f"--task-param {field.removeprefix('task.params.')}={path}")
            raise UserError(f"--run {runs[0]}: its config.yaml records code to import ({field} {path!r}); erft "
                            f"imports only code you name: if you trust it, pass {again}")
        return [(cfg.task.name, dict(cfg.task.params))]
    return [("champ", {})]



def _local_file(source: Any) -> bool:
    """Whether a task's ``source`` parameter names a file on this machine (not a hub id)."""
    return isinstance(source, str) and bool(source.strip()) and Path(source).expanduser().is_file()


def plan(models: list[str], runs: list[Path], checkpoints: bool, datasets: list[str], task_params: dict[str, Any],
         seed: int, limit: int | None) -> tuple[list[dict[str, Any]], list[tuple[str, Any, list]]]:
    """The policies (``--model`` names, then each run's checkpoints and ``final/``) and the datasets (name, task,
    its first ``limit`` validation examples), every task built and every model found before the first is
    evaluated. ``datasets`` empty: the first run's own task, or champ."""
    from entropy_rft.training import preflight

    specs = [{"label": m, "path": m} for m in models]
    for r in runs:
        specs += run_models(r, checkpoints)
    if not specs:
        raise UserError("nothing to evaluate: pass --model NAME_OR_PATH and/or --run DIR")
    named: list[tuple[str, dict]] = [(d, {}) for d in datasets] or default_datasets(runs, task_params)
    tasks = []
    for name, params in named:
        params = {**params, **task_params}
        if "val_size" not in params and _local_file(params.get("source")):  # one's own file: all of it is evaluated
            params["val_size"] = "all"
        task = preflight.build_task(name, params, flag="--dataset", params_flag="--task-param")
        examples = task.split(seed)[1]
        if not examples:
            raise UserError(f"--dataset {name}: has no evaluation questions (its validation split is empty); pass "
                            "--task-param val_size=N (or all) to hold out questions")
        tasks.append((name, task, examples[:limit] if limit else examples))
    for m in models:  # every policy is found before the first is evaluated
        preflight.check_model(m)
    return specs, tasks


# ----------------------------------------------------------------------------- the loop


def evaluate(specs: list[dict[str, Any]], tasks: list[tuple[str, Any, list]], s: Sampling, ks: list[int],
             on_result: Callable[[list[dict[str, Any]]], object] | None = None) -> list[dict[str, Any]]:
    """Every (policy, dataset) result, printed as it finishes; ``on_result(results so far)`` after each. A
    checkpoint that a live run pruned since it was listed is skipped with a warning."""
    import torch

    from entropy_rft.common.threads import apply_threads
    from entropy_rft.policy import evaluation
    from entropy_rft.training.step_log import prompt_progress

    results: list[dict[str, Any]] = []
    for spec in specs:
        try:
            model, tok = load_model(spec, s.device, s.dtype)
        except UserError:
            if not pruned(spec):
                raise
            from entropy_rft.rundir.files import warn

            warn(f"{spec['checkpoint']} was removed while erft eval ran (the live run keeps only its newest "
                 "checkpoints); skipped")
            continue
        apply_threads(s.threads, model, s.device)
        for name, task, examples in tasks:
            check_fits(model, tok, examples, s.max_new_tokens, f"{spec['label']} on {name}")
            gen = torch.Generator(device=s.device).manual_seed(s.seed)
            t0 = time.perf_counter()
            with prompt_progress(f"{spec['label']} on {name}", len(examples)) as on_progress:
                m = evaluation.evaluate_policy(model, tok, task, examples, n_samples=s.samples,
                                               temperature=s.temperature, max_new_tokens=s.max_new_tokens,
                                               generator=gen, batch_size=s.batch_size, prefix="",
                                               on_progress=on_progress, cuda_graphs=s.cuda_graphs)
            n = s.samples
            hist = m["pass_rate_hist"]
            metrics = {f"avg@{n}": m[f"avg@{n}"], f"maj@{n}": m[f"maj@{n}"]}
            metrics.update({f"pass@{k}": v for k, v in evaluation.pass_at_k_from_hist(hist, ks).items()})
            res = {"model": spec["label"], "dataset": name, "questions": len(examples), "samples": n,
                   "temperature": s.temperature, "metrics": metrics, "pass_rate_hist": hist,
                   "entropy": m["entropy"], "response_tokens": m["response_tokens"],
                   "distinct_correct": m["distinct_correct"], "seconds": time.perf_counter() - t0,
                   "examples": m["samples"][:3]}
            results.append(res)
            scores = ", ".join(f"{k} {100 * v:.2f}" for k, v in metrics.items())
            print(visible(f"{spec['label']} on {name}: {scores} ({len(examples)} questions, {res['seconds']:.1f} s)"),
                  flush=True)
            if on_result is not None:
                on_result(results)
        del model
    return results


# ----------------------------------------------------------------------------- outputs


def markdown_table(results: list[dict[str, Any]], ks: list[int], n: int) -> str:
    datasets = list(dict.fromkeys(r["dataset"] for r in results))
    models = list(dict.fromkeys(r["model"] for r in results))
    cols = [f"avg@{n}"] + [f"pass@{k}" for k in ks] + [f"maj@{n}"]
    from entropy_rft.common.text import table_cell

    head = "| model | " + " | ".join(f"{table_cell(d)} {c}" for d in datasets for c in cols) + " |"
    lines = [head, "|" + "---|" * (1 + len(datasets) * len(cols))]
    by = {(r["model"], r["dataset"]): r for r in results}
    for m in models:
        cells = []
        for d in datasets:
            r = by.get((m, d))
            cells += [f"{100 * r['metrics'][c]:.2f}" if r else "" for c in cols]
        lines.append(f"| {table_cell(m)} | " + " | ".join(cells) + " |")
    qs = ", ".join(f"{d}: {next(r['questions'] for r in results if r['dataset'] == d)}" for d in datasets)
    lines.append("")
    lines.append(f"Percentages. n = {n} samples per question; questions per dataset: {qs}.")
    return "\n".join(lines) + "\n"


def write_results(out: Path, results: list[dict[str, Any]], s: Sampling, ks: list[int], *, complete: bool) -> Path:
    """``eval.json`` and ``eval.md`` with the results so far (each file replaced atomically); ``complete``
    false while models or datasets are still to come, so an interrupted eval keeps what finished."""
    from entropy_rft.rundir import files as rundir

    out.mkdir(parents=True, exist_ok=True)
    summary = {"samples": s.samples, "temperature": s.temperature, "pass_k": ks, "seed": s.seed,
               "max_new_tokens": s.max_new_tokens, "complete": complete, "results": results}
    rundir.atomic_write_text(out / "eval.json", json.dumps(rundir.json_safe(summary), indent=1))
    rundir.atomic_write_text(out / "eval.md", markdown_table(results, ks, s.samples))
    return out
