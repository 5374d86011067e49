"""One metric table: every key either engine writes to metrics.jsonl is in ``entropy_rft.common.metric_names`` (one
name, one meaning), every entry is written by some run, and docs/metrics.md's glossary is the table."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from entropy_rft.common import metric_names
from entropy_rft.config.loading import load_config
from entropy_rft.launch.run import start
from micro import make_micro_policy, micro_overrides

ROOT = Path(__file__).resolve().parents[1]
PROBES = {"probe.jvp_every": 2, "probe.counterfactual_every": 2, "eval.every": 2, "train.max_steps": 3,
          "train.tensorboard": "false", "train.samples_every": 0, "probe.records_every": 0}
NATIVE = {
    "autopilot": {"method.name": "clip_v", "method.entropy_target": "0.8x"},
    # issue 74: the evaluation at a second temperature and greedy pass@1
    "ppo_clip_cov": {"method.name": "clip_cov", "algo.algorithm": "ppo", "algo.ref_kl_coef": 0.01,
                     "eval.extra_temperature": 0.7, "eval.greedy": "true"},
    # issue 28: a method's own controller and EntroPIC's terms; advantage shaping; CE-GPPO (two minibatches)
    "entropic": {"method.name": "entropic", "method.params": "{high_prob: 0.2}", "probe.jvp_every": 0,
                 "eval.every": 0},
    "entropy_adv": {"method.name": "entropy_adv", "probe.jvp_every": 0, "eval.every": 0,
                    "probe.counterfactual_every": 0},
    "ce_gppo": {"method.name": "ce_gppo", "algo.minibatches": 2, "probe.jvp_every": 0, "eval.every": 0,
                "probe.counterfactual_every": 0},
    # issue 39: Entrocraft's band and mode
    "entrocraft": {"method.name": "entrocraft", "probe.jvp_every": 0, "eval.every": 0,
                   "probe.counterfactual_every": 0, "train.max_steps": 2},
    "aepo": {"method.name": "aepo", "method.params": "{prompt_frac: 1.0}", "probe.jvp_every": 0, "eval.every": 0,
             "probe.counterfactual_every": 0, "train.max_steps": 2},
}


def rows_of(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def micro_model(tmp_path_factory) -> Path:
    return make_micro_policy(tmp_path_factory.mktemp("micro") / "policy")


@pytest.fixture(scope="module")
def native_rows(micro_model, tmp_path_factory) -> dict[str, list[dict]]:
    out = {}
    for name, sets in NATIVE.items():
        run = tmp_path_factory.mktemp("native") / name
        start(load_config(None, micro_overrides(micro_model, **{**PROBES, **sets})), run)
        out[name] = rows_of(run)
    return out


@pytest.fixture(scope="module")
def trl_rows(micro_model, tmp_path_factory) -> list[dict]:
    sets = micro_overrides(micro_model, **{"eval.every": 0, "train.tensorboard": "false", "train.max_steps": 2,
                                          "train.checkpoint_every": 2})
    cfg = load_config(None, sets, extra={"engine": "trl", "method": {
        "name": "clip_cov", "params": {"ratio": 0.1, "lb": -5.0, "ub": 5.0}}})
    run = tmp_path_factory.mktemp("trl") / "run"
    start(cfg, run)
    return rows_of(run)


def keys(rows: list[dict]) -> set[str]:
    return set().union(*(r.keys() for r in rows))


def test_every_native_key_is_in_the_table(native_rows):
    written = set().union(*(keys(r) for r in native_rows.values()))
    assert not sorted(k for k in written if not metric_names.is_known(k))
    # probes, eval, the autopilot and PPO's value loss were all due at least once
    for k in ("probe/jvp_corr", "probe/dH_method_effect", "eval/pass@4", "control/knob", "loss/value",
              "lens_ppo/drop_rate/zero", "loss/counted_frac", "eval_t0.7/pass@4", "eval/greedy_pass@1"):
        assert k in written, k


def test_every_trl_key_is_in_the_table_without_an_alias(native_rows, trl_rows):
    written = keys(trl_rows)
    assert not sorted(k for k in written if not metric_names.is_known(k))
    native = set().union(*(keys(r) for r in native_rows.values()))
    # the one TRL-only name is a distinct figure (the rollout-level keep-mask alone), not a native one renamed
    assert written - native <= {"control/rollout_kept_frac"}
    assert {"control/kept_frac", "control/zeroed_frac", "loss/total", "entropy/mean"} <= written


def test_every_table_entry_is_written_by_some_engine(native_rows, trl_rows):
    written = set().union(*(keys(r) for r in native_rows.values())) | keys(trl_rows)
    used = {metric_names.lookup(k) for k in written}
    assert not sorted(set(metric_names.METRICS) - used)


def test_kept_frac_is_the_share_that_trains(native_rows):
    """control/kept_frac excludes Clip-Cov's zeroed tokens; loss/counted_frac (no keep-mask here) does not."""
    rows = [r for r in native_rows["ppo_clip_cov"] if r.get("control/zeroed_frac")]
    assert rows
    for r in rows:
        assert r["control/kept_frac"] == pytest.approx(1.0 - r["control/zeroed_frac"])
        assert r["loss/counted_frac"] == 1.0


