"""Hub ids through the Hugging Face cache, and every model error as one UserError line (issue 13).

The hub cache is laid out by hand (``models--org--name/{refs/main,snapshots/<rev>/}``) with a micro policy in
it; nothing here reaches the network: "online" cases talk to a fake hub on 127.0.0.1 or to a closed port.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

from entropy_rft.common.errors import UserError
from entropy_rft.models import files as model_files
from entropy_rft.models import loading as models
from micro import make_micro_policy

REV = "0123456789abcdef0123456789abcdef01234567"
ERFT = Path(sys.executable).with_name("erft")


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory) -> Path:
    return make_micro_policy(tmp_path_factory.mktemp("policy") / "p")


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory, policy_dir) -> Path:
    """A hub cache holding org/name at main -> REV, laid out as huggingface_hub does: the micro policy's
    files in blobs/<sha256>, linked from snapshots/REV/."""
    hub = tmp_path_factory.mktemp("hf") / "hub"
    repo = hub / "models--org--name"
    snap = repo / "snapshots" / REV
    snap.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for f in policy_dir.iterdir():
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snap / f.name).symlink_to(Path("..") / ".." / "blobs" / blob.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REV)
    return hub


@pytest.fixture
def offline_hub(monkeypatch, hub_cache):
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return hub_cache


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True)
    return dst


def _user_error(fn, value: str) -> str:
    with pytest.raises(UserError) as e:
        fn(value)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"--model {value!r}: "), msg
    return msg


def _env(hub: Path, tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_", "TRANSFORMERS_"))}
    env.update(HF_HOME=str(tmp_path / "hf-home"), HF_HUB_CACHE=str(hub), ERFT_CACHE=str(tmp_path / "erft"),
               TOKENIZERS_PARALLELISM="false", **extra)
    return env


# ----------------------------------------------------------------------------------------- the hub cache


def test_cached_hub_id_located_and_loaded_offline(offline_hub):
    snap = offline_hub / "models--org--name" / "snapshots" / REV
    assert models.locate_policy("org/name") == str(snap)
    model, tok = models.load_policy("org/name")
    assert type(model).__name__ == "LlamaForCausalLM" and not model.training
    assert tok.padding_side == "left" and tok.pad_token is not None
    for name in models.policy_names():  # built-in names pass through untouched (nothing is built)
        assert models.locate_policy(name) == name


def test_cached_hub_id_loads_in_a_fresh_process(hub_cache, tmp_path):
    # huggingface_hub reads HF_HUB_CACHE / HF_HUB_OFFLINE at import: the honest check is a new process
    code = ("from entropy_rft.models.loading import load_policy, locate_policy\n"
            "m, t = load_policy('org/name')\n"
            "print(locate_policy('org/name'), type(m).__name__, len(t))\n")
    out = subprocess.run([sys.executable, "-c", code], env=_env(hub_cache, tmp_path, HF_HUB_OFFLINE="1"),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(hub_cache / "models--org--name" / "snapshots" / REV), "LlamaForCausalLM",
                                  "21"]


def test_uncached_hub_id_offline_one_line(offline_hub):
    t0 = time.perf_counter()
    msg = _user_error(models.locate_policy, "org/uncached")
    assert time.perf_counter() - t0 < 2  # refused from the cache alone: no request, no retry
    assert "not in the Hugging Face cache" in msg and str(offline_hub) in msg and "HF_HUB_OFFLINE" in msg
    assert "hf download org/uncached" in msg
    _user_error(models.load_policy, "org/uncached")
    msg = _user_error(models.locate_policy, "gpt2")  # a bare name is a hub id too, as in transformers
    assert "built-in name (default, default-strong, smollm2-135m)" in msg


def test_incomplete_cached_snapshot_offline(offline_hub, tmp_path, monkeypatch):
    hub = tmp_path / "hub"
    repo = _copy(offline_hub / "models--org--name", hub / "models--org--half")
    (repo / "snapshots" / REV / "model.safetensors").unlink()
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    msg = _user_error(models.locate_policy, "org/half")
    assert "cached copy is incomplete" in msg and "has no weights" in msg and str(repo / "snapshots" / REV) in msg


def test_train_cli_uncached_hub_id_fails_fast(hub_cache, tmp_path):
    t0 = time.perf_counter()
    out = subprocess.run([str(ERFT), "train", "--model", "org/uncached", "--out", str(tmp_path / "run")],
                         env=_env(hub_cache, tmp_path, HF_HUB_OFFLINE="1"), capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)
    wall = time.perf_counter() - t0
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr + out.stdout, out.stderr
    assert lines[0].startswith("erft train: error: --model 'org/uncached': not a local folder and not in the "
                               "Hugging Face cache"), lines[0]
    assert wall < 20, wall


# ----------------------------------------------------------------------------------------- "online" hubs


class _FakeHub(BaseHTTPRequestHandler):
    """GET /api/models/org/online -> a model with config and weights; any other id -> 404 RepoNotFound."""

    def do_GET(self):  # noqa: N802 (http.server's name)
        if self.path.split("?")[0] == "/api/models/org/online":
            body = json.dumps({"id": "org/online", "siblings": [{"rfilename": "config.json"},
                                                                {"rfilename": "model.safetensors"}]}).encode()
            self.send_response(200)
        elif self.path.split("?")[0] == "/api/models/org/readme-only":
            body = json.dumps({"id": "org/readme-only", "siblings": [{"rfilename": "README.md"}]}).encode()
            self.send_response(200)
        else:
            body = b'{"error": "Repository not found"}'
            self.send_response(404)
            self.send_header("X-Error-Code", "RepoNotFound")
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def online(monkeypatch, tmp_path):
    from huggingface_hub import constants

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    monkeypatch.setenv("HF_TOKEN", "")  # no token file is read, no auth header is sent

    def use(endpoint: str) -> None:
        monkeypatch.setattr(constants, "ENDPOINT", endpoint)

    return use


def test_online_hub_found_not_found_and_not_a_model(online):
    server = HTTPServer(("127.0.0.1", 0), _FakeHub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        online(f"http://127.0.0.1:{server.server_address[1]}")
        assert models.locate_policy("org/online") == "org/online"  # left to from_pretrained to download
        msg = _user_error(models.locate_policy, "org/missing")
        assert "no such model on the Hugging Face hub" in msg
        msg = _user_error(models.locate_policy, "org/readme-only")
        assert "no config.json" in msg
    finally:
        server.shutdown()
        server.server_close()


def test_unreachable_hub_fails_fast(online):
    with socket.socket() as s:  # a port nobody listens on: connection refused at once
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    online(f"http://127.0.0.1:{port}")
    t0 = time.perf_counter()
    msg = _user_error(models.locate_policy, "org/uncached")
    assert "the hub cannot be reached" in msg and "hf download org/uncached" in msg
    assert time.perf_counter() - t0 < 5


# ----------------------------------------------------------------------------------------- local folders


def test_missing_path_and_non_model_folders(tmp_path, policy_dir):
    msg = _user_error(models.locate_policy, str(tmp_path / "nope"))
    assert f"no such folder ({tmp_path / 'nope'})" in msg
    _user_error(models.load_policy, str(tmp_path / "nope"))
    _user_error(models.locate_policy, "./runs/nope/final")
    (tmp_path / "empty").mkdir()
    msg = _user_error(models.locate_policy, str(tmp_path / "empty"))
    assert "no config.json" in msg and str(tmp_path / "empty") in msg
    no_weights = _copy(policy_dir, tmp_path / "no-weights")
    (no_weights / "model.safetensors").unlink()
    msg = _user_error(models.locate_policy, str(no_weights))
    assert "has no weights" in msg
    msg = _user_error(models.locate_policy, str(policy_dir / "config.json"))
    assert "is a file, not a model folder" in msg
    with pytest.raises(UserError, match="--model is empty"):
        models.locate_policy("")


def test_truncated_safetensors_named(tmp_path, policy_dir, monkeypatch):
    bad = _copy(policy_dir, tmp_path / "trunc")
    weights = bad / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    msg = _user_error(models.locate_policy, str(bad))
    assert f"{weights} is truncated ({len(data) // 2} bytes, its header needs {len(data)})" in msg
    _user_error(models.load_policy, str(bad))
    weights.write_bytes(data[:5])
    assert "is truncated" in _user_error(models.locate_policy, str(bad))
    weights.write_bytes(b"\xff" * 64)  # a header length far beyond the file (safetensors: HeaderTooLarge)
    assert "truncated or corrupt" in _user_error(models.locate_policy, str(bad))
    # and should a broken file get past the cheap checks, loading it still gives one line naming it
    weights.write_bytes(data[: len(data) // 2])
    monkeypatch.setattr(model_files, "folder_problem", lambda folder: None)
    msg = _user_error(models.load_policy, str(bad))
    assert f"{weights} cannot be loaded (SafetensorError" in msg


def test_config_not_json_and_broken_tokenizer_named(tmp_path, policy_dir):
    bad_cfg = _copy(policy_dir, tmp_path / "cfg")
    (bad_cfg / "config.json").write_text('{"model_type": "llama",')
    msg = _user_error(models.load_policy, str(bad_cfg))
    assert f"{bad_cfg / 'config.json'} is not valid JSON" in msg
    bad_tok = _copy(policy_dir, tmp_path / "tok")
    (bad_tok / "tokenizer.json").write_text('{"version": "1.0", "trunc')
    msg = _user_error(models.locate_policy, str(bad_tok))
    assert f"{bad_tok / 'tokenizer.json'} is not valid JSON" in msg
    # a tokenizer.json that parses but is not a tokenizer: caught when loading
    (bad_tok / "tokenizer.json").write_text('{"version": "1.0"}')
    assert models.locate_policy(str(bad_tok)) == str(bad_tok)
    msg = _user_error(models.load_policy, str(bad_tok))
    assert "tokenizer" in msg and str(bad_tok) in msg and "cannot be loaded" in msg
