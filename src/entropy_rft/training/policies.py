"""Which policy a ``--model`` name means, building a built-in one when needed: the layer above ``models``
(loading folders and hub ids, converting SmolLM2) and ``sft`` (building the default policy).

Building the default policy trains a small model (minutes, cached after the first time). It happens here,
as an explicit step of whoever asks for ``"default"``, never as a side effect of ``models.load_policy``.
"""

from __future__ import annotations

import os
from typing import Any

from entropy_rft.models import loading as models
from entropy_rft.models.files import SFT_NAMES, SMOLLM2_NAME


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
                build_kwargs: dict[str, Any] | None = None, cache_dir: str | os.PathLike | None = None):
    """``models.load_policy`` for any ``--model`` value: ``"default"`` and ``"default-strong"`` (built on first
    use), ``"smollm2-135m"`` (converted on first use), a local folder or a hub id. The cheap checks run first,
    so a typo fails before anything is built."""
    models.locate_policy(str(name_or_path))
    where = resolve_policy(str(name_or_path), build_kwargs=build_kwargs, cache_dir=cache_dir)
    return models.load_policy(where, device=device, dtype=dtype)
