"""Verifiers for math answers: math-verify in a warm pool of worker processes with hard time limits.

``math_reward(response, answer) -> 1.0 | 0.0`` takes the response's LAST ``\\boxed{...}`` (nested braces
allowed) and asks math-verify whether it equals the gold ``answer``. Plain-text gold answers (``0.5``,
``x^2+2x+1``, ``\\sqrt{12}``) are wrapped as ``$\\boxed{...}$`` before parsing, so they compare as maths.

Why processes: math-verify bounds its own work with ``signal.alarm``, which only works in a main thread,
and some inputs (towers of powers, huge factorials) make sympy run for minutes. So every check runs in a
persistent worker process (started once, with sympy imported: *warm*), and the parent waits at most
``timeout`` seconds (default 2 s, not counting the worker's start-up) for each answer. A worker that
overruns is killed and replaced, and its answer scores 0.0: a pathological answer is wrong, never a hang.

``RewardPool`` is the general mechanism: any picklable-argument function named by import path
(``"pkg.mod:fn"``) runs in it, which is how custom rewards plug in. ``format_reward`` is the optional
format check (a complete ``\\boxed{}``).
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import os
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from functools import lru_cache
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as mp_wait
from typing import Any

DEFAULT_TIMEOUT = 2.0
MAX_ANSWER_CHARS = 1000  # longer boxed answers are wrong without parsing

__all__ = ["DEFAULT_TIMEOUT", "RewardPool", "default_pool", "format_reward", "last_boxed", "math_reward",
           "math_rewards", "math_verify_pair", "resolve_callable", "shutdown_default_pool", "wrap_gold"]


# ----------------------------------------------------------------------------- extraction


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, braces matched; else None.

    ``\\boxed 5`` (no braces) gives ``"5"``. An unclosed last box gives None.
    """
    if not isinstance(text, str):
        return None
    idx = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if idx < 0:
        return None
    i = idx + (6 if text.startswith("\\boxed", idx) else 5)
    if i < len(text) and text[i] == " ":  # \boxed 5
        j = i + 1
        while j < len(text) and not text[j].isspace() and text[j] not in "$":
            j += 1
        return text[i + 1 : j] or None
    if i >= len(text) or text[i] != "{":
        return None
    depth = 0
    for j in range(i, len(text)):
        c = text[j]
        if c == "{" and text[j - 1] != "\\":
            depth += 1
        elif c == "}" and text[j - 1] != "\\":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None


def wrap_gold(answer: Any) -> str:
    """A gold answer as math-verify should read it: ``$\\boxed{answer}$``.

    Numbers are printed; ``$...$`` delimiters are stripped; a gold that already has a ``\\boxed{}`` keeps
    only its last box's content.
    """
    s = str(answer).strip() if not isinstance(answer, float) else repr(answer)
    boxed = last_boxed(s)
    if boxed is not None:
        s = boxed
    while len(s) >= 2 and s.startswith("$") and s.endswith("$"):
        s = s[1:-1].strip()
    if s.startswith("\\(") and s.endswith("\\)"):
        s = s[2:-2].strip()
    return f"$\\boxed{{{s}}}$"


def format_reward(response: str) -> float:
    """1.0 when the response holds a complete ``\\boxed{...}`` with non-empty content, else 0.0."""
    b = last_boxed(response)
    return 1.0 if b is not None and b.strip() else 0.0


# ----------------------------------------------------------------------------- the check (in a worker)


@lru_cache(maxsize=4096)
def _parse_gold(gold: str):
    from math_verify import parse

    return parse(wrap_gold(gold), parsing_timeout=1)


