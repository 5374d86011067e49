"""The one table of metric names: every key an engine writes to ``metrics.jsonl``, its meaning and its unit.

Native trainer and TRL engine use the same name for the same figure and never two names for one figure; a
name means one thing everywhere. Patterned families are one entry: ``{k}`` is a sample count (eval's K),
``{q}`` one of the lens quadrants (``control.lens.QUADRANTS``), ``{t}`` the temperature of the second
evaluation (``eval.extra_temperature``, :func:`eval_prefix`). docs/metrics.md's glossary is
``glossary_markdown()`` (checked by ``tests/test_metric_names.py``). Torch-free (layer 0).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import NamedTuple

__all__ = ["METRICS", "PER", "QUADRANTS", "Metric", "eval_prefix", "glossary_markdown", "is_known", "lookup",
           "mean_defined", "names_per"]

# The lens quadrants: sign of the advantage (pos/neg/zero) × sign of S_c (spos, sneg: S_c <= 0).
QUADRANTS = ("pos_spos", "pos_sneg", "neg_spos", "neg_sneg", "zero")


class Metric(NamedTuple):
    meaning: str
    unit: str
    per: str = "step"  # how a step's value is made of what the engine measures (a key of PER)


# How one row's value is made: the aggregation column of the glossary. A loss call is one micro-batch's
# ``core.loss_types.LossOutputs``; every engine takes the step's value of a "loss call" metric as the mean over
# its loss calls that define it (native: each optimizer update's micro-batches, then its updates; TRL: the step's
# micro-batches, ``integrations.window.StepMetrics``).
CALL, NATIVE_CALL, UPDATE, EVAL = "loss call", "loss call, native", "update", "evaluation"
PER = {
    "step": "once per step, over the step's whole batch (or the step's state)",
    "loss call": "each loss call; the step's value is the mean over its loss calls",
    "loss call, native": "each loss call, logged by the native engine only (the mean over its loss calls); TRL, "
                         "whose loss calls split a minibatch, logs the step's global token counts instead "
                         "(control/kept_frac, control/zeroed_frac)",
    "update": "each optimizer update; the step's value is the mean over its updates",
    "evaluation": "at the steps that evaluate (step 0 and every eval.every)",
}


_VALID = "valid response tokens"

METRICS: dict[str, Metric] = {
    "step": Metric("the erft step the row belongs to (0-based native, 1-based TRL)", "count"),
    # rewards and responses
    "reward/mean": Metric("mean reward of the step's sampled responses", "reward"),
    "reward/accuracy": Metric("share of the step's responses with a positive reward", "fraction"),
    "response/length": Metric("mean response length", "tokens"),
    "response/truncated_frac": Metric("share of responses that hit the length limit without EOS", "fraction"),
    # token statistics of the old policy (metrics.stats_metrics)
    "entropy/mean": Metric(f"mean token entropy of the sampling policy over the {_VALID}", "nats"),
    "dynamics/s_star_mean": Metric("mean of S* = p·(H + log p) of the sampled token (Lemma 3.1)", "nats"),
    "dynamics/s_star_std": Metric("population std of S*", "nats"),
    "dynamics/s_centered_mean": Metric("mean of S_c = S* − E_p[S] (Corollary 3.5: ~0)", "nats"),
    "dynamics/s_centered_std": Metric("population std of S_c", "nats"),
    "dynamics/s_expected_mean": Metric("mean of E_p[S]", "nats"),
    "dynamics/cov_logp_adv": Metric("Cov(log π, A) over the valid tokens (Paper B)", "nats·adv"),
    "dynamics/cov_adv_s_centered": Metric("Cov(A, S_c) over the valid tokens", "nats·adv"),
    "dynamics/pred_dH": Metric("Thm 3.3's first-order batch ΔH: mean of −A·S_c (no lr scale)", "nats·adv"),
    # the surrogate loss (loss.policy_loss; native: mean over minibatches)
    "loss/total": Metric("total policy loss (surrogate + KL-Cov + ref-KL + entropy bonus + EntroPIC's "
                         "adjustment)", "loss", CALL),
    "loss/pg": Metric("policy-gradient surrogate term", "loss", CALL),
    "loss/kl_cov": Metric("KL-Cov penalty term (null unless KL-Cov)", "loss", CALL),
    "loss/kl_ref": Metric("reference-KL penalty term, coefficient included (null without a reference)", "loss", CALL),
    "loss/entropy_bonus": Metric("entropy-bonus term, −coef·H aggregated (null without a bonus)", "loss", CALL),
    "loss/value": Metric("value-head loss (PPO with a critic)", "loss", UPDATE),
    "loss/adv_shift_mean": Metric("mean advantage shift over counted tokens: ψ (entropy_adv) or (λ − 1)·A "
                                   "(steer)", "adv", CALL),
    "loss/weight_adjust": Metric("EntroPIC's term alpha·agg(−r·|A|) over its high-probability tokens", "loss", CALL),
    "loss/counted_frac": Metric("share of a loss call's valid tokens that count in the loss (not dropped by a "
                                "keep-mask; zeroed tokens still count)",
                                "fraction", NATIVE_CALL),
    "loss/zeroed_frac": Metric("share of a loss call's counted tokens zeroed (Clip-Cov; null without "
                               "zeroing)", "fraction", NATIVE_CALL),
    "kl/ref": Metric("KL(π‖π_ref) estimate, aggregated, no coefficient (null without a reference)", "nats", CALL),
    "tokens/counted": Metric("tokens counted in one loss call", "tokens", NATIVE_CALL),
    "clip/ratio_low_frac": Metric("share of counted tokens clipped at 1 − ε_low (A < 0)", "fraction", CALL),
    "clip/ratio_high_frac": Metric("share of counted tokens clipped at 1 + ε_high (A > 0)", "fraction", CALL),
    "clip/ratio_frac": Metric("share of counted tokens clipped at either bound", "fraction", CALL),
    "clip/dual_frac": Metric("share of counted tokens hit by dual-clip (null without dual-clip)", "fraction", CALL),
    "clip/ce_frac": Metric("share of counted tokens outside the clip that CE-GPPO gives a bounded gradient",
                           "fraction", CALL),
    "ratio/mean": Metric("mean importance ratio π/π_old over counted tokens", "ratio", CALL),
    "ratio/max": Metric("largest importance ratio over a loss call's counted tokens (the step's value: the mean of "
                        "those maxima, not their maximum)", "ratio", CALL),
    "ratio/min": Metric("smallest importance ratio over a loss call's counted tokens (the step's value: the mean "
                        "of those minima)", "ratio", CALL),
    "optim/grad_norm": Metric("gradient norm before clipping (null without clipping)", "norm", UPDATE),
    "optim/lr": Metric("learning rate after the step", "lr", UPDATE),
    "policy/approx_kl": Metric(f"k3 estimate of KL(π_old‖π_new) over the {_VALID}, after the update", "nats"),
    # control (methods and autopilot)
    "control/kept_frac": Metric(f"share of the {_VALID} whose loss enters the gradient: not dropped by a "
                                "keep-mask and not zeroed (records.trained_mask)", "fraction"),
    "control/zeroed_frac": Metric(f"share of the {_VALID} zeroed by the method (Clip-Cov)", "fraction"),
    "control/rollout_kept_frac": Metric(f"TRL only: share of the {_VALID} kept by the rollout-level keep-mask, "
                                        "before minibatch selection and zeroing", "fraction"),
    "control/kl_cov_selected_frac": Metric("share of counted tokens KL-Cov penalises (null unless KL-Cov)",
                                           "fraction", CALL),
    "control/knob": Metric("the autopilot's current method knob", "knob"),
    "control/entropy_target": Metric("the autopilot's entropy target at this step", "nats"),
    "control/entropy_smoothed": Metric("the autopilot's smoothed entropy", "nats"),
    "control/entropy_error": Metric("target − smoothed entropy", "nats"),
    "control/integral": Metric("the autopilot's integral term", "nats·steps"),
    "control/saturated": Metric("+1 / -1 when the autopilot's knob pushes entropy up / down as hard as it can "
                                "(at that end of its range or the activity edge, or moved by the whole "
                                "autopilot.max_step); 0 otherwise", "flag"),
    "control/knob_edge": Metric("the knob value where the method stops acting on this batch, the autopilot's "
                                "clamp toward lower entropy (null: no edge, or autopilot.edge_clamp off)", "knob"),
    "control/own_entropy": Metric("a controller method's own measured entropy (adaptive_entropy, entropic, "
                                  "entrocraft; no autopilot)", "nats"),
    "control/own_target": Metric("a controller method's own entropy target at this step (entrocraft: the band's "
                                 "middle)", "nats"),
    "control/own_low": Metric("entrocraft: the band's lower bound at this step", "nats"),
    "control/own_high": Metric("entrocraft: the band's upper bound at this step", "nats"),
    "control/own_output": Metric("a controller method's output: the applied entropy coefficient "
                                 "(adaptive_entropy), alpha (entropic), aepo's sampling temperature, or "
                                 "entrocraft's mode (+1: above the band, RAFT++, correct rollouts only; -1: below "
                                 "it, NSR, wrong ones only; 0: GRPO)", "coef"),
    "control/own_integral": Metric("EntroPIC's integral of the entropy error", "nats·steps"),
    "control/spliced_frac": Metric("aepo: share of the batch's rollouts swapped for ones sampled at the step's "
                                   "temperature (A = 1)", "fraction"),
    "control/weight_selected_frac": Metric("share of counted tokens in EntroPIC's adjustment (p > high_prob)",
                                           "fraction", CALL),
    # probes
    "probe/dH_actual": Metric(f"actual batch-mean entropy change of the step over the {_VALID}", "nats"),
    "probe/dH_pred": Metric("tabular first-order prediction, batch mean (no lr scale)", "nats·adv"),
    "probe/sign_agreement": Metric("share of tokens where sign(pred ΔH) = sign(actual ΔH)", "fraction"),
    "probe/sign_agreement_weighted": Metric("sign agreement weighted by |pred ΔH|", "fraction"),
    "probe/corr": Metric("per-token Pearson correlation of predicted and actual ΔH", "correlation"),
    "probe/batch_sign_agree": Metric("1 when dH_pred and dH_actual have the same sign, else 0", "flag"),
    "probe/dH_jvp": Metric("the network's first-order ΔH along the update (JVP), batch mean", "nats"),
    "probe/jvp_corr": Metric("per-token correlation of the JVP prediction and actual ΔH", "correlation"),
    "probe/jvp_sign_agreement": Metric("share of tokens where the JVP prediction's sign is right", "fraction"),
    "probe/jvp_sign_agreement_weighted": Metric("JVP sign agreement weighted by |prediction|", "fraction"),
    "probe/jvp_rel_err": Metric("‖jvp − actual‖ / ‖actual‖ over tokens", "ratio"),
    "probe/dH_method": Metric("batch-mean ΔH of the method's update (counterfactual steps)", "nats"),
    "probe/dH_vanilla": Metric("batch-mean ΔH of the vanilla update from the same state", "nats"),
    "probe/dH_method_effect": Metric("dH_method − dH_vanilla: the method's own effect", "nats"),
    # evaluation
    "eval/avg@{k}": Metric("mean accuracy over K samples per validation prompt", "fraction", EVAL),
    "eval/pass@{k}": Metric("unbiased Pass@k over the validation prompts (k = 1 and k = K)", "fraction", EVAL),
    "eval/maj@{k}": Metric("majority-vote accuracy over K samples", "fraction", EVAL),
    "eval/distinct_correct": Metric("mean number of distinct correct answers per prompt", "count", EVAL),
    "eval/pass_rate_hist": Metric("prompts with c = 0..K correct samples (a list)", "count", EVAL),
    "eval/entropy": Metric("mean token entropy of the evaluation samples", "nats", EVAL),
    "eval/response_tokens": Metric("mean evaluation response length", "tokens", EVAL),
    "eval/correct_per_question": Metric("per validation prompt, in the run's fixed order, its correct samples out "
                                        "of K (a list; eval/pass_rate_hist is its tally)", "count", EVAL),
    "eval/question_ids": Metric("step 0 only: per validation prompt, in that order, a stable id (12 hex digits of "
                                "the prompt's SHA-256; a list), to pair per-question counts across runs", "id", EVAL),
    "eval/greedy_pass@1": Metric("share of the validation prompts whose greedy (argmax) response is correct "
                                 "(eval.greedy)", "fraction", EVAL),
    "eval/greedy_correct_per_question": Metric("per validation prompt, in order, 1 when its greedy response is "
                                               "correct (a list; eval.greedy)", "count", EVAL),
    # the same evaluation at eval.extra_temperature = {t} (eval_prefix): its own prefix, the same figures
    "eval_t{t}/avg@{k}": Metric("as eval/avg@{k}, sampled at T = {t}", "fraction", EVAL),
    "eval_t{t}/pass@{k}": Metric("as eval/pass@{k}, sampled at T = {t}", "fraction", EVAL),
    "eval_t{t}/maj@{k}": Metric("as eval/maj@{k}, sampled at T = {t}", "fraction", EVAL),
    "eval_t{t}/distinct_correct": Metric("as eval/distinct_correct, sampled at T = {t}", "count", EVAL),
    "eval_t{t}/pass_rate_hist": Metric("as eval/pass_rate_hist, sampled at T = {t} (a list)", "count", EVAL),
    "eval_t{t}/entropy": Metric("as eval/entropy, sampled at T = {t}", "nats", EVAL),
    "eval_t{t}/response_tokens": Metric("as eval/response_tokens, sampled at T = {t}", "tokens", EVAL),
    "eval_t{t}/correct_per_question": Metric("as eval/correct_per_question, sampled at T = {t} (a list)", "count",
                                             EVAL),
    # lens (Wang et al. 2026): D = the tokens the method dropped or zeroed; lens_ppo: those PPO's clip dropped
    "lens/drop_frac": Metric(f"|D| / N over the N {_VALID}", "fraction"),
    "lens/drop_frac/{q}": Metric("|D ∩ quadrant| / N (they sum to lens/drop_frac)", "fraction"),
    "lens/drop_rate/{q}": Metric("|D ∩ quadrant| / |quadrant| (null when empty)", "fraction"),
    "lens/dH_dropped": Metric("first-order ΔH (Σ −w·A·S_c) of the dropped tokens", "nats·adv"),
    "lens/dH_dropped/{q}": Metric("first-order ΔH of the dropped tokens in a quadrant", "nats·adv"),
    "lens/dH_kept": Metric("first-order ΔH of the kept tokens", "nats·adv"),
    "lens/dH_total": Metric("first-order ΔH of all valid tokens", "nats·adv"),
    "lens_ppo/drop_frac": Metric("as lens/drop_frac, D = tokens PPO's ratio clip left out after the update",
                                 "fraction"),
    "lens_ppo/drop_frac/{q}": Metric("as lens/drop_frac/{q}, for PPO's clip", "fraction"),
    "lens_ppo/drop_rate/{q}": Metric("as lens/drop_rate/{q}, for PPO's clip", "fraction"),
    "lens_ppo/dH_dropped": Metric("as lens/dH_dropped, for PPO's clip", "nats·adv"),
    "lens_ppo/dH_dropped/{q}": Metric("as lens/dH_dropped/{q}, for PPO's clip", "nats·adv"),
    "lens_ppo/dH_kept": Metric("as lens/dH_kept, for PPO's clip", "nats·adv"),
    "lens_ppo/dH_total": Metric("as lens/dH_total, for PPO's clip", "nats·adv"),
    # weight lens: g = −∂L/∂log π per token (method's loss vs vanilla's), ΔH_t = −g·S_c (Theorem 3.3)
    "lensw/dH_vanilla": Metric("first-order ΔH Σ −g·S_c of the vanilla loss's token weights (end-point ratios)",
                               "nats·adv"),
    "lensw/dH_method": Metric("first-order ΔH Σ −g·S_c of the method's token weights", "nats·adv"),
    "lensw/dH_change": Metric("dH_method − dH_vanilla: the method's change in token weights", "nats·adv"),
    "lensw/dH_change/{q}": Metric("the change's first-order ΔH in a quadrant (they sum to lensw/dH_change)",
                                  "nats·adv"),
    "lensw/removed_rate/{q}": Metric("share of a quadrant's tokens whose gradient the method removed", "fraction"),
    "lensw/added_rate/{q}": Metric("share of a quadrant's tokens given a gradient vanilla has not", "fraction"),
    "lensw/reweighted_rate/{q}": Metric("share of a quadrant's tokens whose weight the method changed",
                                        "fraction"),
    # time and throughput (volatile)
    "time/generate": Metric("rollout time", "s"),
    "time/forward": Metric("scoring, old-policy forward, reference, advantages and selection time", "s"),
    "time/counterfactual": Metric("pre-update probes: JVP snapshot and vanilla counterfactual (~0 when not due)", "s"),
    "time/backward": Metric("update (loss, backward, optimizer) time", "s"),
    "time/probe": Metric("probe time", "s"),
    "time/eval": Metric("evaluation time (steps with an evaluation)", "s"),
    "time/step": Metric("wall time of the whole step", "s"),
    "perf/tokens_per_s": Metric("response tokens per second of the step (before eval)", "tokens/s"),
    "perf/peak_memory_gb": Metric("the process's peak memory so far: the CUDA allocator's peak reservation on a GPU "
                                  "(the CUDA context not in it), the peak resident set on a CPU", "GiB"),
}

_FILL = {"k": r"[0-9]+", "q": "(?:" + "|".join(QUADRANTS) + ")", "t": r"[0-9]+(?:\.[0-9]+)?(?:e[-+][0-9]+)?"}


def eval_prefix(temperature: float) -> str:
    """The prefix of the evaluation at ``eval.extra_temperature``: ``eval_t`` and the temperature in Python's
    shortest ``g`` form, then ``/`` (``eval_t0.7/``, ``eval_t1/``); ``{t}`` of the table's patterns."""
    return f"eval_t{temperature:g}/"


