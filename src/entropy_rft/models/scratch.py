"""The pieces of a policy trained from scratch: the character tokenizer, a small Llama config, saving a model
in HF format, and counting its parameters (used by :mod:`entropy_rft.training.sft` and :mod:`entropy_rft.models.micro`).
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
from tokenizers import models as tok_models
from transformers import (
    GenerationConfig,
    LlamaConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

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
