"""Chat templates rendered as transformers renders them.

The environment is transformers' (``utils/chat_template_utils.py``): jinja2's immutable
sandbox with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, a
``{% generation %}`` block that renders its body, a ``tojson`` filter that does not escape HTML,
and the globals ``raise_exception``, ``strftime_now``, ``dict`` and ``namespace``. Templates
come from model directories and are untrusted, hence the sandbox.
"""

from __future__ import annotations

import datetime
import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any


class TemplateError(ValueError):
  """A chat template refused the conversation (``raise_exception``) or failed to render."""


@functools.lru_cache(maxsize=16)
def _compile(template: str):
  import jinja2
  import jinja2.ext
  from jinja2.sandbox import ImmutableSandboxedEnvironment

  class GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text; it renders the body."""

    tags = {"generation"}

    def parse(self, parser):
      lineno = next(parser.stream).lineno
      body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
      return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
      return caller()

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(
      x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )

  def strftime_now(fmt):
    return datetime.datetime.now().strftime(fmt)

  class Namespace(jinja2.utils.Namespace):
    """``namespace(...)`` that refuses underscore attributes (as transformers' does)."""

    def __init__(*args, **kwargs):
      self, args = args[0], args[1:]
      attrs = dict(*args, **kwargs)
      for name in attrs:
        Namespace._check(name)
      jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
      Namespace._check(name)
      jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
      if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} starts with '_'")

  class TemplateDict:
    """``dict(...)`` without the type itself (no attribute access to the class)."""

    def __call__(self, *args, **kwargs):
      return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
      return dict.fromkeys(*args, **kwargs)

  env = ImmutableSandboxedEnvironment(
    trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlock, jinja2.ext.loopcontrols]
  )
  env.filters["tojson"] = tojson
  env.globals.update(
    raise_exception=raise_exception,
    strftime_now=strftime_now,
    dict=TemplateDict(),
    namespace=Namespace,
  )
  try:
    return env.from_string(template)
  except jinja2.exceptions.TemplateSyntaxError as e:
    raise TemplateError(f"chat template does not parse: {e}") from None


def _plain(value: Any) -> Any:
  """Messages as plain dicts/lists (pydantic models and dataclasses too); None-valued keys of a
  message dropped, as transformers does."""
  if hasattr(value, "model_dump"):
    value = value.model_dump()
  if isinstance(value, Mapping):
    return {k: _plain(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_plain(v) for v in value]
  return value


def render(
  template: str,
  messages: Sequence[Mapping],
  add_generation_prompt: bool = True,
  variables: Mapping[str, Any] | None = None,
) -> str:
  """``template`` rendered over ``messages`` (a list of {"role", "content", ...}) with
  ``add_generation_prompt`` and ``variables`` (bos_token, eos_token, tools, ...)."""
  import jinja2

  if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
    raise TemplateError("messages must be a non-empty list of {'role': ..., 'content': ...}")
  chat = []
  for i, m in enumerate(_plain(list(messages))):
    if not isinstance(m, dict):
      raise TemplateError(f"messages[{i}] must be an object with 'role' and 'content'")
    chat.append({k: v for k, v in m.items() if v is not None})
  kw = {"tools": None, "documents": None, **(variables or {})}
  try:
    return _compile(template).render(
      messages=chat, add_generation_prompt=add_generation_prompt, **kw
    )
  except jinja2.exceptions.TemplateError as e:
    raise TemplateError(f"chat template: {e}") from None
