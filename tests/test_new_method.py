"""Issue 66, item 4: a method declares what its selection exchanges across ranks (``Method.exchange``), the
distributed selections read the declaration (a subclass inherits it), and a selecting method that declares none
is refused in one line when it is built. A new method, one module and one registration (``tests/new_method.py``),
runs on the native engine, in TRL's subclass and on several ranks with no other edit; verl's loss entry point
runs it in ``tests_verl/test_new_method_verl.py`` (``make test-verl``, verl's own virtualenv).
"""

from __future__ import annotations

import json
import socket
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest
import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))

from entropy_rft import control  # noqa: E402
from entropy_rft.config.loading import load_config  # noqa: E402
from entropy_rft.control import registry  # noqa: E402
from entropy_rft.control.exchange import EXCHANGES, exchange_problem  # noqa: E402
from entropy_rft.control.paper_methods import ClipB, ClipCov  # noqa: E402
from entropy_rft.launch.run import start  # noqa: E402
from micro import make_micro_policy, micro_overrides  # noqa: E402
from new_method import LowEntropyNegatives, registered  # noqa: E402

# the refusal of a rollout-stage method that declares nothing, word for word
REFUSAL = ("method 'test_undeclared' selects tokens at its rollout stage and runs on native, trl, verl, but declares "
           "no exchange across ranks: set exchange = \"local\" (a rule that reads each token alone), \"tokens\" "
           "(gather every rank's tokens) or a statistic of integrations.dist_select (s_star_mean_std, "
           "s_centered_std_top_k) on its class")


@dataclass
class Undeclared(LowEntropyNegatives):  # the new method's rule with its declaration taken back
    name: ClassVar[str] = "test_undeclared"
    exchange: ClassVar[str | None] = None


@dataclass
class MuchClipB(ClipB):  # a subclass that only moves a default: it inherits ClipB's exchange
    name: ClassVar[str] = "test_much_clip_b"
    mu: float = control.param(0.5, "threshold in batch stds of S", ge=0)


@dataclass
class OtherRuleClipB(ClipB):  # a subclass with a rule of its own under ClipB's declaration
    name: ClassVar[str] = "test_other_rule_clip_b"

    def rollout_masks(self, stats, advantages, mask):
        return control.Masks(keep=mask.bool() & (stats.entropy > 1.0))


@dataclass
class SecondTokenOff(control.Method):  # a per-token minibatch rule (unregistered): local on every rank
    name: ClassVar[str] = "test_second_token_off"
    stage: ClassVar[str] = "minibatch"
    exchange: ClassVar[str | None] = "local"
    masks: ClassVar[tuple[str, ...]] = ("keep",)

    def minibatch_masks(self, logp, old_logp, advantages, mask, *, clipped=None, generator=None):
        keep = torch.ones_like(mask, dtype=torch.bool)
        keep[:, 1] = False
        return control.Masks(keep=keep & (logp > old_logp - 10))


# ----------------------------------------------------------------------------- the declaration


def test_every_builtin_that_selects_declares_its_exchange():
    for name in control.available_methods():
        cls = control.get_method_class(name)
        assert exchange_problem(cls, on_ranks=True) is None, name
        assert (cls.exchange is None) == (cls.stage == "static"), name
    assert control.method_info("clip_cov")["exchange"] == "covariance_random_pick"


def test_a_statistic_exchange_runs_the_methods_own_rule_with_the_ranks_reductions():
    """Each statistic of EXCHANGES is some built-in's, whose hook takes ``reduce`` (dist_select calls it with its
    global reductions: the rule has one home, control.masks); a hook that takes none is refused in one line."""
    from entropy_rft.control.exchange import STATISTICS

    used = {control.get_method_class(n).exchange for n in control.available_methods()}
    assert set(STATISTICS) <= used and set(EXCHANGES) == {"local", "tokens", *STATISTICS}

    @dataclass
    class NoReduce(ClipB):  # ClipB's exchange over a rule of its own that cannot take the ranks' reductions
        name: ClassVar[str] = "test_no_reduce"
        exchange: ClassVar[str | None] = "s_star_mean_std"

        def rollout_masks(self, stats, advantages, mask):
            return control.Masks(keep=mask.bool())

    msg = exchange_problem(NoReduce)
    assert msg is not None and "\n" not in msg and "its rollout_masks takes no reduce=" in msg


