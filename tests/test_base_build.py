"""Issue 77: the built-in base policy shipped with the package (its bytes checked against their build's record and
its name and settings against the recipe; a cache gets a copy, not a build), and progress that says what a run
waits for while a base policy builds (the build's step, rate and time left; whose build it is)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from entropy_rft.launch import sweep
from entropy_rft.models import cache
from entropy_rft.models.cache import file_sha256, progress_words, write_progress
from entropy_rft.training import sft, shipped

DEFAULT_FOLDER = sft.default_policy_dir(None, isa="").name  # the pinned default's cache folder

# The package ships no base policy today: the one build made for it (an AMD EPYC, family 26) did not reproduce the
# README's table, so no bytes are shipped until a CPU that does builds them (benchmarks/cpu/shipped_policy.py
# --write). These tests ship a small build of their own under the default's folder name.
SMALL = {"steps": 4, "d_model": 32, "layers": 1, "heads": 2, "mlp": 64, "eval_prompts": 0, "batch_size": 8}


def test_nothing_is_shipped_that_a_recipe_did_not_build():
    for folder in (p for p in shipped.SHIPPED_ROOT.iterdir() if p.is_dir()) if shipped.SHIPPED_ROOT.is_dir() else ():
        assert cache.checksum_problem(folder) is None  # every file as its build recorded it
        info = json.loads((folder / "erft_build.json").read_text())
        assert folder.name == DEFAULT_FOLDER and info["recipe"] == sft.RECIPE_VERSION  # a changed recipe fails here
        assert info["build"] == {k: v for k, v in sft.DEFAULT_BUILD.items() if not k.startswith("eval_")}
        assert info["cpu_numerics"]["pinned"] is True


@pytest.fixture
def shipped_root(tmp_path, monkeypatch):
    """A package that ships a (small) build under the default's folder name."""
    built = sft.build_default_policy(tmp_path / "build-cache", **SMALL)
    root = tmp_path / "shipped"
    shutil.copytree(built, root / DEFAULT_FOLDER)
    monkeypatch.setattr(shipped, "SHIPPED_ROOT", root)
    return root


def test_a_cache_gets_the_shipped_copy_not_a_build(tmp_path, monkeypatch, shipped_root):
    monkeypatch.setattr(sft, "_build", lambda *a, **k: pytest.fail("built from the recipe"))
    monkeypatch.setattr(sft, "isa_tag", lambda: "")  # the pinned folder, as erft's pinned processes ask for it
    got = sft.build_default_policy(tmp_path / "cache")
    assert got.name == DEFAULT_FOLDER
    src = shipped_root / DEFAULT_FOLDER
    for f in src.iterdir():
        if f.name != "erft_build.json":
            assert file_sha256(got / f.name) == file_sha256(f), f.name
    info = json.loads((got / "erft_build.json").read_text())
    assert "installed_from" in info and cache.checksum_problem(got) is None
    assert sft.build_default_policy(tmp_path / "cache") == got  # cached


def test_asking_for_the_recipe_or_another_build_never_takes_the_shipped_copy(monkeypatch, shipped_root):
    monkeypatch.setenv(shipped.FROM_RECIPE_ENV, "1")
    assert shipped.shipped_folder(DEFAULT_FOLDER) is None
    monkeypatch.delenv(shipped.FROM_RECIPE_ENV)
    assert shipped.shipped_folder(DEFAULT_FOLDER) == shipped_root / DEFAULT_FOLDER
    assert shipped.shipped_folder(DEFAULT_FOLDER + "-native-avx512-mkloff") is None  # unpinned: its own bytes
    assert shipped.shipped_folder(sft.default_policy_dir(None, isa="", p_correct=1.0).name) is None  # not shipped


def test_a_damaged_shipped_copy_is_not_installed(tmp_path, monkeypatch):
    fake = tmp_path / "shipped" / "x"
    fake.mkdir(parents=True)
    (fake / "model.safetensors").write_bytes(b"abc")
    cache.write_build_info(fake, {"name": "x"})
    cache.record_checksums(fake)
    monkeypatch.setattr(shipped, "SHIPPED_ROOT", tmp_path / "shipped")
    assert shipped.shipped_folder("x") == fake
    (fake / "model.safetensors").write_bytes(b"abd")  # same size, other bytes
    assert shipped.shipped_folder("x") is None


