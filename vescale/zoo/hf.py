"""Tiny random LLaMA models for tests, demos and benchmarks: the zoo's own and HuggingFace's.

Both use the same sizes (``TINY_LLAMA_SIZES``), so one plan and one mesh fit either. The HF model is
built from a config, never downloaded; ``transformers`` is imported only when it is asked for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .llama import LlamaConfig, LlamaForCausalLM

if TYPE_CHECKING:
    from torch import nn

__all__ = ["TINY_LLAMA_SIZES", "tiny_llama_config", "tiny_llama", "tiny_hf_llama_config", "tiny_hf_llama"]

# Small enough for a CPU test, but every dimension a plan shards (heads, kv heads, intermediate,
# vocab, batch, sequence) divides by 2 and 4, and GQA is on (2 query heads per kv head).
TINY_LLAMA_SIZES = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def tiny_llama_config(**overrides: Any) -> LlamaConfig:
    """The in-package model's config at the tiny sizes; keyword arguments override any LlamaConfig field."""
    return LlamaConfig(**{**TINY_LLAMA_SIZES, **overrides})


def tiny_llama(**overrides: Any) -> LlamaForCausalLM:
    """The in-package LlamaForCausalLM at the tiny sizes, initialised from the default generator."""
    return LlamaForCausalLM(tiny_llama_config(**overrides))


def _transformers():
    try:
        import transformers
    except ImportError as e:
        raise ImportError(
            "the HuggingFace models in vescale.zoo need the `transformers` package; "
            "install it with `pip install -e '.[hf]'` (or `pip install transformers`)"
        ) from e
    return transformers


def tiny_hf_llama_config(**overrides: Any) -> Any:
    """A ``transformers.LlamaConfig`` at the tiny sizes with the model's default attention (SDPA),
    no KV cache; overrides use HF's names (``attn_implementation="eager"`` for HF's eager attention)."""
    # use_cache=False: training needs no KV cache, and HF's cache starts as a plain empty tensor that
    # it concatenates with the keys, which fails once the keys are DTensors.
    settings = {
        **TINY_LLAMA_SIZES, "rope_theta": 10000.0, "use_cache": False, **overrides
    }
    return _transformers().LlamaConfig(**settings)


def tiny_hf_llama(**overrides: Any) -> nn.Module:
    """``transformers.LlamaForCausalLM`` from ``tiny_hf_llama_config(**overrides)``, randomly initialised."""
    return _transformers().LlamaForCausalLM(tiny_hf_llama_config(**overrides))
