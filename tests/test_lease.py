"""The GPU lease kit (issue 32): plans that fit a 15-minute lease, carries under the size limit, what comes back
within the device tool's limits, the page that documents each call, and ``train.checkpoints: false``. The kit's
end-to-end run under the device's conditions is ``make lease-rehearsal`` (a step of .ci/run)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.lease import carry, collect, plans, rehearse, status
from entropy_rft.launch.run import start
from micro import make_micro_policy, micro_overrides

ROOT = Path(__file__).resolve().parents[1]

MIB = 1 << 20


def test_the_allocation_is_one_file_and_the_kits_limits_follow_from_it(tmp_path):
    """The lease's allowance (device time, a command's limit, a call's tree and carry, what $OUT returns) is
    benchmarks/lease/allocation.json; the kit's limits are derived from it, so a new allocation is one file."""
    committed = json.loads((ROOT / "benchmarks" / "lease" / "allocation.json").read_text())
    assert plans.CALL_DEADLINE_S == committed["command_limit_s"] - 90 < plans.CALL_TIMEOUT_S < committed[
        "command_limit_s"]
    assert (committed["tree_and_carry_mib"] - 4) * plans.MIB == plans.CARRY_LIMIT
    want = (committed["out_max_files"], committed["out_max_file_mib"] * plans.MIB)
    assert want == (plans.OUT_MAX_FILES, plans.OUT_MAX_FILE)
    small = {**committed, "command_limit_s": 300, "tree_and_carry_mib": 32}
    (tmp_path / "a.json").write_text(json.dumps(small))
    a = plans.Allocation.read(tmp_path / "a.json")
    assert (a.call_deadline_s(), a.call_timeout_s(), a.carry_limit()) == (210, 270, 28 * plans.MIB)
    for bad in ({k: v for k, v in committed.items() if k != "out_max_files"}, {**committed, "out_max_depth": 1.5},
                {**committed, "device_time_s": True}):
        (tmp_path / "b.json").write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=r"b\.json: (out_max_files|out_max_depth|device_time_s) must be"):
            plans.Allocation.read(tmp_path / "b.json")


@pytest.fixture(scope="module")
def micro_model(tmp_path_factory) -> Path:
    return make_micro_policy(tmp_path_factory.mktemp("micro") / "policy")


def test_plans_fit_a_lease():
    """kernels is one call, the realm plan one a GGUF part (three); every call returns at most 8 files and its
    sections' budgets fit the call's deadline, which the device tool's timeout_s (<= 600 s) covers."""
    assert list(plans.PLANS) == ["kernels", "realm"]
    assert len(plans.PLANS["kernels"].calls) == 1
    assert plans.CALL_DEADLINE_S <= 510 < plans.CALL_TIMEOUT_S <= 600
    for name, plan in plans.PLANS.items():
        assert len(plan.calls) == (1 if name == "kernels" else plans.GGUF_PARTS)
        for call in plan.calls:
            returned = {"lease.json", "log.txt", *(f for s in call.sections for f in s.files)}
            assert len(returned) <= plans.OUT_MAX_FILES, (name, returned)
            fixed = sum(s.budget_s for s in call.sections)
            install = 20 if any("wheels" in c for c in call.carry) else 0
            training = 120 if any(s.budget_s == 0 for s in call.sections) else 0  # at least 2 minutes of it
            assert fixed + install + training <= plans.CALL_DEADLINE_S, (name, fixed, install, training)
    assert [p.name for p in plans.PLANS.values() if p.realm] == ["realm"]
    # the runs a realm lease trains and ships, in its order: seed 0's five methods, then seed 1's, then seed 2's
    names = plans.realm_run_names()
    assert len(names) == 15 and names[:6] == ["none-s0", "clip_b-s0", "clip_v-s0", "clip_cov-s0", "kl_cov-s0",
                                              "none-s1"] and names[-1] == "kl_cov-s2"


