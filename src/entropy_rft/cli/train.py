"""``erft train``: reinforcement fine-tuning with entropy control, into a run directory."""

from __future__ import annotations

import argparse

from entropy_rft.common.errors import UserError
from entropy_rft.common.options import ENGINES

NAME = "train"
HELP = "Train a policy with GRPO/PPO and an entropy-control method (see `erft methods`)."

# Flags that would change a recorded run; --resume refuses them.
_FIXED_ON_RESUME = ("config", "method", "model", "seed", "set", "overwrite", "task", "engine", "entropy_target")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML config (default: the built-in configs/default.yaml).")
    p.add_argument("--method", help="Entropy-control method, e.g. none, clip_b, clip_v, clip_cov, kl_cov.")
    p.add_argument("--entropy-target", metavar="H",
                   help="Entropy autopilot: steer the method's knob to hold the batch entropy at H: nats (0.43), a "
                        "multiple of the first batch's entropy (0.6x), or a schedule linear:H0:H1[:STEPS] / "
                        "cosine:H0:H1[:STEPS]. Methods with a knob only (`erft methods`).")
    p.add_argument("--model", help="'default', 'default-strong', 'smollm2-135m', a local HF folder or a hub id.")
    p.add_argument("--task", help="Task name or 'module:Class' (with --resume: the run's recorded import path, "
                   "named again, which a resume requires).")
    p.add_argument("--engine", choices=ENGINES, help="Training engine (default: native).")
    p.add_argument("--max-steps", type=int, help="Total steps of the run (also when resuming).")
    p.add_argument("--out", help="Run directory (default: runs/<method>).")
    p.add_argument("--seed", type=int, help="Run seed.")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="Override a config field, e.g. --set optim.lr=1e-4 (repeatable).")
    p.add_argument("--resume", metavar="DIR", help="Continue the run in DIR from its last checkpoint.")
    p.add_argument("--overwrite", action="store_true", help="Replace an existing run directory.")
    p.add_argument("--help-config", action="store_true", help="List every config field with its help text.")
    p.add_argument("--no-doctor", action="store_true",
                   help="Do not run erft doctor's checks while training (by default each new or worse finding is "
                        "printed on stderr as it arises and recorded in the run's doctor.jsonl).")
    p.add_argument("--doctor-every", type=int, default=10, metavar="N",
                   help="The live doctor checks at each evaluation and every N steps (default 10).")


def cli_extra(args: argparse.Namespace) -> dict:
    """Config overrides implied by the dedicated flags."""
    extra: dict = {}
    # ``is not None``: an empty value (--task '') is a mistake to report, not a flag left out.
    if args.method is not None:
        extra.setdefault("method", {})["name"] = args.method
    if getattr(args, "entropy_target", None) is not None:
        from entropy_rft.launch.variants import target_value

        extra.setdefault("method", {})["entropy_target"] = target_value(args.entropy_target)
    if args.model is not None:
        extra.setdefault("model", {})["name"] = args.model
    if getattr(args, "task", None) is not None:
        extra.setdefault("task", {})["name"] = args.task
    if getattr(args, "engine", None):
        extra["engine"] = args.engine
    if args.max_steps is not None:
        extra.setdefault("train", {})["max_steps"] = args.max_steps
    if args.seed is not None:
        extra.setdefault("train", {})["seed"] = args.seed
    return extra


def task_params_help(args: argparse.Namespace) -> str:
    """The parameters of the task this command line would train (``task.params`` depends on ``task.name``)."""
    from entropy_rft.cli import tasks as tasks_cmd
    from entropy_rft.config.loading import load_config
    from entropy_rft.tasks import introspect

    cfg = load_config(args.config, args.set, extra=cli_extra(args), check_method=False)
    (info,) = introspect.infos(cfg.task.name)
    return (f"\ntask.params of task '{cfg.task.name}' (this command line's task; `erft tasks` lists every task):\n"
            + tasks_cmd.render_one(info, tasks_cmd.terminal_width()))


_CODE_FIELDS = ("task.params.reward", "task.params.val_task", "task.params.val_task_params.reward")


def code_given_again(args: argparse.Namespace) -> tuple[dict[str, str], list[str]]:
    """With --resume: the code references this command line names again (``--task PATH``, ``--set
    task.params.reward=PATH``, ...), which the recorded config must hold unchanged; and the other ``--set``s (which
    --resume refuses). Consumes ``args.task``."""
    code: dict[str, str] = {}
    if args.task is not None:
        code["task.name"], args.task = args.task, None
    rest = []
    for item in args.set:
        key, eq, value = str(item).partition("=")
        if eq and key.strip() in _CODE_FIELDS:
            code[key.strip()] = value.strip()
        else:
            rest.append(item)
    return code, rest


def live_doctor(args: argparse.Namespace, out: str):
    """erft doctor's findings as they arise (``analysis.live_doctor.RowDoctor``), unless --no-doctor."""
    if args.no_doctor:
        return None
    from entropy_rft.analysis.live_doctor import RowDoctor

    return RowDoctor(out, every=args.doctor_every)


def run(args: argparse.Namespace) -> int:
    from entropy_rft.config.loading import load_config
    from entropy_rft.config.schema import help_text
    from entropy_rft.training import preflight

    if args.help_config:
        print("\n".join(help_text()))
        print(task_params_help(args))
        return 0
    preflight.check_min("--doctor-every", args.doctor_every, 1)
    if args.resume is not None:
        code, args.set = code_given_again(args)
        given = [k for k in _FIXED_ON_RESUME if getattr(args, k, None) is not None]
        bad = [f"--{k.replace('_', '-')}" for k in given if getattr(args, k) is not False and getattr(args, k) != []]
        if args.out is not None and args.out != args.resume:
            bad.append("--out")
        if bad:
            raise UserError(f"--resume continues the recorded config; {', '.join(bad)} cannot change it "
                            "(only --max-steps can)")
        if not args.resume.strip():
            raise UserError("--resume is empty; pass the run directory to continue")
        preflight.check_resume_dir(args.resume)
        preflight.check_min("--max-steps", args.max_steps, 1)
        from entropy_rft.launch import run as launch  # torch: only once the arguments are known to be good

        doctor = live_doctor(args, args.resume)
        try:
            last = launch.resume(args.resume, max_steps=args.max_steps, given=code,
                                 on_row=None if doctor is None else doctor.row)
        finally:
            if doctor is not None:
                doctor.close()
        if last.get("already_finished"):
            print(f"run '{args.resume}' already finished at step {last['step']}")
        return 0
    preflight.check_min("--max-steps", args.max_steps, 1)
    # The method's check imports torch: check_train makes it after the cheap checks.
    cfg = load_config(args.config, args.set, extra=cli_extra(args), check_method=False)
    out = args.out if args.out is not None else f"runs/{cfg.method.name}"
    # The whole request (output folder, device, task, method, model) before the run directory is made; the
    # method it builds is the run's (built once).
    method = preflight.check_train(cfg, out)
    from entropy_rft.launch import run as launch

    doctor = live_doctor(args, out)
    try:
        launch.start(cfg, out, overwrite=args.overwrite, method=method, on_row=None if doctor is None else doctor.row)
    finally:
        if doctor is not None:
            doctor.close()
    print(f"run written to {out}")
    return 0
