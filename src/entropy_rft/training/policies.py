"""Which policy a ``--model`` name means, building a built-in one when needed: the layer above ``models``
(loading folders and hub ids, converting SmolLM2) and ``sft`` (building the default policy).

Building the default policy trains a small model (minutes, cached after the first time). It happens here,
as an explicit step of whoever asks for ``"default"``, never as a side effect of ``models.load_policy``.
"""

from __future__ import annotations

import os
from typing import Any

from entropy_rft.common.numerics import choose_mkl_branch, mkl_fallback, numerics_record
from entropy_rft.models import loading as models
from entropy_rft.models.files import SFT_NAMES, SMOLLM2_NAME


def exact_gemm(name_or_path: str, cpu_gemm: str = "auto") -> bool:
    """Whether a policy's CPU matrix multiplies take MKL's vendor-independent branch (``model.cpu_gemm``). The
    built-in SFT policies always do: their builds and runs are what erft promises to the last digit, and a build
    (cached for every later run) happens in the process that asks for it. Otherwise 'exact' and 'fast' say so, and
    'auto' is exact for local folders and fast for SmolLM2 and hub ids (pretrained models: their CPU runs are one
    draw of their CPU's vendor, at about half the step time)."""
    if name_or_path in SFT_NAMES:
        return True
    if cpu_gemm != "auto":
        return cpu_gemm == "exact"
    return name_or_path != SMOLLM2_NAME and os.path.isdir(name_or_path)


def resolve_policy(name_or_path: str, *, build_kwargs: dict[str, Any] | None = None,
                   cache_dir: str | os.PathLike | None = None) -> str:
    """The folder (or hub id) that ``name_or_path`` refers to, building the built-in one if needed
    (``default``, ``default-strong``: their SFT recipes are ``training.sft.BUILT_IN_RECIPES``)."""
    if name_or_path in SFT_NAMES:
        from entropy_rft.training.sft import BUILT_IN_RECIPES, build_default_policy

        return str(build_default_policy(cache_dir, **{**BUILT_IN_RECIPES[name_or_path], **(build_kwargs or {})}))
    if build_kwargs:
        raise ValueError(f"build_kwargs only apply to {', '.join(SFT_NAMES)}, not {name_or_path!r}")
    if name_or_path == SMOLLM2_NAME:
        return str(models.build_smollm2(cache_dir))
    return str(name_or_path)


def load_policy(name_or_path: str, *, device: str = "cpu", dtype: Any = None,
                build_kwargs: dict[str, Any] | None = None, cache_dir: str | os.PathLike | None = None,
                cpu_gemm: str = "auto"):
    """``models.load_policy`` for any ``--model`` value: ``"default"`` and ``"default-strong"`` (built on first
    use), ``"smollm2-135m"`` (converted on first use), a local folder or a hub id. The cheap checks run first,
    so a typo fails before anything is built. MKL's branch for the process is chosen before anything is computed
    (:func:`exact_gemm` with ``cpu_gemm``, ``model.cpu_gemm``; ``numerics.choose_mkl_branch``)."""
    models.locate_policy(str(name_or_path))
    choose_mkl_branch(exact_gemm(str(name_or_path), cpu_gemm))
    from entropy_rft.training.preflight import warn_once

    warn_once(mkl_fallback(numerics_record()))  # a MKL_CBWR of the user's that MKL did not take
    where = resolve_policy(str(name_or_path), build_kwargs=build_kwargs, cache_dir=cache_dir)
    return models.load_policy(where, device=device, dtype=dtype)
