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

Note: [Causal attention without a mask under compile]
    ``transformers`` calls SDPA with ``is_causal=True`` and no mask (the
    flash kernel on a GPU) only where it sees that the attention is plain
    causal over whole sequences: a 2-D ``attention_mask`` that is all ones
    (no padding), no cache, no window shorter than the sequence, and only
    when not tracing (``_ignore_causal_mask_sdpa`` checks
    ``is_torchdynamo_compiling()``, for ``torch.export``'s sake). Without an
    ``attention_mask`` it reads the positions for packed sequences and always
    builds a mask. Under ``torch.compile`` every layer therefore got a
    materialized ``(B, 1, T, T)`` boolean mask and SDPA with
    ``is_causal=False``: on a GPU the memory-efficient kernel over the whole
    square instead of flash over its lower half.

    Our model is only ever given whole sequences (no padding, no packing, no
    cache), so :class:`TransformersCausalLM` passes an ``attention_mask`` of
    ones, marks its ``transformers`` config (``_simplefsdp_whole_sequences``),
    and :func:`causal_attention_without_mask` registers, as ``transformers``'
    ``"sdpa"`` mask function (``AttentionMaskInterface``), one that takes
    ``transformers``' own decision without the tracing clause for a marked
    config (``allow_is_causal_skip``, query and keys the same length from
    position 0, a window or chunk longer than the sequence) and defers to
    ``transformers``' function otherwise. Compiled steps then run what eager
    ones run; other models in the process are untouched.

    No mask means causal only where the mask reaches nothing but
    ``transformers``' SDPA attention function (which then passes
    ``is_causal=True``); Doge, for one, builds its own mask from it and
    would lose causality. :func:`_mask_reaches_only_sdpa` checks that once
    per configuration with a forward of a fake-tensor copy of the model,
    every mask it builds followed (sliding windows' too, which a marked
    model's layers may then run in chunks: Note: [Sliding windows of
    transformers models in chunks]).
    A model that fails the check, routes its tokens to experts (the check's
    forward does not run data-dependent routing), or does not build its
    masks through ``transformers.masking_utils`` is called as before,
    without an ``attention_mask``.

