"""Model families: Llama 3 (``llama3``) and mixture of experts (``moe``).

Each family is a folder with a ``spec.py`` defining its
:class:`~simplefsdp.models.spec.ModelSpec`; :mod:`simplefsdp.models.registry`
names them and their flavors. This package's own namespace imports no torch.
"""

from simplefsdp.models.registry import (
    canonical_flavor,
    family_names,
    flavor_names,
    get_spec,
    resolve_flavor,
)
from simplefsdp.models.spec import ModelSpec

__all__ = [
    "ModelSpec",
    "canonical_flavor",
    "family_names",
    "flavor_names",
    "get_spec",
    "resolve_flavor",
]
