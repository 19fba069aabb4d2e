"""Generation settings from a model directory's ``generation_config.json`` (and ``config.json``).

HF semantics: ``do_sample`` false (the default) is greedy whatever the temperature says; when
true, ``temperature`` (default 1.0), ``top_k`` (default 50) and ``top_p`` (default 1.0) apply.
``eos_token_id`` is one id or a list; generation stops at any of them.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable

from lrjax.text.tokenizer import read_json

GENERATION_CONFIG = "generation_config.json"
HF_CONFIG = "config.json"


def _ids(v, where: str) -> tuple[int, ...]:
  if v is None:
    return ()
  vals = v if isinstance(v, (list, tuple)) else [v]
  out = []
  for x in vals:
    if isinstance(x, bool) or not isinstance(x, int) or x < 0:
      raise ValueError(f"{where}: eos/bos token id {x!r} must be a non-negative int (or a list)")
    out.append(x)
  return tuple(out)


@dataclasses.dataclass(frozen=True)
class GenerationDefaults:
  """Default sampling for requests that leave a setting unset; ``temperature`` 0 is greedy."""

  eos_ids: tuple[int, ...] = ()
  bos_id: int | None = None
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  max_new_tokens: int | None = None

  @classmethod
  def from_dir(cls, path: str | os.PathLike, extra_eos: Iterable[int] = ()) -> GenerationDefaults:
    """Read ``generation_config.json`` (and ``config.json``'s eos/bos ids) if present;
    ``extra_eos`` (e.g. the tokenizer's eos id) joins the stop ids."""
    path = os.fspath(path)
    gen, hf = {}, {}
    gp, hp = os.path.join(path, GENERATION_CONFIG), os.path.join(path, HF_CONFIG)
    if os.path.isfile(gp):
      gen = read_json(gp)
    if os.path.isfile(hp):
      hf = read_json(hp)
    eos: list[int] = []
    for ids in (
      _ids(gen.get("eos_token_id"), gp),
      _ids(hf.get("eos_token_id"), hp),
      tuple(extra_eos),
    ):
      eos += [i for i in ids if i not in eos]
    bos = _ids(gen.get("bos_token_id", hf.get("bos_token_id")), gp)
    kw: dict = dict(eos_ids=tuple(eos), bos_id=bos[0] if bos else None)
    if gen.get("do_sample"):
      t, k, p = gen.get("temperature", 1.0), gen.get("top_k", 50), gen.get("top_p", 1.0)
      if not isinstance(t, (int, float)) or isinstance(t, bool) or not t >= 0:
        raise ValueError(f"{gp}: temperature={t!r} must be a number >= 0")
      if not isinstance(k, int) or isinstance(k, bool) or k < 0:
        raise ValueError(f"{gp}: top_k={k!r} must be an int >= 0")
      if not isinstance(p, (int, float)) or isinstance(p, bool) or not 0 < p <= 1:
        raise ValueError(f"{gp}: top_p={p!r} must be in (0, 1]")
      kw.update(temperature=float(t), top_k=int(k), top_p=float(p))
    m = gen.get("max_new_tokens")
    if m is not None:
      if not isinstance(m, int) or isinstance(m, bool) or m < 1:
        raise ValueError(f"{gp}: max_new_tokens={m!r} must be an int >= 1")
      kw["max_new_tokens"] = m
    return cls(**kw)
