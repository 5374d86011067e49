"""Where a policy's files are, by cheap checks only: built-in names, local model folders, the Hugging Face cache.

:func:`locate_policy` is what ``preflight`` and ``models.load_policy`` ask before any weight is loaded. No torch
here, and ``huggingface_hub`` is imported only when a hub id is looked up.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from entropy_rft.common.errors import UserError
from entropy_rft.common.paths import expand_user
from entropy_rft.common.streams import parse_json

# Built-in policy names (built by ``entropy_rft.training.sft`` and ``entropy_rft.models.loading.build_smollm2``).
DEFAULT_NAME = "default"
STRONG_NAME = "default-strong"  # the same family, every SFT target correct: the second regime of docs/results.md
SMOLLM2_NAME = "smollm2-135m"
SFT_NAMES = (DEFAULT_NAME, STRONG_NAME)  # built by SFT one layer up (``entropy_rft.training.policies``)


def policy_names() -> list[str]:
    """The built-in policy names ``load_policy`` accepts besides paths and hub ids."""
    return [*SFT_NAMES, SMOLLM2_NAME]


WEIGHT_FILES = (
    "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json"
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model", "sentencepiece.bpe.model", "tokenizer.tiktoken")
_SAFETENSORS_MAX_HEADER = 100_000_000  # safetensors' own limit (HeaderTooLarge above it)
_HUB_PROBE_TIMEOUT_S = 10.0
_BUILTIN_HINT = f"a local model folder, a hub id (org/name) or a built-in name ({', '.join(policy_names())})"


def first_line(e: BaseException) -> str:
    """The first line of an exception's message (at most 200 characters), else its type name."""
    text = str(e).strip()
    return (text.splitlines()[0][:200] if text else "") or type(e).__name__


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().upper() in {"1", "ON", "YES", "TRUE"}


TRUST_REMOTE_CODE_ENV = "ERFT_TRUST_REMOTE_CODE"


def trust_remote_code() -> bool:
    """Whether a model or tokenizer folder may run its own code (``auto_map``: transformers'
    ``trust_remote_code``): only when the person running erft opts in with ``ERFT_TRUST_REMOTE_CODE=1``. Every
    ``from_pretrained`` of erft passes this value explicitly, so transformers never asks (its interactive
    "run the custom code? [y/N]")."""
    return _env_true(TRUST_REMOTE_CODE_ENV)


def remote_code_refused(name: str, e: BaseException) -> str | None:
    """The one-line refusal of a model folder whose files ask to run their own code, when ``e`` is
    transformers' refusal of it (None otherwise)."""
    if "trust_remote_code" not in str(e):
        return None
    return (f"--model {name!r}: its files ask to run their own code (auto_map in config.json or "
            f"tokenizer_config.json); erft runs no code from a model folder unless you set "
            f"{TRUST_REMOTE_CODE_ENV}=1 for a folder you trust")


def hub_offline() -> bool:
    """Whether the hub must not be asked: ``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) set now or at import."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE) or _env_true("HF_HUB_OFFLINE") or _env_true("TRANSFORMERS_OFFLINE")


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache, read from the environment now: ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``,
    else ``huggingface_hub``'s default (``~/.cache/huggingface/hub``)."""
    from huggingface_hub import constants

    for key in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(key):
            return expand_user(os.path.expandvars(os.environ[key]), key)
    if os.environ.get("HF_HOME"):
        return expand_user(os.path.expandvars(os.environ["HF_HOME"]), "HF_HOME") / "hub"
    return Path(constants.HF_HUB_CACHE)