def test_what_comes_back_is_checked_against_the_tools_limits(tmp_path):
    ok = tmp_path / "ok"
    (ok / "a" / "b").mkdir(parents=True)
    (ok / "a" / "b" / "f.json").write_text("{}")
    for i in range(7):
        (ok / f"x{i}.txt").write_text("x")
    assert rehearse.check_out(ok) == []
    (ok / "ninth.txt").write_text("x")
    assert any("9 files, over 8" in p for p in rehearse.check_out(ok))
    deep = tmp_path / "deep" / "a" / "b" / "c"
    deep.mkdir(parents=True)
    (deep / "f").write_text("x")
    assert any("more than 2 folders down" in p for p in rehearse.check_out(tmp_path / "deep"))
    big = tmp_path / "big"
    big.mkdir()
    with (big / "runs.tar.gz").open("wb") as f:
        f.truncate(16 * MIB + 1)
    assert any("over 16 MiB" in p for p in rehearse.check_out(big))
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "a b.txt").write_text("x")
    assert any("a name with characters" in p for p in rehearse.check_out(odd))


def test_the_gguf_travels_in_parts_that_join_to_its_bytes(tmp_path):
    src = tmp_path / "model.gguf"
    data = os.urandom(100_001)
    src.write_bytes(data)
    parts = [tmp_path / f"gguf.{k}" for k in (1, 2, 3)]
    carry.split_file(src, parts, 40_000)
    # the last two 40,000 bytes each, the first the 20,001 left
    assert [p.stat().st_size for p in parts] == [20_001, 40_000, 40_000]
    assert b"".join(p.read_bytes() for p in parts) == data
    carry.split_file(src, parts[:2], 60_000)
    assert (tmp_path / "gguf.2").stat().st_size == 60_000
    assert (tmp_path / "gguf.1").read_bytes() + (tmp_path / "gguf.2").read_bytes() == data


def test_the_carry_is_exactly_what_the_image_lacks():
    image = set(carry.image_packages())
    assert {"transformers", "torch", "triton", "accelerate", "huggingface-hub"} & image == {
        "transformers", "triton", "accelerate", "huggingface-hub"}
    kernels = carry.closure(plans.PLANS["kernels"].wheels, image, "3.12")
    assert {"trl", "datasets", "dill", "multiprocess", "liger-kernel"} <= set(kernels)
    assert not {"transformers", "accelerate", "numpy", "pyarrow"} & set(kernels)
    assert kernels["trl"] == "1.16.0" and kernels["liger-kernel"] == "0.8.5"
    realm = carry.closure(plans.PLANS["realm"].wheels, image, "3.12")
    assert {"reasoning-gym", "gguf", "pytz", "pycosat", "zss"} <= set(realm)


def test_the_pycosat_stand_in_installs_imports_and_refuses_in_one_line(tmp_path):
    wheel = carry.stub_wheel("pycosat", carry.STUBS["pycosat"], tmp_path)
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(site),
                    str(wheel)], check=True, capture_output=True)
    r = subprocess.run([sys.executable, "-c", "import pycosat; pycosat.itersolve([[1]])"], capture_output=True,
                       text=True, env={**os.environ, "PYTHONPATH": str(site)})
    assert r.returncode == 1
    assert "RuntimeError: pycosat is not carried to the GPU machine" in r.stderr.strip().splitlines()[-1]


def test_each_call_fits_the_carry_limit_with_the_working_tree(tmp_path):
    """Packs every plan for the device's Python (wheels from PyPI, cached in .lease/cache) and the GGUF parts,
    and checks each call's bytes with the working tree against 60 MiB."""
    tree = carry.tree_bytes(ROOT)
    # the tree travels with every call: three GGUF parts hold one of up to 24 MiB (today ~14: the committed runs and
    # the shipped base policy); a tree that outgrows it fails here before a lease does
    assert tree < 20 * MIB
    for plan in plans.PLANS.values():
        sizes = carry.pack(plan, root=tmp_path, tree=tree)
        for k, n in sizes.items():
            assert n <= plans.CARRY_LIMIT, (plan.name, k, n)
        if plan.realm:
            parts = [tmp_path / c for call in plan.calls for c in call.carry if "gguf" in c]
            assert sum(p.stat().st_size for p in parts) == carry.gguf_source().stat().st_size
            # the parts after the first ride alone, each as large as fits, in order (the first, beside the wheels,
            # holds what is left, nothing on a small tree)
            assert sizes["call 2"] >= plans.CARRY_LIMIT - 2 * MIB
        wheels = sorted(p.name for p in (tmp_path / plan.calls[0].carry[0]).glob("*.whl"))
        assert all(w.endswith("-none-any.whl") for w in wheels), wheels  # nothing compiled for another Python


