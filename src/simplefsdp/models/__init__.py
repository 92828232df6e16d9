"""Model families: Llama 3 (``llama3``) and mixture of experts (``moe``).

Each family is a folder with a ``spec.py`` defining its
:class:`~simplefsdp.models.spec.ModelSpec`; :mod:`simplefsdp.models.registry`
names them and their flavors. This package's own namespace imports no torch.
"""

from simplefsdp.models.registry import flavor_names as _flavor_names

#: Canonical names of the Llama 3 flavors (the registry's ``flavor_names("llama3")``).
LLAMA_MODELS: tuple[str, ...] = _flavor_names("llama3")
#: Names of the mixture-of-experts flavors (the registry's ``flavor_names("moe")``).
MOE_MODELS: tuple[str, ...] = _flavor_names("moe")

__all__ = ["LLAMA_MODELS", "MOE_MODELS"]
