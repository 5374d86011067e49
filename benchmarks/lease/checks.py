"""What a lease brings back, and the lease records committed since, are data (issue 65): every file is checked
here before ``collect``, ``shrink`` or ``next`` acts on it, and a malformed one ends in one line naming the file
and the field (:class:`LeaseDataError`), before anything is written.

- ``runs.tar.gz``: read member by member before anything is extracted; only the files a run ships
  (``<method>-s<seed>/{metrics.jsonl,config.yaml,run.json,samples.jsonl}``) and ``environment.json``, each a
  plain file within ``MEMBER_MAX`` bytes, ``TOTAL_MAX`` in all; then extracted streaming, counting bytes.
- ``lease.json``: a call's record of the shape ``device.py`` writes; its ``wave`` of the shape ``realm_wave.py``
  writes (the fields ``status.py`` reads, each of its type).
- a run's ``run.json`` and ``metrics.jsonl``: the fields the kit reads, of their types, read line by line.
- a kernels part: its ``device`` (bounded) and ``date``, which name the committed files, and every field the
  committed markdown is rendered from (``kernels_report.table_rows``), of its type.

The standard library and ``entropy_rft.common.text`` only (the device imports this module before any carried
wheel).
"""

from __future__ import annotations

import json
import math
import re
import tarfile
import zlib
from pathlib import Path

from entropy_rft.common.text import visible  # the standard library only; shown, never obeyed

MEMBER_MAX = 32 << 20  # bytes of one file of a run, unpacked (a real run's metrics.jsonl: ~1 MB)
TOTAL_MAX = 256 << 20  # bytes of the whole tar, unpacked
JSON_MAX = 16 << 20  # bytes of a lease.json, env.json, sampler.json or kernels part (the tool returns <= 16 MiB)
DATE = re.compile(r"\d{4}-\d{2}-\d{2}\Z")
RECORD_NAME = re.compile(r"lease-[a-z0-9]+(-[a-z0-9]+)*\.json\Z")


class LeaseDataError(Exception):
    """A returned file or a committed record that is not what the kit writes; ``str()`` is its one line (the
    file and the field, control characters escaped). ``kit.py`` prints it and exits 2."""

    def __init__(self, where: object, what: str):
        super().__init__(f"{visible(where)}: {visible(what)}")


def _number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def read_json(path: Path, limit: int = JSON_MAX) -> object:
    """``path``'s JSON, read only when within ``limit`` bytes."""
    try:
        size = path.stat().st_size
        if size > limit:
            raise LeaseDataError(path, f"{size} bytes, over the {limit} a lease file may hold")
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise LeaseDataError(path, f"cannot be read ({type(e).__name__})") from None
    except ValueError as e:
        raise LeaseDataError(path, f"is not JSON ({e})") from None


def _need(cond: bool, where: object, what: str) -> None:
    if not cond:
        raise LeaseDataError(where, what)


def check_wave(wave: object, where: object) -> dict:
    """A wave's record (``realm_wave.py``): the fields the kit reads, each of its type."""
    _need(isinstance(wave, dict), where, "wave is not an object")
    assert isinstance(wave, dict)
    _need(isinstance(wave.get("verdict"), str), where, "wave.verdict is not text")
    for key in ("finished", "failed", "runs", "started"):
        v = wave.get(key, [])
        _need(isinstance(v, list) and all(isinstance(x, str) for x in v), where, f"wave.{key} is not a list of names")
    stopped = wave.get("stopped", {})
    _need(isinstance(stopped, dict) and all(isinstance(v, str) for v in stopped.values()), where,
          "wave.stopped is not an object of texts")
    for key in ("needed_s", "budget_s", "pace_share"):
        _need(key not in wave or _number(wave[key]), where, f"wave.{key} is not a number")
    for key in ("pace", "settings", "memory", "proposal"):
        _need(key not in wave or isinstance(wave[key], dict), where, f"wave.{key} is not an object")
    pace = wave.get("pace") or {}
    _need(all(_number(pace.get(k, 0)) for k in ("startup_s", "step_s", "eval_s")), where,
          "wave.pace's startup_s, step_s or eval_s is not a number")
    peak = (wave.get("memory") or {}).get("peak_mib")
    _need(peak is None or _number(peak), where, "wave.memory.peak_mib is not a number")
    if wave["verdict"] == "nothing fits" and wave.get("pace"):
        missing = [k for k in ("pace_run", "pace_share", "needed_s", "budget_s", "settings", "proposal")
                   if k not in wave]
        _need(not missing, where, f"a 'nothing fits' wave with a pace lacks {', '.join(missing)}")
    prop = wave.get("proposal") or {}
    _need(prop.get("sets") is None or isinstance(prop["sets"], dict), where, "wave.proposal.sets is not an object")
    _need(all(_number(prop.get(k, 0)) for k in ("predicted_s", "budget_s")), where,
          "wave.proposal's predicted_s or budget_s is not a number")
    return wave