def _finished_run(folder: Path) -> None:
    """A finished run as the kit sees it: run.json says so and the rows prove it (every step, no evaluations)."""
    folder.mkdir(parents=True)
    (folder / "run.json").write_text(json.dumps({"status": "finished", "step": 60, "max_steps": 60}))
    (folder / "config.yaml").write_text("eval:\n  every: 0\n")
    (folder / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 61)))


def test_the_next_plan_is_the_first_that_has_not_run(tmp_path):
    assert status.next_plan(tmp_path).name == "kernels"
    rec = tmp_path / "benchmarks" / "results" / "lease-kernels-2026-12-01-1200.json"
    rec.parent.mkdir(parents=True)
    rec.write_text(json.dumps({"calls": [{"call": 1, "sections": [{"name": "env", "status": "ok"},
                                                       {"name": "trl", "status": "timed out"}]}]}))
    # a section did not finish: the kernels plan runs again, but after the realm plans (issue 64: the comparison
    # is the larger missing result, the kernels have figures already)
    assert not status.plan_done(plans.PLANS["kernels"], tmp_path)
    assert status.next_plan(tmp_path).name == "realm"
    for m in plans.REALM_METHODS:
        _finished_run(tmp_path / "results" / "smollm2-gpu" / f"{m}-s1")
    # one plan, offered again until all 15 runs are in; what is missing, in the order a wave trains it: seeds first
    assert status.next_plan(tmp_path).name == "realm"
    assert status.missing_runs(tmp_path) == [f"{m}-s{s}" for s in (0, 2) for m in plans.REALM_METHODS]
    for seed in (0, 2):
        for m in plans.REALM_METHODS:
            _finished_run(tmp_path / "results" / "smollm2-gpu" / f"{m}-s{seed}")
    assert status.missing_runs(tmp_path) == []
    assert status.next_plan(tmp_path).name == "kernels"  # every run is in: the kernels plan's second try
    rec.write_text(json.dumps({"calls": [{"call": 1, "sections": [{"name": "env", "status": "ok"}]}]}))
    assert status.next_plan(tmp_path) is None  # a lease ran every section
    rec.write_text(json.dumps({"calls": [{"call": 1, "sections": [{"name": "trl", "status": "failed"}]}]}))
    rec.with_name("lease-kernels-2026-12-02-1200.json").write_text(rec.read_text())
    assert status.kernel_leases(tmp_path)[rec] == ["trl"]
    assert status.next_plan(tmp_path) is None  # failed twice: mend it here, no third lease


def test_the_first_wave_checks_the_task_against_issue_34s_wants():
    assert collect.task_verdict({"pass@1": 0.12, "pass@k": 0.5, "k": "eval/pass@8", "response_tokens": 60}) == []
    miss = collect.task_verdict({"pass@1": 0.4, "pass@k": 0.7, "k": "eval/pass@8", "response_tokens": 30})
    assert len(miss) == 3 and "outside 0.05-0.3" in miss[0] and "under 2.0x" in miss[1] and "under 48" in miss[2]
    assert collect.task_verdict({}) == ["no step-0 evaluation came back"]


def test_the_lease_page_gives_each_calls_exact_command_and_carry():
    page = (ROOT / "docs" / "lease.md").read_text()
    for plan in plans.PLANS.values():
        for i, call in enumerate(plan.calls, 1):
            assert call.command(plan.name, i) in page, (plan.name, i)
            assert json.dumps(list(call.carry)) in page, (plan.name, i)
    assert f"timeout_s: {plans.CALL_TIMEOUT_S}" in page


