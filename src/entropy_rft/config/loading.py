"""Reading a run configuration: YAML files, ``--set a.b=c`` overrides, the dedicated flags, the built-in defaults,
and the mapping they make turned into a :class:`~entropy_rft.config.schema.Config` (each value's type checked
against its field's annotation), then validated (``config.validation``).

Every problem (a missing or malformed file, an unknown field, a value of the wrong type) raises one line
:class:`~entropy_rft.common.errors.UserError` naming the file or the field. Torch-free.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import types
import typing
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from entropy_rft.common.errors import UserError
from entropy_rft.config.fields import short as _short
from entropy_rft.config.schema import Config
from entropy_rft.config.validation import validate

# ----------------------------------------------------------------------------- dict -> dataclass


def _type_ok(value: Any, tp: Any) -> tuple[bool, Any]:
    """Check (and lightly coerce) ``value`` against a field annotation. Returns (ok, value)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return True, None
        for a in args:
            if a is type(None):
                continue
            ok, v = _type_ok(value, a)
            if ok:
                return True, v
        return False, value
    if tp is float:
        if isinstance(value, bool):
            return False, value
        if isinstance(value, (int, float)):
            try:
                return True, float(value)
            except OverflowError:  # an int beyond float's range
                return False, value
        if isinstance(value, str):  # YAML 1.1 reads '1e-3' (no dot) as a string
            try:
                return True, float(value)
            except ValueError:
                return False, value
        return False, value
    if tp is int:
        return (isinstance(value, int) and not isinstance(value, bool)), value
    if tp is bool:
        return isinstance(value, bool), value
    if tp is str:
        return isinstance(value, str), value
    if tp in (dict,) or origin is dict:
        return isinstance(value, dict), value
    if tp in (list,) or origin is list:
        return isinstance(value, list), value
    return True, value