Note: [A sequence context through transformers' code]
    Document masks and context parallelism need every attention to see the
    batch's positions, documents and, across ranks, the other ranks' keys:
    what :class:`~simplefsdp.context_parallel.SequenceContext` computes in
    ``attend``. ``transformers``' models pass the keyword arguments of their
    forward down to the attention function of each layer, so
    :class:`TransformersCausalLM` calls the model with the context under
    :data:`CONTEXT_KWARG`, with this rank's ``position_ids`` (the split's
    global positions, or positions restarting per document), and the
    ``"sdpa"`` attention function registered here hands queries, keys and
    values (after the model's rotary embedding), its window and sinks to
    ``attend`` with it; the model's own mask is left unread. Where that
    would be wrong the model is refused in one line before any process
    starts (:func:`sequence_context_refusal`, one forward of a fake-tensor
    copy): code that reads the mask elsewhere, does not pass its keywords
    to every layer's attention (GPT-2), ignores ``position_ids``, has
    attention dropout, or mixes tokens outside attention (a convolution:
    Mamba, LFM2's short convolutions), where each rank would see only its
    own tokens.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from simplefsdp.context_parallel.attention import runs_in_chunks
from simplefsdp.models.common.attention import attend
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


#: The attribute marking a ``transformers`` config whose model is only given
#: whole sequences (see Note: [Causal attention without a mask under compile]).
WHOLE_SEQUENCES = "_simplefsdp_whole_sequences"

#: A ``config.json`` key that settles :func:`_mask_reaches_only_sdpa` for a
#: planning variant of a model (its blocks of one kind, Note: [Blocks of
#: several kinds in the plan]): the whole model's answer, not the variant's.
MASK_CHECKED = "_simplefsdp_mask_reaches_only_sdpa"

#: The keyword under which :class:`TransformersCausalLM` hands its sequence
#: context to ``transformers``' code, which passes it down to the attention
#: function (Note: [A sequence context through transformers' code]).
CONTEXT_KWARG = "simplefsdp_sequence_context"

#: While :func:`_mask_reaches_only_sdpa` runs: the tensor the mask function
#: returns in place of "no mask", followed to what reads it.
_PROBE: list[torch.Tensor] = []


@functools.cache
def causal_attention_without_mask() -> bool:
    """Register the ``"sdpa"`` mask function that leaves plain causal
    attention over whole sequences to SDPA's ``is_causal`` under
    ``torch.compile`` too (see Note: [Causal attention without a mask under
    compile]); ``False`` where the installed ``transformers`` has no such
    registry (its masks stay)."""
    try:
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError:
        return False
    sdpa_mask = getattr(AttentionMaskInterface, "_global_mapping", {}).get("sdpa")
    if sdpa_mask is None or not hasattr(AttentionMaskInterface, "register"):
        return False

    def mask(
        batch_size: int,
        cache_position: torch.Tensor,
        kv_length: int,
        kv_offset: int = 0,
        *args: Any,
        local_size: int | None = None,
        allow_is_causal_skip: bool = True,
        **kwargs: Any,
    ) -> torch.Tensor | None:
        whole = getattr(kwargs.get("config"), WHOLE_SEQUENCES, False)
        if whole and _PROBE:  # every mask followed, sliding windows' too
            return _PROBE[0]
        if (
            allow_is_causal_skip
            and whole
            and kv_offset == 0
            and cache_position.shape[0] == kv_length
            and (local_size is None or kv_length < local_size)
        ):
            return None
        return sdpa_mask(
            batch_size,
            cache_position,
            kv_length,
            kv_offset,
            *args,
            local_size=local_size,
            allow_is_causal_skip=allow_is_causal_skip,
            **kwargs,
        )

    AttentionMaskInterface.register("sdpa", mask)
    _windows_in_chunks()
    return True


def _windows_in_chunks() -> None:
    """Register, as ``transformers``' ``"sdpa"`` attention function, one
    that runs a sliding window under half the sequence of a marked config
    in chunks (Note: [Sliding windows of transformers models in chunks]) and
    calls ``transformers``' own otherwise."""
    try:
        from transformers import AttentionInterface
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
    except ImportError:
        return
    if not hasattr(AttentionInterface, "register"):
        return

    def attention(
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        dropout: float = 0.0,
        scaling: float | None = None,
        is_causal: bool | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        context = kwargs.pop(CONTEXT_KWARG, None)
        softcap = kwargs.get("softcap")
        if softcap:
            if context is not None:
                raise ValueError(
                    f"{type(module).__name__}: attention logit softcapping ({softcap}) "
                    "cannot take document masks or context parallelism"
                )
            window = kwargs.get("sliding_window")
            return _softcapped_attention(
                query,
                key,
                value,
                attention_mask,
                dropout,
                scaling,
                softcap,
                window if isinstance(window, int) else None,
                causal=is_causal is not False and getattr(module, "is_causal", True),
            )
        if context is not None:  # Note: [A sequence context through transformers' code]
            window = kwargs.get("sliding_window")
            if dropout or is_causal is False or not getattr(module, "is_causal", True):
                raise ValueError(
                    f"{type(module).__name__}: attention with dropout or without a causal "
                    "mask cannot take document masks or context parallelism"
                )
            out = attend(
                query,
                key,
                value,
                scale=scaling,
                sliding_window=window if isinstance(window, int) else None,
                sinks=kwargs.get("s_aux"),
                context=context,
            )
            return out.transpose(1, 2).contiguous(), None
        # Note: [Sliding windows of transformers models in chunks]
        # A sliding-window layer of transformers' code gets a (B, 1, T, T)
        # boolean mask and runs SDPA over every (query, key) pair, the
        # memory-efficient kernel on a GPU. Where the model is given whole
        # sequences (its config marked, and its mask checked to reach
        # nothing but this function) and the layer passes its window
        # (``sliding_window=``, as transformers' flash-attention path reads
        # it), the mask is causal within that window, and ``attend`` runs it
        # as chunks of the window against the two chunks of keys each
        # reaches: T x 2W pairs. The mask is left unread (dead code once
        # compiled). Dropout, sinks (``s_aux``), a window of half the
        # sequence or more, non-causal layers and queries of another length
        # than the keys go to transformers' function.
        window = kwargs.get("sliding_window")
        length = query.shape[2]
        if (
            getattr(getattr(module, "config", None), WHOLE_SEQUENCES, False)
            and attention_mask is not None
            and isinstance(window, int)
            and runs_in_chunks(window, length)
            and key.shape[2] == length
            and not dropout
            and kwargs.get("s_aux") is None
            and is_causal is not False
            and getattr(module, "is_causal", True)
        ):
            out = attend(query, key, value, scale=scaling, sliding_window=window)
            return out.transpose(1, 2).contiguous(), None
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs
        )

    AttentionInterface.register("sdpa", attention)


def _softcapped_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    dropout: float,
    scaling: float | None,
    softcap: float,
    window: int | None,
    causal: bool = True,
) -> tuple[torch.Tensor, None]:
    """Attention whose scores are capped, ``softcap * tanh(s / softcap)``
    (Gemma 2's ``attn_logit_softcapping``), as ``transformers``' eager
    attention computes it: SDPA has no such term, and ``transformers``' own
    SDPA function leaves it out. The scores are materialized. ``mask``: the
    SDPA function's (boolean, or additive); ``None``: causal attention
    (within ``window``, where given), or none where not ``causal``.

    Returns:
        ``(B, T, H, d_v)`` and ``None`` (no attention weights), as the
        ``"sdpa"`` attention function returns them.
    """
    n_rep = query.shape[1] // key.shape[1]
    key, value = (x.repeat_interleave(n_rep, dim=1) for x in (key, value))
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    scores = torch.matmul(query, key.transpose(2, 3)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    keys = key.shape[2]
    if mask is None and causal:
        k_pos = torch.arange(keys, device=query.device)
        q_pos = k_pos[keys - query.shape[2] :, None]
        mask = k_pos <= q_pos
        if window is not None:
            mask = mask & (k_pos > q_pos - window)
    if mask is not None and mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask[..., :keys], float("-inf"))
    elif mask is not None:
        scores = scores + mask[..., :keys]
    probs = nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    if dropout:
        probs = nn.functional.dropout(probs, p=dropout)
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), None


