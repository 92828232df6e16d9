"""Model families: Llama 3 (``llama3``) and mixture of experts (``moe``).

This package's own namespace imports no torch: the configuration names below
serve command lines that check a model name before importing torch (a unit
test keeps them equal to each family's config tables).
"""

#: Names of the Llama 3 model configurations (``simplefsdp.models.llama3``).
LLAMA_MODELS: tuple[str, ...] = ("debug", "small", "8B", "70B", "405B")
#: Names of the mixture-of-experts configurations (``simplefsdp.models.moe``'s ``MOE_CONFIGS``).
MOE_MODELS: tuple[str, ...] = (
    "moe_debug",
    "moe_small",
    "deepseek_v3_16b",
    "deepseek_v3_671b",
    "llama4_scout",
)

__all__ = ["LLAMA_MODELS", "MOE_MODELS"]