def _from_dict(cls: type, data: dict, prefix: str) -> Any:
    if not isinstance(data, dict):
        raise UserError(f"config field '{prefix.rstrip('.') or '<root>'}' must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        if key not in fields:
            raise UserError(
                f"unknown config field '{prefix}{key}'; valid fields here: {', '.join(sorted(fields))}"
            )
        tp = hints[key]
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            if value is None or value == "":  # 'model:' with nothing under it
                value = {}
            kwargs[key] = _from_dict(tp, value, f"{prefix}{key}.")
            continue
        ok, value = _type_ok(value, tp)
        if not ok:
            tname = getattr(tp, "__name__", str(tp)).replace("typing.", "")
            raise UserError(f"config field '{prefix}{key}' must be {tname}, got {_short(value)}")
        if isinstance(value, float) and not math.isfinite(value):
            raise UserError(f"config field '{prefix}{key}' must be a finite number, got {value}")
        kwargs[key] = value
    return cls(**kwargs)


def config_from_dict(data: dict, *, check_method: bool = True) -> Config:
    """Build and validate a :class:`Config` from a nested dict (missing fields take defaults).

    ``check_method=False`` leaves out :func:`validate_method` (which imports torch), for a caller that runs the
    cheap checks of a request first and calls it itself."""
    cfg = _from_dict(Config, data or {}, "")
    validate(cfg, check_method=check_method)
    return cfg


# ----------------------------------------------------------------------------- files and overrides


def default_config_path(model: str | None = None) -> Path:
    """The built-in config: the model's own for a built-in model that has one (``smollm2-135m``), else the
    default policy's (``configs/default.yaml``)."""
    base = resources.files("entropy_rft") / "configs"
    if model and (base / f"{model}.yaml").is_file():
        return Path(str(base / f"{model}.yaml"))
    return Path(str(base / "default.yaml"))


def _section(data: dict, name: str) -> dict:
    return data[name] if isinstance(data.get(name), dict) else {}


class _DuplicateKey(Exception):
    def __init__(self, key: Any, line: int, first: int):
        super().__init__(key)
        self.key, self.line, self.first = key, line, first


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key given twice in one mapping (plain YAML keeps the last one)."""


def _unique_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key = loader.construct_object(key_node, deep=deep)
        try:
            first = seen.setdefault(key, key_node.start_mark.line + 1)
        except TypeError:  # an unhashable key: construct_mapping names it
            continue
        if first != key_node.start_mark.line + 1:
            raise _DuplicateKey(key, key_node.start_mark.line + 1, first)
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


MAX_CONFIG_BYTES = 1 << 20  # a config is a few hundred lines; a bigger file is not one
MAX_CONFIG_VALUES = 100_000  # values a config may expand to through its aliases (an alias bomb has billions)


def _expanded_values(node: yaml.Node, memo: dict[int, int], open_: set[int]) -> int:
    """How many values ``node`` stands for once every alias in it is written out, counted on the composed
    graph (an alias is the same node again, so the count costs one visit per node); -1 when a node holds
    itself (a recursive alias)."""
    key = id(node)
    if key in open_:
        return -1
    if key not in memo:
        open_.add(key)
        children = ([c for kv in node.value for c in kv] if isinstance(node, yaml.MappingNode)
                    else list(node.value) if isinstance(node, yaml.SequenceNode) else [])
        counts = [_expanded_values(c, memo, open_) for c in children]
        open_.discard(key)
        memo[key] = -1 if -1 in counts else 1 + sum(counts)
    return memo[key]


def _load_bounded(text: str, p: Path) -> Any:
    """``text`` read as YAML (keys unique), refused in one line when its aliases expand to more than
    :data:`MAX_CONFIG_VALUES` values or refer to themselves: the graph is composed, counted, then built."""
    loader = _UniqueKeyLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        n = _expanded_values(node, {}, set())
        if n < 0:
            raise UserError(f"config file '{p}' has an alias (*name) inside the value it names; write the value "
                            "out instead")
        if n > MAX_CONFIG_VALUES:
            raise UserError(f"config file '{p}' expands to {n:,} values through its aliases (*name), over the "
                            f"{MAX_CONFIG_VALUES:,} a config may hold (an alias bomb?); write the values out, or "
                            "remove the aliases")
        return loader.construct_document(node)
    finally:
        loader.dispose()


def load_yaml(path: str | Path) -> dict:
    """A YAML config file as a dict; every problem (missing, unreadable, not UTF-8, bad YAML, over
    :data:`MAX_CONFIG_BYTES`, aliases expanding past :data:`MAX_CONFIG_VALUES`) is a UserError naming the file."""
    if not str(path).strip():
        raise UserError("config file name is empty; pass an existing YAML file to --config")
    p = Path(path)
    if p.is_dir():
        raise UserError(f"config file '{p}' is a folder; pass a YAML file to --config")
    if not p.is_file():
        raise UserError(f"config file '{p}' not found; pass an existing YAML file to --config")
    with contextlib.suppress(OSError):
        size = p.stat().st_size
        if size > MAX_CONFIG_BYTES:
            raise UserError(f"config file '{p}' is {size / 1e6:.1f} MB, over the {MAX_CONFIG_BYTES / 1e6:.0f} MB a "
                            "config may be; pass the YAML file of field: value lines to --config")
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise UserError(f"config file '{p}' cannot be read ({e.strerror or e}); check its permissions") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"config file '{p}' is not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}); "
                        "re-save it as UTF-8") from None
    try:
        data = _load_bounded(text, p)
    except _DuplicateKey as e:
        raise UserError(f"config file '{p}' gives '{e.key}' twice in one section (lines {e.first} and {e.line}); "
                        "keep one") from None
    except yaml.YAMLError as e:
        first = str(e).splitlines()[0] if str(e) else "parse error"
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise UserError(f"config file '{p}' is not valid YAML{where} ({first}); fix the syntax") from None
    except RecursionError:
        raise UserError(f"config file '{p}' is nested too deeply to be a config") from None
    except MemoryError:
        raise UserError(f"config file '{p}' needs more memory than this machine has to be read; it is not a "
                        "config: pass the YAML file of field: value lines to --config") from None
    if data is None:
        raise UserError(f"config file '{p}' is empty; put field: value lines in it, or leave out --config for the "
                        "built-in config")
    if not isinstance(data, dict):
        raise UserError(f"config file '{p}' must hold a mapping (field: value lines) at the top level, "
                        f"got a {type(data).__name__}")
    return data


def deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict) and k not in ("params",):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def parse_override(item: str) -> tuple[list[str], Any]:
    """Parse ``a.b=c`` into (['a', 'b'], value); the value is read as YAML (numbers, null, lists)."""
    if "=" not in item:
        raise UserError(f"--set '{item}' must look like key.path=value, e.g. --set optim.lr=1e-4")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key:
        raise UserError(f"--set '{item}' has an empty key; use key.path=value")
    parts = [p.strip() for p in key.split(".")]
    if not all(parts):
        raise UserError(f"--set '{item}': key '{key}' has an empty part; use key.path=value, e.g. optim.lr=1e-4")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except (yaml.YAMLError, RecursionError):
        value = raw
    return parts, value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    out = deep_merge({}, data)
    for item in overrides:
        path, value = parse_override(item)
        node = out
        for part in path[:-1]:
            nxt = node.get(part)
            if nxt is None:
                nxt = node[part] = {}
            elif not isinstance(nxt, dict):
                raise UserError(f"--set {item}: '{part}' is not a section")
            node = nxt
        node[path[-1]] = value
    return out


def _drop_other_tasks_params(data: dict, file_task: str | None, requested: dict) -> dict:
    """``--task X`` (or ``--set task.name=X``) naming another task than the config file's: the file's
    ``task.params`` were written for its own task, so they do not carry over (``task.params`` given on the
    command line, in ``requested``, do)."""
    wanted = _section(data, "task").get("name")
    if wanted is None or wanted == file_task or "params" in _section(requested, "task"):
        return data
    task = dict(_section(data, "task"))
    task.pop("params", None)
    return {**data, "task": task}


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                extra: dict | None = None, *, check_method: bool = True) -> Config:
    """Load ``path`` (or the built-in config: the requested model's own, see :func:`default_config_path`), apply
    ``--set`` overrides, then ``extra`` (the dedicated CLI flags such as ``--method``, which win), and validate
    (``check_method``: see :func:`config_from_dict`)."""
    try:
        return _load_config(path, overrides, extra, check_method=check_method)
    except MemoryError:  # whatever is left that a config can size: the config's fault, named with the file
        where = f"config file '{path}'" if path is not None else "the built-in config with --set"
        raise UserError(f"{where} exhausts this machine's memory while it is read; make its values smaller "
                        "(lists and mappings under task.params, method.presets, trl)") from None


def _load_config(path: str | Path | None, overrides: list[str] | None, extra: dict | None, *,
                 check_method: bool) -> Config:
    requested = deep_merge(apply_overrides({}, overrides or []), extra or {})  # the command line alone
    if path is None:
        model = _section(requested, "model").get("name")
        path = default_config_path(model if isinstance(model, str) else None)
    data = load_yaml(path)
    file_task = _section(data, "task").get("name")
    data = deep_merge(apply_overrides(data, overrides or []), extra or {})
    data = _drop_other_tasks_params(data, file_task, requested)
    return config_from_dict(data, check_method=check_method)