def _pattern(name: str) -> re.Pattern[str]:
    parts = re.split(r"\{(\w+)\}", name)
    return re.compile("".join(re.escape(p) if i % 2 == 0 else _FILL[p] for i, p in enumerate(parts)) + r"\Z")


_PATTERNS = {name: _pattern(name) for name in METRICS if "{" in name}


def lookup(key: str) -> str | None:
    """The table entry (a name or a pattern) that ``key`` is, or None when it is not a metric."""
    if key in METRICS:
        return key
    return next((name for name, rx in _PATTERNS.items() if rx.match(key)), None)


def is_known(key: str) -> bool:
    return lookup(key) is not None


def mean_defined(values: Iterable[float | None]) -> float | None:
    """A metric's value over what the engine measured (a step's loss calls, its updates): the mean of the defined
    values (None: undefined, left out), summed in their order; None when none is. The one aggregation every engine's
    row uses (native ``training.stages.mean_rows``, TRL's ``integrations.window.StepMetrics``)."""
    vals = [float(v) for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


def names_per(per: str) -> frozenset[str]:
    """The table's names whose value is made ``per`` (a key of ``PER``; another is a ``KeyError``)."""
    if per not in PER:
        raise KeyError(f"{per!r} is not an aggregation of the metric table (one of: {', '.join(PER)})")
    return frozenset(name for name, m in METRICS.items() if m.per == per)


def glossary_markdown() -> str:
    """docs/metrics.md's metric glossary: one table row per entry, in the table's order; then what each value of
    its aggregation column means."""
    rows = ["| metric | meaning | unit | per |", "|---|---|---|---|"]
    rows += [f"| `{name}` | {m.meaning} | {m.unit} | {m.per} |" for name, m in METRICS.items()]
    rows += ["", "The column *per* says how a row's value is made:", ""]
    rows += [f"- *{per}*: {words}" for per, words in PER.items()]
    return "\n".join(rows) + "\n"
