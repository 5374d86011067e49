"""Issue 26 item 4: Pearson r and sign agreement have one home, ``core.correlation``, used by the trainer's
probes, ``erft probe``, the report's scatter and the steps of a run. Hand-computed cases, and the rule of
which pairs count (both finite and non-zero, at least 3 for r) checked through every caller."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from entropy_rft.analysis.agreement import run_agreement
from entropy_rft.core.correlation import agreement, paired, pearson
from entropy_rft.rundir.files import has_metrics, is_run_dir, write_status
from entropy_rft.training.probe import agreement_metrics, probe_metrics

# x = 1, 2, 3; y = 2, 4, 7: means 2 and 13/3; Σdx·dy = (-1)(-7/3) + 0 + (1)(8/3) = 5; Σdx² = 2;
# Σdy² = 49/9 + 1/9 + 64/9 = 114/9; r = 5 / sqrt(2 · 114/9) = 15 / sqrt(228).
R_123 = 15 / math.sqrt(228)


def test_pearson_by_hand():
    x, y = paired([1, 2, 3], [2, 4, 7])
    assert x.dtype == torch.float64
    assert pearson(x, y) == pytest.approx(R_123, rel=1e-12)
    assert pearson(*paired([1, 2], [2, 4])) is None  # two points always lie on a line
    assert pearson(*paired([1, 1, 1], [2, 4, 7])) is None  # a constant side
    assert pearson(*paired([], [])) is None


def test_the_pairs_that_count_are_finite_and_non_zero():
    # The zero, NaN and inf pairs drop out; what is left is the hand-computed case above.
    ag = agreement([1, 2, 0, 3, math.nan, 5, math.inf], [2, 4, 9, 7, 1, 0, 1])
    assert ag.n == 3 and ag.corr == pytest.approx(R_123, rel=1e-12) and ag.sign == 1.0
    # Signs: pairs (1, .5), (-2, -1), (3, -1) (the zero pair is left out): two of three agree; weighted by
    # |pred|: (1 + 2) / (1 + 2 + 3).
    ag = agreement([1.0, -2.0, 0.0, 3.0], [0.5, -1.0, 4.0, -1.0])
    assert (ag.n, ag.sign, ag.sign_weighted) == (3, pytest.approx(2 / 3), pytest.approx(0.5))
    none = agreement([0.0, 1.0], [1.0, 0.0])
    assert (none.n, none.corr, none.sign, none.sign_weighted) == (0, None, None, None)
    with pytest.raises(ValueError, match="same number"):
        agreement([1.0, 2.0], [1.0])


def test_tensors_arrays_and_lists_give_the_same_bits():
    rng = np.random.default_rng(0)
    p = rng.normal(size=50)
    a = 0.5 * p + rng.normal(size=50)
    p[:5] = 0.0
    ref = agreement(torch.tensor(p, dtype=torch.float64), torch.tensor(a, dtype=torch.float64))
    assert agreement(p, a) == ref == agreement(list(p), list(a))
    pairs = [(x, y) for x, y in zip(p, a) if x != 0 and y != 0]
    mx, my = sum(x for x, _ in pairs) / 45, sum(y for _, y in pairs) / 45
    cov = sum((x - mx) * (y - my) for x, y in pairs)
    vx, vy = sum((x - mx) ** 2 for x, _ in pairs), sum((y - my) ** 2 for _, y in pairs)
    assert ref.n == 45 and ref.corr == pytest.approx(cov / math.sqrt(vx * vy), abs=1e-12)
    assert ref.sign == pytest.approx(sum((x > 0) == (y > 0) for x, y in pairs) / 45)


def test_the_trainer_probe_counts_the_same_pairs():
    # valid tokens: the masked-out one (pred 9) is not looked at; of the rest, the zero pair drops out.
    pred = torch.tensor([[1.0, 2.0, 0.0, 3.0, 9.0]])
    actual = torch.tensor([[2.0, 4.0, 5.0, 7.0, -1.0]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    m = agreement_metrics(pred, actual, mask, "x/")
    assert m["x/corr"] == pytest.approx(R_123, rel=1e-12) and m["x/sign_agreement"] == 1.0
    assert m["x/sign_agreement_weighted"] == 1.0
    # rel_err over all valid tokens: ‖(-1, -2, -5, -4)‖ / ‖(2, 4, 5, 7)‖ = sqrt(46) / sqrt(94)
    assert m["x/rel_err"] == pytest.approx(math.sqrt(46 / 94), rel=1e-12)
    two = probe_metrics(pred[:, :2], actual[:, :2], mask[:, :2])
    assert two["probe/corr"] is None and two["probe/sign_agreement"] == 1.0  # two tokens: no r


def test_steps_of_a_run_leave_out_a_zero_prediction_from_r_too():
    # Step 4 predicts exactly 0 (say all advantages were zero): it counts neither for the sign nor for r, so r
    # is the hand-computed one of the other three steps (with step 4 it would be 0.36...).
    rows = [{"step": s, "dynamics/pred_dH": p, "probe/dH_actual": a, "dynamics/cov_logp_adv": -p,
             "dynamics/cov_adv_s_centered": -p}
            for s, (p, a) in enumerate(zip([1.0, 2.0, 3.0, 0.0], [2.0, 4.0, 7.0, -9.0]), 1)]
    out = run_agreement(rows)
    assert out["dH_agree/a_sc_r"] == pytest.approx(R_123, rel=1e-12)
    assert out["dH_agree/a_sc_sign"] == 1.0 and out["dH_agree/cov_r"] == pytest.approx(R_123, rel=1e-12)
    assert out["dH_agree/steps"] == 4  # steps that logged both numbers


def test_has_metrics_and_is_run_dir_say_different_things(tmp_path):
    rows_only = tmp_path / "copied"
    rows_only.mkdir()
    (rows_only / "metrics.jsonl").write_text("")
    assert has_metrics(rows_only) and not is_run_dir(rows_only)  # readable rows, no erft marker
    marked = tmp_path / "fresh"
    marked.mkdir()
    write_status(marked, "running")
    assert is_run_dir(marked) and not has_metrics(marked)  # erft's run that has not logged yet
    assert not has_metrics(tmp_path / "missing") and not has_metrics(rows_only / "metrics.jsonl")
