"""``erft doctor``: findings on a run (erft's own or another engine's, as ``erft fit-law`` reads them).

Each detector is a small pure function over series (step -> value) with its rule and thresholds as named module
constants below; it returns a :class:`Finding` or None. A false alarm costs more than a miss, so every threshold
is set where a healthy run of the project's committed data (results/smollm2-cpu) stays quiet and a rule reads
the recent window, not the whole run (an early transient such as truncation at step 1 does not fire). A
prescription is built from the method registry (``control.registry``: name, knob, its direction, paper), never
from text in the log.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

Series = Mapping[int, float]
LEVELS = ("info", "warn", "error")

RECENT_STEPS = 5          # the "recent window": the last 5 logged steps of a per-step series
# (a) entropy collapse
ENTROPY_FLOOR = 0.05      # nats: a policy this sharp samples nearly one token per position
COLLAPSE_HORIZON = 1.0    # fire when the projected floor step is within this fraction of the run's length ahead
TREND_FRAC = 0.5          # the trend: a least-squares line over the last half of the entropy series (>= 4 points)
# (a), (c) the score has stopped improving
STALL_EVALS = 3           # the last 3 evaluations ...
MIN_GAIN = 0.02           # ... beat the best before them by less than 0.02 (2 points of accuracy)
MIN_EVALS = 5             # and there are at least 5 evaluations
# (b) entropy surge
SURGE_RATIO = 1.5         # recent mean > 1.5 x the lowest earlier window mean ...
SURGE_NATS = 0.3          # ... and higher by at least 0.3 nats
# (c) the law's ceiling
CEILING_GAP = 0.03        # the law's ceiling b - a at most 0.03 above the best score so far (or below it)
# (d) advantage collapse, (e) truncation, (f) clip saturation, (g) KL drift: recent means, once RECENT_STEPS are logged
ZERO_STD_WARN, ZERO_STD_ERROR = 0.5, 0.9
TRUNCATED_WARN = 0.2
CLIP_WARN = 0.2
# (g) KL drift: the recent mean of the reference KL
KL_WARN = 0.5             # nats
# (h) a control method that barely acts
KEPT_BARELY = 0.995       # mean kept share of the valid tokens over the run's training steps

# Keys read, by engine (erft, TRL, verl): the first one logged is used.
ZERO_STD_KEYS = ("frac_reward_zero_std", "train/frac_reward_zero_std")
TRUNCATED_KEYS = ("response/truncated_frac", "completions/clipped_ratio", "train/completions/clipped_ratio",
                  "clipped_ratio", "response_length/clip_ratio")
CLIP_KEYS = ("clip/ratio_frac", "clip_ratio/region_mean", "train/clip_ratio/region_mean", "clip_ratio",
             "actor/pg_clipfrac")
KL_KEYS = ("kl/ref", "kl", "train/kl", "actor/kl_loss")
KEPT_KEYS = ("control/kept_frac",)
# a method that acts on chosen tokens without dropping them (KL-Cov's penalty): the share of tokens it chose
SELECTED_KEYS = ("control/kl_cov_selected_frac",)


@dataclass(frozen=True)
class Prescription:
    method: str
    knob: str | None
    direction: str  # e.g. "lower mu"
    paper: str
    expect: str


@dataclass(frozen=True)
class Finding:
    id: str
    level: str
    title: str
    evidence: str
    keys: tuple[str, ...]
    rule: str
    prescription: Prescription | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class RunSeries:
    """What the detectors read from one run: the series and the key each came from."""

    name: str
    entropy: dict[int, float]
    score: dict[int, float]
    keys: dict[str, str]  # role -> key read
    extra: dict[str, dict[int, float]]  # role (reward, zero_std, truncated, clip, kl, kept) -> series
    method: str = "none"
    params: dict[str, Any] | None = None


def _recent(s: Series, n: int = RECENT_STEPS) -> list[float]:
    return [s[k] for k in sorted(s)[-n:]]


def _mean(v: Sequence[float]) -> float:
    return sum(v) / len(v)


def stalled(score: Series) -> tuple[bool, float, float]:
    """(stalled, best of the last STALL_EVALS evaluations, best before them)."""
    vals = [score[k] for k in sorted(score)]
    if len(vals) < MIN_EVALS:
        return False, float("nan"), float("nan")
    last, before = max(vals[-STALL_EVALS:]), max(vals[:-STALL_EVALS])
    return last - before < MIN_GAIN, last, before


def _trend(s: Series) -> tuple[float, float, int] | None:
    """(slope per step, fitted value at the last step, last step) of a line over the last TREND_FRAC."""
    steps = sorted(s)
    n = max(4, int(len(steps) * TREND_FRAC))
    if len(steps) < 4:
        return None
    xs, ys = steps[-n:], [s[k] for k in steps[-n:]]
    mx, my = _mean(xs), _mean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return slope, my + slope * (xs[-1] - mx), xs[-1]


def _method_info(name: str) -> dict[str, Any]:
    import entropy_rft.control.builtins  # noqa: F401  (registers the methods)
    from entropy_rft.control.registry import method_info

    return method_info(name)


def raise_entropy(method: str, params: Mapping[str, Any] | None, expect: str) -> Prescription:
    """Move the run's method knob toward higher entropy (its value now, from the run's config); with no method (or
    one with no knob), train with ClipB and move its knob from the registry's default (no "now": the run has none)."""
    info = _method_info(method) if method != "none" else None
    own = not (info is None or not info["knob"] or not info["knob_raises_entropy"])
    if not own:
        info, params = _method_info("clip_b"), None
    assert info is not None
    knob = info["knob"]
    verb = "raise" if info["knob_raises_entropy"] > 0 else "lower"
    # a knob that is no parameter of its own (clip_b_paper's mu sets mu_low and mu_high; EntroPIC's controller
    # state) has no default to name
    default = next((p["default"] for p in info["params"] if p["name"] == knob), None)
    now = (params or {}).get(knob, default)
    if own:
        words = (f"{verb} {knob} (now {now:g}; {info['direction']})" if isinstance(now, (int, float)) else
                 f"{verb} {knob} ({info['direction']})")
    else:
        words = f"train with {info['name']} and {verb} {knob} from its default {default:g} ({info['direction']})"
    return Prescription(info["name"], knob, words, info["paper"], expect)