def math_verify_pair(pred: str, gold: str) -> tuple[float, str | None]:
    """(1.0 or 0.0, canonical form) for a boxed prediction against a gold answer. Runs in a worker.

    The canonical form is math-verify's sympy reading of the prediction (for Maj@K), or the stripped
    text when it cannot be parsed.
    """
    from math_verify import parse, verify

    text = pred.strip()
    if not text or len(text) > MAX_ANSWER_CHARS:
        return 0.0, (text or None) if len(text) <= MAX_ANSWER_CHARS else None
    p = parse(f"$\\boxed{{{text}}}$", parsing_timeout=1)
    canon = str(p[0]) if p else " ".join(text.split())
    g = _parse_gold(str(gold))
    if not g or not p:
        return 0.0, canon
    return (1.0 if verify(g, p, timeout_seconds=1) else 0.0), canon


def resolve_callable(path: str) -> Callable[..., Any]:
    """Import ``"package.module:function"``."""
    mod, _, attr = str(path).partition(":")
    if not mod or not attr:
        raise ValueError(f"reward function {path!r}: expected 'package.module:function'")
    obj: Any = importlib.import_module(mod)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"reward function {path!r} is not callable")
    return obj


def _worker_main(rconn: Connection, wconn: Connection, fn_path: str) -> None:
    """Worker loop: import the function once (warm), then answer ``(job_id, args)`` until told to stop."""
    try:
        fn = resolve_callable(fn_path)
        if fn is math_verify_pair:  # import sympy/math-verify now, not on the first answer
            for pred, gold in (("1", "1"), ("\\frac{1}{2}", "0.5"), ("(x+1)^2", "x^2+2x+1")):
                math_verify_pair(pred, gold)
    except Exception as e:  # noqa: BLE001 - reported to the parent
        wconn.send(("error", f"{type(e).__name__}: {e}"))
        return
    wconn.send(("ready", None))
    while True:
        try:
            msg = rconn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        job_id, args = msg
        try:
            result = fn(*args)
        except BaseException:  # noqa: BLE001 - a failing check scores as wrong
            result = None
        try:
            wconn.send((job_id, result))
        except (OSError, ValueError):
            return


def _serve(fn_path: str) -> None:
    """Entry point of a worker process (``python -m entropy_rft.tasks.rewards FN``): frames go over stdin/stdout,
    and anything the function prints goes to stderr."""
    rfd, wfd = os.dup(0), os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    _worker_main(Connection(rfd, writable=False), Connection(wfd, readable=False), fn_path)


# ----------------------------------------------------------------------------- the pool


