"""A run folder as the comparison's drivers see it (``realm.py``, ``realm_wave.py``, the lease kit): the files a run
ships, and whether it finished. The standard library only; the lowest layer of benchmarks/ (its README)."""

from __future__ import annotations

import json
from pathlib import Path

SHIPPED = ("metrics.jsonl", "config.yaml", "run.json", "samples.jsonl")  # per run; everything else stays


def finished(run_dir: Path) -> bool:
    """Whether ``run_dir``'s ``run.json`` says the run finished all its steps. A damaged ``run.json`` is data: the
    run is not finished (no traceback)."""
    try:
        info = json.loads((run_dir / "run.json").read_text())
        return info.get("status") == "finished" and int(info.get("step", 0)) >= int(info.get("max_steps", 1 << 30))
    except (OSError, ValueError, TypeError, AttributeError):
        return False