def test_a_selecting_method_that_declares_no_exchange_is_refused_in_one_line_at_build():
    control.register_method(Undeclared)
    try:
        with pytest.raises(ValueError) as e:
            control.build_method("test_undeclared")
        assert str(e.value) == REFUSAL
    finally:
        registry._REGISTRY.pop("test_undeclared", None)
    # a native-only one need not declare; a built instance handed to TRL's trainer is refused by the trainer
    assert exchange_problem(type("NativeOnly", (Undeclared,), {"engines": ("native",)})) is None
    from entropy_rft.integrations.trl import EntropyControlGRPOTrainer

    with pytest.raises(ValueError, match="declares no exchange across ranks"):
        EntropyControlGRPOTrainer(method=Undeclared())


def test_a_subclass_inherits_the_exchange_unless_it_replaces_the_rule():
    assert exchange_problem(MuchClipB) is None and MuchClipB.exchange == "s_star_mean_std"
    assert exchange_problem(OtherRuleClipB) == (
        "method 'test_other_rule_clip_b' selects tokens at its rollout stage and runs on native, trl, verl: "
        "OtherRuleClipB redefines rollout_masks below ClipB, whose exchange 's_star_mean_std' describes the rule "
        "it replaces; set exchange = \"local\" (a rule that reads each token alone), \"tokens\" (gather every "
        "rank's tokens) or a statistic of integrations.dist_select (s_star_mean_std, s_centered_std_top_k) on "
        "OtherRuleClipB")
    wrong = type("WrongStage", (ClipCov,), {"exchange": "s_star_mean_std"})
    assert "exchange 's_star_mean_std' is not one of its stage's" in exchange_problem(wrong)


# ----------------------------------------------------------------------------- on several ranks

WORLD, ROWS, WIDTHS = 2, [3, 5], [6, 4]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _batch():
    from entropy_rft.core.dynamics import TokenStats

    g = torch.Generator().manual_seed(11)
    n, w = sum(ROWS), max(WIDTHS)
    mask = torch.rand(n, w, generator=g) < 0.9
    mask[: ROWS[0], WIDTHS[0]:] = False
    mask[ROWS[0]:, WIDTHS[1]:] = False
    f = {k: torch.randn(n, w, generator=g) for k in ("logp", "s_star", "s_expected")}
    f["logp"] = -f["logp"].abs()
    f["entropy"] = torch.rand(n, w, generator=g) * 2
    f["s_centered"] = f["s_star"] - f["s_expected"]
    adv = torch.randn(n, generator=g)
    return TokenStats(**f), adv, mask, f["logp"] - 0.1 * torch.rand(n, w, generator=g)


def _rank_part(rank: int):
    from entropy_rft.core.dynamics import TokenStats

    st, adv, mask, old = _batch()
    sl, w = slice(sum(ROWS[:rank]), sum(ROWS[: rank + 1])), WIDTHS[rank]
    local = TokenStats(**{k: getattr(st, k)[sl, :w] for k in ("entropy", "logp", "s_star", "s_expected",
                                                              "s_centered")})
    return st, adv, mask, old, sl, w, local


