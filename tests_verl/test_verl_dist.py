"""Two CPU processes (gloo) through the verl integration's distributed paths: ``rollout_keep`` (ClipV with its
cap, ClipB) and the minibatch selection of Clip-Cov and KL-Cov exchange only sums, counts and top-k candidates
(``integrations.dist_select``) and equal the single-process selection on the concatenated batch, ties
included (the coarse-grid batch of tests/test_dist_select.py)."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank: int, port: int) -> None:
    import torch.distributed as dist

    from entropy_rft import control
    from entropy_rft.core.loss import ppo_clipped_mask
    from entropy_rft.integrations import verl as ev
    from test_dist_select import WIDTHS, synthetic

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        st, adv, mask, old, slices = synthetic(7)
        sl = slice(slices[2 * rank].start, slices[2 * rank + 1].stop)  # ranks 0-1 and 2-3 of the 4-rank batch
        w = max(WIDTHS[2 * rank : 2 * rank + 2])
        stats = {f: getattr(st, f)[sl, :w] for f in ev.STATS_FIELDS}
        for name, params in (("clip_v", {"mu": 0.2, "max_frac": 0.04, "advantage_sign": "any"}),
                             ("clip_b_paper", {"mu_low": 0.8, "mu_high": 0.6})):
            m = control.build_method(name, **params)
            want = m.rollout_masks(st, adv, mask).keep & mask
            assert torch.equal(ev.rollout_keep(m, stats, adv[sl], mask[sl, :w]), want[sl, :w]), (rank, name)
        kw = {"eps_low": 0.2, "eps_high": 0.2}
        for name, params in (("clip_cov", {"ratio": 0.1, "lb": -0.5, "ub": 2.0}), ("kl_cov", {"ratio": 0.1})):
            m = control.build_method(name, **params)
            got = ev._minibatch_selection(m, st.logp[sl, :w], old[sl, :w], adv[sl], mask[sl, :w], None, kw,
                                          torch.Generator().manual_seed(5), {"dp_size": WORLD})
            clipped = ppo_clipped_mask(st.logp, old, adv, mask, 0.2, 0.2)
            want = m.minibatch_masks(st.logp, old, adv, mask, clipped=clipped,
                                     generator=torch.Generator().manual_seed(5))
            field = "zeroed" if name == "clip_cov" else "kl_cov_select"
            assert torch.equal(getattr(got.masks, field), getattr(want, field)[sl, :w]), (rank, name)
    finally:
        dist.destroy_process_group()


def test_two_process_verl_selections_equal_single_process():
    mp.spawn(worker, args=(_free_port(),), nprocs=WORLD, join=True)
