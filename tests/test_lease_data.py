"""What a GPU lease brings back, and the lease records committed since, are data (issue 65): ``kit.py collect``
copies only a run's shipped files, checks the tar member by member and every file's fields before anything is
written, refuses runs of other settings, and ends each malformed input in one line; ``shrink`` writes only what
a wave may shrink; ``next`` survives a damaged record; two records never overwrite each other."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest
import yaml

from benchmarks.lease import checks, collect, kit, plans, shrink, status

ROOT = Path(__file__).resolve().parents[1]

REALM = plans.PLANS["realm"]
RUN = ROOT / "results" / "smollm2-cpu" / "none-s0"  # a real run's shipped files (issue 63), as templates


def run_files(lr: str = "2.0e-05", steps: int = 20) -> dict[str, bytes]:
    config = (RUN / "config.yaml").read_text().replace("  lr: 2.0e-05", f"  lr: {lr}")
    every = yaml.safe_load(config)["eval"]["every"]  # an evaluation wherever the run evaluates: a finished run's rows
    evals = {"eval/pass@1": 0.125, "eval/pass@8": 0.5, "eval/response_tokens": 60.0}
    rows = [json.dumps({"step": s, **({"loss/total": 0.1} if s else {}),
                        **(evals if s % every == 0 or s == steps else {})}) for s in range(steps + 1)]
    return {"config.yaml": config.encode(), "metrics.jsonl": ("\n".join(rows) + "\n").encode(),
            "run.json": json.dumps({"status": "finished", "step": steps, "max_steps": steps}).encode(),
            "samples.jsonl": b'{"step": 1}\n'}


def make_tar(path: Path, members: dict[str, bytes], extra: list[tarfile.TarInfo] = ()) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for info in extra:
            tar.addfile(info)
    return path


def returned(tmp: Path, members: dict[str, bytes] | None = None, wave: dict | None = None,
             record: object = None, extra: list[tarfile.TarInfo] = ()) -> list[Path]:
    """Call 1's and call 2's folders as the device tool returns them."""
    one, two = tmp / "call1", tmp / "call2"
    for f in (one, two):
        f.mkdir(parents=True, exist_ok=True)
    (one / "lease.json").write_text(json.dumps({"call": 1, "sections": [{"name": "env", "status": "ok"}]}))
    rec = record if record is not None else {"call": 2, "sections": [{"name": "train", "status": "ok"}],
                                             "wave": wave or {"verdict": "partial", "finished": ["none-s0"]}}
    (two / "lease.json").write_text(json.dumps(rec))
    if members is None:
        members = {f"none-s0/{k}": v for k, v in run_files().items()}
    make_tar(two / "runs.tar.gz", members, list(extra))
    return [one, two]


def written(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def refused(root: Path, folders: list[Path], *words: str) -> str:
    with pytest.raises(checks.LeaseDataError) as e:
        collect.collect(REALM, folders, root=root, force=True)
    line = str(e.value)
    assert "\n" not in line and all(w in line for w in words), line
    assert written(root) == []  # nothing written: no record, no run
    return line


def test_only_a_runs_shipped_files_are_collected_and_a_foreign_member_refuses_the_tar(tmp_path):
    root = tmp_path / "repo"
    root.mkdir()
    got = collect.collect(REALM, returned(tmp_path), root=root, force=True)
    assert sorted(p.name for p in (root / "results" / "smollm2-gpu" / "none-s0").iterdir()) == sorted(
        plans_shipped())
    assert any(p.name.startswith("lease-realm-") for p in got)
    # a repository inside a run folder (its config could name a command git runs): refused, nothing written
    root2 = tmp_path / "repo2"
    root2.mkdir()
    members = {**{f"none-s0/{k}": v for k, v in run_files().items()},
               "none-s0/.git/config": b"[core]\n\tfsmonitor = touch /tmp/pwned\n"}
    refused(root2, returned(tmp_path / "b", members), "none-s0/.git/config", "which no run ships")


def plans_shipped() -> list[str]:
    from entropy_rft.rundir.finished import SHIPPED

    return list(SHIPPED)


@pytest.mark.parametrize("case", ["dotdot", "absolute", "symlink", "fifo", "folder", "twice"])
def test_a_member_that_is_not_a_plain_shipped_file_is_one_line(tmp_path, case):
    files = {f"none-s0/{k}": v for k, v in run_files().items()}
    extra = []
    if case in ("dotdot", "absolute"):
        files["../evil" if case == "dotdot" else "/tmp/evil"] = b"x"
    else:
        info = tarfile.TarInfo("none-s0/samples.jsonl" if case != "folder" else "none-s0")
        info.type = {"symlink": tarfile.SYMTYPE, "fifo": tarfile.FIFOTYPE, "folder": tarfile.DIRTYPE,
                     "twice": tarfile.REGTYPE}[case]
        if case == "symlink":
            info.linkname = "/etc/passwd"
        extra.append(info)
    root = tmp_path / "repo"
    root.mkdir()
    refused(root, returned(tmp_path, files, extra=extra), "runs.tar.gz")


def test_a_tar_bomb_is_refused_by_its_header_before_it_is_read(tmp_path, monkeypatch):
    monkeypatch.setattr(checks, "MEMBER_MAX", 4096)  # as 32 MiB is to a real run's ~1 MB of metrics
    files = run_files()
    files["metrics.jsonl"] = files["metrics.jsonl"] + b" " * 5000
    root = tmp_path / "repo"
    root.mkdir()
    refused(root, returned(tmp_path, {f"none-s0/{k}": v for k, v in files.items()}), "metrics.jsonl unpacks to",
            "over 4096")
    monkeypatch.setattr(checks, "TOTAL_MAX", 2000)  # the sum of the members, unpacked
    refused(root, returned(tmp_path / "b"), "unpacks to over 2000 bytes")


@pytest.mark.parametrize("damage", ["cut", "not gzip"])
def test_a_tar_cut_short_or_not_gzip_is_one_line(tmp_path, damage):
    folders = returned(tmp_path)
    tar = folders[1] / "runs.tar.gz"
    data = tar.read_bytes()
    tar.write_bytes(data[: len(data) // 2] if damage == "cut" else b"PK\x03\x04 a zip, not a tar")
    root = tmp_path / "repo"
    root.mkdir()
    refused(root, folders, "runs.tar.gz", "is not a whole gzip tar")


@pytest.mark.parametrize("record,words", [
    ([], ("lease.json", "is not an object")),
    ({"sections": []}, ("call is None",)),
    ({"call": "2", "sections": []}, ("call is '2'",)),
    ({"call": 7, "sections": []}, ("call is 7",)),
    ({"call": 2, "sections": "ok"}, ("sections is not a list",)),
    ({"call": 2, "sections": [], "wave": {"verdict": "partial", "stopped": 5}}, ("wave.stopped",)),
    ({"call": 2, "sections": [], "wave": {"verdict": "nothing fits", "pace": {"step_s": 1.0}}}, ("lacks pace_run",)),
    ({"call": 2, "sections": [], "wave": {"verdict": 3}}, ("wave.verdict is not text",)),
])
def test_a_lease_json_of_the_wrong_shape_is_one_line_before_anything_is_written(tmp_path, record, words):
    root = tmp_path / "repo"
    root.mkdir()
    refused(root, returned(tmp_path, record=record), *words)


@pytest.mark.parametrize("file,text,words", [
    ("run.json", '{"status": "finished", "step": "two", "max_steps": 20}', ("run.json", "step is 'two'")),
    ("run.json", "[1, 2]", ("run.json", "is not an object")),
    ("metrics.jsonl", '[1, 2]\n', ("metrics.jsonl line 1", "is not an object")),
    ("metrics.jsonl", '{"step": 0, "eval/pass@1": "high"}\n', ("metrics.jsonl line 1", "eval/pass@1 is not a number")),
    ("metrics.jsonl", '{"step": 0}\n{"step": "1"\n', ("metrics.jsonl line 2", "is not JSON")),
    ("config.yaml", "optim: [\n", ("config.yaml",)),
    ("metrics.jsonl", '{"step": 0, "eval/pass@1": 0.1}\n{"step": 1}\n',  # cut short beside a finished run.json
     ("none-s0's run.json says finished, but metrics.jsonl: step(s) 2-20 of 0-20 missing",)),
])
def test_run_fields_of_the_wrong_type_are_one_line(tmp_path, file, text, words):
    files = run_files()
    files[file] = text.encode()
    root = tmp_path / "repo"
    root.mkdir()
    refused(root, returned(tmp_path, {f"none-s0/{k}": v for k, v in files.items()}), *words)


def test_runs_of_other_settings_than_the_committed_ones_are_refused(tmp_path):
    root = tmp_path / "repo"
    committed = root / "results" / "smollm2-gpu" / "none-s0"
    committed.mkdir(parents=True)
    for k, v in run_files().items():
        (committed / k).write_bytes(v)
    members = {f"clip_b-s0/{k}": v for k, v in run_files(lr="5.0e-05").items()}
    line = refused_after(root, returned(tmp_path, members))
    assert "clip_b-s0 was trained with other settings" in line and "optim.lr: 2e-05 in none-s0, 5e-05 here" in line
    # the same settings (another method, another seed's folder name) are collected
    ok = {f"clip_b-s0/{k}": v for k, v in run_files().items()}
    collect.collect(REALM, returned(tmp_path / "b", ok), root=root, force=True)
    assert (root / "results" / "smollm2-gpu" / "clip_b-s0" / "run.json").is_file()


def refused_after(root: Path, folders: list[Path], plan: plans.Plan = REALM) -> str:
    before = written(root)
    with pytest.raises(checks.LeaseDataError) as e:
        collect.collect(plan, folders, root=root, force=True)
    assert written(root) == before
    return str(e.value)


def test_a_kernels_date_that_names_another_file_is_refused(tmp_path):
    plan = plans.PLANS["kernels"]
    out = tmp_path / "call1"
    out.mkdir()
    (out / "lease.json").write_text(json.dumps({"call": 1, "sections": [{"name": "env", "status": "ok"}]}))
    (out / "kernels-stats.json").write_text(json.dumps({"device": "H200", "date": "../../evil", "stats": {}}))
    root = tmp_path / "repo"
    root.mkdir()
    with pytest.raises(checks.LeaseDataError, match="date is '../../evil', not YYYY-MM-DD"):
        collect.collect(plan, [out], root=root)
    assert written(root) == []


def test_two_collects_in_one_second_keep_both_records(tmp_path, monkeypatch):
    monkeypatch.setattr(collect.time, "strftime", lambda fmt, t=None: "2026-12-01-120000")
    root = tmp_path / "repo"
    root.mkdir()
    a = collect.collect(REALM, returned(tmp_path / "a"), root=root, force=True)[0]
    b = collect.collect(REALM, returned(tmp_path / "b"), root=root, force=True)[0]
    assert (a.name, b.name) == ("lease-realm-2026-12-01-120000.json", "lease-realm-2026-12-01-120000-2.json")
    assert len(status.lease_records("realm", root)) == 2


def test_a_damaged_committed_record_is_named_and_left_out_so_next_still_offers_a_plan(tmp_path, capsys):
    res = tmp_path / "benchmarks" / "results"
    res.mkdir(parents=True)
    (res / "lease-kernels-2026-12-01-1200.json").write_text(json.dumps({"calls": [{"sections": [
        {"name": "env", "status": "ok"}], "call": 1}]}))
    (res / "lease-kernels-2026-12-02-1200.json").write_text(json.dumps({"calls": [[1], "x"]}))
    (res / "lease-realm-2026-12-02-1200.json").write_text("{not json")
    assert status.next_plan(tmp_path).name == "realm"
    assert status.last_wave(REALM, tmp_path) is None
    err = capsys.readouterr().err
    assert "lease-kernels-2026-12-02-1200.json: is not an object" in err and "lease-realm-2026-12-02-1200.json" in err


def test_terminal_escapes_in_a_record_reach_the_terminal_escaped(tmp_path, capsys):
    root = tmp_path / "repo"
    root.mkdir()
    wave = {"verdict": "partial", "finished": ["none-s0"], "stopped": {"clip_b-s0": "cut\x1b[2J at 40 s"}}
    collect.collect(REALM, returned(tmp_path / "a", wave=wave), root=root, force=True)
    wave["verdict"] = "partial\x1b]0;owned\x07"
    collect.collect(REALM, returned(tmp_path / "b", wave=wave), root=root, force=True)
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out
    assert "partial\\x1b]0;owned\\x07" in out and "cut\\x1b[2J at 40 s" in out


def test_kit_collect_says_one_line_and_exits_2(tmp_path, capsys):
    folders = returned(tmp_path, record={"call": "2", "sections": []})
    assert kit.main(["collect", "realm", *map(str, folders)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("collect: ") and err.endswith("nothing was written") and "\n" not in err


SETTINGS = {"train.max_steps": 60, "eval.every": 8, "eval.prompts": 64, "rollout.max_new_tokens": 128}


@pytest.mark.parametrize("sets,words", [
    ({"task.name": "os:system"}, "names task.name, which a lease may not change"),
    ({"eval.prompts": "32"}, "eval.prompts is '32', not a whole number from 1 to 64"),
    ({"eval.prompts": -5}, "eval.prompts is -5"),
    ({"train.max_steps": 100000}, "train.max_steps is 100000, not a whole number from 1 to 60"),
    ({"eval.prompts": "32\ntask:\n  name: os:system"}, "eval.prompts is '32\\ntask:"),
    ({"eval.prompts": True}, "eval.prompts is True"),
])
def test_shrink_writes_only_what_a_wave_may_shrink(tmp_path, sets, words):
    (tmp_path / "configs").mkdir()
    cfg = tmp_path / plans.REALM_CONFIG
    cfg.write_text((ROOT / plans.REALM_CONFIG).read_text())
    rec = tmp_path / "benchmarks" / "results" / "lease-realm-2026-12-02-1200.json"
    rec.parent.mkdir(parents=True)
    wave = {"verdict": "nothing fits", "settings": SETTINGS, "budget_s": 200.0, "pace_run": "none-s0",
            "pace_share": 1, "needed_s": 380.0, "pace": {"startup_s": 20.0, "step_s": 3.0, "eval_s": 20.0},
            "proposal": {"sets": sets, "predicted_s": 155.0, "budget_s": 200.0}}
    rec.write_text(json.dumps({"calls": [{"call": 2, "sections": [], "wave": wave}]}))
    before = cfg.read_text()
    with pytest.raises(SystemExit) as e:
        shrink.shrink(REALM, tmp_path)
    assert words in str(e.value) and "\n" not in str(e.value)
    assert cfg.read_text() == before
    # a proposal of the allowed keys and ranges goes through the config's own validation, then is written
    wave["proposal"]["sets"] = {"eval.prompts": 32, "train.max_steps": 30, "eval.every": 4}
    rec.write_text(json.dumps({"calls": [{"call": 2, "sections": [], "wave": wave}]}))
    assert shrink.shrink(REALM, tmp_path) == wave["proposal"]["sets"]
    assert status.config_settings(tmp_path) == {**SETTINGS, "eval.prompts": 32, "train.max_steps": 30,
                                                "eval.every": 4}


def test_nothing_the_device_returns_lands_outside_the_shipped_files(tmp_path):
    """Every member name a tar may hold is one of the 15 runs' four files or environment.json."""
    from entropy_rft.rundir.finished import SHIPPED

    root = tmp_path / "repo"
    root.mkdir()
    members = {f"{n}/{f}": v for n in ("none-s0", "kl_cov-s2") for f, v in run_files().items()}
    members["environment.json"] = b"[]"
    collect.collect(REALM, returned(tmp_path, members), root=root, force=True)
    files = [p.relative_to(root / "results" / "smollm2-gpu") for p in (root / "results" / "smollm2-gpu").rglob("*")
             if p.is_file()]
    assert sorted(map(str, files)) == sorted(["environment.json", *(f"{n}/{f}" for n in ("kl_cov-s2", "none-s0")
                                                                     for f in SHIPPED)])