def _check_rank(rank: int) -> None:
    import torch.distributed as dist

    from entropy_rft.integrations import window
    from entropy_rft.integrations.verl_stats import rollout_keep

    st, adv, mask, old, sl, w, local = _rank_part(rank)
    gathered = []
    orig = dist.all_gather
    dist.all_gather = lambda parts, x, *a, **k: (gathered.append(x.numel() * x.element_size()), orig(parts, x))[1]
    try:
        with registered() as name:
            m = control.build_method(name, h_min=0.8)
            whole = m.rollout_masks(st, adv, mask).keep
            assert not whole[mask].all()  # the rule acts
            gathered.clear()
            got = window.global_rollout_batch(m, local, adv[sl], mask[sl, :w]).masks.keep
            assert torch.equal(got, whole[sl, :w]) and gathered == []  # local: each rank's rows, nothing sent
            adv_tok = adv[:, None].expand_as(mask).float() * mask
            stats = {k: getattr(local, k) for k in ("entropy", "s_star", "s_expected", "s_centered")}
            assert torch.equal(rollout_keep(m, stats, adv_tok[sl, :w], mask[sl, :w]), whole[sl, :w] & mask[sl, :w])
        sub = MuchClipB()  # inherits ClipB's exchange: sums, not tokens (the old code gathered a subclass's tokens)
        gathered.clear()
        got = window.global_rollout_batch(sub, local, adv[sl], mask[sl, :w]).masks.keep
        assert torch.equal(got, sub.rollout_masks(st, adv, mask).keep[sl, :w])
        assert sum(gathered) == 16 + 8, gathered  # [sum, count] and [sum of squares], float64
        per_token = SecondTokenOff()
        kw = {"eps_low": 0.2, "eps_high": 0.2}
        got = window.global_minibatch_masks(per_token, [st.logp[sl, :w]], [old[sl, :w]], [adv[sl]], [mask[sl, :w]],
                                            kw, None)[0]
        assert torch.equal(got.keep, per_token.minibatch_masks(st.logp, old, adv, mask).keep[sl, :w])
        with pytest.raises(ValueError, match="'test_undeclared' .* declares no exchange across ranks"):
            window.global_rollout_batch(Undeclared(), local, adv[sl], mask[sl, :w])
    finally:
        dist.all_gather = orig


def _worker(rank: int, port: int, queue) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        _check_rank(rank)
        queue.put((rank, "ok", ""))
    except BaseException:
        queue.put((rank, "failed", traceback.format_exc()))
        raise
    finally:
        dist.destroy_process_group()


def test_on_two_ranks_the_declaration_picks_the_exchange():
    """With two gloo processes: the new method (``local``) selects on each rank's rows and sends nothing, equal to
    the single-process masks (TRL's ``window`` and verl's ``rollout_keep``); a ClipB subclass inherits ClipB's
    sums; a per-token minibatch rule runs locally; an undeclared method is refused in its one line."""
    queue = mp.get_context("spawn").Queue()
    try:
        mp.start_processes(_worker, args=(_free_port(), queue), nprocs=WORLD, join=True, start_method="spawn")
    except mp.ProcessRaisedException:
        while not queue.empty():
            rank, status, trace = queue.get()
            assert status != "failed", f"rank {rank}: {trace}"
        raise
    assert sorted(queue.get(timeout=10)[:2] for _ in range(WORLD)) == [(0, "ok"), (1, "ok")]


# ----------------------------------------------------------------------------- the engines


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory) -> Path:
    return make_micro_policy(tmp_path_factory.mktemp("new_method") / "policy")


def _run(policy_dir: Path, out: Path, engine: str | None) -> list[dict]:
    sets = micro_overrides(policy_dir, **{"eval.every": 0, "train.tensorboard": "false", "train.max_steps": 2,
                                          "train.checkpoint_every": 2, "task.name": "micro:OverlapTask"})
    extra = {"method": {"name": LowEntropyNegatives.name, "params": {"h_min": 5.0}}}  # every A<0 token goes
    start(load_config(None, sets, extra={**extra, **({"engine": engine} if engine else {})}), out)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("engine", [None, "trl"], ids=["native", "trl"])
def test_the_new_method_trains_on_the_native_engine_and_in_trl(policy_dir, tmp_path, engine):
    with registered():
        rows = [r for r in _run(policy_dir, tmp_path / "run", engine) if r.get("step", 0) >= 1]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["loss/total"] is not None and abs(r["loss/total"]) < 1e3 for r in rows)
    assert any(r["control/kept_frac"] < 1.0 for r in rows)  # the method dropped its tokens
    assert json.loads((tmp_path / "run" / "run.json").read_text())["status"] == "finished"