def lower_entropy(method: str, params: Mapping[str, Any] | None, expect: str) -> Prescription | None:
    if method == "none":
        return None
    info = _method_info(method)
    if not info["knob"] or not info["knob_raises_entropy"]:
        return None
    verb = "lower" if info["knob_raises_entropy"] > 0 else "raise"
    return Prescription(info["name"], info["knob"], f"{verb} {info['knob']} ({info['direction']})", info["paper"],
                        expect)


def entropy_collapse(entropy: Series, score: Series, keys: tuple[str, ...], method: str = "none",
                     params: Mapping[str, Any] | None = None) -> Finding | None:
    """Entropy collapse: a line fitted to the last half of the entropy series (at least 4 points) reaches
    ENTROPY_FLOOR nats within COLLAPSE_HORIZON x the run's length ahead (error when it is already below), and the
    score has stopped improving (the last STALL_EVALS of at least MIN_EVALS evaluations beat the best before them
    by less than MIN_GAIN). A falling entropy while the score still climbs is the normal course: quiet."""
    t = _trend(entropy)
    if t is None:
        return None
    slope, now, last = t
    stop, best_last, best_before = stalled(score)
    if not stop:
        return None
    below = _recent(entropy, 1)[0] <= ENTROPY_FLOOR
    if not below and slope >= 0:
        return None
    at = last if below else last + (now - ENTROPY_FLOOR) / -slope
    if at > last + COLLAPSE_HORIZON * last:
        return None
    ev = (f"entropy {_recent(entropy, 1)[0]:.4f} at step {last}, trend {slope:+.4f}/step; reaches "
          f"{ENTROPY_FLOOR} at step {at:.0f}; score {best_last:.4f} (last {STALL_EVALS}) vs {best_before:.4f} before")
    return Finding("entropy_collapse", "error" if below else "warn", "entropy is collapsing and the score has "
                   "stopped improving", ev, keys,
                   f"trend over the last {TREND_FRAC:.0%} reaches {ENTROPY_FLOOR} nats within {COLLAPSE_HORIZON:g}x "
                   f"the run's length, and the last {STALL_EVALS} evaluations gain < {MIN_GAIN}",
                   raise_entropy(method, params, "entropy held higher; the score keeps room to climb (Paper A)"))


