"""Cheap checks of a whole request before anything is written (one line per mistake, nothing created).

``check_train(cfg, out)`` is called before the run directory is made (``launch.start``, ``erft train``): the
output path, the device, the task (built once, so unknown names, unknown parameters and bad data files are
refused here, naming what is valid), the policy (``models.locate_policy``: no weights are loaded) and the
optional packages the config asks for. A failed check raises :class:`~entropy_rft.common.errors.UserError`, so a
corrected retry with the same ``--out`` starts cleanly.

``check_prompt_lengths`` is the pure rule the trainer applies once the tokenizer is loaded.

Torch is imported only to check a device other than the CPU and the method (``config.validation.validate_method``,
which builds the run's method once), ``entropy_rft.models.loading`` (transformers) only for the model check, and
trl only for engine 'trl' (``check_trl``: the ``trl:`` section and the settings that engine refuses or ignores).
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from entropy_rft.common.errors import UserError
from entropy_rft.common.paths import expand_user
from entropy_rft.training import limits

if TYPE_CHECKING:
    from entropy_rft.control.registry import Method

# Virtual file systems: nothing a run writes belongs there.
VIRTUAL_ROOTS = ("/proc", "/sys", "/dev")
_NAME_MAX = 255

# Checks that passed, so that a second call (erft train, then launch.start; erft compare's runs) costs nothing.
# Keys include the size and mtime of the files involved, so that a file changed in between is checked again.
_passed: set[tuple] = set()


def _stamp(paths: list[Path]) -> tuple:
    out: list[tuple[str, int | None, int | None]] = []
    for p in paths:
        try:
            st = p.stat()
            out.append((str(p), st.st_mtime_ns, st.st_size))
        except OSError:
            out.append((str(p), None, None))
    return tuple(out)


def _folder_stamp(name: str) -> tuple:
    p = expand_user(name, "--model")
    try:
        return _stamp([p, *sorted(p.iterdir())]) if p.is_dir() else _stamp([p])
    except OSError:
        return ()


def check_train(cfg: Any, out: str | os.PathLike | None, *, method: Method | None = None) -> Method:
    """Check a training request before anything is created. ``out=None``: a resume, or no output folder.

    Returns the run's method, built once (``config.validation.validate_method``) for the run to use; a
    ``method`` an earlier check of this same request returned is handed back as it is, not built again."""
    from entropy_rft.config.validation import validate_method

    if out is not None:
        check_out(out)
    check_device(cfg.model.device, "config field 'model.device'", "--set model.device=cpu")
    response_tokens, splits = check_task(cfg.task.name, cfg.task.params)
    for note in splits.notes:
        warn_once(note)
    limits.check_request(cfg, splits)  # a training and a validation set; batches this machine can hold
    check_optional_packages(cfg)
    check_model(cfg.model.name)
    if method is None:
        method = validate_method(cfg)  # imports torch: after the cheap checks
    lines = settings_warnings(cfg, response_tokens)
    if getattr(cfg, "engine", "native") == "trl":
        lines += check_trl(cfg)
    elif getattr(cfg, "trl", None):
        lines.append(f"config section 'trl' ({', '.join(map(str, cfg.trl))}) is read by engine 'trl' only; the "
                     "native engine ignores it (pass --engine trl, or remove it)")
    for line in lines:
        warn_once(line)
    return method


def warn_once(line: str | None) -> None:
    """Print a warning line (``rundir.warn``) unless this process has printed it already (a request is checked
    by the command and again by launch: say it once). None: nothing to say."""
    from entropy_rft.rundir.files import warn  # imports torch

    if line is not None and line not in _warned:
        _warned.add(line)
        warn(line)


# ----------------------------------------------------------------------------- the output folder


def _is_under(path: Path, root: str) -> bool:
    return path == Path(root) or Path(root) in path.parents


def check_resume_dir(path: str | Path) -> None:
    """``--resume PATH``: refused in one line when it is missing or a file (a folder that is not a run is
    refused by ``checkpoints.load_run_config``, which says which file is missing)."""
    what = "is a file, not a run directory" if Path(path).exists() else "no such run directory"
    if not Path(path).is_dir():
        raise UserError(f"--resume {path}: {what}")
    check_utf8_path(os.fspath(path), "--resume")


def check_utf8_path(text: str, flag: str) -> None:
    """Refuse a path that is not UTF-8 (bytes the file system took, decoded as surrogates): the tokenizer's
    writer, safetensors and the trackers cannot encode it, so a run would fail at its end, after the work."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = os.fsencode(text[e.start:e.end])
        shown = os.fsencode(text).decode("utf-8", "backslashreplace")
        raise UserError(f"{flag} '{shown}': the path is not UTF-8 (byte 0x{bad[0]:02x}), which the tokenizer and "
                        "safetensors cannot write to; choose a name in UTF-8") from None


