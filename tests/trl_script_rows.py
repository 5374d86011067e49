"""Runs TRL's own ``trl/scripts/grpo.py`` over the drop-in's rows in one process (tests/test_trl_script.py):
``python trl_script_rows.py stock|none ROWS.json``, where ROWS.json maps a row name to the script's arguments.
``stock`` is the unchanged script; ``none`` the script with ``EntropyControlGRPOTrainer`` (method none) in place
of ``GRPOTrainer`` (``entropy_rft.integrations.trl_script``)."""

from __future__ import annotations

import json
import sys

from entropy_rft.integrations.trl_script import run_script, trainer_class


def main() -> None:
    which, path = sys.argv[1], sys.argv[2]
    with open(path) as f:
        rows = json.loads(f.read())
    trainer = None if which == "stock" else trainer_class(which, None)
    for name, argv in rows.items():
        print(f"row {name}", flush=True)
        run_script(argv, trainer)


if __name__ == "__main__":
    main()
