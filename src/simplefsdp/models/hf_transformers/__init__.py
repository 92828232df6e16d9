"""Any causal language model of ``transformers``, trained through its own modeling code.

The family ``transformers`` takes a Hugging Face folder whose ``model_type``
no native family reads: its configuration is the folder's ``config.json``
(:class:`TransformersConfig`), its model ``AutoModelForCausalLM.from_config``
behind a thin wrapper whose forward returns the logits
(:class:`TransformersCausalLM`), its tensor names the folder's own. See
docs/models/transformers.md.
"""

from simplefsdp.models.hf_transformers.config import TransformersConfig
from simplefsdp.models.hf_transformers.model import TransformersCausalLM