def entropy_surge(entropy: Series, keys: tuple[str, ...], method: str = "none",
                  params: Mapping[str, Any] | None = None) -> Finding | None:
    """Entropy surge: the mean of the last RECENT_STEPS steps exceeds SURGE_RATIO x the lowest mean of an
    earlier window of RECENT_STEPS steps, and by at least SURGE_NATS nats."""
    steps = sorted(entropy)
    n = RECENT_STEPS
    if len(steps) < 2 * n:
        return None
    vals = [entropy[k] for k in steps]
    recent = _mean(vals[-n:])
    low = min(_mean(vals[i:i + n]) for i in range(len(vals) - 2 * n + 1))
    if not (recent > SURGE_RATIO * low and recent - low >= SURGE_NATS):
        return None
    return Finding("entropy_surge", "warn", "entropy is rising fast", f"recent mean {recent:.4f} vs lowest "
                   f"earlier {low:.4f} (steps {steps[0]}-{steps[-1]})", keys,
                   f"last {n}-step mean > {SURGE_RATIO}x the lowest earlier one and by >= {SURGE_NATS} nats",
                   lower_entropy(method, params, "entropy back toward its earlier level"))


def plateau(score: Series, entropy_at_score: Series, keys: tuple[str, ...], method: str = "none",
            params: Mapping[str, Any] | None = None) -> Finding | None:
    """Plateau: the score has stopped improving (as in entropy_collapse); the law R = -a*exp(H) + b fitted to the
    evaluations (analysis.law) is reported, and the level is warn when its ceiling b - a lies within CEILING_GAP
    of the best score (more of the same training will not lift it), info otherwise."""
    stop, best_last, best_before = stalled(score)
    if not stop:
        return None
    ceiling = None
    pts = [k for k in sorted(score) if k in entropy_at_score]
    if len(pts) >= 3:
        from entropy_rft.analysis.law import fit_law
        from entropy_rft.common.errors import UserError

        try:
            ceiling = fit_law([entropy_at_score[k] for k in pts], [score[k] for k in pts]).ceiling
        except UserError:  # a degenerate fit (all H equal, too few points): no ceiling to report
            ceiling = None
    best = max(score.values())
    near = ceiling is not None and ceiling - best <= CEILING_GAP
    ev = f"score {best_last:.4f} over the last {STALL_EVALS} evaluations vs {best_before:.4f} before"
    ev += "" if ceiling is None else f"; the law's ceiling {ceiling:.4f} (best so far {best:.4f})"
    return Finding("plateau", "warn" if near else "info", "the score has plateaued" + (" at the law's ceiling"
                   if near else ""), ev, keys, f"last {STALL_EVALS} of >= {MIN_EVALS} evaluations gain < "
                   f"{MIN_GAIN}; warn when the ceiling is at most {CEILING_GAP} above the best",
                   raise_entropy(method, params, "a higher ceiling: b - a grows as entropy is spent more slowly "
                                 "(Paper B)") if near else None)


