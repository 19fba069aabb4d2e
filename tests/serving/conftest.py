"""Shared by the server tests: the tiny chat fixture, compressed, and its tokenizer."""

import os

os.environ.setdefault("RAYON_NUM_THREADS", "1")  # tokenizers' thread pool

import pytest  # noqa: E402

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures")
CHAT = os.path.join(FIXTURES, "hf", "llama_chat")


@pytest.fixture(scope="session")
def chat_model():
  """The llama_chat fixture with 30 % of its projection params removed (SVD, deterministic)."""
  import lrjax
  from lrjax.models import from_hf

  return lrjax.compress(from_hf(CHAT), ratio=0.3, method="svd", block=8, progress=False)


@pytest.fixture(scope="session")
def chat_text():
  from lrjax import text

  return text.load_text(CHAT)


def pytest_terminal_summary(terminalreporter):
  """The engine fuzz's case counts, where CI logs show them."""
  import sys

  for name, mod in list(sys.modules.items()):
    if name.endswith("test_engine_fuzz") and getattr(mod, "STATS", {}).get("cases"):
      s = mod.STATS
      terminalreporter.write_line(
        f"engine fuzz: {s['cases']} cases, {s['requests']} requests ({s['rejected']} refused, "
        f"{s['cancelled']} cancelled, {s['errors']} failed at admission), {s['steps']} steps, "
        f"{s['crashes']} failing runs"
      )
