"""Bad command lines get one line, exit 2, no traceback, and create nothing (issue 13).

Each case runs the real ``erft`` in a subprocess (a small thread pool runs them all at once, the first time a
case is asked for) and checks: exit status 2, stderr is exactly one non-empty line that contains the case's
substring (the field, file or value it is about), no "Traceback" anywhere, and the case's ``--out`` folder was
not created, so that a corrected retry with the same ``--out`` starts cleanly.

``ERFT_BIN`` runs the table against another ``erft`` executable (used to count the tracebacks of an older tree).
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

ERFT = Path(os.environ.get("ERFT_BIN") or Path(sys.executable).parent / "erft")
WORKERS = 4
TIMEOUT_S = 120

# Small settings, so that a case that wrongly passes every check fails fast instead of training for minutes.
SMALL = ["--max-steps", "1", "--set", "eval.every=0", "--set", "rollout.prompts_per_step=2",
         "--set", "rollout.group_size=2", "--set", "train.threads=1"]


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        return False


IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0
HAS_CUDA = _has_cuda()


@dataclass(frozen=True)
class Case:
    id: str
    argv: tuple[str, ...]
    must: str  # stderr must contain this (the field, file or value)
    out: str | None = None  # a folder that must not exist afterwards
    skip: str | None = None  # reason to skip here


def train(cid: str, *args: str, must: str, out: str | None = "", skip: str | None = None) -> Case:
    """A train case with the small settings; ``out=""``: its own --out runs/<id>, which must not be created."""
    if out == "":
        out = f"runs/{cid}"
        args = (*args, "--out", out)
    return Case(cid, ("train", *SMALL, *args), must, out, skip)


def case(cid: str, *argv: str, must: str, out: str | None = None, skip: str | None = None) -> Case:
    return Case(cid, tuple(argv), must, out, skip)


NO_CUDA = "a CUDA GPU is available here" if HAS_CUDA else None
# Cases that import torch or transformers (the rest fail before): started first.
SLOW = ("model-not", "model-trunc", "device-cuda", "device-mps", "method-unknown", "methods-", "trl-")

CASES: list[Case] = [
    # --- train: task
    train("task-unknown", "--task", "nosuch", must="nosuch"),
    train("task-empty", "--task", "", must="task"),
    train("task-bad-import-path", "--task", "no_such_pkg.mod:Cls", must="no_such_pkg"),
    train("log-every-negative", "--set", "train.log_every=-1", must="train.log_every"),
    train("task-rg-unknown", "--task", "rg:no_such_dataset", must="basic_arithmetic"),
    train("task-rg-bad-param", "--task", "rg:products", "--set", "task.params={params: {max_digitz: 1}}",
          must="max_digitz"),
    train("task-rg-bad-format", "--task", "rg:products", "--set", "task.params={answer_format: xml}",
          must="answer_format"),
    train("task-param-unknown", "--set", "task.params={foo: 1}", must="foo"),
    train("task-param-bad-value", "--set", "task.params={max_target: 500}", must="max_target"),
    train("task-params-not-mapping", "--set", "task.params=3", must="task.params"),
    train("data-file-latin1", "--task", "math", "--set", "task.params={source: data_latin1.jsonl}",
          must="data_latin1.jsonl"),
    train("data-file-bad-json", "--task", "math", "--set", "task.params={source: data_bad.json}",
          must="data_bad.json"),
    train("data-file-missing", "--task", "math", "--set", "task.params={source: nosuch.jsonl}",
          must="nosuch.jsonl"),
    train("math-no-source", "--task", "math", must="task.params"),
    train("task-param-wrong-type", "--set", "task.params={n_val: abc}", must="n_val"),
    train("task-param-nested-type", "--task", "math",
          "--set", "task.params={source: data_ok.jsonl, val_task_params: 3}", must="val_task_params"),
    # --- train: output folder
    train("out-is-file", "--out", "afile", must="afile", out=None),
    train("out-under-file", "--out", "afile/run", must="afile", out=None),
    train("out-proc", "--out", "/proc/erft-run", must="/proc", out=None),
    train("out-sys", "--out", "/sys/erft-run", must="/sys", out=None),
    train("out-empty", "--out", "", must="--out", out=None),
    train("out-unwritable", "--out", "ro/run", must="ro", out="ro/run",
          skip="root writes into a 0555 folder" if IS_ROOT else None),
    train("out-name-too-long", "--out", "x" * 300, must="longer than", out=None),
    # --- train: config files
    train("config-latin1", "--config", "latin.yaml", must="latin.yaml"),
    train("config-bad-yaml", "--config", "bad.yaml", must="bad.yaml"),
    train("config-top-list", "--config", "list.yaml", must="list.yaml"),
    train("config-missing", "--config", "missing.yaml", must="missing.yaml"),
    train("config-is-folder", "--config", "adir", must="adir"),
    train("config-empty", "--config", "empty.yaml", must="empty.yaml' is empty"),
    train("config-key-twice", "--config", "twice.yaml", must="'optim' twice"),
    train("config-preset-unknown-method", "--config", "preset_name.yaml", must="method.presets.nope"),
    train("config-preset-unknown-param", "--config", "preset_param.yaml", must="method.presets.clip_b"),
    train("config-empty-name", "--config", "", must="--config"),
    train("config-unknown-field", "--config", "typo.yaml", must="optim.lrr"),
    train("config-python-tag", "--config", "tag.yaml", must="tag.yaml"),
    # --- train: values
    train("betas-strings", "--set", "optim.betas=[a,b]", must="optim.betas"),
    train("betas-one", "--set", "optim.betas=[0.9]", must="optim.betas"),
    train("betas-scalar", "--set", "optim.betas=0.9", must="optim.betas"),
    train("betas-out-of-range", "--set", "optim.betas=[0.9,1.5]", must="optim.betas"),
    train("betas-bool", "--set", "optim.betas=[true,0.9]", must="optim.betas"),
    train("betas-nan", "--set", "optim.betas=[0.9,.nan]", must="optim.betas"),
    train("lr-inf", "--set", "optim.lr=.inf", must="optim.lr"),
    train("lr-nan-string", "--set", "optim.lr=nan", must="optim.lr"),
    train("lr-word", "--set", "optim.lr=fast", must="optim.lr"),
    train("lr-huge-int", "--set", "optim.lr=" + "9" * 400, must="optim.lr"),
    train("temperature-nan", "--set", "rollout.temperature=.nan", must="rollout.temperature"),
    train("eps-high-neg-inf", "--set", "algo.eps_high=-.inf", must="algo.eps_high"),
    train("max-grad-norm-inf", "--set", "optim.max_grad_norm=.inf", must="optim.max_grad_norm"),
    train("weight-decay-negative", "--set", "optim.weight_decay=-0.1", must="optim.weight_decay"),
    train("adv-eps-negative", "--set", "algo.adv_eps=-1", must="algo.adv_eps"),
    train("threads-negative", "--set", "train.threads=-1", must="train.threads"),
    train("group-size-zero", "--set", "rollout.group_size=0", must="rollout.group_size"),
    train("checkpoint-every-float", "--set", "train.checkpoint_every=1.5", must="train.checkpoint_every"),
    train("progress-not-bool", "--set", "train.progress=maybe", must="train.progress"),
    train("seed-huge", "--set", "train.seed=99999999999", must="train.seed"),
    train("preset-not-mapping", "--set", "method.presets.none=3", must="method.presets.none"),
    train("method-param-int-key", "--set", "method.params={1: 2}", must="method.params"),
    train("rollout-backend-unknown", "--set", "rollout.backend=foo", must="rollout.backend"),
    train("entropy-target-schedule-bad", "--set", "method.entropy_target={kind: linear}", must="entropy_target"),
    train("section-not-mapping", "--set", "model=3", must="model"),
    train("unknown-section", "--set", "nosuch.field=1", must="nosuch"),
    train("set-no-equals", "--set", "optim.lr", must="optim.lr"),
    train("set-empty-key", "--set", "=1", must="--set"),
    train("set-empty-part", "--set", "optim..lr=1", must="optim..lr"),
    # wandb and mlflow are in the test extra; trackio is not (it needs pillow < 13, constraints.txt has 13).
    train("tracker-missing", "--set", "train.report_to=[trackio]", must="pip install trackio"),
    train("tracker-unknown", "--set", "train.report_to=[tensorboard, neptune]", must="train.report_to"),
    # --- train: device
    train("device-cuda", "--set", "model.device=cuda", must="cuda", skip=NO_CUDA),
    train("device-mps", "--set", "model.device=mps", must="mps", skip="macOS" if sys.platform == "darwin" else None),
    train("device-garbage", "--set", "model.device=foo", must="model.device"),
    train("device-bad-index", "--set", "model.device=cuda:x", must="model.device"),
    train("device-empty", "--set", "model.device=", must="model.device"),
    # --- train: flags
    train("max-steps-zero", "--max-steps", "0", must="max-steps"),
    train("max-steps-negative", "--max-steps", "-5", must="max-steps"),
    train("max-steps-word", "--max-steps", "abc", must="--max-steps"),
    train("seed-negative", "--seed", "-1", must="train.seed"),
    train("method-unknown", "--method", "nosuch", must="nosuch"),
    train("entropy-target-garbage", "--method", "clip_v", "--entropy-target", "lots", must="entropy_target"),
    train("entropy-target-inf", "--method", "clip_v", "--entropy-target", "inf", must="entropy_target"),
    train("engine-unknown", "--engine", "bogus", must="--engine"),
    train("trl-section-unknown-key", "--engine", "trl", "--set", "trl.use_vlm=true", must="trl.use_vllm"),
    train("trl-refuses-unhonoured", "--engine", "trl", "--set", "algo.drop_uniform_groups=true",
          must="algo.drop_uniform_groups"),
    train("unknown-flag", "--bogus-flag", must="--bogus-flag"),
    # --- train: model (entropy_rft.models.loading.locate_policy)
    train("model-missing-path", "--model", "/nonexistent/model", must="/nonexistent/model"),
    train("model-missing-relative", "--model", "./no_model_here", must="no_model_here"),
    train("model-not-a-model-folder", "--model", "notmodel", must="notmodel"),
    train("model-truncated-safetensors", "--model", "trunc_model", must="model.safetensors"),
    train("model-empty", "--model", "", must="model"),
    # --- train --resume (only arguments; damaged run directories are tested elsewhere)
    case("resume-missing", "train", "--resume", "no_such_run", must="no_such_run"),
    case("resume-empty", "train", "--resume", "", must="--resume"),
    case("resume-with-method", "train", "--resume", "fakerun", "--method", "clip_v", must="--method"),
    case("resume-with-seed-0", "train", "--resume", "fakerun", "--seed", "0", must="--seed"),
    # --- eval
    case("eval-nothing", "eval", "--out", "ev/nothing", must="--model", out="ev/nothing"),
    case("eval-model-missing", "eval", "--model", "/nonexistent/model", "--dataset", "countdown", "--out", "ev/m",
         must="/nonexistent/model", out="ev/m"),
    case("eval-run-missing", "eval", "--run", "no_such_run", must="no_such_run"),
    case("eval-run-no-final", "eval", "--run", "fakerun", "--out", "ev/nf", must="final", out="ev/nf"),
    case("eval-samples-zero", "eval", "--model", "default", "--samples", "0", must="--samples"),
    case("eval-limit-zero", "eval", "--model", "default", "--limit", "0", must="--limit"),
    case("eval-batch-size-zero", "eval", "--model", "default", "--batch-size", "0", "--out", "ev/b",
         must="--batch-size", out="ev/b"),
    case("eval-threads-negative", "eval", "--model", "default", "--threads", "-1", must="--threads"),
    case("eval-temperature-nan", "eval", "--model", "default", "--temperature", "nan", must="--temperature"),
    case("eval-seed-negative", "eval", "--model", "default", "--seed", "-1", must="--seed"),
    case("eval-device-garbage", "eval", "--model", "default", "--device", "gpu0", must="gpu0"),
    case("eval-dataset-unknown", "eval", "--model", "default", "--dataset", "nosuch", "--out", "ev/d",
         must="nosuch", out="ev/d"),
    case("eval-task-param-unknown", "eval", "--model", "default", "--dataset", "countdown", "--task-param", "foo=1",
         must="foo"),
    case("eval-task-param-no-equals", "eval", "--model", "default", "--task-param", "foo", must="foo"),
    case("eval-data-latin1", "eval", "--model", "default", "--dataset", "math", "--task-param",
         "source=data_latin1.jsonl", must="data_latin1.jsonl"),
    case("eval-out-is-file", "eval", "--model", "default", "--out", "afile", must="afile"),
    case("eval-pass-k-zero", "eval", "--model", "default", "--pass-k", "0", must="--pass-k"),
    case("eval-pass-k-word", "eval", "--model", "default", "--pass-k", "a,b", must="--pass-k"),
    case("eval-dtype-bad", "eval", "--model", "default", "--dtype", "int8", must="--dtype"),
    # --- compare
    case("compare-methods-empty", "compare", "--methods", "", "--out", "cmp/e", must="--methods", out="cmp/e"),
    case("compare-seed-negative", "compare", "--methods", "none", "--seed", "-1", "--out", "cmp/n", must="--seed",
         out="cmp/n"),
    case("compare-seeds-zero", "compare", "--methods", "none", "--seeds", "0", "--out", "cmp/s", must="--seeds",
         out="cmp/s"),
    case("compare-out-is-file", "compare", "--methods", "none", "--out", "afile", must="afile"),
    case("compare-twice", "compare", "--methods", "none,none", "--out", "cmp/t", must="twice", out="cmp/t"),
    case("compare-lr-inf", "compare", "--methods", "none", "--set", "optim.lr=.inf", "--out", "cmp/l",
         must="optim.lr", out="cmp/l"),
    case("compare-variant-no-value", "compare", "--methods", "clip_v:mu", "--out", "cmp/v", must="mu", out="cmp/v"),
    case("compare-empty-target", "compare", "--methods", "clip_v@", "--out", "cmp/at", must="clip_v@", out="cmp/at"),
    case("compare-model-missing", "compare", "--methods", "none", "--model", "/nonexistent/model", "--out", "cmp/m",
         must="/nonexistent/model", out="cmp/m"),
    case("compare-task-unknown", "compare", "--methods", "none", "--set", "task.name=nosuch", "--out", "cmp/k",
         must="nosuch", out="cmp/k"),
    case("compare-no-out", "compare", "--methods", "none", must="--out"),
    case("compare-jobs-zero", "compare", "--methods", "none", "--jobs", "0", "--out", "cmp/j", must="--jobs",
         out="cmp/j"),
    case("compare-targets-empty", "compare", "--methods", "all", "--entropy-targets", ",", "--out", "cmp/te",
         must="--entropy-targets", out="cmp/te"),
    case("compare-methods-empty-item", "compare", "--methods", "none,,clip_b", "--out", "cmp/ei", must="empty item",
         out="cmp/ei"),
    case("compare-param-twice", "compare", "--methods", "clip_v:mu=1.5:mu=2", "--out", "cmp/pt", must="mu twice",
         out="cmp/pt"),
    case("compare-targets-twice", "compare", "--methods", "clip_b", "--entropy-targets", "0.5x,0.5x", "--out",
         "cmp/tt", must="gives 0.5x twice", out="cmp/tt"),
    case("compare-targets-bad", "compare", "--methods", "clip_b", "--entropy-targets", "0.5x,abc", "--out",
         "cmp/tb", must="--entropy-targets 'abc'", out="cmp/tb"),
    case("compare-targets-no-knob", "compare", "--methods", "none,grad_mask", "--entropy-targets", "0.5x", "--out",
         "cmp/nk", must="knob", out="cmp/nk"),
    case("compare-entry-target-bad", "compare", "--methods", "clip_v@foo=1", "--out", "cmp/eb",
         must="--methods entry 'clip_v@foo=1'", out="cmp/eb"),
    case("compare-out-run-dir", "compare", "--methods", "none", "--out", "fakerun", must="training run directory"),
    case("compare-out-foreign", "compare", "--methods", "none", "--out", "notmodel", must="README.md"),
    case("compare-targets-method-unknown", "compare", "--methods", "nosuch", "--entropy-targets", "0.5x", "--out",
         "cmp/tm", must="nosuch", out="cmp/tm"),
    # --- report
    case("report-run-missing", "report", "no_such_run", "--out", "rep/a", must="no_such_run", out="rep/a"),
    case("report-run-is-file", "report", "afile", "--out", "rep/b", must="afile", out="rep/b"),
    case("report-out-is-file", "report", "fakerun", "--out", "afile", must="afile"),
    case("report-out-proc", "report", "fakerun", "--out", "/proc/erft-report", must="/proc"),
    case("report-no-out", "report", "fakerun", must="--out"),
    # --- probe
    case("probe-vocab-words", "probe", "--vocab-sizes", "a,b", must="--vocab-sizes"),
    case("probe-vocab-with-model", "probe", "--model", "default", "--vocab-sizes", "50", must="--vocab-sizes"),
    case("probe-seed-negative", "probe", "--seed", "-1", must="--seed"),
    case("probe-model-missing", "probe", "--model", "/nonexistent/model", must="/nonexistent/model"),
    case("probe-device-garbage", "probe", "--model", "default", "--device", "gpu", must="gpu"),
    case("probe-json-folder", "probe", "--json", "adir", must="adir"),
    case("probe-json-proc", "probe", "--json", "/proc/erft.json", must="/proc"),
    case("probe-json-under-file", "probe", "--json", "afile/x.json", must="afile"),
    # --- filter
    case("filter-n-zero", "filter", "--n", "0", must="--n"),
    case("filter-min-pass-word", "filter", "--min-pass", "abc", must="--min-pass"),
    case("filter-min-above-max", "filter", "--min-pass", "0.9", "--max-pass", "0.1", must="--min-pass"),
    case("filter-temperature-zero", "filter", "--temperature", "0", must="--temperature"),
    case("filter-batch-size-negative", "filter", "--batch-size", "-1", must="--batch-size"),
    case("filter-dataset-unknown", "filter", "--dataset", "nosuch", "--out", "flt/d", must="nosuch", out="flt/d"),
    case("filter-model-missing", "filter", "--dataset", "countdown", "--model", "/nonexistent/model", "--out",
         "flt/m", must="/nonexistent/model", out="flt/m"),
    case("filter-out-run-dir", "filter", "--dataset", "countdown", "--model", "default", "--out", "fakerun",
         must="training run directory"),
    case("filter-out-is-file", "filter", "--dataset", "countdown", "--model", "default", "--out", "afile",
         must="afile"),
    # --- fit-law
    case("fit-law-run-missing", "fit-law", "no_such_run", must="no_such_run"),
    case("fit-law-run-is-file", "fit-law", "afile", must="afile"),
    case("fit-law-frac-two", "fit-law", "fakerun", "--fit-frac", "2", must="--fit-frac"),
    case("fit-law-frac-nan", "fit-law", "fakerun", "--fit-frac", "nan", must="--fit-frac"),
    case("fit-law-json-folder", "fit-law", "fakerun", "--json", "adir", must="adir"),
    case("fit-law-entropy-bad", "fit-law", "fakerun", "--entropy", "bogus", must="--entropy"),
    # --- experiment
    case("experiment-unknown", "experiment", "bogus", must="bogus"),
    case("experiment-steps-one", "experiment", "masking", "--steps", "1", "--out", "exp/s", must="--steps",
         out="exp/s"),
    case("experiment-window-zero", "experiment", "masking", "--window", "0", "--out", "exp/w", must="--window",
         out="exp/w"),
    case("experiment-tol-nan", "experiment", "masking", "--tol", "nan", "--out", "exp/t", must="--tol", out="exp/t"),
    case("experiment-windows-overlap", "experiment", "masking", "--steps", "6", "--window", "4", "--out", "exp/o",
         must="--steps >= 8", out="exp/o"),
    case("experiment-method-set", "experiment", "masking", "--set", "method.name=clip_b", "--out", "exp/n",
         must="--set method.name", out="exp/n"),
    case("experiment-out-is-file", "experiment", "masking", "--out", "afile", must="afile"),
    case("experiment-lr-negative", "experiment", "masking", "--set", "optim.lr=-1", "--out", "exp/l",
         must="optim.lr", out="exp/l"),
    case("experiment-model-missing", "experiment", "masking", "--model", "/nonexistent/model", "--out", "exp/m",
         must="/nonexistent/model", out="exp/m"),
    # --- methods, and the command line itself
    case("methods-unknown", "methods", "nosuch", must="nosuch"),
    case("no-command", must="COMMAND"),
    case("unknown-command", "nosuchcmd", must="nosuchcmd"),
]


# ----------------------------------------------------------------------------- the scratch folder


def _safetensors_truncated() -> bytes:
    header = json.dumps({"w": {"dtype": "F32", "shape": [1000], "data_offsets": [0, 4000]}}).encode()
    return struct.pack("<Q", len(header)) + header + b"\0" * 10


def make_workdir(root: Path) -> Path:
    """The files the cases name: a plain file, bad configs, bad data files, non-model folders, a run dir."""
    w = root / "work"
    w.mkdir()
    (w / "afile").write_text("not a folder\n")
    (w / "adir").mkdir()
    (w / "latin.yaml").write_bytes("model:\n  name: caf\xe9\n".encode("latin-1"))
    (w / "bad.yaml").write_text("optim: [unclosed\n")
    (w / "list.yaml").write_text("- 1\n- 2\n")
    (w / "typo.yaml").write_text("optim:\n  lrr: 0.1\n")
    (w / "empty.yaml").write_text("# nothing but a comment\n")
    (w / "twice.yaml").write_text("optim:\n  lr: 1.0e-3\nrollout:\n  group_size: 2\noptim:\n  lr: 2.0e-3\n")
    (w / "preset_name.yaml").write_text("method:\n  presets:\n    nope: {mu: 1.0}\n")
    (w / "preset_param.yaml").write_text("method:\n  presets:\n    clip_b: {nope: 1.0}\n")
    (w / "tag.yaml").write_text("optim: !!python/object/apply:os.system ['true']\n")
    (w / "data_latin1.jsonl").write_bytes('{"prompt": "caf\xe9?", "answer": "1"}\n'.encode("latin-1"))
    (w / "data_bad.json").write_text('[{"prompt": "1+1", "answer": ')
    (w / "data_ok.jsonl").write_text("".join(json.dumps({"prompt": f"{i}+1?", "answer": str(i + 1)}) + "\n"
                                             for i in range(20)))
    (w / "notmodel").mkdir()
    (w / "notmodel" / "README.md").write_text("not a model\n")
    tm = w / "trunc_model"
    tm.mkdir()
    (tm / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tm / "model.safetensors").write_bytes(_safetensors_truncated())
    (tm / "tokenizer.json").write_text("{}")
    run = w / "fakerun"
    run.mkdir()
    (run / "config.yaml").write_text("method:\n  name: none\ntrain:\n  seed: 0\n")
    rows = [{"step": s, "eval/pass@1": 0.1 + 0.002 * s, "eval/avg@8": 0.1 + 0.002 * s,
             "eval/entropy": 0.8 - 0.002 * s, "entropy/mean": 0.8 - 0.002 * s} for s in range(0, 201, 20)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "run.json").write_text(json.dumps({"status": "finished", "step": 200}))
    ro = w / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    return w


def _env(root: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("ERFT_DEBUG", "PYTHONWARNINGS")}
    env.update(HF_HUB_OFFLINE="1", HF_HOME=str(root / "hf"), ERFT_CACHE=str(root / "erft-cache"),
               TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    return env


@dataclass
class Result:
    rc: int
    stdout: str
    stderr: str
    seconds: float
    created: bool


def _run(c: Case, work: Path, env: dict[str, str]) -> Result:
    t0 = time.perf_counter()
    try:
        p = subprocess.run([str(ERFT), *c.argv], cwd=work, env=env, capture_output=True, text=True,
                           timeout=TIMEOUT_S, stdin=subprocess.DEVNULL)
        rc, out, err = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        rc, out, err = -999, str(e.stdout or ""), f"TIMEOUT after {TIMEOUT_S}s: {e.stderr or ''}"
    created = c.out is not None and (work / c.out).exists()
    return Result(rc, out, err, time.perf_counter() - t0, created)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, Result]:
    root = tmp_path_factory.mktemp("bad-inputs")
    work = make_workdir(root)
    env = _env(root)
    todo = [c for c in CASES if c.skip is None]
    # The slow cases (they import torch or transformers) first, so that the pool ends together.
    todo.sort(key=lambda c: not c.id.startswith(SLOW))
    if os.environ.get("ERFT_BIN"):  # another erft: each case a fresh process of it
        with ThreadPoolExecutor(WORKERS) as pool:
            futures = {c.id: pool.submit(_run, c, work, env) for c in todo}
            out = {cid: f.result() for cid, f in futures.items()}
    else:
        out = _run_forked(todo, work, env)
    (work / "ro").chmod(0o755)
    return out


def _run_forked(todo: list[Case], work: Path, env: dict[str, str]) -> dict[str, Result]:
    """Every case as its own process forked from tests/cli_zygote.py, which imported torch and erft's command line
    once (a fresh erft process spends ~2.5 s on torch before refusing a bad compare or filter argument)."""
    zygote = subprocess.Popen([sys.executable, str(Path(__file__).with_name("cli_zygote.py")), str(WORKERS)],
                              cwd=work, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    requests = "".join(json.dumps(list(c.argv)) + "\n" for c in todo)
    stdout, stderr = zygote.communicate(requests, timeout=TIMEOUT_S * 8)
    answers = [json.loads(line) for line in stdout.splitlines()]
    assert zygote.returncode == 0 and len(answers) == len(todo), stderr[-3000:]
    return {c.id: Result(a["rc"], a["stdout"], a["stderr"], a["seconds"], c.out is not None and (work / c.out).exists())
            for c, a in zip(todo, answers)}


def test_enough_cases_and_unique_ids():
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids)), "duplicate case ids"
    assert len(APPLICABLE) >= 60


# A case whose premise does not hold on this machine (root writes into a 0555 folder; a GPU makes
# model.device=cuda valid) is not a bad input here: it is left out of the table rather than skipped.
APPLICABLE = [c for c in CASES if c.skip is None]


@pytest.mark.parametrize("c", APPLICABLE, ids=[c.id for c in APPLICABLE])
def test_bad_input_is_one_line(c: Case, results: dict[str, Result]):
    r = results[c.id]
    shown = f"erft {' '.join(c.argv)}\nrc={r.rc}\nstderr:\n{r.stderr}\nstdout:\n{r.stdout[-2000:]}"
    assert "Traceback" not in r.stderr + r.stdout, shown
    assert r.rc == 2, shown
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].strip(), shown
    assert lines[0].startswith("erft"), shown
    assert ": error: " in lines[0], shown
    assert c.must in lines[0], shown
    assert not r.created, f"{c.out} was created\n{shown}"


# ----------------------------------------------------------------------------- --debug, exit codes, helpers


def test_debug_flag_and_env_show_the_traceback(tmp_path):
    env = _env(tmp_path)
    argv = [str(ERFT), "train", "--set", "optim.betas=[a,b]", "--out", str(tmp_path / "run")]
    plain = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert plain.returncode == 2 and "Traceback" not in plain.stderr
    for extra_argv, extra_env in (([str(ERFT), "--debug", *argv[1:]], {}), (argv, {"ERFT_DEBUG": "1"}),
                                  ([*argv, "--debug"], {})):
        p = subprocess.run(extra_argv, env={**env, **extra_env}, capture_output=True, text=True, timeout=TIMEOUT_S)
        assert p.returncode != 0 and "Traceback" in p.stderr and "optim.betas" in p.stderr, p.stderr
    assert not (tmp_path / "run").exists()


def test_unexpected_and_os_errors_are_one_line(monkeypatch, capsys):
    import errno

    from entropy_rft.cli import main as cli

    def boom(args):
        raise RuntimeError("kaput\nsecond line")

    def disk_full(args):
        raise OSError(errno.ENOSPC, "No space left on device", "/data/run/metrics.jsonl")

    def denied(args):
        raise PermissionError(errno.EACCES, "Permission denied", "/data/run")

    def interrupted(args):
        raise KeyboardInterrupt

    for fn, code, text in ((boom, 1, "internal error: RuntimeError: kaput; second line (rerun with --debug"),
                           (disk_full, 1, "'/data/run/metrics.jsonl': No space left on device"),
                           (denied, 2, "'/data/run': Permission denied"),
                           (interrupted, 130, "interrupted")):
        monkeypatch.setattr("entropy_rft.cli.methods.run", fn)
        assert cli.main(["methods"]) == code
        err = capsys.readouterr().err
        assert text in err and len(err.splitlines()) == 1, err
    monkeypatch.setattr("entropy_rft.cli.methods.run", boom)
    with pytest.raises(RuntimeError):
        cli.main(["--debug", "methods"])


def test_unwritable_folder_is_named(tmp_path, monkeypatch):
    """Root writes anywhere, so the permission case is checked in-process with os.access denied."""
    from entropy_rft.common.errors import UserError
    from entropy_rft.training import preflight

    real_access = os.access
    monkeypatch.setattr(preflight.os, "access", lambda p, mode: False if Path(p) == tmp_path else real_access(p, mode))
    with pytest.raises(UserError, match="permission denied on folder") as e:
        preflight.check_out(tmp_path / "run")
    assert str(tmp_path) in str(e.value)
    assert not (tmp_path / "run").exists()


def test_prompt_lengths():
    from entropy_rft.common.errors import UserError
    from entropy_rft.training.preflight import check_prompt_lengths

    check_prompt_lengths([10, 20], 12, 64, truncate=False)
    check_prompt_lengths([10, 20], 12, None, truncate=False)
    check_prompt_lengths([], 12, 8, truncate=False)
    check_prompt_lengths([60], 12, 64, truncate=True)  # cut to 52 prompt tokens
    with pytest.raises(UserError, match="rollout.max_new_tokens to at most 3,") as e:
        check_prompt_lengths([10, 20, 60, 61], 12, 64, truncate=False)
    assert "2 of 4 prompts" in str(e.value)
    with pytest.raises(UserError, match="rollout.max_new_tokens"):
        check_prompt_lengths([5], 64, 64, truncate=True)
    with pytest.raises(UserError, match="shorten the prompts"):
        check_prompt_lengths([70], 12, 64, truncate=False)


def test_config_backends_match_rollout():
    from entropy_rft.config.schema import ROLLOUT_BACKENDS
    from entropy_rft.policy.rollout import BACKENDS

    assert tuple(ROLLOUT_BACKENDS) == tuple(BACKENDS)


def test_cli_and_config_import_no_torch():
    code = ("import sys, entropy_rft.cli.main as c, entropy_rft.config.schema, entropy_rft.training.preflight; "
            "c.build_parser(); "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=TIMEOUT_S)
    assert p.stdout.strip() == "[]", p.stdout + p.stderr
