"""The byte tokenizer of an lca-jax export (``lca-convert to-hf``), for ``AutoTokenizer``.

``lca_jax.interop.hf_export`` copies this file into the export as ``tokenization_lca.py``. Ids
are those of ``lca_jax.vocab`` (ByT5's layout): pad 0, eos 1, unk 2, byte b is id b + 3, then
``<en>`` 259 and ``<eot>`` 260. Text is encoded as its UTF-8 bytes and nothing else: no eos is
appended (a causal LM continues the text) and a special token's name inside the text is encoded
as its bytes (``split_special_tokens``). It imports only transformers.
"""

from transformers import ByT5Tokenizer

__all__ = ["LcaByteTokenizer"]


class LcaByteTokenizer(ByT5Tokenizer):
  """ByT5's byte ids without its appended eos, with ``<en>`` and ``<eot>`` after the bytes."""

  def __init__(
    self,
    eos_token="<eos>",
    unk_token="<unk>",
    pad_token="<pad>",
    extra_ids=0,
    additional_special_tokens=None,
    split_special_tokens=True,
    **kwargs,
  ):
    super().__init__(
      eos_token=eos_token,
      unk_token=unk_token,
      pad_token=pad_token,
      extra_ids=0,
      additional_special_tokens=additional_special_tokens or ["<en>", "<eot>"],
      split_special_tokens=split_special_tokens,
      **kwargs,
    )

  def build_inputs_with_special_tokens(self, token_ids_0, token_ids_1=None):
    return list(token_ids_0) + list(token_ids_1 or [])

  def create_token_type_ids_from_sequences(self, token_ids_0, token_ids_1=None):
    return [0] * (len(token_ids_0) + len(token_ids_1 or []))

  def get_special_tokens_mask(
    self, token_ids_0, token_ids_1=None, already_has_special_tokens=False
  ):
    if already_has_special_tokens:
      return super().get_special_tokens_mask(token_ids_0, token_ids_1, True)
    return [0] * (len(token_ids_0) + len(token_ids_1 or []))
