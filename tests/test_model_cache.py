"""A cache that cannot lie (issue 36 item 5): a cached model whose files changed after their build (same size,
finite values, loadable) is built again when erft asks the cache for it, and refused in one line when it is
loaded by its path."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
from safetensors.torch import load_file

from entropy_rft.common.errors import UserError
from entropy_rft.models import cache
from entropy_rft.models import loading as models
from entropy_rft.training import policies, sft

MICRO = {"steps": 4, "batch_size": 8, "d_model": 32, "layers": 1, "heads": 2, "mlp": 64, "eval_prompts": 0,
         "eval_samples": 0}


def _damage_in_place(path: Path) -> None:
    """Overwrite one float32 of the last tensor's data with another finite value: same size, still loadable."""
    data = bytearray(path.read_bytes())
    at = len(data) - 8
    old = struct.unpack_from("<f", data, at)[0]
    struct.pack_into("<f", data, at, old + 0.25)
    path.write_bytes(bytes(data))


def _thing_build(calls: list[Path]):
    def build(tmp: Path) -> None:
        calls.append(tmp)
        (tmp / "weights.bin").write_bytes(bytes(range(256)) * 4)
        cache.write_build_info(tmp, {"name": "thing"})
    return build


def test_the_build_records_what_it_wrote_and_a_change_in_place_is_rebuilt(tmp_path, capfd):
    final, calls = tmp_path / "models" / "thing", []
    build = _thing_build(calls)
    assert cache.cached_build(final, build) == final
    files = cache.read_build_info(final)["files"]
    assert set(files) == {"weights.bin"} and files["weights.bin"]["size"] == 1024
    assert cache.checksum_problem(final) is None
    assert cache.cached_build(final, build) == final and len(calls) == 1  # intact: reused

    blob = final / "weights.bin"
    blob.write_bytes(b"\xff" + blob.read_bytes()[1:])  # same size, another first byte
    cache._DIGESTS.clear()  # as in a new process (within one, a write in place also changes the file's mtime)
    assert "weights.bin changed after its build" in cache.checksum_problem(final)
    assert cache.cached_build(final, build) == final and len(calls) == 2  # rebuilt
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(final) in err[0] and "building it again" in err[0]
    assert blob.read_bytes() == bytes(range(256)) * 4 and cache.checksum_problem(final) is None


def test_a_folder_without_checksums_is_rebuilt(tmp_path):
    """A folder an older erft built records no checksums: it cannot vouch for its bytes, so it is built again."""
    final, calls = tmp_path / "models" / "thing", []
    final.mkdir(parents=True)
    (final / "weights.bin").write_bytes(b"old")
    cache.write_build_info(final, {"name": "thing"})
    assert "records no checksums" in cache.checksum_problem(final)
    cache.cached_build(final, _thing_build(calls))
    assert len(calls) == 1 and cache.checksum_problem(final) is None


def test_a_damaged_base_policy_is_rebuilt_by_erft_and_refused_by_path(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("ERFT_CACHE", str(tmp_path / "cache"))
    folder = sft.build_default_policy(progress=False, **MICRO)
    weights = folder / "model.safetensors"
    built = weights.read_bytes()
    _damage_in_place(weights)
    assert weights.stat().st_size == len(built) and weights.read_bytes() != built
    assert all(t.isfinite().all() for t in load_file(weights).values())  # nothing else would notice

    with pytest.raises(UserError) as refused:  # loaded by its path: refused, one line naming the folder and fix
        models.load_policy(str(folder))
    msg = str(refused.value)
    assert "\n" not in msg and str(folder) in msg and "model.safetensors changed after its build" in msg
    assert f"delete {folder} and it is built again" in msg

    model, _ = policies.load_policy("default", build_kwargs=MICRO)  # asked of the cache: built again
    assert "building it again" in capfd.readouterr().err
    assert weights.read_bytes() == built  # the same bytes as the first build (deterministic per seed)
    assert model is not None and cache.checksum_problem(folder) is None


def test_the_converted_smollm2_records_its_checksums(smollm2_cache):
    """SmolLM2's conversion goes through the same cached build: its record covers the 540 MB of weights."""
    folder = models.build_smollm2(smollm2_cache)
    files = cache.read_build_info(folder)["files"]
    assert files["model.safetensors"]["size"] == (folder / "model.safetensors").stat().st_size
    assert {"config.json", "tokenizer.json"} <= set(files) and cache.checksum_problem(folder) is None