def check_out(out: str | os.PathLike, flag: str = "--out", *,
              file_hint: str = " (a new folder, or an existing run with --overwrite)") -> Path:
    """``out`` can become (or already is) a folder we may write into: not empty, not a file, no parent that is
    a file, not under /proc, /sys or /dev, and its nearest existing folder writable. Nothing is created."""
    text = os.fspath(out)
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    if not text.strip():
        raise UserError(f"{flag} is empty; pass a folder, e.g. {flag} runs/my-run")
    check_utf8_path(text, flag)
    p = Path(text)
    long_parts = [part for part in p.parts if len(os.fsencode(part)) > _NAME_MAX]
    if long_parts:
        raise UserError(f"{flag} '{text[:60]}...': a path component is longer than {_NAME_MAX} bytes; "
                        "use a shorter name")
    absolute = Path(os.path.abspath(p))
    try:
        real = p.resolve()
    except (OSError, RuntimeError):
        raise UserError(f"{flag} '{text}': the path has a symlink loop; fix the link or choose another "
                        "folder") from None
    for root in VIRTUAL_ROOTS:
        if _is_under(absolute, root) or _is_under(real, root):
            raise UserError(f"{flag} '{text}' is under {root}, a virtual file system; choose a folder on disk, "
                            f"e.g. {flag} runs/my-run")
    if os.path.lexists(p):
        if p.is_dir():
            _check_writable(p, text, flag, p)
            return p
        if p.is_symlink() and not p.exists():
            raise UserError(f"{flag} '{text}' is a broken symbolic link; remove it or choose another folder")
        raise UserError(f"{flag} '{text}' is a file, not a folder; choose another path{file_hint}")
    ancestor = absolute.parent
    while not os.path.lexists(ancestor) and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise UserError(f"{flag} '{text}': '{ancestor}' is a file, not a folder, so the folder cannot be made "
                        "there; choose another path")
    _check_writable(ancestor, text, flag, p)
    return p


def check_out_file(path: str | os.PathLike, flag: str) -> Path:
    """``path`` can be written as a file (``--json FILE``): not empty, not a folder, not under /proc, /sys or
    /dev, and its nearest existing folder writable (missing parent folders are created by the writer)."""
    text = os.fsdecode(os.fspath(path))
    if not text.strip():
        raise UserError(f"{flag} is empty; pass a file name, e.g. {flag} result.json")
    p = Path(text)
    if p.is_dir():
        raise UserError(f"{flag} '{text}' is a folder; pass a file name, e.g. {flag} {Path(text) / 'result.json'}")
    absolute = Path(os.path.abspath(p))
    for root in VIRTUAL_ROOTS:
        if _is_under(absolute, root):
            raise UserError(f"{flag} '{text}' is under {root}, a virtual file system; choose a file on disk, "
                            f"e.g. {flag} result.json")
    check_out(p.parent, flag=f"{flag} '{text}': folder", file_hint="")
    if p.exists() and not os.access(p, os.W_OK):
        raise UserError(f"{flag} '{text}' cannot be overwritten: permission denied; choose another file")
    return p


