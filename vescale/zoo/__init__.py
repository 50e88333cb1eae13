"""Model zoo: plain single-device models and ready plans that parallelise them unchanged.

    model = vescale.zoo.tiny_llama()                    # or tiny_hf_llama(): HF's LlamaForCausalLM
    plan = vescale.zoo.llama_plan(mesh, zero3=True)     # TP + SP + DP + ZeRO-3, as the mesh allows
    vescale.parallelize(model, plan, mesh)

    dit = vescale.zoo.tiny_dit()                        # diffusers' DiTTransformer2DModel, default config
    vescale.parallelize(dit, vescale.zoo.dit_plan(mesh, dit.config, zero3=True), mesh)
"""

from .data import synthetic_batches
from .dit import TINY_DIT_SIZES, dit_plan, tiny_dit
from .hf import TINY_LLAMA_SIZES, tiny_hf_llama, tiny_hf_llama_config, tiny_llama, tiny_llama_config
from .llama import LlamaConfig, LlamaForCausalLM
from .plans import llama_plan
from .moe import (TINY_MOE_SIZES, moe_plan, tiny_hf_mixtral, tiny_hf_mixtral_config, tiny_hf_qwen3_moe,
                  tiny_hf_qwen3_moe_config)
from .gpt2 import TINY_GPT2_SIZES, gpt2_plan, tiny_hf_gpt2, tiny_hf_gpt2_config

__all__ = [
    "LlamaConfig", "LlamaForCausalLM", "llama_plan", "synthetic_batches", "TINY_LLAMA_SIZES",
    "tiny_llama", "tiny_llama_config", "tiny_hf_llama", "tiny_hf_llama_config",
    "moe_plan", "TINY_MOE_SIZES", "tiny_hf_mixtral", "tiny_hf_mixtral_config", "tiny_hf_qwen3_moe",
    "tiny_hf_qwen3_moe_config",
    "gpt2_plan", "tiny_hf_gpt2", "tiny_hf_gpt2_config", "TINY_GPT2_SIZES",
    "TINY_DIT_SIZES", "tiny_dit", "dit_plan",
]
