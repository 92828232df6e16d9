"""Named Llama 3 configurations.

* ``llama3_debug``: about 3.3M parameters with a byte-level vocabulary (256 bytes plus
  4 special tokens). Small enough to train on a CPU.
* ``llama3_small``: about 101M parameters (dim 768, 16 layers, 12 query heads, 4 KV
  heads) with the same 260-token byte-level vocabulary, so nearly all
  parameters are in the transformer blocks rather than in the embeddings.
* ``llama3_8b``, ``llama3_70b``, ``llama3_405b``: the published Llama 3.1 shapes (vocabulary 128256,
  rope theta 500000, Llama 3.1 rope scaling), with ``max_seq_len`` 8192.

The short names ``debug``, ``small``, ``8B``, ``70B`` and ``405B`` are
accepted aliases (:func:`simplefsdp.models.registry.canonical_flavor`).
Use :func:`get_config` to fetch one, optionally with field overrides.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

from .args import ModelArgs, RopeScaling

#: 256 byte values plus 4 special tokens.
BYTE_VOCAB_SIZE = 260

#: Published Llama 3.1 rope scaling.
LLAMA31_ROPE_SCALING = RopeScaling(
    factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)

_CONFIGS: dict[str, ModelArgs] = {
    "llama3_debug": ModelArgs(
        dim=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        vocab_size=BYTE_VOCAB_SIZE,
        multiple_of=256,
        rope_theta=500000.0,
        max_seq_len=512,
    ),
    "llama3_small": ModelArgs(
        dim=768,
        n_layers=16,
        n_heads=12,
        n_kv_heads=4,
        vocab_size=BYTE_VOCAB_SIZE,
        multiple_of=256,
        rope_theta=500000.0,
        max_seq_len=2048,
    ),
    "llama3_8b": ModelArgs(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=128256,
        multiple_of=1024,
        ffn_dim_multiplier=1.3,
        norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=LLAMA31_ROPE_SCALING,
        max_seq_len=8192,
    ),
    "llama3_70b": ModelArgs(
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        vocab_size=128256,
        multiple_of=4096,
        ffn_dim_multiplier=1.3,
        norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=LLAMA31_ROPE_SCALING,
        max_seq_len=8192,
    ),
    "llama3_405b": ModelArgs(
        dim=16384,
        n_layers=126,
        n_heads=128,
        n_kv_heads=8,
        vocab_size=128256,
        multiple_of=4096,
        ffn_dim_multiplier=1.2,
        norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=LLAMA31_ROPE_SCALING,
        max_seq_len=8192,
    ),
}


class _FlavorTable(Mapping):
    """A read-only ``name -> config`` table whose lookups also accept the
    registry's aliases (``"debug"`` finds ``"llama3_debug"``); iteration
    lists the canonical names only."""

    def __init__(self, configs: dict[str, ModelArgs]) -> None:
        self._configs = configs

    def __getitem__(self, name: str) -> ModelArgs:
        from simplefsdp.models.registry import ALIASES

        return self._configs[ALIASES.get(name, name)]

    def __iter__(self) -> Iterator[str]:
        return iter(self._configs)

    def __len__(self) -> int:
        return len(self._configs)


#: The Llama 3 flavors by canonical name (lookups accept the short aliases).
LLAMA3_CONFIGS: Mapping[str, ModelArgs] = _FlavorTable(_CONFIGS)


def get_config(name: str, **overrides: Any) -> ModelArgs:
    """Return the named configuration, optionally with fields overridden.

    Args:
        name: One of the keys of :data:`LLAMA3_CONFIGS`, or its short alias
            (``"debug"`` for ``"llama3_debug"``).
        **overrides: :class:`ModelArgs` fields to replace, e.g.
            ``get_config("debug", vocab_size=300, max_seq_len=256)``.

    Returns:
        A validated :class:`ModelArgs`.

    Raises:
        ValueError: If ``name`` is unknown (the message lists the valid names),
            an override names a field that does not exist, or the resulting
            configuration is invalid.
    """
    try:
        base = LLAMA3_CONFIGS[name]
    except KeyError:
        valid = ", ".join(repr(k) for k in LLAMA3_CONFIGS)
        raise ValueError(f"unknown Llama 3 config {name!r}; valid names: {valid}") from None
    fields = {f.name for f in dataclasses.fields(ModelArgs)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(
            f"unknown ModelArgs field(s) {unknown}; valid fields: {', '.join(sorted(fields))}"
        )
    return dataclasses.replace(base, **overrides)