def _worker_env() -> dict[str, str]:
    """The parent's environment, its import path (so custom functions import the same) and one thread."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p or os.getcwd() for p in sys.path)
    for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env.setdefault(k, "1")
    return env


class _Worker:
    """One worker: a fresh interpreter (``python -m entropy_rft.tasks.rewards``), so no user ``__main__`` is
    re-imported and nothing of the parent (threads, CUDA, torch) is inherited."""

    def __init__(self, fn_path: str):
        self.proc = subprocess.Popen([sys.executable, "-m", "entropy_rft.tasks.rewards", fn_path],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=_worker_env(),
                                     close_fds=True)
        stdin, stdout = self.proc.stdin, self.proc.stdout
        assert stdin is not None and stdout is not None  # both are PIPE
        self.wconn = Connection(os.dup(stdin.fileno()), readable=False)
        self.conn = Connection(os.dup(stdout.fileno()), writable=False)
        stdin.close()
        stdout.close()
        self.ready = False
        self.job: int | None = None
        self.deadline = 0.0
        self.started = time.monotonic()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        try:
            self.proc.kill()
            self.proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            pass
        for c in (self.conn, self.wconn):
            with contextlib.suppress(OSError):
                c.close()


class RewardPool:
    """A persistent pool of worker processes that run ``fn`` (an import path) with a hard time limit.

    ``map(args_list)`` returns one result per argument tuple, in order: ``fn(*args)``, or ``default`` when
    the call raised, the worker died, or it ran past ``timeout`` seconds (counted from when the job reached
    a ready worker, so start-up is not counted). An overrunning worker is killed and replaced.

    Args:
        fn: ``"package.module:function"``; it must be importable in a fresh process.
        workers: worker processes (they run jobs in parallel).
        timeout: hard per-call limit in seconds.
        startup_timeout: how long a worker may take to import ``fn`` before the pool gives up.
    """

    def __init__(self, fn: str = "entropy_rft.tasks.rewards:math_verify_pair", *, workers: int = 1,
                 timeout: float = DEFAULT_TIMEOUT, default: Any = None,
                 startup_timeout: float = 120.0) -> None:
        if workers < 1:
            raise ValueError(f"RewardPool: workers must be >= 1, got {workers}")
        if not timeout > 0:
            raise ValueError(f"RewardPool: timeout must be > 0, got {timeout}")
        self.fn, self.n_workers, self.timeout, self.default = fn, int(workers), float(timeout), default
        self.startup_timeout = float(startup_timeout)
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._workers: list[_Worker] = []
        self.n_timeouts = 0  # calls that hit the hard limit (their workers were replaced)
        self.n_restarts = 0

    # -- lifecycle
    def _ensure_workers(self) -> None:
        if os.getpid() != self._pid:  # inherited through fork: the pipes belong to the parent
            self._workers, self._pid = [], os.getpid()
        self._workers = [w for w in self._workers if w.alive() or w.job is not None]
        while len(self._workers) < self.n_workers:
            self._workers.append(_Worker(self.fn))

    def start(self) -> RewardPool:
        """Start the workers and wait until all are warm."""
        with self._lock:
            self._ensure_workers()
            self._wait_ready(self._workers)
        return self

    def _wait_ready(self, workers: list[_Worker]) -> None:
        for w in workers:
            if w.ready:
                continue
            left = self.startup_timeout - (time.monotonic() - w.started)
            if not w.conn.poll(max(0.0, left)):
                raise RuntimeError(f"reward worker for {self.fn} did not start within {self.startup_timeout:.0f} s")
            self._on_startup_message(w)

    def _on_startup_message(self, w: _Worker) -> None:
        try:
            kind, info = w.conn.recv()
        except (EOFError, OSError):
            kind, info = "error", "worker exited during start-up"
        if kind != "ready":
            w.kill()
            self._workers.remove(w)
            raise RuntimeError(f"reward worker for {self.fn} failed to start: {info}")
        w.ready = True

    def close(self) -> None:
        """Stop every worker (politely, then by force)."""
        with self._lock:
            if os.getpid() != self._pid:
                self._workers = []
                return
            for w in self._workers:
                try:
                    if w.job is None:
                        w.wconn.send(None)
                except (OSError, ValueError):
                    pass
            for w in self._workers:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    w.proc.wait(timeout=1)
                w.kill()
            self._workers = []

    def __enter__(self) -> RewardPool:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # -- work
    def _replace(self, w: _Worker) -> None:
        w.kill()
        self._workers.remove(w)
        self._workers.append(_Worker(self.fn))
        self.n_restarts += 1

    def map(self, args_list: Sequence[tuple]) -> list[Any]:
        """Run ``fn(*args)`` for every tuple; ``default`` for calls that failed or overran."""
        results: list[Any] = [self.default] * len(args_list)
        if not args_list:
            return results
        with self._lock:
            self._ensure_workers()
            queue = deque(range(len(args_list)))
            pending = len(args_list)
            while pending:
                now = time.monotonic()
                for w in list(self._workers):  # hand out jobs to idle, ready workers
                    if w.ready and w.job is None and queue:
                        i = queue.popleft()
                        try:
                            w.wconn.send((i, tuple(args_list[i])))
                        except (OSError, ValueError):  # died while idle: replace, retry the job
                            queue.appendleft(i)
                            self._replace(w)
                            continue
                        w.job, w.deadline = i, time.monotonic() + self.timeout
                busy = [w for w in self._workers if w.job is not None]
                starting = [w for w in self._workers if not w.ready]
                deadlines = [w.deadline for w in busy] + [w.started + self.startup_timeout for w in starting]
                wait_s = max(0.0, min(deadlines) - now) if deadlines else 0.0
                ready_conns = mp_wait([w.conn for w in busy + starting], timeout=wait_s)
                now = time.monotonic()
                for w in list(self._workers):
                    if w.conn in ready_conns:
                        if not w.ready:
                            self._on_startup_message(w)
                            continue
                        try:
                            job_id, res = w.conn.recv()
                        except (EOFError, OSError):  # crashed on this job: it scores default
                            assert w.job is not None  # a started worker waited on is a busy one
                            results[w.job], w.job = self.default, None
                            pending -= 1
                            self._replace(w)
                            continue
                        if job_id == w.job:
                            results[job_id] = self.default if res is None else res
                            pending -= 1
                        w.job = None
                    elif w.job is not None and now >= w.deadline:  # hard limit: kill, replace, score default
                        results[w.job] = self.default
                        pending -= 1
                        self.n_timeouts += 1
                        self._replace(w)
                    elif not w.ready and now >= w.started + self.startup_timeout:
                        w.kill()
                        self._workers.remove(w)
                        raise RuntimeError(f"reward worker for {self.fn} did not start within "
                                           f"{self.startup_timeout:.0f} s")
        return results

    def __call__(self, *args) -> Any:
        return self.map([args])[0]


# ----------------------------------------------------------------------------- the default pool

_DEFAULT_POOL: RewardPool | None = None
_DEFAULT_LOCK = threading.Lock()


def default_pool() -> RewardPool:
    """The process-wide math-verify pool, started on first use.

    Size: ``$ERFT_REWARD_WORKERS`` (default 2); limit: ``$ERFT_REWARD_TIMEOUT`` seconds (default 2).
    """
    global _DEFAULT_POOL
    with _DEFAULT_LOCK:
        if _DEFAULT_POOL is None or _DEFAULT_POOL._pid != os.getpid():
            _DEFAULT_POOL = RewardPool(workers=int(os.environ.get("ERFT_REWARD_WORKERS", "2")),
                                       timeout=float(os.environ.get("ERFT_REWARD_TIMEOUT", DEFAULT_TIMEOUT)),
                                       default=(0.0, None))
        return _DEFAULT_POOL


def shutdown_default_pool() -> None:
    global _DEFAULT_POOL
    with _DEFAULT_LOCK:
        if _DEFAULT_POOL is not None:
            _DEFAULT_POOL.close()
            _DEFAULT_POOL = None


atexit.register(shutdown_default_pool)


def math_check(responses: Sequence[str], answers: Sequence[Any],
               pool: RewardPool | None = None) -> list[tuple[float, str | None]]:
    """(reward, canonical answer) per response; a response with no complete ``\\boxed{}`` is (0.0, None)."""
    if len(responses) != len(answers):
        raise ValueError(f"math_check: {len(responses)} responses but {len(answers)} answers")
    boxed = [last_boxed(r) for r in responses]
    todo = [i for i, b in enumerate(boxed) if b is not None and b.strip()]
    out: list[tuple[float, str | None]] = [(0.0, None)] * len(responses)
    if todo:
        pool = pool or default_pool()
        res = pool.map([(boxed[i], str(answers[i])) for i in todo])
        for i, r in zip(todo, res):
            out[i] = (float(r[0]), r[1]) if isinstance(r, tuple) else (0.0, None)
    return out


def math_rewards(responses: Sequence[str], answers: Sequence[Any], pool: RewardPool | None = None) -> list[float]:
    """``math_reward`` over a batch, spread over the pool's workers."""
    return [r for r, _ in math_check(responses, answers, pool)]


def math_reward(response: str, answer: Any) -> float:
    """1.0 when the response's last ``\\boxed{...}`` equals ``answer`` (math-verify), else 0.0. Never raises
    on bad input; an answer that takes longer than the hard limit scores 0.0."""
    return math_rewards([response], [answer])[0]


if __name__ == "__main__":  # run the imported module's copy, so ``fn is math_verify_pair`` holds
    from entropy_rft.tasks import rewards as _rewards

    _rewards._serve(sys.argv[1])