class _ReadsOf(torch.overrides.TorchFunctionMode):
    """Records whether any torch function is given ``tensor``."""

    def __init__(self, tensor: torch.Tensor) -> None:
        super().__init__()
        self.tensor = tensor
        self.read = False

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        leaves = torch.utils._pytree.tree_leaves((args, kwargs))
        if any(leaf is self.tensor for leaf in leaves):
            self.read = True
        return func(*args, **kwargs)


@contextlib.contextmanager
def _sdpa_function(attention: Any) -> Iterator[bool]:
    """``transformers``' ``"sdpa"`` attention function replaced by
    ``attention`` inside the block (for the probes' fake forwards); yields
    ``False``, replacing nothing, where the installed ``transformers`` has
    no such registry."""
    try:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    except ImportError:
        yield False
        return
    functions = getattr(ALL_ATTENTION_FUNCTIONS, "_global_mapping", None)
    original = functions.get("sdpa") if isinstance(functions, dict) else None
    if original is None:
        yield False
        return
    functions["sdpa"] = attention
    try:
        yield True
    finally:
        functions["sdpa"] = original


def _mask_reaches_only_sdpa(config: TransformersConfig) -> bool:
    """Whether :func:`_mask_check` passes for ``config``."""
    return _mask_check(config)[0]