# ----------------------------------------------------------------------------- the kernels plan (issue 73, item 7)

KERNELS = plans.PLANS["kernels"]


def trainer(s_step: float | None, *steps: float, error: str | None = None) -> dict:
    """One TRL trainer's pooled figures as kernels_trl.pool_trl_runs writes them, by hand: each run's ``steps``
    start with an untimed warm-up step of 9 s."""
    if error:
        return {"s_step": None, "min": None, "max": None, "n": 0, "steps": [], "peak": None, "error": error,
                "runs": [{"error": error}]}
    return {"s_step": s_step, "min": min(steps), "max": max(steps), "n": len(steps), "steps": list(steps),
            "peak": None, "runs": [{"steps": [9.0, s]} for s in steps]}


def kernels_parts() -> dict[str, dict]:
    """Each part of a kernels lease as kernels.py --json writes it (the run's fields, then the part's own), by
    hand: token_stats 5 ms against logsumexp's 10 ms; our head 50 ms against 100 ms, TRL's not installed; verl 2 ms
    against 20 ms; TRL's trainers 2.0 s (stock), 2.2 s (none) a step, clip_v failed."""
    base = {"device": "NVIDIA H200", "date": "2026-12-01", "torch": "2.11.0+cu130", "triton": "3.6.0",
            "cuda": "13.0", "quick": False, "wall_s": 10.0}
    return {
        "stats": {**base, "stats": [{
            "dtype": "bfloat16", "shape": [4096, 151936], "temperature": 1.0, "bytes": 1000,
            "t": {"copy": 0.004, "logsumexp": 0.010, "token_stats": 0.005}, "ratio": 0.5, "errors": {},
            "extra_peak": 5, "syncs": 1, "launches": 2, "launches_logsumexp": 3, "error_over_bound": {"entropy": 0.25},
            "copy_bw_fraction": 0.8}]},
        "head": {**base, "head": [{"shape": [16384, 1536, 151936], "t": {"ours": 0.05, "baseline": 0.1},
                                   "peak": {"ours": None, "baseline": None}, "errors": {"trl": "ImportError: no trl"},
                                   "max_abs_logp_err": 2e-6}]},
        "verl": {**base, "verl": {"shape": [8192, 151936], "t": {"ours": 0.002, "verl_entropy": 0.02}, "ratio": 0.1}},
        "trl": {**base, "trl": {"micro": {"stock": trainer(2.0, 1.9, 2.1), "none": trainer(2.2, 2.2),
                                          "clip_v": trainer(None, error="exit code 1")}}},
    }


