"""Tiny random-weight models made at test time, one per architecture and KV shape of the model matrix.

Each model is a `transformers` config (`AutoConfig.for_model`) with seeded random weights
(`from_config` after `torch.manual_seed`), 2-4 layers and hidden size <= 256, so a vLLM engine
starts in seconds, plus the default model's tokenizer (`$DSS_MODEL_DIR`), so the chat template and
vocabulary are those of the other engine tests. A model is written once to
`~/.cache/dss/tiny-models/<name>-<hash>` (`$DSS_TINY_MODEL_DIR` overrides the parent), where the
hash covers the config, the seed and the tokenizer, and is reused by later runs.

Weights are drawn with `initializer_range=0.2` (transformers' default is 0.02): with the default,
a random model's next-token distribution is nearly flat, so greedy decoding is decided by ties in
the last bits and says little; larger weights give peaked distributions.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")
INIT_RANGE = 0.2


@dataclass(frozen=True)
class TinySpec:
    """One tiny model: a transformers `model_type` and the config fields that shape its KV."""

    name: str
    model_type: str
    config: dict[str, Any]
    attention: str  # what the matrix reports: "full", "sliding+full", "sliding", "mla"
    seed: int = 0
    notes: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def head_size(self) -> int:
        c = self.config
        if "kv_lora_rank" in c:
            return int(c["kv_lora_rank"]) + int(c["qk_rope_head_dim"])
        return int(c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"])

    @property
    def gqa(self) -> int:
        c = self.config
        return int(c["num_attention_heads"]) // int(c.get("num_key_value_heads") or c["num_attention_heads"])


def _dense(hidden: int, heads: int, kv_heads: int, head_dim: int, layers: int = 2) -> dict[str, Any]:
    return {
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
    }


SPECS: dict[str, TinySpec] = {
    s.name: s
    for s in [
        # Llama-style, head size 128, GQA 4:1 (the matrix's base case).
        TinySpec("llama-h128-gqa4", "llama", _dense(256, 4, 1, 128), "full"),
        # Shape variants: head sizes 64 / 256, GQA ratios 1, 2, 8.
        TinySpec("llama-h64-gqa1", "llama", _dense(256, 4, 4, 64), "full"),
        TinySpec("llama-h256-gqa2", "llama", _dense(256, 2, 1, 256), "full"),
        TinySpec("llama-h64-gqa8", "llama", _dense(256, 8, 1, 64), "full"),
        # Qwen2-style (attention biases), head 64, GQA 2:1.
        TinySpec("qwen2-h64-gqa2", "qwen2", _dense(256, 4, 2, 64), "full"),
        # Mistral-style: every layer a sliding window of 256 tokens.
        TinySpec("mistral-swa", "mistral", {**_dense(256, 4, 2, 64), "sliding_window": 256}, "sliding"),
        # Gemma-2-style: sliding and full attention layers alternate, window 256.
        TinySpec(
            "gemma2-swa",
            "gemma2",
            {**_dense(256, 4, 2, 64, layers=4), "sliding_window": 256, "query_pre_attn_scalar": 64},
            "sliding+full",
        ),
        # Gemma-3-style: five sliding layers per full one (here: 3 sliding, 1 full), window 256.
        TinySpec(
            "gemma3-swa",
            "gemma3_text",
            {**_dense(256, 4, 2, 64, layers=4), "sliding_window": 256, "sliding_window_pattern": 4},
            "sliding+full",
        ),
        # DeepSeek-V2-style MLA with DeepSeek's latent dims (512 + 64 = 576, the only latent size
        # vLLM's CPU MLA decode kernel is built for); the MoE is kept dense (first_k_dense_replace).
        TinySpec(
            "deepseek-v2-mla",
            "deepseek_v2",
            {
                "hidden_size": 256,
                "intermediate_size": 512,
                "moe_intermediate_size": 128,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 4,
                "kv_lora_rank": 512,
                "q_lora_rank": None,
                "qk_rope_head_dim": 64,
                "qk_nope_head_dim": 128,
                "v_head_dim": 128,
                "n_routed_experts": 4,
                "num_experts_per_tok": 2,
                "n_shared_experts": 1,
                "first_k_dense_replace": 2,
                # vLLM's DeepseekV2 never ties its output head to the embeddings: a tied checkpoint
                # (no lm_head weight) left it uninitialised, so every logit was equal (usually 0)
                # and each answer was token 0, whatever the KV, or a garbage head picked at random.
                "tie_word_embeddings": False,
            },
            "mla",
        ),
    ]
}


def tokenizer_dir() -> Path:
    """The default model's folder, whose tokenizer every tiny model uses."""
    from engine_patch.setup.model import find_model

    found = find_model()
    if found is not None:
        return found
    from tests.engine_helpers import model_path

    return model_path()


def cache_root() -> Path:
    env = os.environ.get("DSS_TINY_MODEL_DIR")
    return Path(env) if env else Path.home() / ".cache" / "dss" / "tiny-models"


def _key(spec: TinySpec, tok_dir: Path) -> str:
    h = hashlib.blake2b(digest_size=6)
    h.update(json.dumps([spec.model_type, spec.config, spec.seed, INIT_RANGE], sort_keys=True).encode())
    tok = tok_dir / "tokenizer.json"
    h.update(hashlib.blake2b(tok.read_bytes(), digest_size=8).digest() if tok.is_file() else b"")
    return h.hexdigest()


def make_tiny_model(name: str, root: Path | None = None) -> Path:
    """The folder of tiny model `name` (made on first use; later calls reuse it)."""
    spec = SPECS[name]
    tok_dir = tokenizer_dir()
    path = (root or cache_root()) / f"{name}-{_key(spec, tok_dir)}"
    if (path / "config.json").is_file() and (path / "model.safetensors").is_file():
        return path
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    cfg = AutoConfig.for_model(
        spec.model_type,
        vocab_size=len(tok),
        max_position_embeddings=4096,
        initializer_range=INIT_RANGE,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        torch_dtype="bfloat16",
        **{"tie_word_embeddings": True, **spec.config},
    )
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16)
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    for f in TOKENIZER_FILES:
        if (tok_dir / f).is_file():
            shutil.copy(tok_dir / f, tmp / f)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        tmp.rename(path)  # another process may have made it meanwhile: theirs is the same model
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


if __name__ == "__main__":
    import sys

    for n in sys.argv[1:] or list(SPECS):
        print(n, make_tiny_model(n))


# The hybrid-manager test's model (tests/engine_patch/connector/test_engine_hybrid.py, bench/swa_capacity.py):
# a window of two blocks, so turns longer than the window drop whole blocks from the sliding-window group.
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
