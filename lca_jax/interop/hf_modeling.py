"""Hugging Face transformers classes of an lca-jax export (``lca-convert to-hf``).

``lca_jax.interop.hf_export`` copies this file into the export as ``modeling_lca.py``, beside
``torch_model.py`` (the PyTorch reference module it wraps), ``torch_incremental.py`` (its
hierarchical caches) and ``torch_multibyte.py`` (multi-byte decoding), so that
``AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)`` builds the model without
lca-jax installed. It imports only torch and transformers.

``config.json`` holds the upstream config (``interop/upstream.py``) under ``lca_config``;
``model.safetensors`` holds the upstream state dict with every name prefixed by ``model.``.
The model is inference-only. Every forward runs through a ``HierCache`` (byte-level KV of the
encoder, decoder and LCA-MBP head, latent KV of the LM module, the open group's pooled sum):
``generate`` keeps it between steps (``cache`` in the outputs, ``reorder_cache`` for beam
search), so a step feeds only the new byte; with ``use_cache=False`` every step feeds the whole
sequence again. Padded rows (left or right) run in one batch; the ids under a zero of
``attention_mask`` are skipped and their logits are zero. The multi-byte heads run only when
asked (``output_mbp_logits=True``). ``generate(mode="threshold" | "verify", n=..., tau=...)``
decodes greedily with the multi-byte head (``torch_multibyte``); any other call is transformers'
own ``generate``.
"""

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.utils import ModelOutput

from .torch_incremental import HierCache
from .torch_model import TorchHierarchicalLM
from .torch_multibyte import MODES, multi_byte_generate

__all__ = ["LcaConfig", "LcaForCausalLM", "LcaCausalLMOutput"]


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
    use_cache=True,
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


@dataclass
class LcaCausalLMOutput(ModelOutput):
  """Next-byte logits [B, K, V] of the K ids fed; the cache (under both names transformers
  versions read); with ``output_mbp_logits`` the LCA-MBP logits [B, K, V] (row t predicts
  x_{t+2}) or the MLP-MBP heads' [B, k, K, V]."""

  loss: Optional[torch.Tensor] = None
  logits: Optional[torch.Tensor] = None
  cache: Optional[Any] = None
  past_key_values: Optional[Any] = None
  mbp_logits: Optional[torch.Tensor] = None
  mlp_mbp_logits: Optional[torch.Tensor] = None


class LcaForCausalLM(PreTrainedModel, GenerationMixin):
  """Next-byte logits of the reference model as a causal LM (``logits[:, t]`` predicts id t+1)."""

  config_class = LcaConfig
  base_model_prefix = "model"
  main_input_name = "input_ids"
  _no_split_modules = ["Block"]
  _keep_in_fp32_modules = ["rotary_embd"]  # RoPE frequencies: bfloat16 would shift positions

  def __init__(self, config):
    super().__init__(config)
    self.model = TorchHierarchicalLM(config.lca_config)
    self.post_init()

  @classmethod
  def _supports_default_dynamic_cache(cls):
    return False  # the forward builds its own HierCache

  def _init_weights(self, module):
    """Every weight comes from the checkpoint; nothing is initialised."""

  def get_input_embeddings(self):
    return self.model.token_embedding

  def get_output_embeddings(self):
    return self.model.head

  @torch.no_grad()
  def forward(
    self,
    input_ids=None,
    attention_mask=None,
    cache=None,
    past_key_values=None,
    use_cache=None,
    labels=None,
    output_mbp_logits=False,
    **kwargs,
  ):
    """Feed ``input_ids`` [B, K] after what ``cache`` holds (a fresh cache when None);
    ``attention_mask`` covers the cached ids and these (its last K columns are read)."""
    cache = cache if cache is not None else past_key_values
    use_cache = self.config.use_cache if use_cache is None else use_cache
    if cache is None:
      cache = HierCache(self.model, input_ids.shape[0])
    k = input_ids.shape[1]
    valid = None if attention_mask is None else attention_mask[:, -k:].bool()
    out = cache.extend(input_ids, valid, with_mbp=output_mbp_logits)
    logits = out["ntp_logits"].float()
    if valid is not None:
      logits = logits * valid[..., None]
    loss = None
    if labels is not None:
      loss = F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]),
        labels[:, 1:].reshape(-1).to(logits.device),
        ignore_index=-100,
      )
    kept = cache if use_cache else None
    return LcaCausalLMOutput(
      loss=loss,
      logits=logits,
      cache=kept,
      past_key_values=kept,
      mbp_logits=out.get("mbp_logits"),
      mlp_mbp_logits=out.get("mlp_mbp_logits"),
    )

  def prepare_inputs_for_generation(
    self, input_ids, attention_mask=None, cache=None, past_key_values=None, use_cache=None, **kw
  ):
    """The ids the cache has not seen (all of them without a cache)."""
    cache = cache if cache is not None else past_key_values
    if cache is not None:
      input_ids = input_ids[:, cache.ncol :]
    return {
      "input_ids": input_ids,
      "attention_mask": attention_mask,
      "cache": cache,
      "use_cache": use_cache,
    }

  def generate(self, inputs=None, *args, mode=None, n=3, tau=0.9, **kwargs):
    """transformers' ``generate``; with ``mode="threshold"`` or ``"verify"`` greedy multi-byte
    decoding with the model's multi-byte head instead: ``n`` bytes drafted per step,
    ``tau`` threshold mode's acceptance probability. The multi-byte modes read
    ``input_ids`` / ``attention_mask`` (left padding), ``max_new_tokens``, ``eos_token_id``,
    ``pad_token_id`` and ``return_dict_in_generate`` (then ``sequences`` and ``steps``)."""
    if mode is None or mode == "ntp":
      return super().generate(inputs, *args, **kwargs)
    if mode not in MODES:
      raise ValueError(f"unknown mode {mode!r}; choose ntp, {', '.join(MODES)}")
    ids = inputs if inputs is not None else kwargs.pop("input_ids")
    mask = kwargs.pop("attention_mask", None)
    if kwargs.pop("do_sample", False) or kwargs.pop("num_beams", 1) != 1:
      raise ValueError(f"{mode} mode decodes greedily (no do_sample, no num_beams)")
    gc = self.generation_config
    max_new = kwargs.pop("max_new_tokens", None) or gc.max_new_tokens or 256
    eos = kwargs.pop("eos_token_id", gc.eos_token_id)
    pad = kwargs.pop("pad_token_id", gc.pad_token_id)
    want_dict = kwargs.pop("return_dict_in_generate", False)
    kwargs.pop("use_cache", None)
    if kwargs:
      raise ValueError(f"{mode} mode does not take {', '.join(sorted(kwargs))}")
    gen, steps = multi_byte_generate(
      self.model,
      ids.to(self.device),
      None if mask is None else mask.to(self.device),
      mode=mode,
      n=n,
      tau=tau,
      max_new_bytes=int(max_new),
      eos_id=-1 if eos is None else int(eos),
    )
    seq = torch.cat([ids.to(gen.device), torch.where(gen < 0, int(pad or 0), gen)], 1)
    if want_dict:
      return {"sequences": seq, "steps": steps}
    return seq
