"""Shared by the server tests: the tiny chat fixture, compressed, and its tokenizer."""

import os

os.environ.setdefault("RAYON_NUM_THREADS", "1")  # tokenizers' thread pool

import pytest  # noqa: E402

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures")
CHAT = os.path.join(FIXTURES, "hf", "llama_chat")


@pytest.fixture(scope="session")
def chat_model():
  """The llama_chat fixture with 30 % of its projection params removed (SVD, deterministic)."""
  from lrjax.compress import compress
  from lrjax.models import from_hf

  return compress(from_hf(CHAT), ratio=0.3, method="svd", block=8, progress=False)


@pytest.fixture(scope="session")
def chat_text():
  from lrjax import text

  return text.load_text(CHAT)