def _check_writable(folder: Path, text: str, flag: str, target: Path) -> None:
    if _read_only_fs(folder):
        raise UserError(f"{flag} '{text}': '{folder}' is on a read-only file system; choose a writable folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        what = "cannot be written into" if folder == target else "cannot be created"
        raise UserError(f"{flag} '{text}' {what}: permission denied on folder '{folder}'; choose a folder you "
                        "can write to, or fix its permissions")


def _read_only_fs(folder: Path) -> bool:
    try:
        return bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
    except (OSError, AttributeError):
        return False


# ----------------------------------------------------------------------------- device


def check_device(device: str, what: str = "config field 'model.device'", fix: str = "--set model.device=cpu") -> None:
    """``device`` parses and exists here: ``cuda`` needs a CUDA GPU (``cuda:N``: at least N+1), ``mps`` Apple's
    Metal backend. Imports torch only for a device other than the CPU."""
    from entropy_rft.config.schema import DEVICE_RE

    if not isinstance(device, str) or not DEVICE_RE.match(device):
        raise UserError(f"{what} must be 'cpu', 'cuda', 'cuda:N' or 'mps', got {device!r}")
    kind, _, index = device.partition(":")
    if kind == "cpu" or ("device", device) in _passed:
        return
    import torch

    if kind == "cuda":
        if not torch.cuda.is_available():
            build = f"built with CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
            raise UserError(f"{what} is {device!r} but no CUDA GPU is available here (torch {torch.__version__}, "
                            f"{build}); use {fix}")
        n = torch.cuda.device_count()
        if index and int(index) >= n:
            raise UserError(f"{what} is {device!r} but this machine has {n} CUDA GPU(s) (cuda:0..cuda:{n - 1}); "
                            f"pick one of those or use {fix}")
    elif kind == "mps":
        mps = getattr(torch.backends, "mps", None)
        if mps is None or not mps.is_available():
            raise UserError(f"{what} is 'mps' but Apple's Metal backend is not available here (it needs macOS on "
                            f"Apple silicon); use {fix}")
    elif kind == "xpu":
        xpu = getattr(torch, "xpu", None)
        if xpu is None or not xpu.is_available():
            raise UserError(f"{what} is {device!r} but no Intel XPU is available here; use {fix}")
        n = xpu.device_count()
        if index and int(index) >= n:
            raise UserError(f"{what} is {device!r} but this machine has {n} XPU(s); use {fix}")
    _passed.add(("device", device))


def check_min(flag: str, value: float | None, low: float) -> None:
    """Refuse a numeric option below ``low`` in one line (None, an option not given, passes)."""
    if value is not None and value < low:
        raise UserError(f"{flag} must be >= {low}, got {value}")


def check_range(flag: str, value: float | None, low: float, high: float, what: str = "") -> None:
    """Refuse a numeric option outside ``low..high`` in one line, ``what`` saying what it counts (None passes)."""
    if value is not None and not low <= value <= high:
        raise UserError(f"{flag} must be in {low}..{high}{f' ({what})' if what else ''}, got {value}")


# ----------------------------------------------------------------------------- task


_UNEXPECTED_KW = re.compile(r"(?P<func>[\w.<>]+)\(\) got an unexpected keyword argument '(?P<arg>[^']+)'")


def _task_factory(name: str) -> Callable[..., Any]:
    from entropy_rft import tasks

    return tasks.task_factory(name)  # ValueError naming the module, attribute or dataset


def _accepted_params(factory: Callable[..., Any], func_qualname: str | None) -> list[str] | None:
    """Parameter names the task's constructor accepts (None when it cannot be told)."""
    candidates: list[Any] = []
    if func_qualname:  # e.g. 'MathTask.__init__' from the TypeError: look it up in the factory's module
        import sys

        module = sys.modules.get(getattr(factory, "__module__", "") or "")
        obj: Any = module
        for part in func_qualname.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if obj is not None:
            candidates.append(obj)
    candidates.append(factory)
    for obj in candidates:
        try:
            sig = inspect.signature(obj)
        except (TypeError, ValueError):
            continue
        params = [p for p in sig.parameters.values() if p.name != "self"]
        if any(p.kind is p.VAR_KEYWORD for p in params):
            continue
        return [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    return None


def _files_in(value: Any) -> list[Path]:
    """Existing files named by string values in task params (nested dicts and lists too)."""
    if isinstance(value, dict):
        return [f for v in value.values() for f in _files_in(v)]
    if isinstance(value, (list, tuple)):
        return [f for v in value for f in _files_in(v)]
    if isinstance(value, str) and value.strip() and len(value) < 4096:
        try:
            p = Path(os.path.expanduser(value))  # a '~nouser' text is no file, not an error
            return [p] if p.is_file() else []
        except (OSError, ValueError):
            return []
    return []


def _not_utf8(params: dict, err: UnicodeDecodeError, task: str) -> UserError:
    for f in _files_in(params):
        try:
            data = f.read_bytes()
            data.decode("utf-8")
        except UnicodeDecodeError as e:
            return UserError(f"dataset file '{f}' (task {task!r}) is not UTF-8 text (byte 0x{data[e.start]:02x} at "
                             f"offset {e.start}); re-save it as UTF-8")
        except OSError:
            continue
    return UserError(f"task {task!r}: a data file is not UTF-8 text ({err.reason} at offset {err.start}); "
                     "re-save it as UTF-8")


def _which(params: dict, message: str, params_flag: str) -> str:
    """' (given task.params: {...})' when the message names none of the parameters, so the line shows the values."""
    if not params or any(str(k) in message for k in params):
        return ""
    text = repr(params)
    return f" (given {params_flag}: {text if len(text) <= 120 else text[:117] + '...'})"


_response_budget: dict[tuple, tuple[int, limits.Splits]] = {}
_warned: set[str] = set()


def check_task(name: str, params: dict | None = None) -> tuple[int, limits.Splits]:
    """The task of a training config can be built (see :func:`build_task`); built once per (name, params).
    Returns the longest response the task's answers need, as it declares it (see
    :func:`declared_response_tokens`), and its split sizes (``limits.task_splits``)."""
    key = ("task", name, repr(sorted(dict(params or {}).items(), key=lambda kv: str(kv[0]))),
           _stamp(_files_in(params or {})))
    if key not in _response_budget:
        task = build_task(name, params)
        _response_budget[key] = declared_response_tokens(task), limits.task_splits(task)
    return _response_budget[key]


def declared_response_tokens(task: Any) -> int:
    """The ``max_response_tokens`` a task declares itself (0 when it only inherits the interface's default)."""
    from entropy_rft.tasks.base import Task

    owners = [vars(task)] + [vars(c) for c in type(task).__mro__ if c is not Task and c is not object]
    return next((int(d["max_response_tokens"]) for d in owners if "max_response_tokens" in d), 0)


def settings_warnings(cfg: Any, response_tokens: int) -> list[str]:
    """Settings a run inherits without fitting it (one line each; the run goes on):

    - a config tuned for another model (``tuned_for``): its token budget, learning rate and method presets
      were chosen for that model;
    - ``rollout.max_new_tokens`` under half of what the task's answers need (``response_tokens``): most
      responses would be cut off before their answer.
    """
    out = []
    if cfg.tuned_for and cfg.tuned_for != cfg.model.name:
        preset = cfg.method.presets.get(cfg.method.name)
        what = f"; method preset {cfg.method.name} {preset}" if preset else ""
        out.append(f"model '{cfg.model.name}' runs with settings tuned for model '{cfg.tuned_for}' "
                   f"(rollout.max_new_tokens {cfg.rollout.max_new_tokens}, optim.lr {cfg.optim.lr:g}{what}); "
                   "pass a --config made for this model, or set tuned_for to it once the settings fit")
    if response_tokens and cfg.rollout.max_new_tokens < response_tokens / 2:
        out.append(f"rollout.max_new_tokens {cfg.rollout.max_new_tokens} is far below the {response_tokens} "
                   f"tokens task '{cfg.task.name}' allows for an answer; most responses will be cut off before "
                   "it (raise rollout.max_new_tokens)")
    return out


def in_flag_terms(message: str, params_flag: str) -> str:
    """A task's error told in the terms of the command that built it: a hint "set task.params.KEY to WHAT"
    (a config field) becomes "pass PARAMS_FLAG KEY=VALUE (WHAT)" (e.g. ``--task-param source=VALUE``)."""
    return re.sub(r"set task\.params\.(\w+) to ([^;]*)", rf"pass {params_flag} \1=VALUE (\2)", message)


def build_task(name: str, params: dict | None = None, *, flag: str = "--task / config field 'task.name'",
               params_flag: str = "task.params") -> Any:
    """``tasks.build_task(name, **params)`` with one-line errors: an unknown name lists the known tasks, an
    unknown parameter the accepted ones, and a data file that is missing, malformed or not UTF-8 is named."""
    from entropy_rft import tasks
    from entropy_rft.tasks.base import Task

    params = dict(params or {})
    known = ", ".join(tasks.available_tasks())
    if not isinstance(name, str) or not name.strip():
        raise UserError(f"{flag} is empty; known tasks: {known} (or 'package.module:ClassName')")
    if name not in tasks.available_tasks() and ":" not in name:
        raise UserError(f"unknown task {name!r} ({flag}); known tasks: {known}, rg:<reasoning-gym dataset> "
                        "(or 'package.module:ClassName')")
    try:
        factory = _task_factory(name)
    except ValueError as e:
        raise UserError(f"task {name!r} ({flag}): {e}") from None
    bad_names = [k for k in params if not isinstance(k, str) or not k.isidentifier()]
    if bad_names:
        raise UserError(f"task {name!r}: invalid parameter name(s) {bad_names} ({params_flag}); use name=value")
    accepted = _accepted_params(factory, None)
    if accepted is not None:
        unknown = sorted(k for k in params if k not in accepted)
        if unknown:
            raise UserError(f"task {name!r} has no parameter {', '.join(map(repr, unknown))} ({params_flag}); "
                            f"valid: {', '.join(accepted) or '(none)'}")
    try:
        task = factory(**params)
    except UserError as e:
        if params_flag == "task.params":
            raise
        raise UserError(in_flag_terms(str(e), params_flag)) from None
    except UnicodeDecodeError as e:
        raise _not_utf8(params, e, name) from None
    except TypeError as e:
        m = _UNEXPECTED_KW.search(str(e))
        if m:
            valid = _accepted_params(factory, m.group("func"))
            hint = f"; valid: {', '.join(valid)}" if valid else ""
            raise UserError(f"task {name!r} has no parameter {m.group('arg')!r} ({params_flag}){hint}") from None
        raise UserError(f"task {name!r}: bad {params_flag} ({e}){_which(params, str(e), params_flag)}") from None
    except (ValueError, KeyError, LookupError) as e:
        raise UserError(f"task {name!r}: {e}{_which(params, str(e), params_flag)}") from None
    if not isinstance(task, Task):
        raise UserError(f"task {name!r} built a {type(task).__name__}, not an entropy_rft Task; point "
                        f"{flag} at a Task subclass or a factory returning one")
    return task


# ----------------------------------------------------------------------------- packages and model


def check_optional_packages(cfg: Any) -> None:
    """Packages the config asks for that are optional: the trackers (train.report_to, train.wandb; an unknown
    tracker name is refused here too, listing the valid ones), trl (engine: trl)."""
    from entropy_rft.rundir.trackers import check as check_trackers

    check_trackers(cfg.train)
    if getattr(cfg, "engine", "native") == "trl" and importlib.util.find_spec("trl") is None:
        raise UserError("config field 'engine' is 'trl' but trl is not installed; pip install trl, or use "
                        "--engine native")


def check_trl(cfg: Any) -> list[str]:
    """Engine 'trl': the ``trl:`` section against TRL's GRPOConfig and the erft settings that engine does not
    honour (``trl_settings.check``; imports trl). Raises a one-line UserError; returns the warnings."""
    from entropy_rft.config import trl as trl_settings

    return trl_settings.check(cfg)


def check_model(name: str) -> None:
    """The policy can be found (``model_files.locate_policy``: built-in name, model folder, cached hub id). It
    imports neither torch nor transformers, and loads no weights."""
    key = ("model", name, _folder_stamp(name))
    if key in _passed:
        return
    from entropy_rft.models.files import locate_policy

    locate_policy(name)
    _passed.add(key)


# ----------------------------------------------------------------------------- prompt lengths


def check_prompt_lengths(prompt_token_counts: list[int], max_new_tokens: int, max_positions: int | None, *,
                         truncate: bool, budget: str = "rollout.max_new_tokens") -> None:
    """Refuse prompts that cannot fit the model's context together with ``max_new_tokens`` response tokens.

    ``max_positions`` is the model's context (``max_position_embeddings``; None: unknown, nothing checked). With
    ``truncate`` the prompts are cut to ``max_positions - max_new_tokens`` tokens, so only room for at least one
    prompt token is needed. ``budget`` names the setting of ``max_new_tokens`` (a config field, or ``erft eval``'s
    ``--max-new-tokens``).
    """
    where = f"config field '{budget}'" if budget.startswith(("rollout.", "eval.")) else budget
    if max_positions is None or not prompt_token_counts:
        return
    if max_new_tokens >= max_positions and min(prompt_token_counts) < max_positions:
        raise UserError(f"{where} ({max_new_tokens}) leaves no room for the prompt in "
                        f"the model's context of {max_positions} positions; set it to at most "
                        f"{max(1, max_positions - max(1, min(prompt_token_counts)))}")
    if truncate:
        return
    longest = max(prompt_token_counts)
    if longest + max_new_tokens <= max_positions:
        return
    over = sum(1 for n in prompt_token_counts if n + max_new_tokens > max_positions)
    room = max_positions - longest
    fix = (f"lower {budget} to at most {room}, or shorten the prompts" if room >= 1
           else "shorten the prompts (the longest alone fills the context)")
    raise UserError(f"{over} of {len(prompt_token_counts)} prompts do not fit the model's context: the longest has "
                    f"{longest} tokens, + {budget} {max_new_tokens} = {longest + max_new_tokens} > "
                    f"{max_positions} positions; {fix}")