def _safetensors_problem(path: Path) -> str | None:
    """Why ``path`` is not a complete safetensors file (header and size only, no tensor is read), or None."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return f"{path} is truncated ({size} bytes, not even a header); re-save or re-download it"
            n = int.from_bytes(head, "little")
            if n > min(size - 8, _SAFETENSORS_MAX_HEADER):
                return (f"{path} is truncated or corrupt (its header claims {n} bytes in a {size}-byte file); "
                        "re-save or re-download it")
            header = parse_json(f.read(n))
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    except OSError as e:
        return f"{path} cannot be read ({first_line(e)})"
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        return f"{path} is corrupt (its header is not valid safetensors JSON); re-save or re-download it"
    if size < 8 + n + end:
        return f"{path} is truncated ({size} bytes, its header needs {8 + n + end}); re-save or re-download it"
    if size > 8 + n + end:
        return (f"{path} is corrupt ({size - 8 - n - end} bytes after its last tensor); "
                "re-save or re-download it")
    return None


def _read_json(path: Path, what: str) -> tuple[Any, str | None]:
    try:
        return parse_json(path.read_text(encoding="utf-8")), None
    except OSError as e:
        return None, f"{path} cannot be read ({first_line(e)})"
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        return None, f"{path} is not valid JSON ({first_line(e)}); {what}"


def folder_problem(folder: Path) -> str | None:
    """Why ``folder`` cannot be a transformers model folder (cheap checks: files, config.json parses,
    safetensors headers and sizes), or None. No weights are loaded."""
    if not folder.is_dir():
        return f"{folder} is a file, not a model folder; pass the folder that holds config.json and the weights"
    config = folder / "config.json"
    if not config.is_file():
        return (f"{folder} is not a model folder (no config.json); pass the folder that holds config.json and "
                "model.safetensors (as save_pretrained writes it)")
    data, problem = _read_json(config, "re-save or re-download the model")
    if problem:
        return problem
    if not isinstance(data, dict):
        return f"{config} is not a model config (a JSON object); re-save or re-download the model"
    weights = next((folder / w for w in WEIGHT_FILES if (folder / w).is_file()), None)
    if weights is None:
        return (f"{folder} has no weights (none of {', '.join(WEIGHT_FILES)}); save the model there with "
                "save_pretrained, or re-download it")
    if weights.name == "model.safetensors" and (problem := _safetensors_problem(weights)):
        return problem
    if weights.name.endswith(".index.json"):
        index, problem = _read_json(weights, "re-save or re-download the model")
        if problem:
            return problem
        shards = sorted(set((index or {}).get("weight_map", {}).values())) if isinstance(index, dict) else []
        if not shards:
            return f"{weights} lists no weight shards; re-save or re-download the model"
        for shard in shards:
            path = folder / shard
            if not path.is_file():
                return f"{path} is missing (listed in {weights.name}); re-download the model"
            if shard.endswith(".safetensors") and (problem := _safetensors_problem(path)):
                return problem
    if not any((folder / t).is_file() for t in TOKENIZER_FILES):
        return (f"{folder} has no tokenizer (none of tokenizer.json, tokenizer_config.json, ...); "
                "save the tokenizer there too (tokenizer.save_pretrained)")
    return _tokenizer_json_problem(folder)


def _tokenizer_json_problem(folder: Path) -> str | None:
    """The first of the tokenizer's JSON files in ``folder`` that does not parse, or None."""
    for t in ("tokenizer_config.json", "tokenizer.json", "special_tokens_map.json"):
        if (folder / t).is_file():
            _, problem = _read_json(folder / t, "re-save the tokenizer or re-download the model")
            if problem:
                return problem
    return None


def _is_repo_id(name: str) -> bool:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def _cached_snapshot(repo_id: str, cache: Path) -> Path | None | bool:
    """The cached snapshot folder of ``repo_id`` at ``main`` (found by its config.json); None if the repo is
    not cached, False if the cache records that it has no config.json."""
    from huggingface_hub import try_to_load_from_cache

    hit = try_to_load_from_cache(repo_id, "config.json", cache_dir=str(cache))
    if isinstance(hit, str):
        return Path(hit).parent
    if hit is not None:  # _CACHED_NO_EXIST
        return False
    return None