def test_table_entries_are_well_formed():
    from entropy_rft.control.lens import QUADRANTS

    assert metric_names.QUADRANTS == QUADRANTS
    for name, m in metric_names.METRICS.items():
        assert m.meaning and m.unit, name
        assert metric_names.lookup(name.replace("{k}", "8").replace("{q}", "zero").replace("{t}", "0.7")) == name
    assert metric_names.lookup("eval/pass@16") == "eval/pass@{k}"
    for t in (0.7, 1.0, 1.25, 1e-5):  # the prefix the trainer writes is the pattern's
        assert metric_names.lookup(metric_names.eval_prefix(t) + "pass@8") == "eval_t{t}/pass@{k}", t
    assert metric_names.eval_prefix(1.0) == "eval_t1/" and metric_names.eval_prefix(0.7) == "eval_t0.7/"
    assert not metric_names.is_known("eval_t/pass@8") and not metric_names.is_known("eval_tx/pass@8")
    assert not metric_names.is_known("lens/drop_frac/sideways") and not metric_names.is_known("eval/pass@")
    assert math.isfinite(len(metric_names.glossary_markdown()))


def test_docs_glossary_is_the_table():
    text = (ROOT / "docs" / "metrics.md").read_text()
    begin, end = "<!-- metrics:begin -->\n", "<!-- metrics:end -->"
    assert text.count(begin) == 1 and text.count(end) == 1
    section = text[text.index(begin) + len(begin): text.index(end)]
    assert section == metric_names.glossary_markdown()


def test_the_aggregation_column_names_what_a_loss_call_writes():
    """A loss call with every term on (dual clip, Clip-Cov's zeroes, KL-Cov's selection, an advantage shift,
    EntroPIC's weights, CE-GPPO's β, the reference KL and the entropy bonus) writes exactly the names the table
    declares per loss call, so the column, not a list in an engine, says which keys a step's row averages."""
    import torch

    from entropy_rft.core.loss import compute_policy_loss
    from entropy_rft.core.loss_types import LossInputs, LossSettings, Masks

    g = torch.Generator().manual_seed(0)
    shape = (4, 6)
    logp = -torch.rand(shape, generator=g) - 0.1
    old = logp + 0.3 * torch.randn(shape, generator=g)
    adv = torch.randn(shape, generator=g)
    mask = torch.ones(shape, dtype=torch.bool)
    pick = torch.rand(shape, generator=g) > 0.5
    masks = Masks(keep=torch.ones(shape, dtype=torch.bool), zeroed=pick, kl_cov_select=~pick,
                  adv_shift=0.1 * torch.ones(shape), weight_select=pick)
    inputs = LossInputs(logp, old, adv, mask, masks, old - 0.05, torch.rand(shape, generator=g))
    settings = LossSettings(dual_clip=3.0, kl_cov_coef=0.1, ref_kl_coef=0.05, entropy_coef=0.01, ce_beta_low=0.5,
                            ce_beta_high=0.5, weight_alpha=0.1)
    written = set(compute_policy_loss(inputs, settings).metrics())
    declared = metric_names.names_per(metric_names.CALL) | metric_names.names_per(metric_names.NATIVE_CALL)
    assert written == declared, (sorted(written - declared), sorted(declared - written))
    with pytest.raises(KeyError, match="one of: step, loss call"):
        metric_names.names_per("minibatch")


