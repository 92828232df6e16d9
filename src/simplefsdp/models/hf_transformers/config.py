"""The configuration of a ``transformers`` causal LM: its ``config.json``.

Torch-free and ``transformers``-free at import; :func:`config_from_hf`
imports ``transformers`` to check the folder's configuration the way
``AutoConfig`` reads it.

Note: [Code from a model folder]
    A ``config.json`` with ``auto_map`` names Python files of the folder that
    ``transformers`` would import and run (``trust_remote_code``). They run
    only when the user passes ``--checkpoint.trust_remote_code true``; the
    configuration then records the folder (``code_folder``), since the
    modeling code lives there and nowhere else.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

#: ``config.json`` keys that record where and how a file was written, not the
#: architecture; left out of :meth:`TransformersConfig.differences`.
_NOT_ARCHITECTURE = frozenset(
    {"transformers_version", "torch_dtype", "dtype", "_name_or_path", "use_cache", "architectures"}
)


@dataclass(frozen=True)
class TransformersConfig:
    """A ``transformers`` causal LM: its ``config.json`` and what training reads of it.

    Attributes:
        hf_config: the parsed ``config.json`` (``model_type`` included).
        vocab_size: the vocabulary (``config.json``'s ``vocab_size``).
        max_seq_len: the longest sequence trained on
            (``max_position_embeddings``, or a ``model.max_seq_len`` override).
        trust_remote_code: the folder's own modeling code may run (see
            Note: [Code from a model folder]).
        code_folder: the folder holding that code (``None``: the model is
            one of ``transformers``' own classes).
    """

    hf_config: Mapping[str, Any] = field(default_factory=dict)
    vocab_size: int = 0
    max_seq_len: int = 2048
    trust_remote_code: bool = False
    code_folder: str | None = None
    keys: Mapping[str, str] = field(default_factory=dict)

    @property
    def model_type(self) -> str:
        """``config.json``'s ``model_type``."""
        return str(self.hf_config.get("model_type", ""))

    def key(self, name: str) -> str:
        """The ``config.json`` key holding the standard field ``name``
        (``num_hidden_layers``, ``hidden_size``, ``num_attention_heads``,
        ``max_position_embeddings``): GPT-2 keeps the layers in ``n_layer``,
        MPT in ``n_layers`` (see :func:`field_keys`)."""
        return self.keys.get(name, name)

    def get(self, name: str, default: Any = None) -> Any:
        """The value of the standard field ``name`` under the key this
        model's ``config.json`` gives it."""
        return self.hf_config.get(self.key(name), default)

    @property
    def n_layers(self) -> int:
        """Decoder layers (``num_hidden_layers`` or the model's own key for
        it; 0 when the config does not say)."""
        return int(self.get("num_hidden_layers") or 0)

    def __hash__(self) -> int:  # the config.json mapping is not hashable itself
        return hash((json.dumps(self.hf_config, sort_keys=True, default=str), self.vocab_size,
                     self.max_seq_len, self.trust_remote_code, self.code_folder,
                     tuple(sorted(self.keys.items()))))  # fmt: skip

    def replace(self, **changes: Any) -> TransformersConfig:
        """A copy with ``changes`` applied."""
        return dataclasses.replace(self, **changes)

    def differences(self, other: TransformersConfig) -> list[str]:
        """``key=ours vs theirs`` for each architecture key of ``config.json``
        in which two configurations differ."""
        keys = sorted((set(self.hf_config) | set(other.hf_config)) - _NOT_ARCHITECTURE)
        return [
            f"{k}={self.hf_config.get(k)!r} vs {other.hf_config.get(k)!r}"
            for k in keys
            if self.hf_config.get(k) != other.hf_config.get(k)
        ]


#: The standard fields training reads, and the keys other models keep them
#: under: where the config class is not ``transformers``' own (a folder's
#: code), the first of these the ``config.json`` has.
_OTHER_KEYS = {
    "num_hidden_layers": ("n_layer", "n_layers", "num_layers"),
    "hidden_size": ("n_embd", "d_model"),
    "num_attention_heads": ("n_head", "n_heads"),
    "max_position_embeddings": ("n_positions", "max_seq_len", "seq_length"),
}


def field_keys(
    config: Mapping[str, Any], attribute_map: Mapping[str, str] | None
) -> dict[str, str]:
    """``standard name -> config.json key`` for the fields of ``_OTHER_KEYS``
    the ``config.json`` keeps under another name: by its config class's
    ``attribute_map`` (GPT-2: ``num_hidden_layers`` is ``n_layer``), else
    (``attribute_map`` ``None``: a folder's own code) the first other key
    present. MPT maps its layers but keeps its positions in ``max_seq_len``,
    which no map names: those fall back as well."""
    out = {}
    for name, others in _OTHER_KEYS.items():
        if name in config:
            continue
        mapped = (attribute_map or {}).get(name)
        if mapped is not None and mapped in config:
            out[name] = mapped
            continue
        found = next((k for k in others if k in config), None)
        if found is not None:
            out[name] = found
    return out


def causal_lm_architectures() -> dict[str, str]:
    """``model_type -> causal-LM class name`` of every model ``transformers``
    builds with ``AutoModelForCausalLM`` (imports ``transformers``)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


@functools.cache
def _reads_is_decoder(class_name: str) -> str | None:
    """``class_name`` where that ``transformers`` causal-LM class reads its
    config's ``is_decoder`` without setting it: an encoder (BERT, RoBERTa,
    ELECTRA, ...) whose attention is causal only when the flag is set;
    ``None`` for decoders, and for the encoder-decoder models' decoders that
    set it themselves (BART's)."""
    import inspect

    import transformers

    try:
        code = inspect.getsource(getattr(transformers, class_name).__init__)
    except Exception:  # noqa: BLE001 - a class that does not import is checked when built
        return None
    if "config.is_decoder" in code and "is_decoder = True" not in code:
        return class_name
    return None


def config_from_hf(
    config: Mapping[str, Any],
    source: str = "config.json",
    *,
    trust_remote_code: bool = False,
    code_folder: str | None = None,
) -> TransformersConfig:
    """The :class:`TransformersConfig` of a ``config.json``.

    Args:
        config: the parsed ``config.json``.
        source: the file's name, for error messages.
        trust_remote_code: the folder's own modeling code (``auto_map``) may run.
        code_folder: the folder holding that code.

    Raises:
        ValueError: one line: code from the folder without
            ``trust_remote_code``, a ``model_type`` ``transformers`` does not
            know or cannot build as a causal LM, no ``vocab_size``.
    """
    model_type = config.get("model_type")
    auto_map = config.get("auto_map")
    if auto_map and not trust_remote_code:
        raise ValueError(
            f"{source}: model_type {model_type!r} comes with its own modeling code "
            "(auto_map), which runs only with --checkpoint.trust_remote_code true"
        )
    if auto_map:
        if "AutoModelForCausalLM" not in auto_map:
            raise ValueError(
                f"{source}: auto_map names no AutoModelForCausalLM (it has: "
                f"{', '.join(sorted(auto_map))}); only causal language models train"
            )
    else:
        known = causal_lm_architectures()
        if model_type not in known:
            from transformers import CONFIG_MAPPING

            what = (
                "is not a causal language model of transformers"
                if model_type in CONFIG_MAPPING
                else "is unknown to the installed transformers"
            )
            raise ValueError(
                f"{source}: model_type {model_type!r} {what}; valid: a model_type "
                "AutoModelForCausalLM builds (e.g. 'llama', 'mistral', 'gemma')"
            )
        reads = _reads_is_decoder(known[model_type])
        if reads and not config.get("is_decoder"):
            raise ValueError(
                f"{source}: model_type {model_type!r} attends to later tokens unless its "
                f'config sets is_decoder ({reads} reads it); valid: "is_decoder": true in '
                "config.json for causal attention, or a decoder model (e.g. 'llama')"
            )
    vocab = config.get("vocab_size")
    if not isinstance(vocab, int) or vocab <= 0:
        raise ValueError(f"{source}: vocab_size {vocab!r} is not a positive integer")
    attribute_map = None
    if not auto_map:
        from transformers import CONFIG_MAPPING

        attribute_map = getattr(CONFIG_MAPPING[model_type], "attribute_map", None) or {}
    read = TransformersConfig(
        hf_config=dict(config),
        keys=field_keys(config, attribute_map),
        vocab_size=vocab,
        trust_remote_code=bool(auto_map) and trust_remote_code,
        code_folder=code_folder if auto_map else None,
    )
    layers = read.get("num_hidden_layers")
    if not isinstance(layers, int) or layers <= 0:
        raise ValueError(
            f"{source}: no number of decoder layers (num_hidden_layers, or the key its "
            f"model type keeps it under: {', '.join(_OTHER_KEYS['num_hidden_layers'])}); "
            f"got {layers!r}"
        )
    return read.replace(max_seq_len=int(read.get("max_position_embeddings") or 2048))