def check_call_record(rec: object, where: object, calls: int | None = None) -> dict:
    """One call's ``lease.json`` (``device.py``): ``call`` a whole number (within the plan's ``calls``),
    ``sections`` a list of objects with a text ``name`` and, when there, a text ``status``; ``wave`` as
    :func:`check_wave` has it."""
    _need(isinstance(rec, dict), where, "is not an object")
    assert isinstance(rec, dict)
    call = rec.get("call")
    _need(isinstance(call, int) and not isinstance(call, bool) and call >= 1
          and (calls is None or call <= calls), where, f"call is {call!r}, not a call number of the plan")
    sections = rec.get("sections")
    _need(isinstance(sections, list) and all(isinstance(s, dict) and isinstance(s.get("name"), str)
                                             and isinstance(s.get("status", ""), str) for s in sections),
          where, "sections is not a list of sections with a name and a status")
    if "wave" in rec:
        check_wave(rec["wave"], where)
    return rec


def check_lease_file(path: Path) -> list[dict]:
    """A committed lease record (``lease-<plan>-<time>.json``, ``collect.lease_record``): its calls."""
    rec = read_json(path)
    _need(isinstance(rec, dict) and isinstance(rec.get("calls"), list), path, "calls is not a list")
    assert isinstance(rec, dict)
    return [check_call_record(c, path) for c in rec["calls"]]


DEVICE_MAX = 100  # bytes of a kernels part's device name, which names the committed files (a GPU's: ~20)


def _shown(v: object) -> str:
    """A value in an error line: its repr, or its length when that is long."""
    r = repr(v)
    if len(r) <= 40:
        return r
    return f"{len(v)} characters of text" if isinstance(v, str) else f"{r[:37]}..."


def _want(cond: bool, where: object, name: str, v: object, what: str) -> None:
    _need(cond, where, f"{name} is {_shown(v)}, not {what}")


def _positive(v: object) -> bool:
    return _number(v) and v > 0  # type: ignore[operator]


def _obj(d: dict, key: str, where: object, name: str, default: object = None) -> dict:
    """``d[key]`` (``default`` when absent and a default is given), which must be an object."""
    v = d.get(key, default) if default is not None else d.get(key)
    _want(isinstance(v, dict), where, f"{name}.{key}", v, "an object")
    assert isinstance(v, dict)
    return v


def _numbers(d: dict, where: object, name: str, test=_number, what: str = "a number", keys=()) -> None:
    """Each of ``keys`` (every key of ``d`` when none are given) a value that passes ``test``."""
    for k in keys or d:
        _want(test(d.get(k)), where, f"{name}.{k}", d.get(k), what)


def _shape(d: dict, n: int, where: object, name: str) -> None:
    v = d.get("shape")
    _want(isinstance(v, list) and len(v) == n and all(isinstance(x, int) and not isinstance(x, bool) and x > 0
                                                      for x in v), where, f"{name}.shape", v,
          f"a list of {n} whole numbers")


def _times(d: dict, where: object, name: str, need: tuple[str, ...] = ()) -> dict:
    """``d["t"]``: seconds, each a positive number, ``need`` among them."""
    t = _obj(d, "t", where, name)
    for k in need:
        _need(k in t, where, f"{name}.t has no {k}")
    _numbers(t, where, f"{name}.t", _positive, "a positive number of seconds")
    return t


def _texts(d: dict, key: str, where: object, name: str) -> None:
    v = _obj(d, key, where, name, {})
    for k, x in v.items():
        _want(isinstance(x, str), where, f"{name}.{key}.{k}", x, "text")


def _maybe(test):
    return lambda v: v is None or test(v)


def _rows(rows: object, where: object, key: str) -> list[tuple[str, dict]]:
    """(its name, the row) for each row of the list ``rows`` (a part's ``key``), each an object."""
    _want(isinstance(rows, list), where, key, rows, "a list of rows")
    assert isinstance(rows, list)
    for i, r in enumerate(rows):
        _want(isinstance(r, dict), where, f"{key}[{i}]", r, "an object")
    return [(f"{key}[{i}]", r) for i, r in enumerate(rows)]


