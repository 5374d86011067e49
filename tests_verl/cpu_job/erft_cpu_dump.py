"""Test harness only: records, on every rank, what the erft worker's ``update_actor`` selected from. Loaded
after ``entropy_rft.integrations.verl`` through ``VERL_USE_EXTERNAL_MODULES`` when ``ERFT_CPU_DUMP`` names a
folder; wraps the plug-in's ``add_rollout_keep`` (the worker calls it by its module name) and saves this rank's
statistics, advantages, response mask and keep mask in the padded response layout, one file per call."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import torch

import entropy_rft.integrations.verl as ev

_CALLS = itertools.count()
_ORIGINAL = ev.add_rollout_keep


def _recording_add_rollout_keep(method, data) -> None:
    _ORIGINAL(method, data)
    folder = Path(os.environ["ERFT_CPU_DUMP"])
    folder.mkdir(parents=True, exist_ok=True)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    record = {f: ev._response_layout(data[ev.PREFIX + f], data).detach().clone() for f in ev.STATS_FIELDS}
    record["advantages"] = ev._response_layout(data["advantages"], data).detach().clone()
    record["response_mask"] = ev._response_layout(data["response_mask"], data).bool().clone()
    record["keep"] = data["erft_keep"].bool().clone()
    torch.save(record, folder / f"call{next(_CALLS)}_rank{rank}.pt")


if os.environ.get("ERFT_CPU_DUMP"):
    ev.add_rollout_keep = _recording_add_rollout_keep
