"""Four CPU processes (gloo): the selections that exchange only sums, counts and top-k candidates
(``integrations.dist_select``) equal the single-process selections on the concatenated batch, ties included,
and the bytes each rank puts into the collectives no longer grow with the number of tokens.

The batch is built on a coarse grid (values k/2, advantages in {-1, -0.5, 0, 0.5, 1}), so equal scores are
frequent, fall on several ranks, and the k-th selected score is tied with unselected ones on other ranks
(asserted, for ClipV's cap and KL-Cov's top-k): a wrong tie-break (by rank, or by local position) fails.
Ranks hold uneven row counts and padded widths.
"""

from __future__ import annotations

import dataclasses
import socket
import traceback

import torch
import torch.multiprocessing as mp

WORLD = 4
ROWS = [3, 5, 2, 6]  # rows per rank
WIDTHS = [5, 8, 4, 7]  # each rank's padded response width


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def synthetic(seed: int, scale: int = 1, spread: bool = True):
    """The whole batch ([N, 8], N = scale·16), each rank's rows and width, and the old log-probs. ``spread``:
    rank 3's S is 3× the others' (its extremes are then all on rank 3)."""
    from entropy_rft.core.dynamics import TokenStats

    g = torch.Generator().manual_seed(seed)
    rows = [r * scale for r in ROWS]
    n, w = sum(rows), max(WIDTHS)
    mask = torch.rand(n, w, generator=g) < 0.85
    slices, start = [], 0
    for r, width in zip(rows, WIDTHS):
        mask[start : start + r, width:] = False
        slices.append(slice(start, start + r))
        start += r

    def grid(lo: int, hi: int) -> torch.Tensor:
        return torch.randint(lo, hi, (n, w), generator=g).float() / 2

    fields = {"entropy": grid(0, 8), "logp": -grid(0, 6), "s_star": grid(-6, 7), "s_expected": grid(-2, 3)}
    if spread:  # the ranks' statistics differ: per-rank thresholds would differ
        fields["s_star"][slices[3]] *= 3.0
    fields["s_centered"] = fields["s_star"] - fields["s_expected"]
    adv = torch.randint(-2, 3, (n,), generator=g).float() / 2
    old = fields["logp"] + grid(-1, 2) / 10
    return TokenStats(**fields), adv, mask, old, slices


def _local(st, sl, w):
    from entropy_rft.core.dynamics import TokenStats

    return TokenStats(**{f: getattr(st, f)[sl, :w] for f in ("entropy", "logp", "s_star", "s_expected",
                                                              "s_centered")})


