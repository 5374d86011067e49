"""The run's logs as one writer: metrics.jsonl (and the trackers of ``train.report_to``), samples.jsonl and
token_records.jsonl, append-only (the files: :mod:`entropy_rft.rundir.files`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from entropy_rft.rundir.files import JsonlWriter, json_safe
from entropy_rft.rundir.trackers import Trackers


class Logger:
    """metrics.jsonl (+ the trackers of ``train.report_to``, :mod:`entropy_rft.rundir.trackers`), samples.jsonl and
    token_records.jsonl, append-only."""

    def __init__(self, out: Path, cfg: Any, purge_step: int | None):
        # Lines are flushed as written (a kill loses none); fsync happens with each checkpoint (resume truncates
        # the logs to the checkpoint's step anyway), not once per line.
        self.metrics = JsonlWriter(out / "metrics.jsonl", fsync=False)
        self.samples = JsonlWriter(out / "samples.jsonl", fsync=False)
        self.records = JsonlWriter(out / "token_records.jsonl", fsync=False)
        self.view = JsonlWriter(out / "token_view.jsonl", fsync=False)
        self.trackers = Trackers(out, cfg, purge_step)

    def log(self, row: dict[str, Any]) -> None:
        self.metrics.write(row)
        scalars = {k: v for k, v in json_safe(row).items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"}
        self.trackers.log(scalars, row["step"])

    def sync(self) -> None:
        for w in (self.metrics, self.samples, self.records, self.view):
            w.sync()

    def close(self, quiet: bool = False) -> None:
        """Close every writer; ``quiet`` (the run is already failing) keeps a full or read-only disk from
        hiding the first error behind a second one."""
        for close in (self.metrics.close, self.samples.close, self.records.close, self.view.close):
            try:
                close()
            except Exception:
                if not quiet:
                    raise
        self.trackers.finish(quiet)
