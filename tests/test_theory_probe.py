"""`erft probe`: figures on synthetic logits and a tiny local model, JSON output, and bad input."""

from __future__ import annotations

import json
import math

import pytest
import torch

from entropy_rft.analysis import theory_probe as tp
from entropy_rft.cli.main import main
from entropy_rft.common.errors import UserError


def _all_finite_or_none(obj) -> bool:
    if isinstance(obj, dict):
        return all(_all_finite_or_none(v) for v in obj.values())
    if isinstance(obj, list):
        return all(_all_finite_or_none(v) for v in obj)
    if isinstance(obj, float):
        return math.isfinite(obj)
    return True


def _check_figures(res: dict, max_rel: float = 0.05) -> None:
    assert _all_finite_or_none(res)
    for kind in ("single", "grpo"):
        r = res[kind]
        # O(eps^2) error: about 4x smaller per halving of eps
        for ratio in r["err_ratio"]:
            assert 3.5 < ratio < 4.6, (kind, r["err_ratio"])
        # relative error is O(eps): small, and halving with eps
        assert r["rel_err"][0] < max_rel
        assert r["rel_err"][1] < 0.6 * r["rel_err"][0]
        assert r["sign_agreement"][-1] > 0.95
        assert r["pearson"][0] > 0.99


def test_probe_synthetic_cli_json(tmp_path, capsys):
    out = tmp_path / "sub" / "probe.json"
    rc = main(["probe", "--model", "synthetic", "--positions", "48", "--seed", "3", "--json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "Thm 3.3" in printed and "Cor 3.4" in printed
    res = json.loads(out.read_text())
    assert res["positions"] == 48
    assert res["eps"] == [0.05, 0.025, 0.0125]
    _check_figures(res)
    c4 = res["cor34"]
    assert c4["residual_float64_max_rel"] < 1e-12
    assert c4["residual_max_rel"] < 2e-5 and c4["residual_max_abs"] < 1e-6
    c5 = res["cor35"]
    # S_c averages out (up to sampling noise) while the uncentred S does not
    assert c5["ratio"] < 4 * c5["noise_floor"]
    assert c5["uncentered_ratio"] > c5["ratio"]
    assert res["stats_vs_float64_max_abs_err"] < 1e-6
    assert not list(out.parent.glob(".probe-*"))  # atomic write leaves no temp file


def test_probe_is_deterministic_for_a_seed():
    cfg = tp.ProbeConfig(positions=12, vocab_sizes=(20, 300), seed=5)
    assert tp.run_probe(cfg) == tp.run_probe(cfg)
    other = tp.run_probe(tp.ProbeConfig(positions=12, vocab_sizes=(20, 300), seed=6))
    assert other["single"]["abs_err"] != tp.run_probe(cfg)["single"]["abs_err"]


def test_synthetic_logits_blocks():
    blocks = tp.synthetic_logits(10, (7, 30, 500), seed=0)
    assert [b.shape for b in blocks] == [(4, 7), (3, 30), (3, 500)]
    for b in blocks:
        assert bool(torch.isfinite(b).any(-1).all())


def _tiny_model(folder):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    chars = "abcdefghijklmnopqrstuvwxyz .,:>+*-()0123456789"
    vocab = {"<unk>": 0, "<bos>": 1}
    for ch in chars:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<bos>")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128,
                      initializer_range=0.5)  # peaked, LM-like distributions rather than near-uniform
    LlamaForCausalLM(cfg).save_pretrained(folder)
    fast.save_pretrained(folder)


def test_probe_real_local_model(tmp_path):
    folder = tmp_path / "tiny"
    _tiny_model(folder)
    out = tmp_path / "p.json"
    rc = main(["probe", "--model", str(folder), "--positions", "40", "--json", str(out),
               "--text", "the policy entropy falls when likely tokens are rewarded, 347>25:3*7+4"])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["positions"] == 40 and res["source"].startswith("model ")
    _check_figures(res, max_rel=0.2)
    assert res["cor34"]["residual_max_rel"] < 2e-5


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--positions", "0"], "--positions"),
        (["--eps", "0"], "--eps"),
        (["--eps", "2"], "--eps"),
        (["--temperature", "0"], "--temperature"),
        (["--halvings", "0"], "--halvings"),
        (["--vocab-sizes", "1,10"], "--vocab-sizes"),
        (["--model", "/no/such/model/folder"], "--model"),
        (["--model", "/no/such/folder", "--vocab-sizes", "10"], "--vocab-sizes"),
    ],
)
def test_probe_bad_input_is_a_one_line_user_error(argv, needle, capsys):
    assert main(["probe", "--positions", "4", *argv] if "--positions" not in argv else ["probe", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err


def test_validate_raises_user_error_directly():
    with pytest.raises(UserError, match="--eps"):
        tp.validate(tp.ProbeConfig(eps=float("nan")))