def _recent_level(name: str, s: Series, key: str, warn: float, error: float | None, title: str, what: str,
                  rx: Prescription | None) -> Finding | None:
    if len(s) < RECENT_STEPS:  # a window not yet full (a live run's first steps): no judgement on it
        return None
    m = _mean(_recent(s))
    if m < warn:
        return None
    level = "error" if error is not None and m >= error else "warn"
    steps = sorted(s)[-RECENT_STEPS:]
    rule = f"mean of the last {RECENT_STEPS} steps >= {warn}" + ("" if error is None else f" (error >= {error})")
    return Finding(name, level, title, f"{what} {m:.4f} over steps {steps[0]}-{steps[-1]}", (key,), rule, rx)


def _fixed(expect: str, what: str) -> Prescription:
    return Prescription("none", None, what, "", expect)


def advantage_collapse(s: Series, key: str) -> Finding | None:
    """Advantage collapse: the recent mean share of groups whose rewards all agree (zero std, zero advantage)
    is >= ZERO_STD_WARN (error >= ZERO_STD_ERROR): most of the batch carries no gradient."""
    return _recent_level("advantage_collapse", s, key, ZERO_STD_WARN, ZERO_STD_ERROR, "most groups have zero "
                         "advantage", "zero-std share", _fixed("more groups with a gradient", "harder or easier "
                         "prompts, or a larger group (rollout.group_size)"))


def truncation(s: Series, key: str) -> Finding | None:
    """Truncation: the recent mean share of responses at the length cap is >= TRUNCATED_WARN."""
    return _recent_level("truncation", s, key, TRUNCATED_WARN, None, "responses hit the length cap",
                         "truncated share", _fixed("fewer cut answers scored as wrong",
                                                   "raise rollout.max_new_tokens"))


def clip_saturation(s: Series, key: str) -> Finding | None:
    """Clip saturation: the recent mean share of tokens clipped by PPO's ratio clip is >= CLIP_WARN (healthy
    runs clip ~0.01-0.05)."""
    return _recent_level("clip_saturation", s, key, CLIP_WARN, None, "PPO's clip cuts many tokens",
                         "clipped share", _fixed("a smaller step per update", "lower the learning rate"))


def kl_drift(s: Series, key: str) -> Finding | None:
    """KL drift: the recent mean reference KL is >= KL_WARN nats."""
    return _recent_level("kl_drift", s, key, KL_WARN, None, "the policy drifts from the reference",
                         "KL", _fixed("the policy kept near the reference", "raise the KL coefficient"))


def barely_acts(kept: Series, key: str, method: str, params: Mapping[str, Any] | None,
                selected: Series | None = None) -> Finding | None:
    """A control method that barely acts: the run has a method with a knob and its mean kept share of the valid
    tokens over the training steps is >= KEPT_BARELY (it changes almost nothing of the gradient). A method that
    acts without dropping (KL-Cov: ``selected``, the share of tokens its penalty chose) acts when that share is
    above 1 - KEPT_BARELY."""
    if method == "none" or not kept:
        return None
    if selected and _mean(list(selected.values())) > 1.0 - KEPT_BARELY:
        return None
    info = _method_info(method)
    if not info["knob"] or not info["knob_raises_entropy"]:
        return None
    m = _mean(list(kept.values()))
    if m < KEPT_BARELY:
        return None
    steps = sorted(kept)
    rx = raise_entropy(method, params, f"{method} drops more tokens and holds entropy higher")
    return Finding("barely_acts", "warn", f"{method} barely acts", f"kept {m:.2%} of the valid tokens on average "
                   f"over steps {steps[0]}-{steps[-1]} (min {min(kept.values()):.2%})", (key,),
                   f"mean kept share >= {KEPT_BARELY:.1%}", rx)


