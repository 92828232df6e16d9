"""What a model family declares: :class:`ModelSpec`.

A family is a folder ``simplefsdp/models/<family>/`` whose ``spec.py``
defines one ``SPEC: ModelSpec``. Train, bench, plan, checkpoint and export
work from the spec (found through :mod:`simplefsdp.models.registry`) and
never name a family. Everything a command line needs before any process
starts (flavors, counts, ``validate``) works without building the model.

Pure data and callables: this module imports no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

#: What a family may compose with: tensor, pipeline, expert and context
#: parallelism, float8 linears, and Hugging Face weights in and out.
Capability = str
CAPABILITIES: tuple[Capability, ...] = ("tp", "pp", "ep", "cp", "float8", "hf")
#: How ``simplefsdp plan`` predicts a family's jobs (``ModelSpec.plan_method``).
PLAN_METHODS: tuple[str, ...] = ("trace", "analytic")


class LayoutDegrees(Protocol):
    """The degrees ``ModelSpec.validate`` checks a configuration against."""

    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    ep: int


def _no_errors(config: Any, layout: Any, **inputs: Any) -> list[str]:
    return []


@dataclass(frozen=True)
class ModelSpec:
    """One model family.

    Attributes:
        family: the family's name (``"llama3"``, ``"moe"``, ...).
        description: one line for listings.
        config_type: the family's configuration dataclass.
        flavors: named configurations (published sizes and debug sizes),
            ``flavor name -> config``.
        build: ``build(config) -> nn.Module``; call it under
            ``torch.device("meta")`` to build without memory.
        init_weights: ``init_weights(model, buffer_device)`` initialises a
            built model (or one of its pipeline stages) in place.
        loss: ``loss(logits, targets) -> scalar`` for ``(B, T, V)`` logits.
        num_params: ``num_params(config, exclude_embeddings=False) -> int``.
        num_active_params: parameters one token uses (MoE: ``top_k`` routed
            experts); defaults to ``num_params``.
        flops_per_token: ``flops_per_token(config, seq_len) -> int``,
            training FLOPs (forward and backward) per token.
        validate: ``validate(config, layout, *, seq_len=None,
            sequence_parallel=False, loss_parallel=False, build=True,
            model_name=None, names=None) -> list[str]``: every rule of the
            model against the layout, one line per problem: ``seq_len`` vs
            ``max_seq_len``; heads, kv-heads, feed-forward sizes (and with
            ``loss_parallel`` the vocabulary) vs ``layout.tp``; ``seq_len``
            vs tp with ``sequence_parallel``; layers vs pipeline stages
            (``layout.num_stages`` where the layout has it, else
            ``layout.pp``); experts vs ``layout.ep``; and, with ``build``
            (train, bench; ``False`` for plan, which only counts), a
            configuration that cannot be built. ``layout`` is anything with the degrees of
            :class:`LayoutDegrees` (missing ones count as 1); ``model_name``
            and ``names`` (how the caller spells each degree: its flags)
            only shape the messages.
        capabilities: what it composes with (:data:`CAPABILITIES`); a
            layout using a missing one is refused by the resolve step.
        tensor_parallel: ``tensor_parallel(model, tp_mesh, *,
            sequence_parallel, loss_parallel)`` applies its TP plan in place.
        pipeline_split: ``pipeline_split(model, stage_ids, num_stages) ->
            list[nn.Module]``, copies of the model keeping each stage's part.
        fullgraph: a compiled forward is one graph (``False``: a MoE layer
            reads its token counts to the host).
        data_dependent_reads: ``data_dependent_reads(config) -> bool``: a
            forward reads parameters that depend on its data (a
            mixture-of-experts block that runs only the experts its tokens
            picked, as Hugging Face Mixtral's), so ranks with different
            data read different parameters. Engines that need every rank to
            read the same parameters (``simplefsdp``, ``fsdp2``, ``ddp``)
            refuse such a model; the eager executor (``simplefsdp_eager``),
            which gathers and reduces whole blocks, trains it. ``None``:
            never.
        after_optimizer_step: ``after_optimizer_step(model, *,
            process_group=None)``, called after each optimizer step (the
            routing-bias update from the tokens each expert received, summed
            over ``process_group``: the ranks that read different data);
            returns the metrics to log (``name -> value``; MoE:
            ``moe_imbalance`` and per-layer ``moe_layers``) or ``None``.
        discard_step_state: ``discard_step_state(model)`` forgets what
            forward passes accumulated since the last optimizer step (MoE:
            the routed-token counts), for forwards that must not count, such
            as a validation pass in training mode; ``None``: nothing to do.
        float8_skip_fqns: module-name fragments float8 conversion leaves
            alone (besides the user's filter), e.g. a router that computes
            in float32.
        hf_adapter: converts to and from Hugging Face checkpoints (``None``:
            no Hugging Face format): an object with ``model_types``,
            ``tied``, ``to_hf_name``/``from_hf_name``, ``to_hf`` (our name
            and full tensor -> one ``(hf_name, tensor)`` pair or a list of
            them), ``hf_region`` (the region of a Hugging Face tensor
            holding a region of ours, and its conversion) or, where one
            tensor of ours is assembled from several stored ones,
            ``read_region(name, offsets, sizes, config, checkpoint)`` (reads
            through :class:`simplefsdp.checkpoint.hf.HFCheckpoint`'s
            ``read_hf``/``hf_shape``/``has``),
            ``config_from_hf``/``config_to_hf``, ``config_differences`` and
            ``hf_sort_key``; optionally ``architectures`` (the
            ``config.json`` class names it reads when the ``model_type``
            is another; default: ``transformers``' causal-LM class of each
            of its model types), ``any_model_type`` (it reads every model
            type no other family reads: the ``transformers`` family) and
            ``hf_files(config)`` (extra files an export copies, such as a
            model's own code); see
            :class:`simplefsdp.models.common.hf_adapter.HFAdapter` (the
            protocol, documented once, with the defaults families share) and
            Note: [Which family reads a folder] in
            :mod:`simplefsdp.checkpoint.hf`.
        sequence_parallel: its ``tensor_parallel`` plan can shard the
            sequence between the blocks (sequence parallelism, what
            ``simplefsdp plan`` plans with TP); ``False``: it keeps whole
            sequences.
        with_layers: ``with_layers(config, n) -> config`` with ``n``
            decoder blocks, as ``simplefsdp plan`` traces 1 and 2 of them
            (``None``: ``dataclasses.replace(config, n_layers=n)``).
        layer_kinds: ``layer_kinds(config) -> tuple`` of one hashable key
            per decoder block, equal where blocks compute the same (their
            attention kind, mixer, ...): ``simplefsdp plan`` traces 1 and 2
            blocks of each kind (``with_layer_kind(config, kind, n)``) and
            counts each kind's blocks (``None``, or one kind: every block
            as the first two).
        with_layer_kind: ``with_layer_kind(config, kind, n) -> config`` with
            ``n`` blocks, all of ``kind``.
        sequence_context_error: ``sequence_context_error(config) -> str |
            None``: why a model of the family cannot take a sequence context
            (document masks, context parallelism with the ``cp``
            capability), refused in one line by the resolve step; ``None``
            (the field, or its answer): every model can.
        plan_method: how ``simplefsdp plan`` predicts a job of this family:
            ``"trace"`` (trace ``build`` with 1 and 2 blocks on the meta
            device) or ``"analytic"`` (from the config's shapes, for
            expert-parallel decoders).
        reference_layouts: published training layouts per flavor name
            (``gpus``, ``tp``, ``batch``, ``seq``, ``ac``): the defaults of
            ``simplefsdp plan`` for that flavor.
    """

    family: str
    description: str
    config_type: type
    flavors: Mapping[str, Any]
    build: Callable[[Any], Any]
    init_weights: Callable[[Any, Any], None]
    loss: Callable[[Any, Any], Any]
    num_params: Callable[..., int]
    flops_per_token: Callable[[Any, int], int]
    num_active_params: Callable[..., int] | None = None
    validate: Callable[..., list[str]] = _no_errors
    capabilities: frozenset[Capability] = field(default_factory=frozenset)
    tensor_parallel: Callable[..., None] | None = None
    pipeline_split: Callable[..., list[Any]] | None = None
    fullgraph: bool = True
    data_dependent_reads: Callable[[Any], bool] | None = None
    after_optimizer_step: Callable[..., Mapping[str, Any] | None] | None = None
    hf_adapter: Any = None
    discard_step_state: Callable[[Any], None] | None = None
    float8_skip_fqns: tuple[str, ...] = ()
    sequence_parallel: bool = True
    with_layers: Callable[[Any, int], Any] | None = None
    layer_kinds: Callable[[Any], tuple[Any, ...] | None] | None = None
    with_layer_kind: Callable[[Any, Any, int], Any] | None = None
    sequence_context_error: Callable[[Any], str | None] | None = None
    plan_method: str = "trace"
    reference_layouts: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        unknown = sorted(set(self.capabilities) - set(CAPABILITIES))
        if unknown:
            raise ValueError(
                f"family {self.family!r} declares unknown capabilities {unknown}; "
                f"valid: {', '.join(CAPABILITIES)}"
            )
        if self.plan_method not in PLAN_METHODS:
            raise ValueError(
                f"family {self.family!r} declares plan_method {self.plan_method!r}; "
                f"valid: {', '.join(PLAN_METHODS)}"
            )

    def supports(self, capability: Capability) -> bool:
        """The family composes with ``capability``."""
        return capability in self.capabilities

    def active_params(self, config: Any, exclude_embeddings: bool = False) -> int:
        """Parameters one token uses (all of them for dense families)."""
        count = self.num_active_params or self.num_params
        return count(config, exclude_embeddings=exclude_embeddings)