def _check_stats(rows: object, where: object) -> None:
    """``stats``: the fields ``kernels_report.table_rows`` reads of each row, of their types."""
    for name, r in _rows(rows, where, "stats"):
        _want(isinstance(r.get("dtype"), str), where, f"{name}.dtype", r.get("dtype"), "text")
        _shape(r, 2, where, name)
        _want(_number(r.get("temperature")) or isinstance(r.get("temperature"), str), where,
              f"{name}.temperature", r.get("temperature"), "a number or text")
        _times(r, where, name, ("token_stats", "logsumexp"))
        _numbers(r, where, name, keys=("ratio", "copy_bw_fraction"))
        _texts(r, "errors", where, name)
        _need("extra_peak" in r, where, f"{name} has no extra_peak")
        _numbers(r, where, name, _maybe(_number), "a number or null", ("extra_peak", "launches", "launches_logsumexp"))
        if r["extra_peak"] is not None:
            _numbers(r, where, name, _positive, "a positive number", ("bytes",))
            _numbers(r, where, name, keys=("syncs",))
        bounds = _obj(r, "error_over_bound", where, name)
        _need(bool(bounds), where, f"{name}.error_over_bound is empty")
        _numbers(bounds, where, f"{name}.error_over_bound")


def _check_head(rows: object, where: object) -> None:
    """``head``: as :func:`_check_stats`, for the fused head's rows."""
    for name, r in _rows(rows, where, "head"):
        _shape(r, 3, where, name)
        _times(r, where, name, ("ours",))
        _numbers(_obj(r, "peak", where, name), where, f"{name}.peak", _maybe(_number), "a number or null")
        _obj(r, "errors", where, name)
        _texts(r, "errors", where, name)
        _numbers(r, where, name, keys=("max_abs_logp_err",))


def _check_trl(models: object, where: object) -> None:
    """``trl``: model -> trainer -> pooled figures (``kernels_trl.pool_trl_runs``): a trainer without ``error``
    has a positive ``s_step``; every run without ``error`` its timed ``steps``."""
    _want(isinstance(models, dict), where, "trl", models, "an object")
    assert isinstance(models, dict)
    for model, runs in models.items():
        _want(isinstance(runs, dict), where, f"trl.{model}", runs, "an object")
        for trainer, r in runs.items():
            name = f"trl.{model}.{trainer}"
            _want(isinstance(r, dict), where, name, r, "an object")
            _want(isinstance(r.get("error", ""), str), where, f"{name}.error", r.get("error"), "text")
            _want(_positive(r.get("s_step")) or (r.get("s_step") is None and "error" in r), where,
                  f"{name}.s_step", r.get("s_step"), "a positive number (or null beside an error)")
            if r.get("s_step") is not None:
                _want(isinstance(r.get("n"), int) and not isinstance(r.get("n"), bool), where, f"{name}.n",
                      r.get("n"), "a whole number")
                _numbers(r, where, name, keys=("min", "max"))
            _numbers(r, where, name, _maybe(_number), "a number or null", ("peak",))
            children = r.get("runs", [])
            _want(isinstance(children, list) and all(isinstance(x, dict) for x in children), where,
                  f"{name}.runs", children, "a list of objects")
            for j, x in enumerate(children):
                steps = x.get("steps")
                _want("error" in x or (isinstance(steps, list) and bool(steps) and all(map(_positive, steps))),
                      where, f"{name}.runs[{j}].steps", steps, "a list of positive seconds")


def _one_line(v: object) -> bool:
    return isinstance(v, str) and visible(v) == v


def check_kernels_part(res: object, where: object) -> dict:
    """A kernels part (``kernels.py --json``): its ``device`` (one line of text, at most ``DEVICE_MAX`` bytes) and
    ``date`` (YYYY-MM-DD), which name the committed files; the title's ``torch``, ``triton`` and ``cuda`` one line
    of text; and every field ``kernels_report.render_markdown`` reads of ``stats``, ``stats_sweep``, ``head``,
    ``verl`` and ``trl``, of its type (a time a positive number: the table divides by it)."""
    _need(isinstance(res, dict), where, "is not an object")
    assert isinstance(res, dict)
    device = res.get("device", "device")
    _want(_one_line(device), where, "device", device, "one line of text")
    _need(len(device.encode()) <= DEVICE_MAX, where, f"device is {len(device.encode())} bytes long, over the "
          f"{DEVICE_MAX} a file name takes from it: no GPU is named so; find out what wrote it")
    date = res.get("date", "")
    _need(date == "" or (isinstance(date, str) and DATE.match(date) is not None), where,
          f"date is {date!r}, not YYYY-MM-DD")
    for key in ("torch", "triton", "cuda"):
        _want(key not in res or res[key] is None or _one_line(res[key]), where, key, res.get(key),
              "one line of text")
    _want(isinstance(res.get("quick", False), bool), where, "quick", res.get("quick"), "true or false")
    _want("wall_s" not in res or _number(res["wall_s"]), where, "wall_s", res.get("wall_s"), "a number")
    if "stats" in res:
        _check_stats(res["stats"], where)
    if res.get("stats_sweep"):
        sweep = res["stats_sweep"]
        _want(isinstance(sweep, dict), where, "stats_sweep", sweep, "an object")
        _shape(sweep, 2, where, "stats_sweep")
        _times(sweep, where, "stats_sweep")
        _numbers(sweep, where, "stats_sweep", _positive, "a positive number", ("bytes",))
    if "head" in res:
        _check_head(res["head"], where)
    if "verl" in res:
        _want(isinstance(res["verl"], dict), where, "verl", res["verl"], "an object")
        _shape(res["verl"], 2, where, "verl")
        _times(res["verl"], where, "verl", ("ours", "verl_entropy"))
        _numbers(res["verl"], where, "verl", keys=("ratio",))
    if "trl" in res:
        _check_trl(res["trl"], where)
    return res


