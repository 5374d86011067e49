"""TRL's own GRPO script (``trl/scripts/grpo.py``, shipped in the trl wheel) with ``EntropyControlGRPOTrainer``
in place of ``GRPOTrainer``: the one line a TRL user changes, without copying the script.

    python -m entropy_rft.integrations.trl_script --erft_method clip_v [--erft_method_params '{"mu": 2}'] \\
        --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct --dataset_name trl-lib/DeepMath-103K --output_dir out ...

Every other flag is the script's own (``python -m trl.scripts.grpo --help``); ``accelerate launch`` and
``torchrun`` run it as they run TRL's script. ``--erft_method none`` trains exactly as the unchanged script
(tests/test_trl_script.py runs both over the drop-in's table of configurations and compares every logged
figure and the saved weights).

The one change to TRL at run time: for the script's run (``run_script``), the module attribute ``trl.GRPOTrainer``
(the name the script imports inside its ``main()``) is bound to the subclass, and put back when the run ends.
"""

from __future__ import annotations

import json
import sys
from typing import Any

OURS = ("--erft_method", "--erft_method_params")


def split_argv(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """Our two flags (``--flag value`` or ``--flag=value``) and the script's arguments, in their order."""
    ours: dict[str, str] = {}
    rest: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        name, eq, value = arg.partition("=")
        if name in OURS:
            if not eq:
                if i + 1 >= len(argv):
                    raise SystemExit(f"{name}: needs a value")
                value, i = argv[i + 1], i + 1
            ours[name] = value
        else:
            rest.append(arg)
        i += 1
    return ours, rest


def trainer_class(method: str | None, params_json: str | None) -> type:
    """``GRPOTrainer`` with ``method`` (and its parameters) bound: what TRL's script builds instead."""
    from entropy_rft.integrations.trl import EntropyControlGRPOTrainer

    try:
        params: dict[str, Any] = json.loads(params_json) if params_json else {}
    except ValueError as e:
        raise SystemExit(f"--erft_method_params: not JSON ({e}); e.g. '{{\"mu\": 2.0}}'") from None
    if not isinstance(params, dict):
        raise SystemExit("--erft_method_params: a JSON object of the method's parameters, e.g. '{\"mu\": 2.0}'")

    class Trainer(EntropyControlGRPOTrainer):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, method=method or "none", method_params=params or None, **kwargs)

    Trainer.__name__ = Trainer.__qualname__ = "EntropyControlGRPOTrainer"
    return Trainer


def run_script(argv: list[str], trainer: type | None) -> None:
    """TRL's ``grpo.py`` as its ``__main__`` runs it, with ``trainer`` (None: stock ``GRPOTrainer``)."""
    import trl
    from trl.scripts import grpo

    stock = trl.GRPOTrainer
    if trainer is not None:
        trl.GRPOTrainer = trainer  # the script imports it from trl inside main()
    try:
        parser = grpo.make_parser()
        parsed = parser.parse_args_and_config(args=argv, fail_with_unknown_args=False)
        grpo.main(*parsed[:4])
    finally:
        trl.GRPOTrainer = stock


def main(argv: list[str] | None = None) -> None:
    ours, rest = split_argv(sys.argv[1:] if argv is None else argv)
    run_script(rest, trainer_class(ours.get("--erft_method"), ours.get("--erft_method_params")))


if __name__ == "__main__":
    main()