def kernels_returned(tmp: Path, parts: dict[str, dict]) -> list[Path]:
    """The kernels call's folder as the device tool returns it."""
    out = tmp / "call1"
    out.mkdir(parents=True)
    (out / "lease.json").write_text(json.dumps({"call": 1, "sections": [{"name": "env", "status": "ok"}]}))
    for part, res in parts.items():
        (out / f"kernels-{part}.json").write_text(json.dumps(res))
    return [out]


def test_a_whole_kernels_lease_is_collected_into_its_table(tmp_path):
    root = tmp_path / "repo"
    root.mkdir()
    got = collect.collect(KERNELS, kernels_returned(tmp_path, kernels_parts()), root=root)
    assert [p.name for p in got[1:]] == ["nvidia-h200-2026-12-01.json", "nvidia-h200-2026-12-01.md"]
    assert got[0].name.startswith("lease-kernels-")
    md = got[2].read_text().splitlines()
    assert md[0] == "# NVIDIA H200, 2026-12-01 (torch 2.11.0+cu130, triton 3.6.0)"
    assert "| token_stats bfloat16 4096x151936 T=1.0 / logsumexp | 0.50x (5.00 ms / 10.00 ms) | <= 1.0x | PASS |" in md
    assert "| head N16384 D1536 V151936: ours / trl | ImportError: no trl |  | n/a |" in md
    assert ("| verl micro-batch 8192x151936 bf16, T 0.7 per token: ours / verl-style | 0.10x (2.00 ms / 20.00 ms) "
            "| <= 1.1x | PASS |") in md
    assert "| TRL micro: none / stock s/step | 1.10x (2.200 / 2.000 s) | <= 1.05x | MISS |" in md
    assert "| TRL micro: clip_v / stock | FAILED | <= 1.15x | MISS |" in md
    assert md[-1] == "Wall time 40 s."  # the four parts' 10 s each
    # the next lease's part of a wrong type: refused, and what the first lease committed is as it was
    parts = kernels_parts()
    parts["head"]["head"][0]["max_abs_logp_err"] = "tiny"
    line = refused_after(root, kernels_returned(tmp_path / "b", parts), plan=KERNELS)
    assert line.endswith("kernels-head.json: head[0].max_abs_logp_err is 'tiny', not a number"), line


