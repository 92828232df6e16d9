"""Components every model family builds on.

* :mod:`.config`: :class:`DecoderArgs` (the shared configuration fields),
  :class:`RopeScaling`, :class:`YarnScaling`, parameter counting;
* :mod:`.norms` (RMSNorm), :mod:`.rotary` (RoPE with Llama 3.1 or YaRN scaling),
  :mod:`.attention` (grouped-query attention), :mod:`.feed_forward` (SwiGLU),
  :mod:`.moe` (router, grouped experts, shared experts) and
  :mod:`.load_balance` (routing-bias update, expert-load metrics);
* :mod:`.decoder`: :class:`Decoder` (embeddings, ``layers`` as an
  ``nn.ModuleDict``, norm, output) and :class:`DecoderBlock`;
* :mod:`.stages`: the pipeline split of a decoder;
* :mod:`.tensor_parallel`: per-component tensor-parallel plans (imports
  ``torch.distributed``; not loaded by this package).
* :mod:`.validate` (the model-against-layout rules and the ``validate``
  factories), :mod:`.decoder_spec` (a ``ModelSpec`` with the defaults
  decoders share) and :mod:`.hf_adapter` (the shape of a Hugging Face
  adapter, name maps, rotary layouts); not loaded by this package.

A family is a folder ``simplefsdp/models/<family>/`` that subclasses these
(see "Adding a model family" in ``docs/design.md``).
"""

from .attention import Attention, repeat_kv
from .config import DecoderArgs, RopeScaling, YarnScaling, count_params
from .decoder import Decoder, DecoderBlock
from .feed_forward import FeedForward, ffn_hidden_dim
from .moe import GroupedExperts, MoE, TokenChoiceRouter, grouped_mm_supported
from .norms import RMSNorm
from .stages import layer_ranges, pipeline_split, stage_ids_for_rank