def _probe_hub(name: str, cache: Path) -> None:
    """Ask the hub (once, short timeout, no retries) whether ``name`` is a model repo with config and weights."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

    try:
        info = HfApi().model_info(name, timeout=_HUB_PROBE_TIMEOUT_S)
    except GatedRepoError:
        raise UserError(f"--model {name!r}: the hub repo is gated; accept its terms on huggingface.co and log in "
                        "(hf auth login), or pass a local folder") from None
    except RepositoryNotFoundError:
        raise UserError(f"--model {name!r}: not a local folder and no such model on the Hugging Face hub (or it is "
                        f"private: hf auth login); check the name, or pass {_BUILTIN_HINT}") from None
    except HfHubHTTPError as e:
        raise UserError(f"--model {name!r}: the Hugging Face hub refused it ({first_line(e)}); pass a local folder "
                        "or retry later") from None
    except Exception as e:  # connection refused, DNS failure, timeout, proxy errors
        raise UserError(f"--model {name!r}: not in the Hugging Face cache ({cache}) and the hub cannot be reached "
                        f"({first_line(e)}); download it where there is network (hf download {name}) into that "
                        "cache, or pass a local folder") from None
    files = {s.rfilename for s in (info.siblings or [])}
    if info.siblings is not None and "config.json" not in files:
        raise UserError(f"--model {name!r}: the hub repo has no config.json (not a transformers model); "
                        f"pass {_BUILTIN_HINT}")
    if info.siblings is not None and not files.intersection(WEIGHT_FILES):
        raise UserError(f"--model {name!r}: the hub repo has no PyTorch weights (none of {', '.join(WEIGHT_FILES)}); "
                        "pass another model or a local folder")


def locate_policy(name_or_path: str) -> str:
    """Where the policy ``name_or_path`` is, by cheap checks only (no model is built, no weight is loaded).

    Resolved as ``transformers`` does: a built-in name (``policy_names()``) is returned as is; an existing
    local folder comes first (it must hold ``config.json`` that parses, weights whose safetensors headers
    match the file sizes, and a tokenizer); anything else that is a valid hub id (``org/name``) is looked up
    in the Hugging Face cache (``hub_cache_dir()``: ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``), and a complete
    cached snapshot is returned as its local folder (used as cached, without asking the hub). An uncached id is
    refused at once when ``HF_HUB_OFFLINE`` is set; otherwise the hub is asked once (short timeout, no retries)
    and the id itself is returned, for ``from_pretrained`` to download.

    Raises ``UserError`` (one line naming the value and the fix) for a missing path, a folder that is not a
    model, a truncated or corrupt file, and a hub id that is neither cached nor available.
    """
    name = str(name_or_path)
    if name in policy_names():
        from entropy_rft.models.cache import cache_root

        cache_root()  # where a built-in policy is built: a '~nouser' in ERFT_CACHE is refused here, in one line
        return name
    path = expand_user(name, "--model")
    if name.strip() and path.exists():
        if (problem := folder_problem(path)) is not None:
            raise UserError(f"--model {name!r}: {problem}")
        return str(path)
    if not name.strip():
        raise UserError(f"--model is empty; pass {_BUILTIN_HINT}")
    if not _is_repo_id(name):
        raise UserError(f"--model {name!r}: no such folder ({path.absolute()}); pass {_BUILTIN_HINT}")
    cache = hub_cache_dir()
    offline = hub_offline()
    snapshot = _cached_snapshot(name, cache)
    if snapshot is False:
        raise UserError(f"--model {name!r}: the cached hub repo has no config.json (not a transformers model); "
                        f"pass {_BUILTIN_HINT}")
    if isinstance(snapshot, Path):
        problem = folder_problem(snapshot)
        if problem is None:
            return str(snapshot)
        if offline:
            raise UserError(f"--model {name!r}: the cached copy is incomplete: {problem} (HF_HUB_OFFLINE is set, so "
                            f"it cannot be completed; run hf download {name} where there is network)")
    elif offline:
        raise UserError(f"--model {name!r}: not a local folder and not in the Hugging Face cache ({cache}), and "
                        f"HF_HUB_OFFLINE is set; download it where there is network (hf download {name}) into "
                        "that cache (HF_HUB_CACHE or HF_HOME), unset HF_HUB_OFFLINE, or pass a local folder or a "
                        f"built-in name ({', '.join(policy_names())})")
    _probe_hub(name, cache)
    return name
