"""Evaluation metrics: Avg@K, Pass@K (unbiased), Maj@K, distinct correct answers, pass-rate histograms, the
per-question correct counts (for paired tests over questions) and greedy pass@1.

Pass@K uses the unbiased estimator of Chen et al. (2021), as Paper A does:
``pass@k = 1 - C(n - c, k) / C(n, k)`` for n >= k samples of which c are correct.
"""

from __future__ import annotations

import hashlib
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

import numpy as np
import torch

# A [problems, K] table of 0/1 (or fractional) scores: nested sequences or an array.
Scores: TypeAlias = Sequence[Sequence[float]] | np.ndarray


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased Pass@K for one problem: 1 - C(n-c, k)/C(n, k), computed as a stable product."""
    if not (isinstance(n, (int, np.integer)) and isinstance(c, (int, np.integer)) and isinstance(k, (int, np.integer))):
        raise ValueError(f"pass_at_k: n, c, k must be integers, got n={n!r}, c={c!r}, k={k!r}")
    if n < 1 or k < 1 or k > n:
        raise ValueError(f"pass_at_k: need 1 <= k <= n, got n={n}, k={k}")
    if c < 0 or c > n:
        raise ValueError(f"pass_at_k: need 0 <= c <= n, got c={c}, n={n}")
    if n - c < k:
        return 1.0
    # C(n-c, k)/C(n, k) = prod_{i=n-c+1}^{n} (1 - k/i)
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def pass_at_k_from_hist(hist: Sequence[int], ks: Sequence[int]) -> dict[int, float]:
    """Mean unbiased Pass@k over problems for each k in ``ks``, from a pass-rate histogram: hist[c] = number of
    problems with c of n = len(hist) - 1 samples right (the one place this is computed; the report's Pass@k
    curve and ``erft eval --checkpoints`` call it)."""
    n, total = len(hist) - 1, sum(hist)
    return {k: sum(h * pass_at_k(n, c, k) for c, h in enumerate(hist)) / total for k in ks}


def avg_at_k(correct: Scores) -> float:
    """Avg@K: mean accuracy over all K samples of all problems (rows: problems, columns: samples)."""
    arr = np.asarray(correct, dtype=np.float64)
    if arr.ndim != 2 or arr.size == 0:
        raise ValueError(f"avg_at_k: correct must be a non-empty [problems, samples] array, got shape {arr.shape}")
    return float(arr.mean())


def mean_pass_at_k(correct: Scores, k: int) -> float:
    """Mean over problems of the unbiased Pass@K, from a [problems, n] 0/1 array."""
    arr = np.asarray(correct, dtype=np.float64)
    if arr.ndim != 2 or arr.size == 0:
        raise ValueError(f"mean_pass_at_k: correct must be a non-empty [problems, samples] array, got {arr.shape}")
    n = arr.shape[1]
    return float(np.mean([pass_at_k(n, int(round(c)), k) for c in arr.sum(axis=1)]))


def maj_at_k(answers: Sequence[Sequence[str | None]], correct: Scores) -> float:
    """Maj@K: a problem counts as solved when its most frequent (valid) answer is a correct one.

    Ties are broken by first occurrence. ``answers[i][j]`` is the canonical answer of sample j (None if
    unparsable); ``correct[i][j]`` whether it was right.
    """
    solved = []
    for ans, cor in zip(answers, correct):
        counts = Counter(a for a in ans if a is not None)
        if not counts:
            solved.append(0.0)
            continue
        top = max(counts.values())
        winner = next(a for a in ans if a is not None and counts[a] == top)
        idx = list(ans).index(winner)
        solved.append(float(cor[idx] > 0))
    return float(np.mean(solved)) if solved else 0.0


def distinct_correct(answers: Sequence[Sequence[str | None]], correct: Scores) -> float:
    """Mean number of distinct correct answers per problem (exploration; feasibility.md's diversity measure)."""
    per = [len({a for a, c in zip(ans, cor) if c > 0 and a is not None}) for ans, cor in zip(answers, correct)]
    return float(np.mean(per)) if per else 0.0


def correct_counts(correct: Scores) -> list[int]:
    """Per problem, in the rows' order, the number of correct samples: the row's sum of scores rounded to an
    integer (as the pass-rate histogram and Pass@K count them), so that the histogram is their tally."""
    arr = np.asarray(correct, dtype=np.float64)
    return np.rint(arr.sum(axis=1)).astype(int).tolist()


def pass_rate_histogram(correct: Scores) -> list[int]:
    """Counts of problems with c = 0, 1, ..., n correct samples (Paper A's pass-rate histogram)."""
    arr = np.asarray(correct, dtype=np.float64)
    n = arr.shape[1]
    c = np.rint(arr.sum(axis=1)).astype(int)
    return np.bincount(c, minlength=n + 1).tolist()


def question_ids(examples: Sequence) -> list[str]:
    """A stable id per example, in order: the first 12 hex digits of the SHA-256 of its prompt's text. The same
    question has the same id in every run, whatever its position, so per-question counts of runs whose
    held-out questions differ (a task whose split depends on the seed) can still be paired."""
    return [hashlib.sha256(str(ex.prompt).encode("utf-8", "backslashreplace")).hexdigest()[:12]
            for ex in examples]


def summarize(correct: Scores, answers: Sequence[Sequence[str | None]],
              prefix: str = "eval/") -> dict[str, float | list[int]]:
    """All evaluation figures for one [problems, K] result, with slash names."""
    arr = np.asarray(correct, dtype=np.float64)
    k = arr.shape[1]
    return {
        f"{prefix}avg@{k}": avg_at_k(arr),
        f"{prefix}pass@1": mean_pass_at_k(arr, 1),
        f"{prefix}pass@{k}": mean_pass_at_k(arr, k),
        f"{prefix}maj@{k}": maj_at_k(answers, arr),
        f"{prefix}distinct_correct": distinct_correct(answers, arr),
        f"{prefix}pass_rate_hist": pass_rate_histogram(arr),
        f"{prefix}correct_per_question": correct_counts(arr),
    }


@torch.no_grad()
def evaluate_policy(model, tokenizer, task, examples: Sequence, *, n_samples: int, temperature: float,
                    max_new_tokens: int, generator: torch.Generator | None = None, batch_size: int = 512,
                    prefix: str = "eval/", on_progress: Callable[[int, int], None] | None = None,
                    cuda_graphs: bool = False, check_every: int = 8) -> dict[str, Any]:
    """Sample ``n_samples`` responses per example (KV-cache sampler; ``temperature == 0`` is greedy), score them
    with the task's verifier and summarise: Avg@K, Pass@1/K, Maj@K, distinct correct answers, the pass-rate
    histogram, the mean token entropy of the sampling distribution (EOS included) and the response length.

    Returns the figures (slash names with ``prefix``) plus ``{prefix}samples``: a few (prompt, response, reward).
    ``on_progress(done, total)`` is called with the prompts evaluated so far, before the first batch and after
    each (``batch_size // n_samples`` prompts at a time). ``cuda_graphs``/``check_every``: the static sampler's
    GPU loop (``rollout.cuda_graphs``).
    """
    from entropy_rft.policy.forward import policy_forward
    from entropy_rft.policy.rollout import sample

    if not examples:
        raise ValueError("examples: need at least one example to evaluate")
    t0 = time.perf_counter()
    per_chunk = max(1, batch_size // n_samples)
    correct: list[list[float]] = []
    answers: list[list[str | None]] = []
    ent_sum, n_tok = 0.0, 0
    shown: list[dict[str, Any]] = []
    for i in range(0, len(examples), per_chunk):
        if on_progress is not None:
            on_progress(i, len(examples))
        part = examples[i : i + per_chunk]
        prompts = [ex.prompt for ex in part for _ in range(n_samples)]
        rb = sample(model, tokenizer, prompts, max_new_tokens=max_new_tokens, temperature=temperature,
                    generator=generator, cuda_graphs=cuda_graphs, check_every=check_every)
        st = policy_forward(model, rb, temperature if temperature > 0 else 1.0).stats
        ent_sum += float((st.entropy.double() * rb.response_mask).sum())
        n_tok += int(rb.response_mask.sum())
        scores = task.rewards(rb.responses, [ex for ex in part for _ in range(n_samples)])
        for j, ex in enumerate(part):
            resp = rb.responses[j * n_samples : (j + 1) * n_samples]
            correct.append(scores[j * n_samples : (j + 1) * n_samples])
            answers.append([task.canonical(r, ex) for r in resp])
            if len(shown) < 8:
                shown.append({"prompt": ex.prompt, "response": resp[0], "reward": correct[-1][0]})
    if on_progress is not None:
        on_progress(len(examples), len(examples))
    out: dict[str, Any] = summarize(correct, answers, prefix=prefix)
    out[f"{prefix}entropy"] = ent_sum / max(1, n_tok)
    out[f"{prefix}response_tokens"] = n_tok / (len(examples) * n_samples)
    out[f"{prefix}seconds"] = time.perf_counter() - t0
    out[f"{prefix}samples"] = shown
    return out


@torch.no_grad()
def greedy_correct(model, tokenizer, task, examples: Sequence, *, max_new_tokens: int, batch_size: int = 512,
                   cuda_graphs: bool = False, check_every: int = 8) -> list[int]:
    """Per example, in order, 1 when its greedy (argmax) response is correct, else 0 (its score rounded, as
    :func:`correct_counts` does): one response per prompt, ``batch_size`` prompts at a time. Greedy decoding
    draws no random number: the sampler gets a generator of its own, never read, so no other stream moves."""
    from entropy_rft.policy.rollout import sample

    if not examples:
        raise ValueError("examples: need at least one example to evaluate")
    device = next(model.parameters()).device
    unused = torch.Generator(device=device).manual_seed(0)
    scores: list[float] = []
    for i in range(0, len(examples), batch_size):
        part = list(examples[i : i + batch_size])
        rb = sample(model, tokenizer, [ex.prompt for ex in part], max_new_tokens=max_new_tokens, temperature=0.0,
                    generator=unused, cuda_graphs=cuda_graphs, check_every=check_every)
        scores += task.rewards(rb.responses, part)
    return correct_counts([[s] for s in scores])
