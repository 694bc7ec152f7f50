"""Hugging Face transformers classes of an lca-jax export (``lca-convert to-hf``).

``lca_jax.interop.hf_export`` copies this file into the export as ``modeling_lca.py``, beside
``torch_model.py`` (the PyTorch reference module it wraps), so that
``AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)`` builds the model without
lca-jax installed. It imports only torch and transformers.

``config.json`` holds the upstream config (``interop/upstream.py``) under ``lca_config``;
``model.safetensors`` holds the upstream state dict with every name prefixed by ``model.``.
The model is inference-only (the reference forward runs without gradients) and keeps no KV
cache: ``generate`` recomputes the whole sequence at every step. Rows with an attention mask
(left or right padding) are computed one row at a time on their unmasked ids.
"""

import torch
import torch.nn.functional as F
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput

from .torch_model import TorchHierarchicalLM

__all__ = ["LcaConfig", "LcaForCausalLM"]


class LcaConfig(PretrainedConfig):
  """The upstream config (``lca_config``) and what transformers reads: vocabulary size, context
  length and the special ids of the byte vocabulary (pad 0, eos 1)."""

  model_type = "lca_byte"

  def __init__(
    self,
    lca_config=None,
    vocab_size=261,
    max_position_embeddings=4096,
    pad_token_id=0,
    eos_token_id=1,
    tie_word_embeddings=False,
    use_cache=False,
    **kwargs,
  ):
    self.lca_config = dict(lca_config or {})
    self.vocab_size = vocab_size
    self.max_position_embeddings = max_position_embeddings
    self.use_cache = use_cache
    super().__init__(
      pad_token_id=pad_token_id,
      eos_token_id=eos_token_id,
      tie_word_embeddings=tie_word_embeddings,
      **kwargs,
    )


class LcaForCausalLM(PreTrainedModel, GenerationMixin):
  """Next-byte logits of the reference model as a causal LM (``logits[:, t]`` predicts id t+1)."""

  config_class = LcaConfig
  base_model_prefix = "model"
  main_input_name = "input_ids"
  _no_split_modules = ["Block"]

  def __init__(self, config):
    super().__init__(config)
    self.model = TorchHierarchicalLM(config.lca_config)
    self.post_init()

  @classmethod
  def _supports_default_dynamic_cache(cls):
    return False

  def _init_weights(self, module):
    """Every weight comes from the checkpoint; nothing is initialised."""

  def get_input_embeddings(self):
    return self.model.token_embedding

  def get_output_embeddings(self):
    return self.model.head

  def _ntp_logits(self, input_ids, attention_mask):
    if attention_mask is None or bool(attention_mask.bool().all()):
      return self.model(input_ids)["ntp_logits"]
    keep = attention_mask.bool()
    out = None
    for row in range(input_ids.shape[0]):
      ids = input_ids[row][keep[row]]
      if ids.numel() == 0:
        continue
      logits = self.model(ids[None])["ntp_logits"][0]
      if out is None:
        out = logits.new_zeros(input_ids.shape + (logits.shape[-1],))
      out[row, keep[row]] = logits
    if out is None:
      out = torch.zeros(input_ids.shape + (self.config.vocab_size,), device=input_ids.device)
    return out

  def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
    logits = self._ntp_logits(input_ids, attention_mask).float()
    loss = None
    if labels is not None:
      loss = F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]),
        labels[:, 1:].reshape(-1).to(logits.device),
        ignore_index=-100,
      )
    return CausalLMOutput(loss=loss, logits=logits)

  def prepare_inputs_for_generation(self, input_ids, attention_mask=None, **kwargs):
    return {"input_ids": input_ids, "attention_mask": attention_mask}