# ----------------------------------------------------------------------------- progress while a base policy builds


def test_progress_words_from_a_builds_record(tmp_path):
    final = tmp_path / "models" / "countdown-llama-v4-seed0"
    final.parent.mkdir(parents=True)
    assert progress_words(final) is None
    write_progress(final, "the base policy default", 0, 690, time.time())
    assert progress_words(final) == f"process {os.getpid()} builds the base policy default: step 0/690"
    write_progress(final, "the base policy default", 230, 690, time.time() - 100.0)
    words = progress_words(final)
    # 230 steps in ~100 s: 2.3 steps/s; 460 left: ~3.3 min
    assert words.startswith(f"process {os.getpid()} builds the base policy default: step 230/690, 2.3 steps/s")
    assert "about 3.3 min left" in words
    rec = json.loads(cache.progress_path(final).read_text())
    rec["pid"] = 2**22 + 12345  # a killed build's leftover: no such process
    cache.progress_path(final).write_text(json.dumps(rec))
    assert progress_words(final) is None


def test_compare_says_its_run_waits_for_the_base_policy_build(tmp_path, monkeypatch):
    monkeypatch.setenv("ERFT_CACHE", str(tmp_path / "cache"))
    folder = sft.default_policy_dir(None, **sft.BUILT_IN_RECIPES["default"])
    folder.parent.mkdir(parents=True)
    cfg = SimpleNamespace(model=SimpleNamespace(name="default"), train=SimpleNamespace(max_steps=300))
    v = SimpleNamespace(label="clip_v", dirname="clip_v")
    assert sweep.progress_words(tmp_path / "out", v, 0, cfg) == "clip_v seed 0: starting"
    write_progress(folder, "the base policy default", 69, 690, time.time() - 30.0)
    words = sweep.progress_words(tmp_path / "out", v, 0, cfg)
    assert words.startswith(f"clip_v seed 0: waiting for its base policy (process {os.getpid()} builds the base "
                            "policy default: step 69/690, 2.3 steps/s, about 4.5 min left")


HOLDER = """
import sys, time
from filelock import FileLock
lock = FileLock(sys.argv[1])
lock.acquire()
print("held", flush=True)
time.sleep(float(sys.argv[2]))
lock.release()
"""


def test_a_process_waiting_on_anothers_build_says_whose_it_is(tmp_path, monkeypatch, capsys):
    final = tmp_path / "models" / "p"
    final.parent.mkdir(parents=True)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(final.parent / ".p.lock"), "1.5"],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    rec = {"pid": holder.pid, "what": "the base policy default", "step": 40, "steps": 690,
           "started": time.time() - 20, "updated": time.time()}
    cache.progress_path(final).write_text(json.dumps(rec))
    monkeypatch.setattr(cache, "WAIT_NOTE_S", 0.3)

    def build(tmp: Path) -> None:
        (tmp / "w").write_text("x")
        cache.write_build_info(tmp, {"name": "p"})

    assert cache.cached_build(final, build) == final
    holder.wait(timeout=30)
    err = capsys.readouterr().err
    assert f"erft: waiting for the build of p: process {holder.pid} builds the base policy default: step 40/690" in err
    assert not cache.progress_path(final).exists()  # the record goes with the build


def test_a_build_without_a_terminal_says_what_it_does_and_records_its_progress(tmp_path, monkeypatch, capsys):
    seen = []
    monkeypatch.setattr(sft, "write_progress", lambda final, what, step, steps, started: seen.append((what, step)))
    small = {"steps": 20, "d_model": 32, "layers": 1, "heads": 2, "mlp": 64, "eval_prompts": 0, "batch_size": 8}
    sft.build_default_policy(tmp_path, **small)
    err = capsys.readouterr().err
    assert "building the base policy: 20 SFT steps" in err
    assert "SFT step 20/20 loss" in err and "steps/s, about 0.0 min left" in err
    # not a built-in recipe: named by its folder; at the start and every 10 steps
    assert [s for _, s in seen] == [0, 10, 20] and seen[0][0].startswith("the base policy countdown-llama-v4-seed0-")
