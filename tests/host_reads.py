"""Helpers for the tests of where tensor values reach the host (issue 66): a counter of the reads and the loss
metrics read tensor by tensor, as before one transfer read them all (the reference values)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from entropy_rft.core.loss_types import LossOutputs


class Reads:
    """Counts the ways a tensor's value reaches the host (``.item()``, ``.tolist()``, ``float()``, ``int()``,
    ``bool()``, ``.cpu()``, ``.numpy()``) while ``on``: ``calls`` lists (way, file name of the caller)."""

    WAYS = ("item", "tolist", "__float__", "__int__", "__bool__", "cpu", "numpy")

    def __init__(self, monkeypatch) -> None:
        self.on = False
        self.calls: list[tuple[str, str]] = []
        for name in self.WAYS:
            monkeypatch.setattr(torch.Tensor, name, self._wrap(name, getattr(torch.Tensor, name)))

    def _wrap(self, name, orig):
        def read(t, *args, **kwargs):
            if self.on:
                self.calls.append((name, Path(sys._getframe(1).f_code.co_filename).name))
            return orig(t, *args, **kwargs)
        return read

    def made_in(self, *files: str) -> list[str]:
        """The reads made by code in ``files``, in order."""
        return [way for way, f in self.calls if f in files]


def per_tensor_metrics(o: LossOutputs) -> dict[str, float | None]:
    """``LossOutputs``' metrics read as before issue 66: each tensor turned into a number on its own."""
    m, c, mk = o.counted, o.clipped, o.masks
    n = int(m.sum())

    def val(x):
        return None if x is None or n == 0 else float(x)

    def frac(x):
        return float((x & m).sum()) / n if n else None

    rm = o.ratio[m]
    n_valid = int(o.valid.sum())
    out = {k: val(v) for k, v in o.terms.items()}
    out.update({
        "clip/ratio_low_frac": frac(c.low), "clip/ratio_high_frac": frac(c.high),
        "clip/ratio_frac": frac(c.low | c.high), "clip/dual_frac": frac(c.dual) if c.dual is not None else None,
        "ratio/mean": float(rm.to(torch.float64).mean()) if n else None,
        "ratio/max": float(rm.max()) if n else None, "ratio/min": float(rm.min()) if n else None,
        "loss/counted_frac": n / n_valid if n_valid else None,
        "loss/zeroed_frac": frac(mk.zeroed) if mk.zeroed is not None else None,
        "control/kl_cov_selected_frac": frac(mk.kl_cov_select) if mk.kl_cov_select is not None else None,
        "tokens/counted": float(n),
    })
    if mk.adv_shift is not None:
        out["loss/adv_shift_mean"] = float(mk.adv_shift.detach().to(torch.float64)[m].mean()) if n else None
    if o.ce is not None:
        out["clip/ce_frac"] = frac(o.ce)
    if mk.weight_select is not None:
        out["loss/weight_adjust"] = val(o.weight_adjust)
        out["control/weight_selected_frac"] = frac(mk.weight_select)
    return out