def describe(f: Finding) -> list[str]:
    """A finding as the terminal shows it: its level, id and title, then its evidence, rule and prescription
    (indented). Keys are text from a log: made visible (``common.text.visible``), never obeyed."""
    from entropy_rft.common.text import visible

    lines = [f"[{f.level}] {f.id}: {f.title}",
             f"  evidence: {f.evidence} (keys: {', '.join(visible(k) for k in f.keys)})", f"  rule: {f.rule}"]
    rx = f.prescription
    if rx is not None:
        via = f"{rx.method}: " if rx.method != "none" else ""
        lines.append(f"  prescription: {via}{rx.direction}; expect {rx.expect}" + (f" [{rx.paper}]" if rx.paper
                                                                                   else ""))
    return lines


def diagnose(run: RunSeries) -> list[Finding]:
    """Every detector on ``run``, ranked: error, then warn, then info (in detector order within a level)."""
    k = run.keys
    x = run.extra
    found: list[Finding | None] = [
        entropy_collapse(run.entropy, run.score, (k["entropy"], k["score"]), run.method, run.params),
        entropy_surge(run.entropy, (k["entropy"],), run.method, run.params),
        plateau(run.score, x.get("score_entropy", run.entropy), (k["score"], k.get("score_entropy", k["entropy"])),
                run.method, run.params),
    ]
    checks: list[tuple[str, Callable[[Series, str], Finding | None]]] = [
        ("zero_std", advantage_collapse), ("truncated", truncation), ("clip", clip_saturation), ("kl", kl_drift)]
    found += [fn(x[role], k[role]) for role, fn in checks if role in x]
    if "kept" in x:
        found.append(barely_acts(x["kept"], k["kept"], run.method, run.params, x.get("selected")))
    out = [f for f in found if f is not None]
    return sorted(out, key=lambda f: -LEVELS.index(f.level))


def score_pairs(run: RunSeries) -> tuple[list[float], list[float]]:
    """(entropies, scores) at the steps with a score: the evaluation's own entropy where logged, else the
    training entropy of that step (another engine's run)."""
    h = run.extra.get("score_entropy", run.entropy)
    steps = [k for k in sorted(run.score) if k in h]
    return [h[k] for k in steps], [run.score[k] for k in steps]


def heading(run: RunSeries, level: float) -> dict[str, Any]:
    """The score at H = 0 by the law and by the linear baseline, each with its prediction interval at ``level``
    (``analysis.interval.ceiling_forecasts``), or why there is none (``{"error": ...}``)."""
    from entropy_rft.analysis.interval import ceiling_forecasts
    from entropy_rft.common.errors import UserError

    hs, rs = score_pairs(run)
    try:
        return ceiling_forecasts(hs, rs, level, what=f"{run.name} ({len(hs)} scored steps)")
    except UserError as e:
        return {"error": str(e), "level": level, "n": len(hs)}


def _pick(rows: Mapping[int, Mapping[str, float]], keys: Sequence[str]) -> tuple[str, dict[int, float]] | None:
    for key in keys:
        s = {st: float(r[key]) for st, r in rows.items() if isinstance(r.get(key), (int, float))}
        if s:
            return key, s
    return None


def _roles(run: RunSeries, rows: Mapping[int, Mapping[str, float]], skip_steps: bool) -> None:
    from entropy_rft.analysis.byo import REWARD_KEYS

    train = {st: r for st, r in rows.items() if not skip_steps or st >= 1}
    for role, keys in (("reward", REWARD_KEYS), ("zero_std", ZERO_STD_KEYS), ("truncated", TRUNCATED_KEYS),
                       ("clip", CLIP_KEYS), ("kl", KL_KEYS), ("kept", KEPT_KEYS), ("selected", SELECTED_KEYS)):
        got = _pick(train, keys)
        if got:
            run.keys[role], run.extra[role] = got