class ByteCounter:
    """Counts the bytes this rank puts into all_gather / all_reduce (its input tensor's size)."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.dist, self.sent = dist, 0
        self.orig = dist.all_gather, dist.all_reduce

        def all_gather(parts, x, *a, **k):
            self.sent += x.numel() * x.element_size()
            return self.orig[0](parts, x, *a, **k)

        def all_reduce(x, *a, **k):
            self.sent += x.numel() * x.element_size()
            return self.orig[1](x, *a, **k)

        dist.all_gather, dist.all_reduce = all_gather, all_reduce

    def take(self) -> int:
        out, self.sent = self.sent, 0
        return out

    def close(self) -> None:
        self.dist.all_gather, self.dist.all_reduce = self.orig


def _tied_across_ranks(score: torch.Tensor, chosen: torch.Tensor, among: torch.Tensor, slices) -> bool:
    """Whether the smallest chosen score is shared by a chosen candidate and a left-out one on different
    ranks (so a tie-break by rank, or by each rank's own position, would choose differently)."""
    if not chosen.any() or not (among & ~chosen).any():
        return False
    rank_of = torch.zeros(score.shape[0], dtype=torch.long)
    for r, sl in enumerate(slices):
        rank_of[sl] = r
    at_cut = score == score[chosen].min()
    ranks_in = set(rank_of[(chosen & at_cut).nonzero()[:, 0]].tolist())
    ranks_out = set(rank_of[(among & ~chosen & at_cut).nonzero()[:, 0]].tolist())
    return any(a != b for a in ranks_in for b in ranks_out)


def check_selections(rank: int) -> list[bool]:
    from entropy_rft import control
    from entropy_rft.control._common import token_covariance
    from entropy_rft.core.loss import ppo_clipped_mask
    from entropy_rft.integrations import window

    st, adv, mask, old, slices = synthetic(7)
    sl, w = slices[rank], WIDTHS[rank]
    ties = []
    flat = synthetic(7, spread=False)[0]  # S_c's extremes on several ranks: the cap's cut crosses ranks
    for name, params, spread in (
            ("clip_b", {"mu": 0.5, "advantage_sign": "negative"}, True),
            ("clip_b_paper", {"mu_low": 0.8, "mu_high": 0.6}, True),
            ("clip_v", {"mu": 0.2, "max_frac": 0.04, "advantage_sign": "any"}, True),
            ("clip_v", {"mu": 0.2, "max_frac": 0.04, "advantage_sign": "any"}, False),
            ("clip_v_paper", {"mu_low": 0.3, "mu_high": 0.3, "max_frac": 0.04}, False),
            ("clip_v_paper", {"mu_low": 0.3, "mu_high": None}, True),
            ("grad_mask", {}, True), ("entropy_adv", {}, True), ("entropic", {}, True), ("steer", {}, True),
            ("steer", {"mapping": "linear"}, True),
            ("high_entropy", {"top_q": 0.3}, True)):
        st = synthetic(7)[0] if spread else flat
        m = control.build_method(name, **params)
        gb = window.global_rollout_batch(m, _local(st, sl, w), adv[sl], mask[sl, :w])
        whole = m.rollout_masks(st, adv, mask)
        for f in dataclasses.fields(whole):
            got, want = getattr(gb.masks, f.name), getattr(whole, f.name)
            assert (got is None) == (want is None), (rank, name, f.name)
            if want is not None:
                assert got.shape == (ROWS[rank], w) and torch.equal(got, want[sl, :w]), (rank, name, f.name)
        want = whole.keep
        if name.startswith("clip_v") and params.get("max_frac") and not spread:
            s, low, high = st.s_centered.double(), params.get("mu_low", params.get("mu")), params.get("mu_high")
            std = s[mask].std(unbiased=False)
            excess = torch.maximum(-low * std - s, s - (high or float("inf")) * std)
            ties.append(_tied_across_ranks(excess, mask & ~want, mask & (excess > 0), slices))
    st = synthetic(7)[0]

    micro = [slice(sl.start, sl.start + 1), slice(sl.start + 1, sl.stop)]
    kw = {"eps_low": 0.2, "eps_high": 0.2}
    for name, params in (("clip_cov", {"ratio": 0.1, "lb": -0.5, "ub": 2.0}),
                         ("clip_cov", {"ratio": 0.5, "lb": 0.0, "ub": 3.0, "exclude_clipped": False}),
                         ("kl_cov", {"ratio": 0.1}), ("kl_cov", {"ratio": 0.37})):
        m = control.build_method(name, **params)
        got = window.global_minibatch_masks(m, [st.logp[r, :w] for r in micro], [old[r, :w] for r in micro],
                                            [adv[r] for r in micro], [mask[r, :w] for r in micro], kw,
                                            torch.Generator().manual_seed(5))
        clipped = ppo_clipped_mask(st.logp, old, adv, mask, 0.2, 0.2)
        want = m.minibatch_masks(st.logp, old, adv, mask, clipped=clipped, generator=torch.Generator().manual_seed(5))
        field = "zeroed" if name == "clip_cov" else "kl_cov_select"
        for r, g_masks in zip(micro, got):
            assert torch.equal(getattr(g_masks, field), getattr(want, field)[r, :w]), (rank, name, params)
        if name == "kl_cov":
            ties.append(_tied_across_ranks(token_covariance(st.logp, adv, mask), want.kl_cov_select, mask, slices))
    return ties


def check_metrics(rank: int) -> None:
    from entropy_rft import control
    from entropy_rft.core.metrics import stats_metrics
    from entropy_rft.integrations import window

    st, adv, mask, _, slices = synthetic(8)
    sl, w = slices[rank], WIDTHS[rank]
    truncated = torch.arange(adv.numel()) % 3 == 0
    m = control.build_method("clip_v", mu=0.3, max_frac=None)
    gb = window.global_rollout_batch(m, _local(st, sl, w), adv[sl], mask[sl, :w])
    got = window.global_batch_metrics(gb, truncated[sl])
    keep = m.rollout_masks(st, adv, mask).keep & mask
    want = {**stats_metrics(st, adv[:, None].expand_as(mask) * mask, mask),
            "control/rollout_kept_frac": int(keep.sum()) / int(mask.sum()),
            "response/length": float(mask.sum(-1).float().mean()),
            "response/truncated_frac": float(truncated.float().mean())}
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert abs(got[k] - v) <= 1e-12 * max(1.0, abs(v)), (k, got[k], v)


def check_loss_scales(rank: int) -> None:
    """The window's loss factors from three global counts equal those from ``agg_weights`` on the
    concatenated counted masks, bit for bit."""
    from entropy_rft.control import microbatch_loss_scale
    from entropy_rft.core.loss import agg_weights
    from entropy_rft.integrations import window

    _, _, mask, _, slices = synthetic(10)
    mask[slices[2]] = False  # a rank with no counted token, and rows that count nothing
    mask[slices[3].start] = False
    sl, w = slices[rank], WIDTHS[rank]
    micro = [slice(sl.start, sl.start + 1), slice(sl.start + 1, sl.stop)]
    for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        for width in (None, 9):
            got = window.global_loss_scales([mask[r, :w] for r in micro], agg, width)
            g = torch.zeros(mask.shape[0], width or mask.shape[1], dtype=torch.bool)
            g[:, : mask.shape[1]] = mask
            weights = agg_weights(g, agg, torch.float64)
            want = [microbatch_loss_scale(weights[r], mask[r, :w], agg) * WORLD for r in micro]
            assert got == want, (rank, agg, width, got, want)


def check_bytes(rank: int) -> dict[str, list[int]]:
    """Bytes this rank sends for one generation batch (ClipV with cap; 80/20, which still gathers) and one
    optimizer window (Clip-Cov, KL-Cov), at two batch sizes."""
    from entropy_rft import control
    from entropy_rft.integrations import window

    counter = ByteCounter()
    out: dict[str, list[int]] = {}
    try:
        for scale in (1, 4):
            st, adv, mask, old, slices = synthetic(9, scale)
            sl, w = slices[rank], WIDTHS[rank]
            for name, params in (("clip_v", {"mu": 0.2, "max_frac": 0.05, "advantage_sign": "any"}),
                                 ("high_entropy", {"top_q": 0.2})):
                counter.take()
                window.global_rollout_batch(control.build_method(name, **params), _local(st, sl, w), adv[sl],
                                            mask[sl, :w])
                out.setdefault(name, []).append(counter.take())
            for name, params in (("clip_cov", {"ratio": 0.05, "lb": -0.5, "ub": 2.0}), ("kl_cov", {"ratio": 0.05})):
                counter.take()
                window.global_minibatch_masks(control.build_method(name, **params), [st.logp[sl, :w]],
                                              [old[sl, :w]], [adv[sl]], [mask[sl, :w]],
                                              {"eps_low": 0.2, "eps_high": 0.2}, torch.Generator().manual_seed(1))
                out.setdefault(name, []).append(counter.take())
            counter.take()
            window.global_loss_scales([mask[sl, :w]], "seq-mean-token-mean")
            out.setdefault("loss_scales", []).append(counter.take())
            window.global_batch_metrics(window.GlobalBatch(_local(st, sl, w), adv[sl], mask[sl, :w],
                                                           control.Masks()), torch.zeros(ROWS[rank] * scale) > 0)
            out.setdefault("metrics", []).append(counter.take())
    finally:
        counter.close()
    return out


def worker(rank: int, port: int, queue) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        ties = check_selections(rank)
        check_metrics(rank)
        check_loss_scales(rank)
        queue.put((rank, ties, check_bytes(rank)))
    except AssertionError:  # reported by the test itself (the other ranks then fail on the lost connection)
        queue.put((rank, "failed", traceback.format_exc()))
        raise
    finally:
        dist.destroy_process_group()


def test_four_process_selections_equal_single_process():
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    try:
        mp.start_processes(worker, args=(_free_port(), queue), nprocs=WORLD, join=True, start_method="spawn")
    except mp.ProcessRaisedException:
        while not queue.empty():
            rank, status, trace = queue.get()
            assert status != "failed", f"rank {rank}: {trace}"
        raise
    results = sorted(queue.get(timeout=10) for _ in range(WORLD))
    ties = results[0][1]
    assert all(r[1] == ties for r in results)
    assert ties[0] and ties[1], "ClipV's cap never cut through a tie across ranks: the tie-break is untested"
    assert ties[2] and ties[3], "KL-Cov's top-k never cut through a tie across ranks: the tie-break is untested"

    # bytes: rank 3 (6 rows of width 7 at scale 1, 24 rows at scale 4), from the tensors the code sends
    sent = results[3][2]
    world = WORLD
    # 80/20 still all-gathers: per all_gather_rows call 16 B of shape, then the padded rows (to the largest
    # row count, 6·scale, and width 8): TokenStats 5 × fp32 + mask uint8 per token, advantages fp32 per row
    for scale, got in zip((1, 4), sent["high_entropy"]):
        rows, tokens = 6 * scale, 6 * scale * 8
        assert got == 7 * 16 + (5 * 4 + 1) * tokens + 4 * rows, (scale, got)
    # ClipV: [sum, count] and [sum of squares] (float64), the global N for the warning (float64), the
    # candidate count (int64) and its k = max(int(0.05·N), 1) candidates (float64 score + int64 position)
    for scale, got in zip((1, 4), sent["clip_v"]):
        st, adv, mask, _, _ = synthetic(9, scale)
        k = max(int(0.05 * int(mask.sum())), 1)
        assert got == 8 * 2 + 8 + 8 + 8 + 16 * k, (scale, got, k)
    # Clip-Cov: [Σ logp, Σ A, n] (float64) and the candidate count (int64): no per-token bytes at all
    assert sent["clip_cov"] == [3 * 8 + 8] * 2
    # KL-Cov: the same sums, the candidate count and k candidates
    for scale, got in zip((1, 4), sent["kl_cov"]):
        st, adv, mask, _, _ = synthetic(9, scale)
        assert got == 3 * 8 + 8 + 16 * max(int(0.05 * int(mask.sum())), 1), (scale, got)
    # loss scales: counted tokens, sequences that count, width (float64)
    assert sent["loss_scales"] == [3 * 8] * 2
    # batch metrics: 8 + 4 float64 sums, and 5 counts
    assert sent["metrics"] == [(8 + 4 + 5) * 8] * 2
    assert world == 4


def test_global_top_k_and_pick_in_one_process_are_the_control_rules():
    """Without a process group the two-stage top-k (one rank) is the stable sort of ``control.masks`` (ties to
    the earlier position), and the pick is ``randperm(C, generator)[:k]`` (``clip_cov_mask``'s draw)."""
    from entropy_rft.integrations.dist_select import global_random_pick, global_top_k

    g = torch.Generator().manual_seed(0)
    score = torch.randint(0, 4, (40,), generator=g).double()
    for k in (0, 1, 5, 13, 39, 40, 41):
        want = torch.zeros(40, dtype=torch.bool)
        want[torch.sort(score, descending=True, stable=True).indices[:k]] = True
        assert torch.equal(global_top_k(score, k), want), k
    assert int((score == score.max()).sum()) > 5  # k = 5 cuts through a tie: position decides
    got = global_random_pick(30, 4, torch.Generator().manual_seed(3), torch.device("cpu"))
    assert torch.equal(got, torch.randperm(30, generator=torch.Generator().manual_seed(3))[:4])
    assert torch.equal(global_random_pick(3, 4, None, torch.device("cpu")), torch.arange(3))
