"""A model directory's tokenizer: ``tokenizer.json`` through the ``tokenizers`` library, and
``tokenizer_config.json``'s special tokens, ``add_bos_token``/``add_eos_token`` and chat template,
applied as transformers applies them.

  tok = Tokenizer.from_dir("path/to/model")       # None when the directory has no tokenizer.json
  ids = tok.encode("Hello")                        # with the BOS the model expects
  ids = tok.encode_chat([{"role": "user", "content": "Hi"}])   # template + generation prompt
  text = tok.decode(ids)
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

from lrjax.files import read_json_object

log = logging.getLogger("lrjax.text")

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
CHAT_TEMPLATE_JINJA = "chat_template.jinja"
CHAT_TEMPLATE_JSON = "chat_template.json"
# The named special tokens transformers passes to chat templates (``special_tokens_map``).
SPECIAL_NAMES = (
  "bos_token",
  "eos_token",
  "unk_token",
  "sep_token",
  "pad_token",
  "cls_token",
  "mask_token",
)


def read_json(path: str | os.PathLike) -> dict:
  """A JSON object from a model directory's file; a one-line ValueError naming it otherwise."""
  return read_json_object(path, hint="restore the file from the model")


def _token_str(v: Any) -> str | None:
  """A special token as tokenizer_config spells it: a string or an AddedToken dict."""
  if v is None:
    return None
  if isinstance(v, str):
    return v
  if isinstance(v, Mapping) and isinstance(v.get("content"), str):
    return v["content"]
  raise ValueError(f"special token {v!r}: expected a string or {{'content': str, ...}}")