def tar_members(tar_path: Path, allowed: set[str]) -> list[str]:
    """The members of ``tar_path`` after checking each header, before anything is extracted: a plain file named
    in ``allowed`` (no other name, no link, no folder, no device), once, within ``MEMBER_MAX`` bytes and
    ``TOTAL_MAX`` in all."""
    names, total = [], 0
    try:
        with tarfile.open(tar_path, "r:gz") as tar:
            for m in tar:
                _need(m.name in allowed, tar_path, f"holds {m.name!r}, which no run ships (a run ships only "
                      "metrics.jsonl, config.yaml, run.json and samples.jsonl)")
                _need(m.isreg(), tar_path, f"{m.name} is not a plain file")
                _need(m.name not in names, tar_path, f"holds {m.name} twice")
                _need(m.size <= MEMBER_MAX, tar_path, f"{m.name} unpacks to {m.size} bytes, over {MEMBER_MAX}")
                total += m.size
                _need(total <= TOTAL_MAX, tar_path, f"unpacks to over {TOTAL_MAX} bytes")
                names.append(m.name)
    except (tarfile.TarError, EOFError, OSError, zlib.error) as e:
        raise LeaseDataError(tar_path, f"is not a whole gzip tar ({type(e).__name__}: {e})") from None
    return names


def extract(tar_path: Path, names: list[str], dest: Path) -> None:
    """Copy the members ``names`` (checked by :func:`tar_members`) into ``dest``, streaming, each stopped at its
    declared size and ``MEMBER_MAX``."""
    want = set(names)
    try:
        with tarfile.open(tar_path, "r:gz") as tar:
            for m in tar:
                if m.name not in want or not m.isreg():
                    continue
                out = dest / m.name
                out.parent.mkdir(parents=True, exist_ok=True)
                src = tar.extractfile(m)
                assert src is not None
                with out.open("wb") as f:
                    copied = 0
                    while chunk := src.read(1 << 20):
                        copied += len(chunk)
                        _need(copied <= min(m.size, MEMBER_MAX), tar_path, f"{m.name} is longer than its header")
                        f.write(chunk)
    except (tarfile.TarError, EOFError, OSError, zlib.error) as e:
        raise LeaseDataError(tar_path, f"is not a whole gzip tar ({type(e).__name__}: {e})") from None


def check_run_json(path: Path) -> dict:
    """A run's ``run.json``: ``status`` text, ``step`` and ``max_steps`` whole numbers (or absent, or null, as
    in a run stopped before its first step); a finished run has both."""
    info = read_json(path)
    _need(isinstance(info, dict), path, "is not an object")
    assert isinstance(info, dict)
    _need(isinstance(info.get("status"), str), path, "status is not text")
    for key in ("step", "max_steps"):
        v = info.get(key)
        _need(v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 0), path,
              f"{key} is {v!r}, not a whole number")
        _need(v is not None or info["status"] != "finished", path, f"a finished run without {key}")
    return info


EVAL_KEYS = re.compile(r"eval/(pass@\d+|response_tokens)\Z")


def check_metrics(path: Path) -> int:
    """A run's ``metrics.jsonl``, line by line: each line an object with a whole ``step``, its ``eval/pass@k``
    and ``eval/response_tokens`` numbers (or null). Returns the rows."""
    n = 0
    try:
        with path.open() as f:
            for i, line in enumerate(f, 1):
                try:
                    row = json.loads(line)
                except ValueError:
                    raise LeaseDataError(f"{path} line {i}", "is not JSON") from None
                _need(isinstance(row, dict), f"{path} line {i}", "is not an object")
                step = row.get("step")
                _need(isinstance(step, int) and not isinstance(step, bool), f"{path} line {i}",
                      f"step is {step!r}, not a whole number")
                bad = [k for k, v in row.items() if EVAL_KEYS.match(str(k)) and v is not None and not _number(v)]
                _need(not bad, f"{path} line {i}", f"{', '.join(bad)} is not a number")
                n += 1
    except (OSError, UnicodeDecodeError) as e:
        raise LeaseDataError(path, f"cannot be read ({type(e).__name__})") from None
    return n