@functools.cache
def _mask_check(config: TransformersConfig) -> tuple[bool, str | None]:
    """The model of ``config`` gives the attention mask of plain causal
    attention to ``transformers``' SDPA attention function and to nothing
    else, so no mask there means ``is_causal`` (Doge, for one, builds its own
    mask from it). Checked by one forward of a fake-tensor copy (no memory)
    whose mask function hands out a tensor followed to every read; the SDPA
    function is given ``None`` in its place. ``(False, why)`` where that
    forward raised (routed experts, code that does not run on fake tensors),
    ``(False, None)`` where it runs no SDPA attention or reads the mask."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    if MASK_CHECKED in config.hf_config:
        return bool(config.hf_config[MASK_CHECKED]), None
    if not causal_attention_without_mask():
        return False, None
    try:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
    except ImportError:
        return False, None
    calls = []

    def attention(module: nn.Module, query, key, value, attention_mask, *args, **kwargs):  # noqa: ANN001
        calls.append(attention_mask is _PROBE[0])
        if attention_mask is _PROBE[0]:
            attention_mask = None
        return sdpa_attention_forward(module, query, key, value, attention_mask, *args, **kwargs)

    try:
        with _sdpa_function(attention) as replaced:
            if not replaced:
                return False, None
            with FakeTensorMode(allow_non_fake_inputs=True), torch.device("cpu"):
                causal_lm = _causal_lm_from_config(_hf_config(config), config, "sdpa")
                setattr(causal_lm.config, WHOLE_SEQUENCES, True)
                tokens = torch.zeros((1, min(16, config.max_seq_len)), dtype=torch.long)
                length = tokens.shape[1]
                _PROBE.append(torch.ones((1, 1, length, length), dtype=torch.bool))
                with _ReadsOf(_PROBE[0]) as reads:
                    causal_lm(
                        input_ids=tokens, attention_mask=torch.ones_like(tokens), use_cache=False
                    )
    except Exception as exc:  # noqa: BLE001 - any failure keeps transformers' own masks
        first = (str(exc).strip().splitlines() or [""])[0]
        return False, f"{type(exc).__name__}: {first}"[:160]
    finally:
        _PROBE.clear()
    return any(calls) and not reads.read, None


@functools.cache
def sequence_context_refusal(config: TransformersConfig) -> str | None:
    """Why the model of ``config`` cannot take a sequence context (document
    masks, context parallelism), or ``None`` where it can (Note: [A sequence
    context through transformers' code]): its mask must reach only SDPA
    attention, every decoder layer's attention must receive the context
    through ``transformers``' keyword arguments, the rotary or position
    embeddings must read ``position_ids``, attention must have no dropout,
    and no convolution or recurrence may mix tokens outside attention."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    model_type = config.hf_config.get("model_type", "?")
    code = f"transformers' code for model_type {model_type!r}"
    dropout = config.hf_config.get("attention_dropout", 0.0)
    if isinstance(dropout, (int, float)) and dropout > 0:
        return f"its attention_dropout is {dropout} (attention runs without dropout here)"
    passed, failure = _mask_check(config)
    if not passed:
        if failure is not None:
            return (
                f"{code} does not run on fake tensors, where its attention mask is checked "
                f"({failure})"
            )
        return f"{code} has no SDPA attention or reads its attention mask elsewhere"
    sentinel = object()
    calls: list[bool] = []
    softcaps: list[float] = []

    def attention(module: nn.Module, query, key, value, *args, **kwargs):  # noqa: ANN001
        calls.append(kwargs.pop(CONTEXT_KWARG, None) is sentinel)
        if kwargs.get("softcap"):
            softcaps.append(kwargs["softcap"])
        b, h, t, _ = query.shape
        return query.new_empty(b, t, h, value.shape[-1]), None

    try:
        with (
            _sdpa_function(attention),  # there: the mask check above passed
            FakeTensorMode(allow_non_fake_inputs=True),
            torch.device("cpu"),
        ):
            causal_lm = _causal_lm_from_config(_hf_config(config), config, "sdpa")
            setattr(causal_lm.config, WHOLE_SEQUENCES, True)
            mixers = sorted(
                {type(m).__name__ for m in causal_lm.modules() if isinstance(m, nn.Conv1d)}
            )
            tokens = torch.zeros((1, min(16, config.max_seq_len)), dtype=torch.long)
            positions = torch.arange(tokens.shape[1])[None]
            with _ReadsOf(positions) as reads:
                causal_lm(
                    input_ids=tokens,
                    attention_mask=torch.ones_like(tokens),
                    position_ids=positions,
                    use_cache=False,
                    **{CONTEXT_KWARG: sentinel},
                )
    except Exception as exc:  # noqa: BLE001 - any failure refuses, in one line
        first = (str(exc).strip().splitlines() or [""])[0]
        return f"{code} does not run with a sequence context ({type(exc).__name__}: {first})"
    if mixers:
        return f"{code} mixes tokens outside attention ({', '.join(mixers)})"
    if softcaps:
        return (
            f"its attention caps its scores (attn_logit_softcapping {softcaps[0]}), "
            "which runs outside SDPA attention"
        )
    if len(calls) < config.n_layers or not all(calls):
        return (
            f"{code} does not hand its keyword arguments to the attention function of "
            f"every layer ({sum(calls)} of {config.n_layers} layers)"
        )
    if not reads.read:
        return f"{code} does not read position_ids"
    return None


def _builds_masks_with_masking_utils(causal_lm: nn.Module) -> bool:
    """The model's code builds its attention masks with
    ``transformers.masking_utils`` (``create_causal_mask``)."""
    import sys

    module = sys.modules.get(type(causal_lm).__module__)
    return module is not None and hasattr(module, "create_causal_mask")


def _causal_lm_from_config(hf_config: Any, config: TransformersConfig, attention: str) -> nn.Module:
    """``AutoModelForCausalLM.from_config`` in float32 with ``attention``;
    a configuration the model's code cannot build is one line."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_config(
            hf_config,
            dtype=torch.float32,
            attn_implementation=attention,
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


def _no_init(skip: bool) -> contextlib.AbstractContextManager[Any]:
    """``transformers``' ``no_init_weights`` where ``skip``: a model built on
    the meta device is initialised by :meth:`TransformersCausalLM.init_weights`
    once materialized, and some models' ``_init_weights`` cannot run on meta
    parameters (Bamba's and Granite 4.0's ``A_log.data = torch.log(...)``
    assigns a host tensor)."""
    if not skip:
        return contextlib.nullcontext()
    try:
        from transformers.modeling_utils import no_init_weights
    except ImportError:
        return contextlib.nullcontext()
    return no_init_weights()


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
        with _parameters_on_meta() if meta else contextlib.nullcontext(), _no_init(meta):
            try:
                causal_lm = _causal_lm_from_config(hf_config, config, self.attention_implementation)
            except ValueError as exc:
                if "scaled_dot_product_attention" not in str(exc):
                    raise
                self.attention_implementation = "eager"
                causal_lm = _causal_lm_from_config(hf_config, config, self.attention_implementation)
        if meta:  # the ties post_init makes only when it initialises
            causal_lm.tie_weights()
        if causal_lm._parameters or causal_lm._buffers:
            raise ValueError(
                f"{type(causal_lm).__name__} holds tensors outside its submodules "
                f"({', '.join([*causal_lm._parameters, *causal_lm._buffers])}); not supported"
            )
        self.config = config
        # see Note: [Causal attention without a mask under compile]
        self.whole_sequence_mask = (
            self.attention_implementation == "sdpa"
            and _builds_masks_with_masking_utils(causal_lm)
            and _mask_reaches_only_sdpa(config)
        )
        if self.whole_sequence_mask:
            setattr(causal_lm.config, WHOLE_SEQUENCES, True)
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

    def forward(self, tokens: torch.Tensor, context: Any = None) -> torch.Tensor:
        """``(B, T)`` token ids -> ``(B, T, V)`` logits.

        ``context``: the batch's :class:`~simplefsdp.context_parallel.SequenceContext`
        (document masks, context parallelism; ``tokens`` are then this
        rank's share), handed to every layer's attention (Note: [A sequence
        context through transformers' code]).

        Raises:
            ValueError: a context for a model that cannot take one
                (:func:`sequence_context_refusal`).
        """
        if context is not None:
            # checked eagerly (resolve refuses such jobs before any process starts)
            refusal = (
                None if torch.compiler.is_compiling() else sequence_context_refusal(self.config)
            )
            if refusal is not None:
                raise ValueError(
                    f"document masks and context parallelism need every layer's attention "
                    f"to see the batch's positions: {refusal}"
                )
            positions = context.rope_positions
            if positions is None:
                positions = context.index[context.rank].expand(tokens.shape[0], -1)
            return self.causal_lm(
                input_ids=tokens,
                attention_mask=torch.ones_like(tokens),
                position_ids=positions,
                use_cache=False,
                **{CONTEXT_KWARG: context},
            ).logits
        if self.whole_sequence_mask:  # no padding: no mask is built, traced or not
            mask = torch.ones_like(tokens)
            return self.causal_lm(input_ids=tokens, attention_mask=mask, use_cache=False).logits
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