def test_a_call_off_the_device_or_of_an_unknown_plan_is_one_line(tmp_path):
    kit = [sys.executable, "-m", "benchmarks.lease.kit"]  # from ROOT, as docs/lease.md gives it
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    r = subprocess.run([*kit, "call", "kernels", "1"], capture_output=True, text=True, env=env, cwd=ROOT)
    assert r.returncode == 2 and r.stderr.strip().startswith("call: $OUT is not set")
    r = subprocess.run([*kit, "show", "realm-9"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 1 and r.stderr.strip() == "unknown plan 'realm-9'; the plans, in order: kernels, realm"
    r = subprocess.run([*kit, "call", "realm", "4"], capture_output=True, text=True, cwd=ROOT,
                       env={**env, "OUT": str(tmp_path / "out"), "ERFT_LEASE_STATE": str(tmp_path / "state")})
    assert r.returncode == 1 and r.stderr.strip() == "plan realm has 3 call(s): 1..3, not 4"
    assert not (tmp_path / "out").exists()  # refused before anything is written


@pytest.mark.parametrize("stop", [False, True])
def test_no_checkpoint_and_no_final_policy_when_train_checkpoints_is_false(micro_model, tmp_path, stop,
                                                                           monkeypatch):
    """A lease's runs are never resumed: no checkpoints/, no final/, and every row still written. Stopped after
    step 1 (as SIGTERM stops a run), a resume starts again from step 0 and writes the same rows."""
    import signal

    import entropy_rft.launch.run as launch
    from entropy_rft.config.loading import load_config

    cfg = load_config(None, micro_overrides(micro_model, **{"train.checkpoints": False, "train.max_steps": 2}))
    out = tmp_path / "run"
    if stop:
        monkeypatch.setattr(launch.StopSignals, "signum", signal.SIGTERM, raising=False)
        monkeypatch.setattr(launch.StopSignals, "__call__", lambda self: True)
        monkeypatch.setattr(launch.StopSignals, "__init__", lambda self: setattr(self, "_old", {}))
        with pytest.raises(SystemExit):
            start(cfg, out)
        assert [r["step"] for r in _rows(out)] == [0, 1]
        assert json.loads((out / "run.json").read_text())["status"] == "stopped"
        assert not (out / "checkpoints").exists()
        monkeypatch.undo()
        launch.resume(out, given={"task.name": "micro:DigitTask"})  # the recorded import path, named again
    else:
        start(cfg, out)
    assert [r["step"] for r in _rows(out)] == [0, 1, 2]
    assert not (out / "checkpoints").exists() and not (out / "final").exists()
    assert json.loads((out / "run.json").read_text())["status"] == "finished"


def _rows(out: Path) -> list[dict]:
    from entropy_rft.rundir.files import read_step_log

    return read_step_log(out / "metrics.jsonl")


# Issue 49: a realm wave paces itself; the figures below are worked by hand.
from benchmarks.gpu import pace  # noqa: E402
from benchmarks.lease import shrink  # noqa: E402

SETTINGS = {"train.max_steps": 60, "eval.every": 8, "eval.prompts": 128, "rollout.max_new_tokens": 128}


def test_a_runs_pace_is_read_off_its_rows():
    assert pace.eval_steps(60, 8) == [0, 8, 16, 24, 32, 40, 48, 56, 60]
    assert pace.eval_steps(4, 0) == []
    rows = [{"step": 0, "eval/pass@1": 0.1},
            {"step": 1, "time/step": 5.0}, {"step": 2, "time/step": 3.0}, {"step": 3, "time/step": 4.0},
            {"step": 4, "time/step": 16.0, "time/eval": 12.0, "eval/pass@1": 0.2}]
    p = pace.measure(rows, startup_s=7.0, eval0_s=9.0)
    # steps 5, 3, 4, 4 (16 - 12): median 4; the one timed evaluation 12 (the step-0 one, timed outside, not used)
    assert (p.step_s, p.eval_s, p.steps, p.evals, p.startup_s) == (4.0, 12.0, 4, 2, 7.0)
    # after a cut at step 2, only steps 3 and 4 count: median of 4 and 4
    assert pace.measure(rows, 7.0, 9.0, since_step=2).step_s == 4.0
    assert pace.measure(rows[:2], 7.0, 9.0).eval_s == 9.0  # no timed evaluation yet: the step-0 one
    assert pace.measure(rows[:1], 7.0, 9.0) is None  # no training step yet
    # 60 steps, 9 evaluations: 56 steps x 4 + 7 evaluations x 12 left; from the launch 7 + 240 + 108
    assert pace.remaining_s(p, 60, 8) == 56 * 4.0 + 7 * 12.0
    assert pace.run_s(p, 60, 8) == 7.0 + 60 * 4.0 + 9 * 12.0


def test_a_wave_keeps_the_runs_that_can_finish_in_the_methods_order():
    # five runs measured sharing the device, 100 s each to go: k of them need 100 k / 5 s, times 1.1
    assert pace.runs_that_fit([100.0] * 5, 5, 50.0) == 2  # 44 s fits, 66 s does not
    assert pace.runs_that_fit([100.0] * 5, 5, 120.0) == 5  # 110 s
    assert pace.runs_that_fit([100.0] * 5, 5, 21.0) == 0  # one alone needs 22 s
    assert pace.runs_that_fit([100.0, 300.0, 100.0], 3, 120.0) == 1  # the second cannot, so not the third
    assert pace.runs_that_fit([100.0, 100.0, float("inf")], 3, 1e9) == 2  # a run with no pace is not kept
    # once cut: each at its own pace, stopped when over what is left by more than 15 %
    assert pace.runs_to_keep([10.0, 30.0, 5.0], 20.0) == 1
    assert pace.runs_to_keep([10.0, 22.0], 20.0) == 2
    assert pace.runs_to_keep([24.0], 20.0) == 0


def test_runs_waiting_for_room_add_their_work_and_the_memory_caps_how_many_run_at_once():
    # two running (40 and 60 s to go, measured two sharing), three not started (100 s each at that pace). The
    # device's throughput is shared: the first k need their total work over 2, and no run ends sooner than it
    # would sharing the device with min(k, cap): k=2: max(100/2, 60x2/2) = 60; k=3: max(200/2, 100x3/2) = 150
    # with room for 5, but max(100, 100x2/2) = 100 with room for 2; k=5: max(400/2, 100x2/2) = 200 with room for 2
    needs = [40.0, 60.0, 100.0, 100.0, 100.0]
    assert pace.finish_s(needs[:2], 2, 5) == 60.0
    assert pace.finish_s(needs[:3], 2, 5) == 150.0 and pace.finish_s(needs[:3], 2, 2) == 100.0
    assert pace.finish_s(needs, 2, 2) == 200.0 and pace.finish_s([], 2, 2) == 0.0
    assert pace.runs_that_fit(needs, 2, 221.0, cap=2) == 5  # 200 x 1.1 = 220
    assert pace.runs_that_fit(needs, 2, 219.0, cap=2) == 4  # 4 runs: max(300/2, 100) = 150, x 1.1 = 165
    assert pace.runs_that_fit(needs, 2, 219.0) == 3  # room for all five: k=3 165, k=4 max(150, 200) x 1.1 = 220
    # the rehearsal's slow device: 2.5 runs is halfway between the first two (60) and three (100, room for 2)
    assert pace.budget_of(needs, 2, 2, 2.5) == pytest.approx(80.0 * 1.1)
    assert pace.budget_of(needs, 2, 2, 0.5) == pytest.approx(10.0 * 1.1)  # half of the first (40 / 2 = 20)
    # a kept run not started yet is given up only when over what is left by more than 15 %
    assert pace.still_fits([100.0], 2, 44.0, 2) and not pace.still_fits([100.0], 2, 43.0, 2)  # 50 <= 44 x 1.15
    # memory: 80,000 MiB free, a run's peak 6,000 MiB with 25 % to spare: 7,500 a run, 10 runs; at least one
    assert pace.memory_cap(80000.0, 6000.0) == 10 and pace.memory_cap(7000.0, 6000.0) == 1
    assert pace.memory_cap(1000.0, 0.0) == 1


def test_the_wave_trains_the_missing_runs_seeds_first_and_reads_its_memory(tmp_path):
    from benchmarks.gpu import realm, realm_wave

    for name in ("none-s0", "clip_v-s0", "clip_b-s1"):
        _finished_run(tmp_path / name)
    got = realm.missing_runs(tmp_path, "none,clip_b,clip_v", 2)
    assert got == [("clip_b", 0), ("none", 1), ("clip_v", 1)]
    # an earlier lease's peak (the context is in it already); the played device holds 3 runs whatever it measures
    mem = realm_wave.Memory(free=20000.0, prior_peak_mib=3000.0, played_runs=None, cuda=True)
    assert (mem.cap, mem.peak) == (5, 3000.0)  # 20000 // 3750
    mem = realm_wave.Memory(free=20000.0, prior_peak_mib=None, played_runs=None, cuda=True)
    assert mem.cap is None  # the first run starts alone until its peak is read
    assert mem.set_peak(3488.0, "none-s0, measured") == 4  # + 512 MiB of CUDA context: 4000, 20000 // 5000
    assert mem.peak == 4000.0
    assert realm_wave.Memory(None, 3000.0, None, False).to_dict()["runs_it_holds"] is None  # unreadable: no cap
    assert realm_wave.Memory(1e9, 3000.0, 3, False).cap == 3


def test_when_no_run_fits_the_least_smaller_setting_that_does_is_proposed():
    p = pace.Pace(startup_s=20.0, step_s=3.0, eval_s=20.0, steps=4, evals=1)
    # as set: 20 + 60 x 3 + 9 x 20 = 380 s. Half the prompts: 20 + 180 + 90 = 290 (x 1.1 = 319 > 300);
    # a quarter: 20 + 180 + 45 = 245 (x 1.1 = 269.5 <= 300)
    assert pace.propose(p, SETTINGS, 300.0) == {"sets": {"eval.prompts": 32}, "predicted_s": 245.0,
                                                "budget_s": 300.0}
    # 200 s: 48 steps (every 6: still 9 evaluations): 20 + 144 + 45 = 209, x 1.1 > 200; 40 steps (every 5):
    # 20 + 120 + 45 = 185, x 1.1 = 203.5 > 200; 30 steps (every 4, 0..28 and 30: 9): 20 + 90 + 45 = 155
    assert pace.propose(p, SETTINGS, 200.0)["sets"] == {"eval.prompts": 32, "train.max_steps": 30,
                                                        "eval.every": 4}
    # shorter responses scale the steps and evaluations: 20 + (90 + 45) x 1/2 = 87.5 at the smallest
    none = pace.propose(p, SETTINGS, 90.0)
    assert none["sets"] is None and none["predicted_s"] == 87.5
    assert none["smallest"]["rollout.max_new_tokens"] == 64


def _lease_record(root: Path, plan: str, wave: dict, stamp: str = "2026-12-01-1200") -> Path:
    rec = root / "benchmarks" / "results" / f"lease-{plan}-{stamp}.json"
    rec.parent.mkdir(parents=True, exist_ok=True)
    rec.write_text(json.dumps({"calls": [{"call": 1, "sections": []}, {"call": 2, "sections": [], "wave": wave}]}))
    return rec


def test_next_and_shrink_read_a_partial_wave_and_a_wave_where_nothing_fits(tmp_path):
    realm = plans.PLANS["realm"]
    (tmp_path / "configs").mkdir()
    (tmp_path / plans.REALM_CONFIG).write_text((ROOT / plans.REALM_CONFIG).read_text())
    for m in plans.REALM_METHODS:
        _finished_run(tmp_path / "results" / "smollm2-gpu" / f"{m}-s0")
    for m in plans.REALM_METHODS[:2]:
        _finished_run(tmp_path / "results" / "smollm2-gpu" / f"{m}-s1")
    _lease_record(tmp_path, "realm", {"verdict": "partial", "finished": ["none-s1", "clip_b-s1"],
                                      "stopped": {"clip_v-s1": "cut at 40 s: 15 runs measured, 7 kept"},
                                      "memory": {"peak_mib": 3100}})
    later = [f"{m}-s{s}" for s in (1, 2) for m in plans.REALM_METHODS][2:]
    assert status.missing_runs(tmp_path) == later
    assert status.known_peak_mib(realm, tmp_path) == 3100.0
    lines = status.plan_state(realm, tmp_path)
    assert lines[0] == ("7 of 15 runs of realm are committed (none-s0, clip_b-s0, clip_v-s0, clip_cov-s0, kl_cov-s0, "
                        "none-s1, clip_b-s1): this lease trains the others, seeds first, as many as fit ("
                        + ", ".join(later) + ")")
    assert "clip_v-s1 (cut at 40 s: 15 runs measured, 7 kept)" in lines[1]
    wave = {"verdict": "nothing fits", "settings": status.config_settings(tmp_path), "budget_s": 200.0,
            "pace": {"startup_s": 20.0, "step_s": 3.0, "eval_s": 20.0, "steps": 4, "evals": 1},
            "pace_run": "none-s1", "pace_share": 1, "needed_s": 380.0,
            "proposal": {"sets": {"eval.prompts": 32, "train.max_steps": 30, "eval.every": 4},
                         "predicted_s": 155.0, "budget_s": 200.0}}
    _lease_record(tmp_path, "realm", wave, "2026-12-02-1200")
    assert status.known_peak_mib(realm, tmp_path) is None  # that lease measured none
    advice = status.plan_state(realm, tmp_path)[1:]
    assert advice[0].startswith("the last lease of realm finished no run: none-s1 needs 380 s (20 s to start, "
                                "3.00 s a step, 20.00 s an evaluation, measured with 1 run(s) on the device); "
                                "the budget was 200 s")
    assert "eval.prompts 64 -> 32, train.max_steps 60 -> 30, eval.every 8 -> 4 (one run 155 s of 200 s)" in advice[1]
    assert "7 run(s) are committed under the old settings" in advice[2]
    with pytest.raises(SystemExit, match="7 run.s. are committed under the current setting"):
        shrink.shrink(realm, tmp_path)
    import shutil

    shutil.rmtree(tmp_path / "results")
    assert shrink.shrink(realm, tmp_path) == wave["proposal"]["sets"]
    after = (tmp_path / plans.REALM_CONFIG).read_text()
    before = (ROOT / plans.REALM_CONFIG).read_text()
    assert status.config_settings(tmp_path) == {**SETTINGS, "eval.prompts": 32, "train.max_steps": 30,
                                                "eval.every": 4}
    changed = [a for a, b in zip(after.splitlines(), before.splitlines()) if a != b]
    assert len(changed) == 3 and all("lease-realm-2026-12-02-1200.json" in line for line in changed)
    assert status.plan_state(realm, tmp_path)[-1] == ("configs/smollm2-gpu.yaml has changed since that lease: "
                                                       "run the plan again")
    with pytest.raises(SystemExit, match="has changed since"):
        shrink.shrink(realm, tmp_path)


def test_a_run_not_measured_yet_borrows_the_pace_of_those_that_are(tmp_path):
    from benchmarks.gpu import realm_wave

    def runner(p=None, row0=None):
        return realm_wave.Runner("r", "none", None, 0.0, tmp_path, t_row0=row0, pace=p)

    got = realm_wave.borrowed_paces([runner(pace.Pace(5.0, 2.0, 10.0, 3, 1)), runner(pace.Pace(6.0, 4.0, 20.0, 2, 1)),
                                     runner(row0=1.0), runner()])
    # the medians of 2 and 4 s a step, 10 and 20 s an evaluation; the third has logged its step-0 evaluation
    assert got[2:] == [pace.Pace(0.0, 3.0, 15.0, 0, 1), pace.Pace(0.0, 3.0, 15.0, 0, 0)]
    assert realm_wave.borrowed_paces([runner()]) == [None]
