"""A ``transformers`` causal LM as our trainer runs it: ``forward(tokens) -> logits``.

Note: [The wrapper shares the model's children]
    :class:`TransformersCausalLM` registers the children of the
    ``transformers`` model (``model``, ``lm_head``, ...) as its own and keeps
    the ``transformers`` object itself as a plain attribute, outside the
    module tree. Its state-dict names are therefore the Hugging Face names
    (``model.layers.0.self_attn.q_proj.weight``, ``lm_head.weight``), and
    what our recipe does to the tree (parametrizations, activation
    checkpointing wrappers, float8 linears) is what the ``transformers``
    forward runs, since both hold the same module objects. ``copy.deepcopy``
    keeps the sharing (its memo maps each child once) and so does pickling.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from simplefsdp.models.hf_transformers.config import TransformersConfig


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Create parameters on the meta device and buffers on the CPU.

    ``nn.Module.register_parameter`` is patched for the duration only (as
    ``accelerate.init_empty_weights(include_buffers=False)`` does): a model's
    buffers (rotary frequencies) are computed in its constructor and nowhere
    else, so a model built without memory keeps them to restore after
    ``to_empty``.
    """
    original = nn.Module.register_parameter

    def register_parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and not param.is_meta:  # a meta one may be tied: keep it
            kwargs = dict(module._parameters[name].__dict__)
            kwargs["requires_grad"] = param.requires_grad
            module._parameters[name] = type(param)(module._parameters[name].to("meta"), **kwargs)

    nn.Module.register_parameter = register_parameter  # type: ignore[method-assign]
    try:
        with torch.device("cpu"):
            yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def _hf_config(config: TransformersConfig) -> Any:
    """The ``transformers`` configuration object of ``config``."""
    from transformers import AutoConfig

    if config.code_folder is not None:
        return AutoConfig.from_pretrained(config.code_folder, trust_remote_code=True)
    fields = dict(config.hf_config)
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


class TransformersCausalLM(nn.Module):
    """``AutoModelForCausalLM.from_config`` of ``config``; ``forward(tokens)``
    returns the ``(B, T, V)`` logits. Attention is SDPA where the model's
    code has it, else the code's own eager attention
    (``attention_implementation`` says which).

    Built under ``torch.device("meta")`` its parameters are on the meta
    device and its buffers keep their values for :meth:`init_weights`. See
    Note: [The wrapper shares the model's children].

    Args:
        config: the model's :class:`TransformersConfig`.

    Raises:
        ValueError: the ``transformers`` model holds parameters of its own
            besides its children's (not supported).
    """

    def __init__(self, config: TransformersConfig) -> None:
        super().__init__()
        hf_config = _hf_config(config)
        meta = torch.get_default_device().type == "meta"
        # SDPA where the model's code has it, else its own eager attention
        # (BLOOM, GPT-J, MPT, ...: the scores materialized)
        self.attention_implementation = "sdpa"
        with _parameters_on_meta() if meta else contextlib.nullcontext():
            try:
                causal_lm = self._from_config(hf_config, config)
            except ValueError as exc:
                if "scaled_dot_product_attention" not in str(exc):
                    raise
                self.attention_implementation = "eager"
                causal_lm = self._from_config(hf_config, config)
        if causal_lm._parameters or causal_lm._buffers:
            raise ValueError(
                f"{type(causal_lm).__name__} holds tensors outside its submodules "
                f"({', '.join([*causal_lm._parameters, *causal_lm._buffers])}); not supported"
            )
        self.config = config
        for name, child in causal_lm.named_children():
            self.add_module(name, child)
        # outside the module tree: see Note: [The wrapper shares the model's children]
        self.__dict__["causal_lm"] = causal_lm
        # by module, not by name (activation checkpointing renames the layers):
        # the buffers' values and the tied parameters' places, for after to_empty
        self.initial_buffers = [
            (module, name, buffer.detach().clone())
            for module in self.modules()
            for name, buffer in module._buffers.items()
            if buffer is not None
        ]
        places: dict[int, list[tuple[nn.Module, str]]] = {}
        for module in self.modules():
            for name, param in module._parameters.items():
                if param is not None:
                    places.setdefault(id(param), []).append((module, name))
        self.tied_places = [group for group in places.values() if len(group) > 1]

    def _from_config(self, hf_config: Any, config: TransformersConfig) -> nn.Module:
        from transformers import AutoModelForCausalLM

        try:
            return AutoModelForCausalLM.from_config(
                hf_config,
                dtype=torch.float32,
                attn_implementation=self.attention_implementation,
                trust_remote_code=config.trust_remote_code,
            )
        except (
            TypeError,
            AttributeError,
            KeyError,
            IndexError,
            AssertionError,
            ImportError,
        ) as exc:
            # the model's code cannot build this configuration (a field it
            # needs missing or None, a library it needs absent): one line,
            # as other bad input
            first = (str(exc).strip().splitlines() or [""])[0]
            raise ValueError(
                f"transformers' code for model_type {config.model_type!r} fails to build "
                f"the model of this config.json ({type(exc).__name__}: {first})"
            ) from exc

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """``(B, T)`` token ids -> ``(B, T, V)`` logits."""
        return self.causal_lm(input_ids=tokens, use_cache=False).logits

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """Initialise every parameter as ``transformers`` does (its
        ``_init_weights`` per module) and restore the buffers and the ties
        (after ``to_empty``, which unties)."""
        for (first, first_name), *others in self.tied_places:
            param = getattr(first, first_name)
            for module, name in others:
                # data_parallel keeps ties (one sharded parameter); to_empty does not
                if name in module._parameters and module._parameters[name] is not param:
                    setattr(module, name, param)
        for module, name, value in self.initial_buffers:
            buffer = module._buffers[name]
            buffer.copy_(value.to(buffer.device, buffer.dtype))
        for module in self.causal_lm.modules():
            self.causal_lm._init_weights(module)
