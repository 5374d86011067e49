"""The logic behind ``erft probe``: Paper A's first-order entropy dynamics checked on real distributions.

For many positions (rows of logits from a causal LM, or seeded synthetic logits) and an on-policy sampled
token k per position, it applies exact logit updates in float64 (``theory.exact_entropy_change``) and
compares the actual entropy change with the library's float32 first-order predictions:

- single-logit update z -> z + eps e_k, predicted -eps S_k (Thm 3.2);
- GRPO logit step z -> z + alpha (e_k - p), alpha = eps * sign(A), predicted -alpha S_c (Thm 3.3);
- the error |actual - predicted| is O(eps^2), so it falls ~4x each time eps halves;
- Corollary 3.4: sum_k p_k S_c(k) = sum_k p_k S_k - E_p[S] = 0 per position (residual at fp32 precision);
- Corollary 3.5: over sampled tokens, |mean S_c| << mean |S| (up to sampling noise std(S_c)/sqrt(N)).
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor

from entropy_rft.common.errors import UserError
from entropy_rft.core.correlation import agreement
from entropy_rft.core.dynamics import token_stats
from entropy_rft.core.theory import exact_entropy_change, predicted_entropy_change, single_logit_entropy_change

DEFAULT_TEXT = (
    "Reinforcement fine-tuning rewards some sampled answers and penalises others. Each update moves the "
    "logits of the sampled token, and the entropy of the policy moves with it: rewarding a likely token "
    "sharpens the distribution, rewarding an unlikely one flattens it. 347>25:3*7+4 812>19:8+1*9+2 "
    "If entropy collapses too early, the policy stops exploring and the pass rate at many samples falls. "
    "265>40:(6-2)*5+6*5 913>36:9*3+1*9 The probe below measures how well the first-order theory predicts it."
)
SYNTHETIC_VOCABS = (50, 1000, 32000, 151936)
_ROW_ELEMS = 1 << 21  # float64 working set per chunk of rows in the exact checks


@dataclass
class ProbeConfig:
    model: str = "synthetic"
    positions: int = 256
    eps: float = 0.05
    halvings: int = 2
    seed: int = 0
    temperature: float = 1.0
    text: str | None = None
    vocab_sizes: tuple[int, ...] = SYNTHETIC_VOCABS
    device: str = "cpu"
    extra: dict[str, Any] = field(default_factory=dict)


def validate(cfg: ProbeConfig) -> None:
    """Raise UserError (one line, naming the argument and the fix) for bad settings."""
    if cfg.positions < 1 or cfg.positions > 1_000_000:
        raise UserError(f"--positions must be between 1 and 1000000, got {cfg.positions}")
    if not math.isfinite(cfg.eps) or not 0 < cfg.eps <= 1:
        raise UserError(f"--eps must be in (0, 1] (the update size; try 0.05), got {cfg.eps}")
    if cfg.halvings < 1 or cfg.halvings > 10:
        raise UserError(f"--halvings must be between 1 and 10, got {cfg.halvings}")
    if not math.isfinite(cfg.temperature) or cfg.temperature <= 0:
        raise UserError(f"--temperature must be > 0 (sampling temperature), got {cfg.temperature}")
    if not cfg.vocab_sizes or any(v < 2 for v in cfg.vocab_sizes):
        raise UserError(f"--vocab-sizes must be a comma list of integers >= 2, got {cfg.vocab_sizes}")


# -------------------------------------------------------------------------------------- distributions


def synthetic_logits(positions: int, vocab_sizes: Sequence[int], seed: int) -> list[Tensor]:
    """Seeded Gaussian logits, float32, one [n_i, V_i] block per vocabulary size.

    Each row gets its own scale, log-uniform in [0.3, 10] (high to low entropy); a third of the rows mask a
    random 30% of the vocabulary with -inf (never the whole row).
    """
    g = torch.Generator().manual_seed(seed)
    sizes = list(vocab_sizes)
    counts = [positions // len(sizes) + (1 if i < positions % len(sizes) else 0) for i in range(len(sizes))]
    blocks = []
    for v, n in zip(sizes, counts):
        if n == 0:
            continue
        scale = torch.exp(torch.empty(n, 1).uniform_(math.log(0.3), math.log(10.0), generator=g))
        z = torch.randn(n, v, generator=g) * scale
        masked_rows = torch.rand(n, generator=g) < 1 / 3
        mask = (torch.rand(n, v, generator=g) < 0.3) & masked_rows.unsqueeze(1)
        mask[:, 0] = False
        blocks.append(z.masked_fill_(mask, float("-inf")))
    return blocks


def _load_model(name: str, device: str):
    load_policy: Callable[..., Any] | None
    try:
        from entropy_rft.training.policies import load_policy
    except ImportError:
        load_policy = None
    try:
        if load_policy is not None:
            return load_policy(name, device=device)
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from entropy_rft.models.files import trust_remote_code

        tok = AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code())
        model = AutoModelForCausalLM.from_pretrained(name, trust_remote_code=trust_remote_code()).to(device).eval()
        return model, tok
    except UserError:
        raise
    except (OSError, ValueError, RuntimeError, KeyError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(
            f"--model {name!r} could not be loaded ({first}); give 'synthetic', 'default', "
            "'default-strong', 'smollm2-135m' or a local model folder"
        ) from None


@torch.no_grad()
def model_logits(name: str, text: str, positions: int, device: str = "cpu") -> Tensor:
    """Next-token logits [n, V] (float32) of a causal LM over ``text``, at most ``positions`` rows."""
    model, tok = _load_model(name, device)
    ids = tok(text, return_tensors="pt")["input_ids"]
    max_pos = getattr(model.config, "max_position_embeddings", None) or ids.shape[1]
    ids = ids[:, : min(ids.shape[1], max_pos, positions)]
    if ids.shape[1] < 1:
        raise UserError("--text produced no tokens for this model's tokenizer; give a longer --text")
    out = model(input_ids=ids.to(device))
    return out.logits[0].float().cpu()


# ------------------------------------------------------------------------------------------ measuring


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def _sample(z: Tensor, temperature: float, g: torch.Generator) -> Tensor:
    p = torch.softmax(z.double() / temperature, dim=-1)
    return torch.multinomial(p, 1, generator=g).squeeze(-1)


def measure(blocks: Sequence[Tensor], cfg: ProbeConfig) -> dict[str, Any]:
    """All the figures of the probe, over the rows of ``blocks`` (each [n_i, V_i] float logits)."""
    g = torch.Generator().manual_seed(cfg.seed + 1)
    t = cfg.temperature
    eps_list = [cfg.eps / 2**j for j in range(cfg.halvings + 1)]
    actual: dict[str, list[list[Tensor]]] = {k: [[] for _ in eps_list] for k in ("single", "grpo")}
    pred: dict[str, list[list[Tensor]]] = {k: [[] for _ in eps_list] for k in ("single", "grpo")}
    s_star, s_c, res_abs, res_rel, res64, stat_err = [], [], [], [], [], []
    for block in blocks:
        rows = max(1, _ROW_ELEMS // block.shape[-1])
        for start in range(0, block.shape[0], rows):
            z = block[start : start + rows].float()
            k = _sample(z, t, g)
            sign = torch.where(torch.rand(z.shape[0], generator=g) < 0.5, -1.0, 1.0).double()
            st = token_stats(z, k, t)
            s_star.append(st.s_star.double())
            s_c.append(st.s_centered.double())
            # Corollary 3.4 per position: sum_k p_k S_c(k) = sum_k p_k S_k - E_p[S]. The sum over k is formed
            # in float64; E_p[S] once in float64 (the identity itself) and once by token_stats (float32).
            lp = torch.log_softmax(z.double() / t, dim=-1)
            p = lp.exp()
            h = -torch.where(p > 0, p * lp, torch.zeros_like(p)).sum(-1)
            s_all = torch.where(p > 0, p * (h.unsqueeze(-1) + lp), torch.zeros_like(p))
            e_s = (p * s_all).sum(-1)
            scale = (p * s_all.abs()).sum(-1).clamp_min(1e-300)
            res64.append((p * (s_all - e_s.unsqueeze(-1))).sum(-1).abs() / scale)
            res = (e_s - st.s_expected.double()).abs()
            res_abs.append(res)
            res_rel.append(res / scale)
            for j, e in enumerate(eps_list):
                a1, p1 = exact_entropy_change(z, k, e, "single", t)
                a2, p2 = exact_entropy_change(z, k, e * sign, "grpo", t)
                actual["single"][j].append(a1)
                actual["grpo"][j].append(a2)
                pred["single"][j].append(single_logit_entropy_change(st, e).double())
                pred["grpo"][j].append(predicted_entropy_change(st, e * sign).double())
                if j == 0:
                    stat_err.append(torch.maximum((pred["single"][0][-1] - p1).abs(), (pred["grpo"][0][-1] - p2).abs()))
    out: dict[str, Any] = {"positions": int(sum(b.shape[0] for b in blocks)), "eps": eps_list}
    for kind in ("single", "grpo"):
        a = [torch.cat(x) for x in actual[kind]]
        pr = [torch.cat(x) for x in pred[kind]]
        abs_err = [float((ai - pi).abs().mean()) for ai, pi in zip(a, pr)]
        rel_err = [float((ai - pi).abs().sum() / pi.abs().sum().clamp_min(1e-300)) for ai, pi in zip(a, pr)]
        ag = [agreement(pi, ai) for ai, pi in zip(a, pr)]
        out[kind] = {
            "rel_err": [_finite(x) for x in rel_err],
            "abs_err": [_finite(x) for x in abs_err],
            "err_ratio": [_finite(abs_err[j] / abs_err[j + 1]) if abs_err[j + 1] > 0 else None
                          for j in range(len(eps_list) - 1)],
            "sign_agreement": [_finite(g.sign) for g in ag],
            "pearson": [_finite(g.corr) for g in ag],
            "mean_actual": _finite(float(a[0].mean())),
            "mean_predicted": _finite(float(pr[0].mean())),
        }
    s_star_t, s_c_t = torch.cat(s_star), torch.cat(s_c)
    n = s_c_t.numel()
    mean_abs_s = float(s_star_t.abs().mean())
    out["cor34"] = {
        "residual_max_abs": _finite(float(torch.cat(res_abs).max())),
        "residual_max_rel": _finite(float(torch.cat(res_rel).max())),
        "residual_float64_max_rel": _finite(float(torch.cat(res64).max())),
    }
    out["cor35"] = {
        "ratio": _finite(abs(float(s_c_t.mean())) / mean_abs_s) if mean_abs_s > 0 else None,
        "uncentered_ratio": _finite(abs(float(s_star_t.mean())) / mean_abs_s) if mean_abs_s > 0 else None,
        "noise_floor": _finite(float(s_c_t.std(unbiased=False)) / math.sqrt(n) / mean_abs_s)
        if mean_abs_s > 0 else None,
    }
    out["stats_vs_float64_max_abs_err"] = _finite(float(torch.cat(stat_err).max()))
    return out


def run_probe(cfg: ProbeConfig) -> dict[str, Any]:
    """Validate, build the distributions, measure. Returns a JSON-ready dict (no NaN: undefined is None)."""
    validate(cfg)
    torch.manual_seed(cfg.seed)
    if cfg.model == "synthetic":
        blocks = synthetic_logits(cfg.positions, cfg.vocab_sizes, cfg.seed)
        source = f"synthetic (V in {list(cfg.vocab_sizes)})"
    else:
        blocks = [model_logits(cfg.model, cfg.text or DEFAULT_TEXT, cfg.positions, cfg.device)]
        source = f"model {cfg.model}"
    figures = measure(blocks, cfg)
    cfg_d = asdict(cfg)
    cfg_d.pop("extra")
    cfg_d["vocab_sizes"] = list(cfg.vocab_sizes)
    return {"source": source, "config": cfg_d, **figures}


# ------------------------------------------------------------------------------------------- output


def _fmt(x: float | None, spec: str = ".3g") -> str:
    return "–" if x is None else format(x, spec)


def render(result: dict[str, Any]):
    """A rich renderable: the two update kinds over eps, then the two corollaries."""
    from rich.console import Group
    from rich.table import Table

    tab = Table(title=f"Entropy dynamics, first order vs exact: {result['source']}, {result['positions']} positions")
    for col in ("update", "eps", "rel. error", "err ratio eps->eps/2 (O(eps^2): ~4)", "sign agreement",
                "pearson"):
        tab.add_column(col, justify="right" if col != "update" else "left")
    names = {"single": "single logit, -eps S_k (Thm 3.2)", "grpo": "GRPO step, -alpha S_c (Thm 3.3)"}
    for kind in ("single", "grpo"):
        r = result[kind]
        for j, e in enumerate(result["eps"]):
            ratio = r["err_ratio"][j] if j < len(r["err_ratio"]) else None
            tab.add_row(names[kind] if j == 0 else "", _fmt(e), _fmt(r["rel_err"][j]), _fmt(ratio, ".2f"),
                        _fmt(r["sign_agreement"][j], ".3f"), _fmt(r["pearson"][j], ".4f"))
    cor = Table(title="Corollaries")
    cor.add_column("check")
    cor.add_column("value", justify="right")
    cor.add_column("expected")
    c4, c5 = result["cor34"], result["cor35"]
    cor.add_row("Cor 3.4 max |E_k~p[S_c]| / E_p|S|, float64", _fmt(c4["residual_float64_max_rel"]),
                "0 to float64 rounding")
    cor.add_row("Cor 3.4 same with token_stats' E_p[S] (fp32)", _fmt(c4["residual_max_rel"]),
                "0 to float32 rounding (~1e-6)")
    cor.add_row("  absolute", _fmt(c4["residual_max_abs"]), "0 up to fp32 rounding")
    cor.add_row("Cor 3.5 |mean S_c| / mean |S|", _fmt(c5["ratio"]), f"<~ noise floor {_fmt(c5['noise_floor'])}")
    cor.add_row("  for contrast |mean S| / mean |S|", _fmt(c5["uncentered_ratio"]), "not ~0")
    cor.add_row("token_stats fp32 vs float64 prediction", _fmt(result["stats_vs_float64_max_abs_err"]), "~1e-8")
    return Group(tab, cor)


def write_json_atomic(path: str, obj: Any) -> None:
    """Write JSON via a temporary file in the same folder and os.replace (never a half-written file)."""
    import json

    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".probe-", suffix=".json", dir=folder)
    except OSError as e:
        raise UserError(f"--json {path}: cannot write there ({e.strerror}); give a writable path") from None
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=2, allow_nan=False)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
