"""Tiny random-weight models made at test time (a few MB, an engine starts in seconds), with the
default model's tokenizer."""

from __future__ import annotations

import shutil
from pathlib import Path

SWA_WINDOW = 64  # tokens: two blocks
SWA_BLOCK_SIZE = 32  # the CPU backend's preferred size; it rounds a hybrid model's 16 up to it


def tiny_gemma2(root: Path, tokenizer_from: Path, window: int = SWA_WINDOW) -> Path:
    """A 4-layer Gemma-2-style model whose layers alternate sliding-window (`window` tokens) and
    full attention: vLLM's hybrid KV cache manager gives it two KV cache groups."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out = root / f"tiny-gemma2-w{window}-v2"
    if (out / "config.json").is_file():
        return out
    cfg = AutoConfig.for_model(
        "gemma2",
        vocab_size=49152,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        sliding_window=window,
        max_position_embeddings=8192,
        layer_types=["sliding_attention", "full_attention"] * 2,
        torch_dtype="float32",
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    # Gemma's RMSNorms scale by (1 + weight), initialised to 1: with them, random weights answer
    # one token over and over whatever the context. Random scales make greedy answers wander
    # over the vocabulary (~147 distinct tokens in 150), so a wrong page shows in the answer.
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if name.endswith("norm.weight"):
                weight.copy_(torch.randn(weight.shape) * 8)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (tokenizer_from / name).is_file():
            shutil.copy(tokenizer_from / name, out / name)
    return out