def _drop(key: str):
    return lambda d: d.pop(key)


@pytest.mark.parametrize("part,change,words", [
    ("stats", lambda r: r.update(device="N" * 300), "device is 300 bytes long, over the 100"),
    ("stats", lambda r: r.update(device="H200\nx"), "device is 'H200\\nx', not one line of text"),
    ("stats", lambda r: r.update(stats="x"), "stats is 'x', not a list of rows"),
    ("stats", lambda r: _drop("logsumexp")(r["stats"][0]["t"]), "stats[0].t has no logsumexp"),
    ("stats", lambda r: r["stats"][0].update(ratio="fast"), "stats[0].ratio is 'fast', not a number"),
    ("stats", lambda r: _drop("extra_peak")(r["stats"][0]), "stats[0] has no extra_peak"),
    ("stats", lambda r: r["stats"][0].update(error_over_bound={}), "stats[0].error_over_bound is empty"),
    ("stats", lambda r: r["stats"][0].update(bytes=0), "stats[0].bytes is 0, not a positive number"),
    ("stats", lambda r: r.update(torch="2.11\n# forged"), "torch is '2.11\\n# forged', not one line of text"),
    ("stats", lambda r: r.update(quick="yes"), "quick is 'yes', not true or false"),
    ("stats", lambda r: r.update(wall_s="long"), "wall_s is 'long', not a number"),
    ("head", lambda r: r["head"][0]["t"].update(baseline=0), "head[0].t.baseline is 0, not a positive number"),
    ("head", lambda r: r["head"][0].update(shape=[16384, 1536]), "head[0].shape is [16384, 1536], not a list of 3"),
    ("head", lambda r: r["head"][0].update(errors=["trl"]), "head[0].errors is ['trl'], not an object"),
    ("verl", lambda r: _drop("ours")(r["verl"]["t"]), "verl.t has no ours"),
    ("trl", lambda r: r["trl"]["micro"]["stock"].update(s_step=None), "trl.micro.stock.s_step is None, not a positive"),
    ("trl", lambda r: r["trl"]["micro"]["stock"]["runs"][0].update(steps=[]),
     "trl.micro.stock.runs[0].steps is [], not a list of positive seconds"),
    ("trl", lambda r: r["trl"].update(micro="fast"), "trl.micro is 'fast', not an object"),
])
def test_a_kernels_part_of_the_wrong_shape_is_one_line_before_anything_is_written(tmp_path, part, change, words):
    """Each field the committed table is rendered from, or that names its files: before the lease record."""
    parts = kernels_parts()
    change(parts[part])
    root = tmp_path / "repo"
    root.mkdir()
    with pytest.raises(checks.LeaseDataError) as e:
        collect.collect(KERNELS, kernels_returned(tmp_path, parts), root=root)
    line = str(e.value)
    assert line.startswith(str(tmp_path / "call1" / f"kernels-{part}.json") + ": ") and words in line, line
    assert "\n" not in line
    assert written(root) == []