class Tokenizer:
  """Encode, decode and chat-template text for one model.

  ``tokenizer`` is a ``tokenizers.Tokenizer``; ``config`` is tokenizer_config.json's dict
  (special tokens, ``add_bos_token``/``add_eos_token``, ``chat_template``).
  """

  def __init__(self, tokenizer, config: Mapping | None = None, chat_template=None):
    from tokenizers import processors

    self.backend = tokenizer
    self.config = dict(config or {})
    self.special: dict[str, str] = {}
    for name in SPECIAL_NAMES:
      s = _token_str(self.config.get(name))
      if s is not None:
        self.special[name] = s
    self.bos_token = self.special.get("bos_token")
    self.eos_token = self.special.get("eos_token")
    self.bos_id = self.token_id(self.bos_token)
    self.eos_id = self.token_id(self.eos_token)
    # tokenizer.json's post-processor decides what encode() adds (transformers 5 ignores the
    # config's add_bos_token/add_eos_token when there is a tokenizer.json). Without one, the
    # config's flags build "[bos] $A [eos]" as transformers 4 did, so a Llama-2/Mistral-style
    # file without a post-processor still gets the BOS its model was trained with.
    if tokenizer.post_processor is None:
      add_bos = bool(self.config.get("add_bos_token", False)) and self.bos_id is not None
      add_eos = bool(self.config.get("add_eos_token", False)) and self.eos_id is not None
      single = (f"{self.bos_token}:0 " if add_bos else "") + "$A:0"
      single += f" {self.eos_token}:0" if add_eos else ""
      pair = single + (f" {self.bos_token}:1" if add_bos else "") + " $B:1"
      pair += f" {self.eos_token}:1" if add_eos else ""
      specials = ([(self.bos_token, self.bos_id)] if add_bos else []) + (
        [(self.eos_token, self.eos_id)] if add_eos else []
      )
      tokenizer.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=specials
      )
    self.clean_up_spaces = bool(self.config.get("clean_up_tokenization_spaces", False))
    template = chat_template if chat_template is not None else self.config.get("chat_template")
    self.chat_templates = _named_templates(template)
    self.special_ids = frozenset(
      i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special
    )

  # ---- construction ------------------------------------------------------------------------
  @classmethod
  def from_dir(cls, path: str | os.PathLike) -> Tokenizer | None:
    """The tokenizer of a model directory, or None when it has no ``tokenizer.json``."""
    from tokenizers import Tokenizer as Backend

    path = os.fspath(path)
    tj = os.path.join(path, TOKENIZER_FILE)
    if not os.path.isfile(tj):
      return None
    try:
      backend = Backend.from_file(tj)
    except Exception as e:  # the Rust library raises its own exception type
      raise ValueError(f"{tj}: not a tokenizers file ({e})") from None
    cfg: dict = {}
    for name in (SPECIAL_TOKENS_MAP, TOKENIZER_CONFIG):  # the config wins over the old map
      p = os.path.join(path, name)
      if os.path.isfile(p):
        cfg.update(read_json(p))
    template = None
    jinja = os.path.join(path, CHAT_TEMPLATE_JINJA)
    if os.path.isfile(jinja):  # transformers >= 4.47 saves the template beside the config
      with open(jinja, encoding="utf-8") as fh:
        template = fh.read()
    elif os.path.isfile(os.path.join(path, CHAT_TEMPLATE_JSON)):
      template = read_json(os.path.join(path, CHAT_TEMPLATE_JSON)).get("chat_template")
    return cls(backend, cfg, template)

  # ---- ids ---------------------------------------------------------------------------------
  @property
  def vocab_size(self) -> int:
    return self.backend.get_vocab_size(with_added_tokens=True)

  def token_id(self, token: str | None) -> int | None:
    return None if token is None else self.backend.token_to_id(token)

  def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
    """Token ids of ``text``; ``add_special_tokens`` adds what the model expects (e.g. BOS)."""
    if not isinstance(text, str):
      raise TypeError(f"text must be a str; got {type(text).__name__}")
    return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    text = self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
    return clean_up_tokenization(text) if self.clean_up_spaces else text

  # ---- chat --------------------------------------------------------------------------------
  @property
  def has_chat_template(self) -> bool:
    return bool(self.chat_templates)

  def apply_chat_template(
    self,
    messages: Sequence[Mapping],
    add_generation_prompt: bool = True,
    template: str | None = None,
    **kwargs,
  ) -> str:
    """The conversation rendered by the model's chat template, as transformers renders it
    (same jinja environment; the special tokens and ``add_generation_prompt`` as variables).

    ``template`` picks a named template when the config holds several (default "default").
    A template's ``raise_exception(msg)`` raises ValueError(msg).
    """
    from lrjax.text.chat import render

    if not self.chat_templates:
      raise ValueError(
        "this tokenizer has no chat template (tokenizer_config.json 'chat_template' or "
        "chat_template.jinja); send a plain prompt instead"
      )
    name = template or (
      "tool_use" if kwargs.get("tools") and "tool_use" in self.chat_templates else "default"
    )
    if name not in self.chat_templates:
      raise ValueError(f"chat template {name!r} not found; have {sorted(self.chat_templates)}")
    variables = {**self.special, **kwargs}
    return render(self.chat_templates[name], messages, add_generation_prompt, variables)

  def encode_chat(
    self, messages: Sequence[Mapping], add_generation_prompt: bool = True
  ) -> list[int]:
    """Token ids of the rendered conversation (its special tokens come from the template)."""
    return self.encode(
      self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False
    )


def _named_templates(t) -> dict[str, str]:
  if t is None:
    return {}
  if isinstance(t, str):
    return {"default": t}
  if isinstance(t, list) and all(
    isinstance(x, Mapping) and "name" in x and "template" in x for x in t
  ):
    return {x["name"]: x["template"] for x in t}
  raise ValueError(
    f"chat_template: expected a string or a list of {{'name', 'template'}}; got {type(t).__name__}"
  )


def clean_up_tokenization(s: str) -> str:
  """transformers' ``clean_up_tokenization`` (spaces before punctuation and contractions)."""
  for a, b in (
    (" .", "."),
    (" ?", "?"),
    (" !", "!"),
    (" ,", ","),
    (" ' ", "'"),
    (" n't", "n't"),
    (" 'm", "'m"),
    (" 's", "'s"),
    (" 've", "'ve"),
    (" 're", "'re"),
  ):
    s = s.replace(a, b)
  return s
