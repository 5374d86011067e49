"""The trackers of ``train.report_to`` (issue 16, item 3): W&B (offline) and MLflow (a SQLite store in the run
directory) record the same metrics as metrics.jsonl, at the same steps, and a resume continues the same tracker
run. Expected values come from metrics.jsonl; the trackers' own files are read back with their own formats."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import pytest

from entropy_rft.cli.main import main
from entropy_rft.common.options import TRACKERS, trackers_selected
from entropy_rft.config.loading import load_config
from entropy_rft.rundir import files as rundir
from micro import again, make_micro_policy, micro_overrides


@pytest.fixture(scope="module")
def micro_model(tmp_path_factory) -> Path:
    return make_micro_policy(tmp_path_factory.mktemp("micro") / "policy")


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """W&B offline with its settings and cache in tmp; MLflow on the run directory's own store."""
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / var.lower()))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


def scalars(rows: list[dict]) -> dict[int, dict[str, float]]:
    """metrics.jsonl as {step: {key: number}}: what every tracker must hold."""
    return {r["step"]: {k: v for k, v in r.items()
                        if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"} for r in rows}


def same(got: dict[int, dict[str, float]], want: dict[int, dict[str, float]]) -> None:
    assert sorted(got) == sorted(want)
    for step, row in want.items():
        assert sorted(got[step]) == sorted(row), f"step {step}"
        assert got[step] == pytest.approx(row, rel=1e-6, abs=1e-12), f"step {step}"


# ----------------------------------------------------------------------------- W&B's offline files


def wandb_records(path: Path) -> list:
    """The records of a ``.wandb`` transaction log: W&B's LevelDB-style log (7-byte file header ':W&B', then
    32 KiB blocks of chunks with a 7-byte header crc32/length/type; full=1, first=2, middle=3, last=4) of
    ``wandb_internal_pb2.Record`` protobufs. wandb 0.31 ships no Python reader of it."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    pos, chunk, out = 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pos += 7
        if kind == 0 and n == 0:  # zero fill to the end of the block
            pos += left - 7
            continue
        chunk += data[pos:pos + n]
        pos += n
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(chunk)
            out.append(rec)
            chunk = b""
    return out


def wandb_runs(out: Path) -> list[tuple[str, dict[int, dict[str, float]]]]:
    """(run id, history {step: {key: value}}) of each offline run folder in ``<out>/wandb``, oldest first."""
    runs = []
    for folder in sorted(p for p in (out / "wandb").glob("offline-run-*") if not p.is_symlink()):
        (log,) = folder.glob("run-*.wandb")
        run_id, history = None, {}
        for rec in wandb_records(log):
            kind = rec.WhichOneof("record_type")
            if kind == "run":
                run_id = rec.run.run_id
            elif kind == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
                step = items.pop("_step")
                history[step] = {k: v for k, v in items.items() if not k.startswith("_")}
        runs.append((run_id, history))
    return runs


# ----------------------------------------------------------------------------- MLflow's store


def mlflow_client(out: Path):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{(out / 'mlflow.db').resolve()}")


def as_mlflow(rows: dict[int, dict[str, float]]) -> dict[int, dict[str, float]]:
    """MLflow's names of metrics.jsonl's keys: '@' (eval/pass@K) is refused by MLflow and written '_at_'; every
    other key must already be an MLflow name, unchanged."""
    allowed = re.compile(r"[\w\-. :/]+")
    assert all(allowed.fullmatch(k.replace("@", "_at_")) for row in rows.values() for k in row)
    return {s: {k.replace("@", "_at_"): v for k, v in row.items()} for s, row in rows.items()}


def mlflow_history(client, run_id: str) -> dict[int, dict[str, float]]:
    got: dict[int, dict[str, float]] = {}
    for key in client.get_run(run_id).data.metrics:
        for m in client.get_metric_history(run_id, key):
            assert key not in got.get(m.step, {}), f"{key} logged twice at step {m.step}"
            got.setdefault(m.step, {})[key] = m.value
    return got


# ----------------------------------------------------------------------------- the runs


def train_args(micro_model: Path, out: Path, **extra) -> list[str]:
    sets = micro_overrides(micro_model, **{"train.max_steps": 2, "train.checkpoint_every": 2, "eval.every": 2,
                                           "train.samples_every": 0, "probe.records_every": 0, **extra})
    return ["train", "--out", str(out), *sum((["--set", s] for s in sets), [])]


def test_wandb_offline_and_mlflow_record_metrics_jsonl_and_resume_into_the_same_run(micro_model, tmp_path, offline):
    out = tmp_path / "run"
    assert main(train_args(micro_model, out, **{"train.report_to": "[tensorboard, wandb, mlflow]"})) == 0
    ids = json.loads((out / "trackers.json").read_text())
    wandb_id, mlflow_id = ids["wandb"]["id"], ids["mlflow"]["run_id"]
    assert ids["wandb"]["project"] == "entropy-rft" and ids["wandb"]["name"] == "run"
    first = scalars(rundir.read_jsonl(out / "metrics.jsonl"))
    assert sorted(first) == [0, 1, 2]
    (run_id, history), = wandb_runs(out)
    assert run_id == wandb_id
    same(history, first)
    client = mlflow_client(out)
    same(mlflow_history(client, mlflow_id), as_mlflow(first))

    # Resume to step 4: the same W&B run (a second offline segment of the same id) and the same MLflow run.
    assert main(["train", "--resume", str(out), *again(out), "--max-steps", "4"]) == 0
    assert json.loads((out / "trackers.json").read_text()) == ids
    rows = scalars(rundir.read_jsonl(out / "metrics.jsonl"))
    assert sorted(rows) == [0, 1, 2, 3, 4]
    segments = wandb_runs(out)
    assert [rid for rid, _ in segments] == [wandb_id, wandb_id]
    assert all(p.name.split("-", 3)[3].startswith(wandb_id)
               for p in (out / "wandb").glob("offline-run-*") if not p.is_symlink())
    same(segments[0][1], {s: rows[s] for s in (0, 1, 2)})
    same(segments[1][1], {s: rows[s] for s in (3, 4)})
    same(mlflow_history(client, mlflow_id), as_mlflow(rows))
    runs = client.search_runs([client.get_experiment_by_name("entropy-rft").experiment_id])
    assert [r.info.run_id for r in runs] == [mlflow_id]
    assert runs[0].info.status == "FINISHED" and runs[0].info.run_name == "run"
    rundir.check_new(out, overwrite=True)  # wandb/, mlflow.db, trackers.json are a run's own: --overwrite may go


def test_an_unknown_tracker_is_refused_before_anything_is_written(micro_model, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(train_args(micro_model, out, **{"train.report_to": "[tensorboard, neptune]"})) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "train.report_to" in err[0] and "'neptune'" in err[0]
    assert all(name in err[0] for name in TRACKERS)
    assert not out.exists()


@pytest.mark.parametrize("sets,want", [
    ([], ["tensorboard"]),
    (["train.tensorboard=false"], []),
    (["train.wandb=true"], ["tensorboard", "wandb"]),
    (["train.report_to=none", "train.wandb=true"], ["wandb"]),
    (["train.report_to=mlflow"], ["mlflow"]),
    (["train.report_to=[wandb, mlflow]", "train.wandb=true", "train.tensorboard=false"], ["wandb", "mlflow"]),
])
def test_legacy_switches_add_and_remove_trackers(sets, want):
    assert trackers_selected(load_config(None, sets).train) == want
