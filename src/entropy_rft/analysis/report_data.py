"""The report's one record: the runs given, read once, and every number a section of ``erft report``'s page draws.

``report_data(paths)`` reads each run once (``byo.load_runs``: an erft run directory's ``config.yaml``,
``metrics.jsonl``, ``run.json`` and ``token_records.jsonl`` by ``runs.load_run``, another engine's log by
``byo.engine_run``, which keeps the log it read for the doctor), and each run's ``token_view.jsonl``; then groups
the runs into series (``runs.assign_labels``) and computes from them, once each, what the page shows: what the
runs lack (``runs.incomplete``), the per-run summaries (``summary.run_summary``) and their means per series,
the lens means, the law's fits, the comparison at equal entropy, the methods through the lens, ``erft doctor``'s
findings and the summary paragraph. The page (``report.page``) renders this record and computes nothing of its
own, so a section added later reads what is here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from entropy_rft.analysis.byo import load_runs
from entropy_rft.analysis.equal_entropy import comparison_numbers
from entropy_rft.analysis.findings import law_fits, quadrant_rows, summary_paragraph
from entropy_rft.analysis.runs import RunData, assign_labels, incomplete, lens_means, methods_in_order, series_info
from entropy_rft.analysis.summary import aggregate, run_summary
from entropy_rft.common.errors import UserError

VIEW_FILE = "token_view.jsonl"  # training.token_view's records of a run, drawn by the report's token view


@dataclass(frozen=True)
class ReportData:
    """The runs of one report and what each section draws of them (``report.json`` holds the same numbers)."""

    runs: tuple[RunData, ...]  # in the order given, each with its series label (assign_labels)
    labels: tuple[str, ...]  # the series in report order (methods_in_order: the vanilla baseline first)
    settings: tuple[str, ...]  # the notes of the settings that keep runs of one method apart (assign_labels)
    incomplete: tuple[str, ...]  # what the runs lack, one line each (runs.incomplete)
    series: tuple[dict[str, Any], ...]  # per series: its method, engine, model, settings, runs, seeds
    summaries: tuple[dict[str, Any], ...]  # per run (as ``runs``): run_summary, its "method" the series label
    methods: dict[str, dict[str, Any]]  # per series (in ``labels`` order): mean ± std over its runs
    lens: dict[str, dict[str, float | None]]  # per series: the lens means (lens/...)
    lens_ppo: dict[str, dict[str, float | None]]  # per series: the tokens PPO's own clip silenced (lens_ppo/...)
    law: tuple[dict[str, Any], ...]  # per run with evaluations: its law points, fit and forecast (law_fits)
    comparison: dict[str, Any]  # the comparison at equal entropy (equal_entropy.comparison_numbers)
    quadrants: tuple[dict[str, Any], ...]  # per series: the method's effect per lens quadrant (quadrant_rows)
    doctor: tuple[dict[str, Any], ...]  # per run: erft doctor's findings and where it is heading, or why not
    views: tuple[tuple[RunData, tuple[dict[str, Any], ...]], ...]  # the runs with a token view, and its rows
    paragraph: str  # the summary paragraph (findings.summary_paragraph)
    read: tuple[str, ...]  # per run of another engine: what was read of its log (byo.choice_note)

    @property
    def kind(self) -> str:
        """What a row of the page's tables is: "method" when every series is a method's variant, else "series"."""
        return "method" if all(r.label == r.variant for r in self.runs) else "series"


def read_views(path: str | Path) -> list[dict[str, Any]]:
    """A run's ``token_view.jsonl`` rows that have the view's shape (anything else is left out: the file is
    data, and a damaged line is counted by the reader's warning)."""
    from entropy_rft.rundir.files import read_jsonl

    f = Path(path) / VIEW_FILE
    if not f.is_file():
        return []
    return [row for row in read_jsonl(f) if isinstance(row.get("step"), int) and isinstance(row.get("responses"), list)]


def token_views(runs: Sequence[RunData]) -> tuple[tuple[RunData, tuple[dict[str, Any], ...]], ...]:
    """The runs (directories) with a token view and its rows, by run name (of two runs of one name, the later)."""
    views = {r.name: (r, tuple(read_views(r.path))) for r in runs if Path(r.path).is_dir()}
    return tuple(v for v in views.values() if v[1])


def diagnoses(runs: Sequence[RunData]) -> list[dict[str, Any]]:
    """``erft doctor`` on each run (``analysis.doctor``): its findings and where it is heading, or why not. Another
    engine's run is diagnosed from the log its ``RunData`` was read from (``engine_log``), not read again."""
    from entropy_rft.analysis.doctor import diagnose, heading, load_series, series_from_log, series_from_rows

    out: list[dict[str, Any]] = []
    for r in runs:
        byo = r.cfg.get("byo")
        try:
            if byo and r.engine_log is not None:
                series = series_from_log(r.engine_log, str(r.path), byo["entropy_key"], byo["metric_key"])
            elif byo:
                series = load_series(r.path, source=byo["source"], entropy_key=byo["entropy_key"],
                                     metric=byo["metric_key"])
            else:
                series = series_from_rows(r.name, r.rows, r.cfg)
                series.method = r.method
            found = diagnose(series)
        except (UserError, KeyError) as e:  # no score, no training step, a method not registered here
            out.append({"run": r.name, "label": r.label, "error": str(e)})
            continue
        out.append({"run": r.name, "label": r.label, "findings": [f.to_dict() for f in found],
                    "heading": heading(series, 0.9)})
    return out


def report_data(paths: Sequence[str | Path], *, source: str | None = None, entropy_key: str | None = None,
                metric: str | None = None) -> ReportData:
    """The record of the runs of ``paths`` (erft run directories, folders of them, and runs of other engines:
    ``byo.load_runs``, whose ``source``, ``entropy_key`` and ``metric`` choose their reader and keys): each run read
    once, each number computed once."""
    runs = load_runs(paths, source=source, entropy_key=entropy_key, metric=metric)
    settings = assign_labels(runs)
    lacking = incomplete(runs)  # after the labels: the runs of one series are siblings
    labels = methods_in_order(runs)
    summaries = [run_summary(r.path, rows=r.rows, cfg=r.cfg) for r in runs]
    for r, s in zip(runs, summaries):
        s["method"] = r.label
    agg = aggregate(summaries)
    lens = lens_means(runs, "lens")
    fits = law_fits(runs)
    return ReportData(
        runs=tuple(runs), labels=tuple(labels), settings=tuple(settings), incomplete=tuple(lacking),
        series=tuple(series_info(runs)), summaries=tuple(summaries), methods={lab: agg[lab] for lab in labels},
        lens=lens, lens_ppo=lens_means(runs, "lens_ppo"), law=tuple(fits), comparison=comparison_numbers(summaries),
        quadrants=tuple(quadrant_rows(runs)), doctor=tuple(diagnoses(runs)), views=token_views(runs),
        paragraph=summary_paragraph(runs, summaries, lens, fits),
        read=tuple(r.cfg["byo"]["note"] for r in runs if "byo" in r.cfg))


def report_numbers(data: ReportData, figures: Sequence[str], omitted: Sequence[Mapping[str, str]],
                   token_view: dict[str, Any]) -> dict[str, Any]:
    """``report.json``: the record's numbers, with what the page drew (``figures``, ``omitted``, ``token_view``)."""
    return {"runs": [str(r.path) for r in data.runs], "summary": data.paragraph, "series": list(data.series),
            "settings": list(data.settings), "incomplete": list(data.incomplete), "figures": list(figures),
            "omitted": list(omitted), "methods": data.methods, "lens": data.lens, "law": list(data.law),
            "comparison": data.comparison, "quadrants": list(data.quadrants), "doctor": list(data.doctor),
            "token_view": token_view, "read": list(data.read)}
