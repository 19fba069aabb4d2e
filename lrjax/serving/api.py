"""The OpenAI request schema: parse and validate a completions / chat completions body into a
:class:`Job` (token ids, sampling, stop strings, streaming), or raise :class:`ApiError` (HTTP 400,
OpenAI's error JSON naming the field and the limit).

Parameters: ``model``, ``prompt`` (a string, a list of token ids, or a one-element list of
either) or ``messages``; ``max_tokens`` (``max_completion_tokens`` for chat), ``temperature``
[0, 2], ``top_p`` (0, 1], ``top_k`` (an extension; 0 or -1 disable it), ``stop`` (a string or up
to 4), ``seed``, ``n`` (only 1), ``stream``, ``stream_options.include_usage``, and
``return_token_ids`` (an extension: the generated ids beside the text). ``presence_penalty`` /
``frequency_penalty`` are accepted at 0 only; ``logprobs``, ``echo``, ``best_of`` > 1,
``suffix``, ``logit_bias``, ``tools`` and non-text ``response_format`` are refused by name.
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Mapping
from typing import Any

from lrjax.serving.sampling import SamplingParams

MAX_STOP = 4
ROLES = ("system", "user", "assistant", "tool", "developer")


class ApiError(Exception):
  """An OpenAI-style error: HTTP ``status``, ``message``, the offending ``param``."""

  def __init__(
    self,
    message: str,
    param: str | None = None,
    status: int = 400,
    type: str = "invalid_request_error",
    code: str | None = None,
  ):
    super().__init__(message)
    self.message, self.param, self.status, self.type, self.code = message, param, status, type, code

  def body(self) -> dict:
    return {
      "error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
    }


@dataclasses.dataclass
class Context:
  """What validation needs to know about the served model."""

  model_name: str
  max_len: int  # cache length per request: prompt + generated tokens
  max_prompt: int  # the longest prompt the engine takes
  vocab_size: int
  tokenizer: Any = None  # lrjax.text.Tokenizer or None (token ids only)
  defaults: Any = None  # lrjax.text.GenerationDefaults or None
  default_max_tokens: int = 16  # completions' OpenAI default


@dataclasses.dataclass
class Job:
  kind: str  # "completion" | "chat"
  prompt_ids: list[int]
  sampling: SamplingParams
  stop: list[str]
  stream: bool
  include_usage: bool
  return_token_ids: bool


def _int(body, name, lo=None, hi=None, default=None):
  v = body.get(name, default)
  if v is None:
    return default
  if isinstance(v, bool) or not isinstance(v, int):
    raise ApiError(f"'{name}' must be an integer; got {type(v).__name__} {v!r}", name)
  if lo is not None and v < lo or hi is not None and v > hi:
    rng = f">= {lo}" if hi is None else f"between {lo} and {hi}"
    raise ApiError(f"'{name}' must be {rng}; got {v}", name)
  return v


def _num(body, name, lo, hi, default, lo_open=False):
  v = body.get(name, default)
  if v is None:
    return default
  if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
    raise ApiError(f"'{name}' must be a number; got {type(v).__name__} {v!r}", name)
  if v < lo or v > hi or (lo_open and v == lo):
    rng = f"in ({lo}, {hi}]" if lo_open else f"between {lo} and {hi}"
    raise ApiError(f"'{name}' must be {rng}; got {v}", name)
  return float(v)


def _bool(body, name, default=False):
  v = body.get(name, default)
  if v is None:
    return default
  if not isinstance(v, bool):
    raise ApiError(f"'{name}' must be true or false; got {v!r}", name)
  return v


def _refuse_unsupported(body: Mapping, kind: str):
  for name in ("presence_penalty", "frequency_penalty"):
    v = body.get(name)
    if v not in (None, 0, 0.0):
      raise ApiError(f"'{name}' is not supported by this server; send 0 or leave it out", name)
  for name in ("logprobs", "echo", "top_logprobs"):
    if body.get(name) not in (None, False, 0):
      raise ApiError(f"'{name}' is not supported by this server; leave it out", name)
  if body.get("best_of") not in (None, 1):
    raise ApiError("'best_of' must be 1 (the only value this server supports)", "best_of")
  for name in ("suffix", "logit_bias", "tools", "functions"):
    if body.get(name):
      raise ApiError(f"'{name}' is not supported by this server; leave it out", name)
  rf = body.get("response_format")
  if rf not in (None, {"type": "text"}):
    raise ApiError(
      "'response_format' other than {'type': 'text'} is not supported", "response_format"
    )


def _stop(body) -> list[str]:
  v = body.get("stop")
  if v is None:
    return []
  if isinstance(v, str):
    v = [v]
  if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
    raise ApiError("'stop' must be a string or a list of strings", "stop")
  if len(v) > MAX_STOP:
    raise ApiError(f"'stop' takes at most {MAX_STOP} strings; got {len(v)}", "stop")
  if any(not s for s in v):
    raise ApiError("'stop' strings must not be empty", "stop")
  return v


def _is_ids(x) -> bool:
  return (
    isinstance(x, list)
    and bool(x)
    and all(isinstance(t, int) and not isinstance(t, bool) for t in x)
  )


def _prompt_ids(body, ctx: Context) -> list[int]:
  if "prompt" not in body:
    raise ApiError("'prompt' is required (a string or a list of token ids)", "prompt")
  p = body["prompt"]
  if isinstance(p, list) and len(p) == 1 and (isinstance(p[0], str) or _is_ids(p[0])):
    p = p[0]  # a batch of one
  if isinstance(p, str):
    if ctx.tokenizer is None:
      raise ApiError(
        "this model has no tokenizer (no tokenizer.json in its checkpoint); send 'prompt' as a "
        "list of token ids",
        "prompt",
      )
    if not p:
      raise ApiError("'prompt' is empty", "prompt")
    return ctx.tokenizer.encode(p)
  if _is_ids(p):
    bad = [t for t in p if not 0 <= t < ctx.vocab_size]
    if bad:
      raise ApiError(
        f"'prompt' token ids {bad[:5]} are outside [0, {ctx.vocab_size}) (the vocabulary)", "prompt"
      )
    return list(p)
  if isinstance(p, list) and len(p) > 1:
    raise ApiError(
      "'prompt' takes one prompt per request (a batch of several is not supported)", "prompt"
    )
  raise ApiError("'prompt' must be a non-empty string or a non-empty list of token ids", "prompt")


def _content(m: Mapping, i: int) -> str:
  c = m.get("content")
  if c is None:
    return ""
  if isinstance(c, str):
    return c
  if isinstance(c, list):
    parts = []
    for part in c:
      if (
        not isinstance(part, Mapping)
        or part.get("type") != "text"
        or not isinstance(part.get("text"), str)
      ):
        raise ApiError(
          f"messages[{i}].content: only text parts ({{'type': 'text', 'text': ...}}) are supported",
          f"messages[{i}].content",
        )
      parts.append(part["text"])
    return "".join(parts)
  raise ApiError(
    f"messages[{i}].content must be a string or a list of text parts", f"messages[{i}].content"
  )


def _chat_ids(body, ctx: Context) -> list[int]:
  from lrjax.text import TemplateError

  msgs = body.get("messages")
  if not isinstance(msgs, list) or not msgs:
    raise ApiError("'messages' must be a non-empty list of {'role', 'content'}", "messages")
  conv = []
  for i, m in enumerate(msgs):
    if not isinstance(m, Mapping):
      raise ApiError(f"messages[{i}] must be an object with 'role' and 'content'", f"messages[{i}]")
    role = m.get("role")
    if role not in ROLES:
      raise ApiError(
        f"messages[{i}].role must be one of {list(ROLES)}; got {role!r}", f"messages[{i}].role"
      )
    conv.append({"role": role, "content": _content(m, i)})
  if ctx.tokenizer is None:
    raise ApiError(
      "this model has no tokenizer (no tokenizer.json in its checkpoint): chat needs one; use "
      "/v1/completions with token ids",
      "messages",
    )
  if not ctx.tokenizer.has_chat_template:
    raise ApiError(
      "this model's tokenizer has no chat template; use /v1/completions with a plain prompt",
      "messages",
    )
  try:
    return ctx.tokenizer.encode_chat(conv, add_generation_prompt=True)
  except TemplateError as e:
    raise ApiError(str(e), "messages") from None


def parse(body: Any, kind: str, ctx: Context) -> Job:
  """Validate an OpenAI request body for ``kind`` ("completion" or "chat") → :class:`Job`."""
  if not isinstance(body, Mapping):
    raise ApiError("the request body must be a JSON object")
  model = body.get("model")
  if model is not None and model != ctx.model_name:
    raise ApiError(
      f"model {model!r} does not exist; this server serves {ctx.model_name!r}",
      "model",
      code="model_not_found",
    )
  _refuse_unsupported(body, kind)
  n = _int(body, "n", default=1)
  if n != 1:
    raise ApiError(f"'n' must be 1 (one choice per request); got {n}", "n")
  ids = _chat_ids(body, ctx) if kind == "chat" else _prompt_ids(body, ctx)
  field = "messages" if kind == "chat" else "prompt"
  if len(ids) > ctx.max_prompt:
    raise ApiError(
      f"'{field}' is {len(ids)} tokens; this server takes at most {ctx.max_prompt} "
      f"(context {ctx.max_len} tokens, prompt and completion together)",
      field,
      code="context_length_exceeded",
    )
  room = ctx.max_len - len(ids)
  name = "max_tokens"
  if kind == "chat" and body.get("max_completion_tokens") is not None:
    name = "max_completion_tokens"
  d = ctx.defaults
  default = (d.max_new_tokens if d is not None and d.max_new_tokens else None) or (
    room if kind == "chat" else ctx.default_max_tokens
  )
  max_tokens = _int(body, name, lo=1, default=min(default, room))
  if max_tokens > room:
    raise ApiError(
      f"'{name}' is {max_tokens}, but the prompt's {len(ids)} tokens leave room for {room} "
      f"(context {ctx.max_len} tokens)",
      name,
      code="context_length_exceeded",
    )
  temperature = _num(body, "temperature", 0.0, 2.0, d.temperature if d is not None else 1.0)
  top_p = _num(body, "top_p", 0.0, 1.0, d.top_p if d is not None else 1.0, lo_open=True)
  top_k = max(0, _int(body, "top_k", lo=-1, default=d.top_k if d is not None else 0))  # -1: off
  seed = _int(body, "seed", lo=0, hi=2**64 - 1)
  if seed is None:  # no seed: a fresh one, so repeated sampled requests differ
    seed = secrets.randbits(64)
  stream = _bool(body, "stream")
  so = body.get("stream_options")
  if so is not None and (
    not isinstance(so, Mapping) or not isinstance(so.get("include_usage", False), bool)
  ):
    raise ApiError("'stream_options' must be {'include_usage': true|false}", "stream_options")
  include_usage = bool(so and so.get("include_usage"))
  if so is not None and not stream:
    raise ApiError("'stream_options' is only allowed with 'stream': true", "stream_options")
  eos = tuple(d.eos_ids) if d is not None else ()
  sampling = SamplingParams(
    temperature=temperature,
    top_k=top_k,
    top_p=top_p,
    max_new_tokens=max_tokens,
    stop_tokens=eos,
    seed=seed,
  )
  return Job(
    kind=kind,
    prompt_ids=ids,
    sampling=sampling,
    stop=_stop(body),
    stream=stream,
    include_usage=include_usage,
    return_token_ids=_bool(body, "return_token_ids") or ctx.tokenizer is None,
  )
