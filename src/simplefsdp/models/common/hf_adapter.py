"""The shape of a family's Hugging Face adapter, and the parts decoders share.

:mod:`simplefsdp.checkpoint.hf` does the generic sliced safetensors I/O and
asks the family's adapter (``ModelSpec.hf_adapter``, an :class:`HFAdapter`)
for each name, region and configuration. A family subclasses
:class:`HFAdapter` and supplies only what differs (see "Adding a model
family" in ``docs/design.md``):

* :class:`HFAdapter`: the protocol, documented once, with the defaults of a
  decoder stored as ``model.embed_tokens``, ``model.layers.{i}.*``,
  ``model.norm`` and ``lm_head``;
* :class:`NameMap`: our names to and from Hugging Face names, one to one;
* :class:`StackedExperts`: our stacked routed experts to and from one
  Hugging Face tensor per expert;
* :func:`pairs_to_halves` / :func:`halves_to_pairs` /
  :func:`rotary_rows_region`: the rotary layouts (Note: [Rotary channel
  order]).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

#: The top-level tensors of a decoder: ours -> Hugging Face's.
DECODER_TOP_NAMES: Mapping[str, str] = MappingProxyType(
    {
        "tok_embeddings.weight": "model.embed_tokens.weight",
        "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
)
#: The query, key, value and output projections of attention: ours -> Hugging Face's.
ATTENTION_NAMES: Mapping[str, str] = MappingProxyType(
    {f"attention.w{p}.weight": f"self_attn.{p}_proj.weight" for p in "qkvo"}
)
#: The SwiGLU feed-forward network: ours -> Hugging Face's.
FEED_FORWARD_NAMES: Mapping[str, str] = MappingProxyType(
    {
        "feed_forward.w1.weight": "mlp.gate_proj.weight",
        "feed_forward.w2.weight": "mlp.down_proj.weight",
        "feed_forward.w3.weight": "mlp.up_proj.weight",
    }
)
#: A block's two norms: ours -> Hugging Face's.
NORM_NAMES: Mapping[str, str] = MappingProxyType(
    {
        "attention_norm.weight": "input_layernorm.weight",
        "ffn_norm.weight": "post_attention_layernorm.weight",
    }
)
#: Stacked SwiGLU experts: ours (relative to a layer) -> the projection of
#: one Hugging Face expert (see :class:`StackedExperts`).
SWIGLU_EXPERT_NAMES: Mapping[str, str] = MappingProxyType(
    {"moe.experts.w1": "gate_proj", "moe.experts.w2": "down_proj", "moe.experts.w3": "up_proj"}
)
#: A decoder's output projection, filled from the embedding where the
#: checkpoint ties them.
TIED_OUTPUT: Mapping[str, str] = MappingProxyType({"output.weight": "model.embed_tokens.weight"})

_OURS_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_HF_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.weight$")


class HFAdapter:
    """Converts one family's models to and from Hugging Face checkpoints.

    Note: [The Hugging Face adapter]
        :mod:`simplefsdp.checkpoint.hf` finds a folder's family by
        ``model_types``, ``architectures`` and ``any_model_type`` (Note:
        [Which family reads a folder]), builds our configuration with
        :meth:`config_from_hf` and reads each tensor of ours region by
        region: through the optional ``read_region(name, offsets, sizes,
        config, checkpoint)`` where the family defines one (it assembles the
        region from any number of stored tensors through
        ``HFCheckpoint.read_hf``/``hf_shape``/``has``, e.g. one stacked
        expert tensor of ours from one tensor per expert), else from the
        tensor :meth:`to_hf_name` names (``tied`` where the checkpoint ties
        it) through :meth:`hf_region`. An export writes :meth:`to_hf` of
        each full tensor, sorted by :meth:`hf_sort_key`, the files
        :meth:`hf_files` names and :meth:`config_to_hf`;
        :meth:`config_differences` says why a folder does not fit a model.

    A family subclasses it, sets ``model_types`` (and ``architectures``
    where ``transformers`` has no causal-LM class of that name) and supplies
    the configuration conversions (module functions assigned as
    ``staticmethod`` where they take no state) and its names (a
    :class:`NameMap`, or :meth:`to_hf_name`/:meth:`from_hf_name` of its
    own); the tensor conversions default to a one-to-one layout.

    Attributes:
        model_types: the ``config.json`` ``model_type`` values it reads.
        architectures: the ``config.json`` ``architectures`` it reads when
            the ``model_type`` is another (``None``: ``transformers``'
            causal-LM class of each of its model types).
        any_model_type: it reads every ``model_type`` no other family reads.
        tied: our tensor -> the Hugging Face tensor that fills it when the
            checkpoint ties the output projection to the embedding.
        names: the one-to-one name map :meth:`to_hf_name` and
            :meth:`from_hf_name` use by default.
    """

    model_types: tuple[str, ...] = ()
    architectures: tuple[str, ...] | None = None
    any_model_type: bool = False
    tied: Mapping[str, str] = TIED_OUTPUT
    names: NameMap | None = None

    def to_hf_name(self, name: str) -> str:
        """Our state-dict name -> the Hugging Face name (default: by ``names``).

        Raises:
            ValueError: ``name`` is not one of the family's tensors.
        """
        return self._name_map().to_hf_name(name)

    def from_hf_name(self, name: str) -> str:
        """A Hugging Face name -> our state-dict name (default: by ``names``).

        Raises:
            ValueError: ``name`` is not one of the family's tensors.
        """
        return self._name_map().from_hf_name(name)

    def _name_map(self) -> NameMap:
        if self.names is None:
            raise NotImplementedError(f"{type(self).__name__} sets no names (a NameMap)")
        return self.names

    def config_from_hf(self, config: Mapping[str, Any], source: str = "config.json") -> Any:
        """Our configuration from a parsed ``config.json`` (``source`` names
        it in messages).

        Raises:
            ValueError: not the family's model, or a feature ours lacks (one
                line naming the key and its value).
        """
        raise NotImplementedError(f"{type(self).__name__} reads no config.json")

    def config_to_hf(self, args: Any, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
        """The ``config.json`` of our model with configuration ``args``,
        weights stored in ``dtype``."""
        raise NotImplementedError(f"{type(self).__name__} writes no config.json")

    def config_differences(self, ours: Any, theirs: Any) -> list[str]:
        """``field=ours vs theirs`` for each architecture field in which two
        configurations differ."""
        raise NotImplementedError(f"{type(self).__name__} compares no configurations")

    def to_hf(
        self, name: str, tensor: torch.Tensor, args: Any
    ) -> tuple[str, torch.Tensor] | list[tuple[str, torch.Tensor]]:
        """Our full tensor ``name`` -> ``(Hugging Face name, tensor)``, or a
        list of such pairs (one per expert of a stacked tensor, none for
        state with no Hugging Face counterpart). Default: the tensor as it
        is, under :meth:`to_hf_name`."""
        return self.to_hf_name(name), tensor

    def hf_region(
        self, name: str, offsets: Sequence[int], sizes: Sequence[int], args: Any
    ) -> tuple[list[int], list[int], Callable[[torch.Tensor], torch.Tensor]]:
        """Which region of the Hugging Face tensor holds region
        ``offsets``/``sizes`` of our tensor ``name``, and how to turn it into
        ours: ``(hf_offsets, hf_sizes, convert)``. Default: the same region,
        unchanged."""
        return list(offsets), list(sizes), _identity

    def hf_files(self, args: Any) -> list[Path]:
        """Files an export copies besides the weights (default: none)."""
        return []

    def hf_sort_key(self, hf_name: str) -> tuple[int, str]:
        """Order in the written shards: embeddings, layer by layer, norm and head."""
        match = _HF_LAYER.match(hf_name)
        if match:
            return int(match.group(1)) + 1, match.group(2)
        return (0 if "embed_tokens" in hf_name else 1 << 30), hf_name


#: The ``config.json`` keys every decoder's configuration is built from.
DECODER_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


def require_keys(
    config: Mapping[str, Any], source: str, keys: Sequence[str] = DECODER_KEYS
) -> None:
    """Refuse a ``config.json`` (``source`` in the message) that lacks any of ``keys``.

    Raises:
        ValueError: ``{source}: missing key(s) ...`` naming each missing key.
    """
    missing = [k for k in keys if k not in config]
    if missing:
        raise ValueError(f"{source}: missing key(s) {', '.join(missing)}")


def _identity(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


@dataclass(frozen=True)
class NameMap:
    """Our state-dict names <-> Hugging Face names of a decoder, one to one:
    ``layers.{i}.<ours>`` is ``model.layers.{i}.<theirs>`` for each pair of
    ``layer``, and ``top`` maps the rest.

    Attributes:
        family: the model's name in messages (``"Llama"``).
        layer: a layer's tensors, ours (relative to the layer) -> Hugging
            Face's (e.g. ``{**ATTENTION_NAMES, **NORM_NAMES, ...}``).
        top: the tensors outside the layers, ours -> Hugging Face's.
    """

    family: str
    layer: Mapping[str, str]
    top: Mapping[str, str] = field(default_factory=lambda: DECODER_TOP_NAMES)
    _from_layer: Mapping[str, str] = field(init=False, repr=False, compare=False)
    _from_top: Mapping[str, str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        inverse = {v: k for k, v in self.layer.items()}
        object.__setattr__(self, "_from_layer", MappingProxyType(inverse))
        object.__setattr__(self, "_from_top", MappingProxyType({v: k for k, v in self.top.items()}))

    def to_hf(self, name: str) -> str | None:
        """The Hugging Face name of our tensor ``name``, or ``None``."""
        return _rename(name, self.top, self.layer, _OURS_LAYER, "model.layers")

    def from_hf(self, name: str) -> str | None:
        """Our name of the Hugging Face tensor ``name``, or ``None``."""
        return _rename(name, self._from_top, self._from_layer, _HF_LAYER, "layers")

    def to_hf_name(self, name: str) -> str:
        """Our state-dict name -> the Hugging Face name.

        Raises:
            ValueError: ``name`` is none of the family's tensors.
        """
        return _found(self.to_hf(name), f"no Hugging Face name for {self.family} parameter", name)

    def from_hf_name(self, name: str) -> str:
        """A Hugging Face name -> our state-dict name.

        Raises:
            ValueError: ``name`` is none of the family's tensors.
        """
        return _found(self.from_hf(name), f"unknown Hugging Face {self.family} tensor", name)


def _found(value: str | None, what: str, name: str) -> str:
    """``value``; a ``ValueError`` "``what`` ``name``" when it is ``None``."""
    if value is None:
        raise ValueError(f"{what} {name!r}")
    return value


def _rename(
    name: str, top: Mapping[str, str], layer: Mapping[str, str], pattern: re.Pattern, prefix: str
) -> str | None:
    """``top[name]``, or ``{prefix}.{i}.{layer[rest]}`` for ``name`` matching
    ``pattern`` (layer ``i``, then ``rest``), or ``None``."""
    if name in top:
        return top[name]
    match = pattern.match(name)
    if match and match.group(2) in layer:
        return f"{prefix}.{match.group(1)}.{layer[match.group(2)]}"
    return None


@dataclass(frozen=True)
class StackedExperts:
    """Our routed experts stacked on dim 0 (``layers.{i}.moe.experts.w1``,
    ``(E, out, in)``) <-> Hugging Face's one tensor per expert
    (``model.layers.{i}.mlp.experts.{j}.gate_proj.weight``). A rank reads
    only the experts its region covers.

    Attributes:
        names: our stacked tensor (relative to the layer) -> the name of the
            projection in each Hugging Face expert.
    """

    names: Mapping[str, str] = field(default_factory=lambda: SWIGLU_EXPERT_NAMES)

    def locate(self, name: str) -> tuple[str, str] | None:
        """``(layer, ours)`` of our stacked expert tensor ``name``, or ``None``."""
        match = _OURS_LAYER.match(name)
        if match and match.group(2) in self.names:
            return match.group(1), match.group(2)
        return None

    def hf_name(self, layer: int | str, ours: str, expert: int | str) -> str:
        """The Hugging Face name of expert ``expert``'s part of our stacked
        tensor ``layers.{layer}.{ours}``."""
        return f"model.layers.{layer}.mlp.experts.{expert}.{self.names[ours]}.weight"

    def from_hf(self, hf_name: str) -> str | None:
        """Our stacked tensor holding the Hugging Face expert tensor
        ``hf_name``, or ``None``."""
        match = _HF_EXPERT.match(hf_name)
        inverse = {v: k for k, v in self.names.items()}
        if match and match.group(3) in inverse:
            return f"layers.{match.group(1)}.{inverse[match.group(3)]}"
        return None

    def to_hf(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]] | None:
        """One ``(Hugging Face name, tensor)`` pair per expert of our full
        stacked tensor ``name``, or ``None`` for another tensor."""
        located = self.locate(name)
        if located is None:
            return None
        return [(self.hf_name(*located, j), t) for j, t in enumerate(tensor.unbind(0))]

    def read(
        self, name: str, offsets: Sequence[int], sizes: Sequence[int], checkpoint: Any
    ) -> torch.Tensor | None:
        """Region ``offsets``/``sizes`` of our stacked tensor ``name`` from
        ``checkpoint`` (an ``HFCheckpoint``), reading only the experts and
        the rows and columns it covers; ``None`` for another tensor."""
        located = self.locate(name)
        if located is None:
            return None
        experts = range(offsets[0], offsets[0] + sizes[0])
        parts = [
            checkpoint.read_hf(self.hf_name(*located, j), offsets[1:], sizes[1:]) for j in experts
        ]
        return torch.stack(parts)  # (experts, *sizes[1:])


# Note: [Rotary channel order]
#     Our rotary embedding rotates adjacent channel pairs ``(2i, 2i + 1)`` of
#     each head (Meta's layout); Hugging Face's rotates channel ``i`` with
#     ``i + head_dim / 2`` ("rotate half"). Within each head our channel
#     ``2i + j`` is Hugging Face's channel ``j * head_dim / 2 + i``, so the
#     rows of the query and key projections (and of whatever scales those
#     channels before the rotation) are permuted within each head. The
#     permutation stays inside a head: a shard covering part of the heads
#     reads only the whole heads it overlaps.


def halves_to_pairs(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Whole heads along dim 0 in Hugging Face's rotary layout -> ours
    (Note: [Rotary channel order]); any trailing dims."""
    heads, tail = w.shape[0] // head_dim, w.shape[1:]
    return w.reshape(heads, 2, head_dim // 2, *tail).transpose(1, 2).reshape(w.shape)


def pairs_to_halves(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Whole heads along dim 0 in our rotary layout -> Hugging Face's
    (Note: [Rotary channel order]); any trailing dims."""
    heads, tail = w.shape[0] // head_dim, w.shape[1:]
    return w.reshape(heads, head_dim // 2, 2, *tail).transpose(1, 2).reshape(w.shape)


def rotary_rows_region(
    offsets: Sequence[int], sizes: Sequence[int], head_dim: int
) -> tuple[list[int], list[int], Callable[[torch.Tensor], torch.Tensor]]:
    """The region of a Hugging Face tensor whose rows (dim 0) are heads in
    the rotate-half layout that holds region ``offsets``/``sizes`` of ours:
    the whole heads it overlaps, and the conversion that permutes them
    (:func:`halves_to_pairs`) and cuts the region out.

    Returns:
        ``(hf_offsets, hf_sizes, convert)``, as :meth:`HFAdapter.hf_region`.
    """
    first, last = offsets[0] // head_dim, -(-(offsets[0] + sizes[0]) // head_dim)
    start = offsets[0] - first * head_dim

    def convert(block: torch.Tensor) -> torch.Tensor:
        return halves_to_pairs(block, head_dim)[start : start + sizes[0]]

    hf_offsets = [first * head_dim, *offsets[1:]]
    hf_sizes = [(last - first) * head_dim, *sizes[1:]]
    return hf_offsets, hf_sizes, convert
