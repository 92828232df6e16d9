"""Long sequences: document masks and context parallelism.

A step's batch goes through :meth:`SequenceOptions.prepare`, which returns this
rank's tokens and targets and a :class:`SequenceContext`; the decoder passes
the context to its layers, whose attention calls
:func:`simplefsdp.models.common.attention.attend`, which hands the
computation to the context. See docs/long-context.md.
"""

from .attention import BACKENDS as BACKENDS
from .attention import SequenceContext as SequenceContext
from .batch import LOAD_BALANCE as LOAD_BALANCE
from .batch import SequenceOptions as SequenceOptions
from .batch import document_ids as document_ids
from .sharding import document_balanced_index as document_balanced_index
from .sharding import document_positions as document_positions
from .sharding import head_tail_index as head_tail_index