def test_trl_rows_leave_out_the_per_call_counts_only_the_native_engine_logs(native_rows, trl_rows):
    native_only = metric_names.names_per(metric_names.NATIVE_CALL)
    assert native_only <= set().union(*(keys(r) for r in native_rows.values()))
    assert not native_only & keys(trl_rows)
    assert {"loss/total", "ratio/max"} <= keys(trl_rows) & metric_names.names_per(metric_names.CALL)


def test_a_native_row_takes_each_key_from_one_source():
    """The native engine's row is the union of its parts (update, batch, probes, controller, lens) in their order;
    a key two parts write is refused naming both, instead of the later part silently winning."""
    from entropy_rft.training.step_log import one_source

    row = one_source({"step": {"step": 3}, "update": {"loss/total": 1.0}, "batch": {"reward/mean": 0.5}})
    assert list(row.items()) == [("step", 3), ("loss/total", 1.0), ("reward/mean", 0.5)]
    with pytest.raises(RuntimeError, match="'control/kept_frac' is written by both the update and the batch part"):
        one_source({"update": {"control/kept_frac": 0.9}, "batch": {"control/kept_frac": 1.0}})


# Metric-shaped literals of the engines that are not metrics of a row, each with why.
NOT_ROW_KEYS = {"probe/rel_err": "agreement_metrics' own key, which the probe deletes before the row (its JVP form "
                                 "is probe/jvp_rel_err)"}


def test_every_metric_name_an_engine_spells_is_in_the_table():
    """Statically, beside the runs above: every string an engine's module (core, control, training, integrations,
    launch) spells in the shape of a metric name (a table prefix, a slash, a name) is a table entry, a prefix it
    builds names from (ending in / or _), or named in NOT_ROW_KEYS; so a name added on a path no test trains is
    still caught."""
    import ast
    import re

    prefixes = sorted({k.split("/")[0] for k in metric_names.METRICS if "/" in k and "{" not in k.split("/")[0]})
    shaped = re.compile("^(" + "|".join(map(re.escape, prefixes)) + r")/[A-Za-z0-9_@{}.\-/]*$")
    unknown = set()
    for layer in ("core", "control", "training", "integrations", "launch"):
        for path in sorted((ROOT / "src" / "entropy_rft" / layer).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                text = node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else ""
                if shaped.match(text) and not text.endswith(("/", "_")) and not metric_names.is_known(text):
                    unknown.add(f"{path.relative_to(ROOT)}: {text}")
    assert sorted(unknown) == sorted(f"src/entropy_rft/training/probe.py: {k}" for k in NOT_ROW_KEYS)


def test_both_engines_take_a_steps_mean_the_same_way():
    """One aggregation for every engine's row: the defined values' mean, summed in their order (None left out).
    On nine values whose sum depends on the order of the additions (numpy's pairwise sum, which the native engine
    used before, gives another float), the native row and TRL's step row give the same float, the in-order one."""
    import numpy as np

    from entropy_rft.integrations.window import StepMetrics
    from entropy_rft.training.stages import mean_rows

    values = [1e16, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, -1e16, None]
    in_order = 0.0
    for v in values[:-1]:
        in_order += v
    want = in_order / 9
    assert want != float(np.mean(values[:-1]))  # the case tells the two apart
    assert metric_names.mean_defined(values) == want and metric_names.mean_defined([None]) is None
    assert mean_rows([{"loss/pg": v} for v in values])["loss/pg"] == want
    trl = StepMetrics()
    for v in values:
        trl.add({"loss/pg": v})
    assert trl.pop()["loss/pg"] == want