def series_from_rows(name: str, rows: Sequence[Mapping[str, Any]], cfg: Mapping[str, Any],
                     metric: str | None = None, *, reward_as_score: bool = False) -> RunSeries:
    """One erft run's series from its metrics rows (``metrics.jsonl``'s, or the rows a live run has logged so
    far) and its config (a dict, as ``config.yaml`` holds it): train entropy/mean, eval/pass@1 or ``metric``
    with the evaluation's eval/entropy, the method and its knob. Refuses in one line (naming ``name``) a run
    with no score or no training step yet; with ``reward_as_score`` (a live run with no evaluation, e.g. on the
    TRL engine) the training reward/mean stands in for a missing score, and ``keys["score"]`` says so."""
    from entropy_rft.common.errors import UserError

    mkey = "eval/pass@1" if metric is None else (metric if "/" in metric else f"eval/{metric}")
    by_step = {int(x["step"]): x for x in rows}
    score = {st: float(v) for st, x in by_step.items() if isinstance(v := x.get(mkey), (int, float))}
    if not score and reward_as_score and metric is None:
        mkey = "reward/mean"
        score = {st: float(v) for st, x in by_step.items() if st >= 1 and isinstance(v := x.get(mkey), (int, float))}
    if not score:
        raise UserError(f"{name}: no validation score {mkey!r}; name another with --metric")
    entropy = {st: float(v) for st, x in by_step.items() if st >= 1
               and isinstance(v := x.get("entropy/mean"), (int, float))}
    if not entropy:
        raise UserError(f"{name}: no entropy/mean logged; the run has no training step yet")
    m = cfg.get("method") or {}
    method = str(m.get("name") or "none")
    params = {**((m.get("presets") or {}).get(method) or {}), **(m.get("params") or {})}
    run = RunSeries(name, entropy, score, {"entropy": "entropy/mean", "score": mkey}, {}, method, params)
    ev = {st: float(v) for st, x in by_step.items() if isinstance(v := x.get("eval/entropy"), (int, float))}
    if ev:
        run.extra["score_entropy"], run.keys["score_entropy"] = ev, "eval/entropy"
    _roles(run, by_step, skip_steps=True)
    return run


def series_from_log(log: Any, name: str, entropy_key: str | None = None, metric: str | None = None, *,
                    reward_as_score: bool = False) -> RunSeries:
    """Another engine's run from its ``engine_logs.EngineLog`` (keys chosen by ``byo.choose_keys``). With
    ``reward_as_score`` (a live run that has logged no validation score yet), the training reward stands in for
    the score, and ``keys["score"]`` names it."""
    from entropy_rft.analysis.byo import REWARD_KEYS, choose_keys
    from entropy_rft.common.errors import UserError

    try:
        choice = choose_keys(log, entropy_key, metric)
        ent, score_key = choice.entropy_key, choice.metric_key
    except UserError:
        logged = log.keys()
        reward = next((k for k in REWARD_KEYS if k in logged), None)
        if not reward_as_score or metric is not None or reward is None:
            raise
        ent, score_key = choose_keys(log, entropy_key, reward).entropy_key, reward  # the entropy key's refusal
    run = RunSeries(name, dict(zip(*log.series(ent))), dict(zip(*log.series(score_key))),
                    {"entropy": ent, "score": score_key}, {})
    _roles(run, log.rows, skip_steps=False)
    return run


def load_series(path: str | Path, *, source: str | None = None, entropy_key: str | None = None,
                metric: str | None = None) -> RunSeries:
    """One run's series: an erft run directory (``series_from_rows`` on its ``metrics.jsonl`` and
    ``config.yaml``) or another engine's log (read by ``engine_logs``, ``series_from_log``)."""
    from entropy_rft.analysis.engine_logs import is_erft_path, read_engine_log

    p = Path(path)
    if source is None and is_erft_path(p):
        from entropy_rft.analysis.runs import load_run

        r = load_run(p)
        run = series_from_rows(str(p / "metrics.jsonl"), r.rows, r.cfg, metric)
        run.name, run.method = r.name, r.method  # a run without config.yaml: "unknown", as the report says
        return run
    return series_from_log(read_engine_log(p, source), str(p), entropy_key, metric)
