"""lrjax.text against transformers: encode (BOS/EOS rules), chat templates, generation config;
incremental detokenization and stop strings; calibration text."""

import os

os.environ.setdefault("RAYON_NUM_THREADS", "1")  # tokenizers' thread pool: one thread is plenty

import json  # noqa: E402
import shutil  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from tokenizers import Tokenizer as Backend  # noqa: E402
from tokenizers import decoders, models, normalizers, processors, trainers  # noqa: E402

from lrjax import text  # noqa: E402
from lrjax.text import (  # noqa: E402
  GenerationDefaults,
  IncrementalDetokenizer,
  StopMatcher,
  TemplateError,
  TextStream,
  Tokenizer,
  calib_tokens_from_text,
)

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures")
CHAT = os.path.join(FIXTURES, "hf", "llama_chat")
CORPUS = os.path.join(FIXTURES, "text", "corpus.txt")
SAMPLES = [
  "Hello world",
  "Café naïve façade — Zürich",
  "日本語のテキスト、中文：你好",
  "emoji 🙂🚀 👍🏽 🇫🇷 done",
  "  leading spaces and\nnew lines\n\n",
  "x",
]
CONVERSATIONS = [
  [{"role": "user", "content": "Hi there"}],
  [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "  And of Japan? 日本  "},
  ],
]


@pytest.fixture(scope="module")
def tok():
  return Tokenizer.from_dir(CHAT)


@pytest.fixture(scope="module")
def hf_tok():
  transformers = pytest.importorskip("transformers")
  return transformers.AutoTokenizer.from_pretrained(CHAT)


def sentencepiece_like(tmp_path, add_bos=True, add_eos=False, template=None, post=True):
  """A Llama-2/Mistral-style tokenizer dir: Metaspace BPE with byte fallback, add_bos_token /
  add_eos_token in the config and (``post``) in the tokenizer.json's post-processor."""
  tk = Backend(models.BPE(unk_token="<unk>", byte_fallback=True))
  tk.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
  tk.pre_tokenizer = None
  tk.decoder = decoders.Sequence(
    [
      decoders.Replace("▁", " "),
      decoders.ByteFallback(),
      decoders.Fuse(),
      decoders.Strip(" ", 1, 0),
    ]
  )
  specials = ["<unk>", "<s>", "</s>"]
  alphabet = [f"<0x{i:02X}>" for i in range(256)]
  trainer = trainers.BpeTrainer(
    vocab_size=600, special_tokens=specials + alphabet, show_progress=False
  )
  tk.train([CORPUS], trainer)
  if post:
    single = ("<s>:0 " if add_bos else "") + "$A:0" + (" </s>:0" if add_eos else "")
    specials_used = [
      (t, tk.token_to_id(t)) for t, on in (("<s>", add_bos), ("</s>", add_eos)) if on
    ]
    tk.post_processor = processors.TemplateProcessing(single=single, special_tokens=specials_used)
  d = tmp_path / "sp"
  d.mkdir()
  tk.save(str(d / "tokenizer.json"))
  cfg = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
  cfg.update(add_bos_token=add_bos, add_eos_token=add_eos)
  cfg["tokenizer_class"] = "PreTrainedTokenizerFast"  # tokenizer.json as it is
  cfg["legacy"] = False
  if template is not None:
    cfg["chat_template"] = template
  (d / "tokenizer_config.json").write_text(json.dumps(cfg))
  return d


# ---- encode / decode / chat ---------------------------------------------------------------------
@pytest.mark.parametrize("s", SAMPLES)
def test_encode_decode_match_transformers(tok, hf_tok, s):
  assert tok.encode(s) == hf_tok.encode(s)
  assert tok.encode(s, add_special_tokens=False) == hf_tok.encode(s, add_special_tokens=False)
  ids = tok.encode(s)
  assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True) == s
  assert tok.decode(ids, skip_special_tokens=False) == hf_tok.decode(ids)


@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("gen_prompt", [True, False])
def test_chat_template_matches_transformers(tok, hf_tok, conv, gen_prompt):
  msgs = CONVERSATIONS[conv]
  want = hf_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen_prompt)
  assert tok.apply_chat_template(msgs, add_generation_prompt=gen_prompt) == want
  ids = hf_tok.apply_chat_template(msgs, add_generation_prompt=gen_prompt)["input_ids"]
  assert tok.encode_chat(msgs, add_generation_prompt=gen_prompt) == ids
  assert ids[0] == tok.bos_id and ids.count(tok.bos_id) == 1  # the template's bos, once


def test_template_raise_exception(tok):
  with pytest.raises(TemplateError, match="Unknown role robot"):
    tok.apply_chat_template([{"role": "robot", "content": "beep"}])
  with pytest.raises(TemplateError, match="non-empty list"):
    tok.apply_chat_template([])
  with pytest.raises(TemplateError, match="messages\\[0\\]"):
    tok.apply_chat_template(["hi"])
  assert issubclass(TemplateError, ValueError)


@pytest.mark.parametrize("add_bos,add_eos", [(True, False), (False, False), (True, True)])
def test_add_bos_eos_from_config_match_transformers(tmp_path, add_bos, add_eos):
  transformers = pytest.importorskip("transformers")
  d = sentencepiece_like(tmp_path, add_bos, add_eos)
  ours = Tokenizer.from_dir(d)
  theirs = transformers.AutoTokenizer.from_pretrained(d)
  for s in SAMPLES:
    assert ours.encode(s) == theirs.encode(s), s
    ids = ours.encode(s)
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
  assert (ours.encode("hi")[0] == ours.bos_id) == add_bos
  assert (ours.encode("hi")[-1] == ours.eos_id) == add_eos


def test_config_flags_apply_without_a_post_processor(tmp_path):
  """A tokenizer.json without a post-processor: the config's add_bos_token adds the BOS (as
  transformers 4 did; transformers 5 ignores the flag when a tokenizer.json exists)."""
  ours = Tokenizer.from_dir(sentencepiece_like(tmp_path, True, False, post=False))
  plain = ours.encode("Hello world", add_special_tokens=False)
  assert ours.encode("Hello world") == [ours.bos_id] + plain


def test_template_variables_and_files(tmp_path):
  """bos_token/eos_token as template variables; chat_template.jinja beside the config;
  named templates; strftime_now, namespace and the tojson filter."""
  transformers = pytest.importorskip("transformers")
  tpl = (
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
    "{{ bos_token }}[{{ m['role'] }}] {{ m['content'] | tojson }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}{{ ns.n }}"
  )
  d = sentencepiece_like(tmp_path, template=None)
  (d / "chat_template.jinja").write_text(tpl)
  ours, theirs = Tokenizer.from_dir(d), transformers.AutoTokenizer.from_pretrained(d)
  msgs = CONVERSATIONS[1]
  for g in (True, False):
    want = theirs.apply_chat_template(msgs, tokenize=False, add_generation_prompt=g)
    assert ours.apply_chat_template(msgs, add_generation_prompt=g) == want
    assert '"  And of Japan? 日本  "' in want  # tojson without escaping
  named = [{"name": "default", "template": "A{{ messages[0]['content'] }}"}]
  named.append({"name": "tool_use", "template": "T{{ tools | length }}"})
  t2 = Tokenizer(ours.backend, {"chat_template": named})
  assert t2.apply_chat_template(msgs) == "ABe brief."
  assert t2.apply_chat_template(msgs, tools=[{"a": 1}]) == "T1"
  with pytest.raises(ValueError, match="not found"):
    t2.apply_chat_template(msgs, template="nope")
  with pytest.raises(ValueError, match="no chat template"):
    Tokenizer(ours.backend, {}).apply_chat_template(msgs)


def test_sandbox_refuses_attribute_escapes(tok):
  evil = Tokenizer(tok.backend, {"chat_template": "{{ messages.__class__.__mro__ }}"})
  with pytest.raises(TemplateError):
    evil.apply_chat_template(CONVERSATIONS[0])


def test_no_tokenizer_dir_says_so_once(tmp_path, caplog):
  d = tmp_path / "ids_only"
  d.mkdir()
  with caplog.at_level("WARNING", logger="lrjax.text"):
    assert text.load_text(d)[0] is None
    assert text.load_text(d)[0] is None
  assert sum("no tokenizer.json" in r.getMessage() for r in caplog.records) == 1


def test_bad_tokenizer_files(tmp_path):
  d = tmp_path / "bad"
  shutil.copytree(CHAT, d)
  (d / "tokenizer_config.json").write_text("{not json")
  with pytest.raises(ValueError, match="tokenizer_config.json: not valid JSON"):
    Tokenizer.from_dir(d)
  (d / "tokenizer_config.json").write_text("{}")
  (d / "tokenizer.json").write_text("[]")
  with pytest.raises(ValueError, match="not a tokenizers file"):
    Tokenizer.from_dir(d)


# ---- generation config --------------------------------------------------------------------------
def test_generation_config_fixture():
  tok, gen = text.load_text(CHAT)
  assert set(gen.eos_ids) == {tok.token_id("<|end_of_text|>"), tok.token_id("<|eot_id|>")}
  assert gen.bos_id == tok.bos_id
  assert (gen.temperature, gen.top_k, gen.top_p) == (0.6, 50, 0.9)  # do_sample; HF top_k 50


@pytest.mark.parametrize(
  "gen,hf,want",
  [
    ({"eos_token_id": 2}, {}, dict(eos_ids=(2,), temperature=0.0)),
    ({"eos_token_id": [7, 9], "do_sample": False, "temperature": 0.7}, {}, dict(eos_ids=(7, 9))),
    ({"do_sample": True}, {"eos_token_id": 2}, dict(eos_ids=(2,), temperature=1.0, top_k=50)),
    ({"max_new_tokens": 33, "eos_token_id": 5}, {"eos_token_id": [5, 6]}, dict(eos_ids=(5, 6))),
    (None, {"eos_token_id": 2, "bos_token_id": 1}, dict(eos_ids=(2,), bos_id=1)),
  ],
)
def test_generation_defaults(tmp_path, gen, hf, want):
  if gen is not None:
    (tmp_path / "generation_config.json").write_text(json.dumps(gen))
  (tmp_path / "config.json").write_text(json.dumps(hf))
  got = GenerationDefaults.from_dir(tmp_path)
  for k, v in want.items():
    assert getattr(got, k) == v, k
  if gen and "max_new_tokens" in gen:
    assert got.max_new_tokens == gen["max_new_tokens"]


@pytest.mark.parametrize(
  "gen", [{"eos_token_id": "2"}, {"eos_token_id": [1, -1]}, {"do_sample": True, "top_p": 0}]
)
def test_generation_config_errors_name_the_file(tmp_path, gen):
  (tmp_path / "generation_config.json").write_text(json.dumps(gen))
  with pytest.raises(ValueError, match="generation_config.json"):
    GenerationDefaults.from_dir(tmp_path)


# ---- streaming ----------------------------------------------------------------------------------
def _stream(tok, ids, context=()):
  d = IncrementalDetokenizer(tok, context)
  pieces = [d.push(i) for i in ids]
  return pieces, d.flush()


@pytest.mark.parametrize("s", SAMPLES)
def test_incremental_detokenization_byte_level(tok, s):
  ids = tok.encode(s, add_special_tokens=False)
  pieces, rest = _stream(tok, ids)
  assert "".join(pieces) + rest == tok.decode(ids) == s
  assert not any("\ufffd" in p for p in pieces)  # never half a character
  assert rest == ""


def test_merges_split_utf8(tok):
  """The fixture's merges really cut characters: some single tokens decode to U+FFFD."""
  ids = tok.encode("🎉 日本語 👍🏽", add_special_tokens=False)
  assert any("\ufffd" in tok.decode([i]) for i in ids)
  pieces, _ = _stream(tok, ids)
  assert "" in pieces and "".join(pieces) == "🎉 日本語 👍🏽"


def test_incremental_detokenization_sentencepiece(tmp_path):
  """Metaspace + byte fallback: leading spaces survive the window, with the prompt as context."""
  sp = Tokenizer.from_dir(sentencepiece_like(tmp_path))
  for s in SAMPLES:
    prompt = sp.encode("The answer:")
    ids = sp.encode(" " + s, add_special_tokens=False)
    pieces, rest = _stream(sp, ids, prompt)
    full = sp.decode(prompt + ids)
    assert "".join(pieces) + rest == full[len(sp.decode(prompt)) :], s
    assert not any("\ufffd" in p for p in pieces)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.lists(st.integers(0, 383), max_size=24), st.integers(0, 6))
def test_incremental_equals_full_decode_any_ids(ids, n_ctx):
  tok = Tokenizer.from_dir(CHAT)
  ctx = tok.encode("Question: what?", add_special_tokens=False)[:n_ctx]
  pieces, rest = _stream(tok, ids, ctx)
  base = tok.decode(ctx)
  assert base + "".join(pieces) + rest == tok.decode(ctx + ids)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
  st.text(alphabet="ab\n é", max_size=30),
  st.lists(st.text(alphabet="ab\n é", min_size=1, max_size=3), max_size=3),
  st.lists(st.integers(1, 5), max_size=30),
)
def test_stop_matcher_cuts_at_the_first_stop(s, stops, cuts):
  m = StopMatcher(stops)
  out, i = [], 0
  for c in cuts + [len(s)]:
    out.append(m.push(s[i : i + c]))
    i += c
    if m.stopped:
      break
  out.append(m.flush())
  want, hit = s, False  # character by character: the first stop to complete, the longest
  for end in range(1, len(s) + 1):
    done = [x for x in stops if s[:end].endswith(x)]
    if done:
      want, hit = s[: end - max(map(len, done))], True
      break
  assert "".join(out) == want
  assert m.stopped == hit


def test_text_stream_eos_and_stop(tok):
  ids = tok.encode("The capital of France is Paris. More", add_special_tokens=False)
  eot = tok.token_id("<|eot_id|>")
  ts = TextStream(tok, stop=["Paris"], eos_ids=[eot])
  out = "".join(ts.push(i) for i in ids)
  assert out == "The capital of France is " and ts.done and ts.reason == "stop_string"
  ts = TextStream(tok, eos_ids=[eot])
  out = "".join(ts.push(i) for i in ids[:3] + [eot] + ids[3:])
  assert out == tok.decode(ids[:3]) and ts.reason == "eos" and ts.tokens == 4
  assert ts.finish() == ""
  ts = TextStream(tok, eos_ids=[eot])
  out = "".join(ts.push(i) for i in ids) + ts.finish()
  assert out == tok.decode(ids) and ts.reason is None


# ---- calibration text ---------------------------------------------------------------------------
def test_calib_text_and_jsonl(tmp_path, tok):
  j = tmp_path / "c.jsonl"
  docs = ["First document, with some words.", "Zweites Dokument: Grüße!", "third 🎉"]
  j.write_text("\n".join(json.dumps({"text": d}) for d in docs) + "\n\n")
  got = calib_tokens_from_text([CORPUS, j], tok, 32)
  stream = tok.encode(open(CORPUS, encoding="utf-8").read())
  for d in docs:
    stream += tok.encode(d)
  n = len(stream) // 32
  assert got.dtype == np.int32 and got.shape == (n, 32)
  assert got.reshape(-1).tolist() == stream[: n * 32]


def test_calib_text_errors(tmp_path, tok):
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"text": "ok"}\n{"txt": "no"}\n')
  with pytest.raises(ValueError, match="bad.jsonl:2: expected an object with a string 'text'"):
    calib_tokens_from_text([bad], tok, 8)
  bad.write_text("{oops\n")
  with pytest.raises(ValueError, match="bad.jsonl:1: not a JSON object"):
    calib_tokens_from_text([bad], tok, 8)
  short = tmp_path / "short.txt"
  short.write_text("tiny")
  with pytest.raises(ValueError, match="fewer than one 64-token window"):
    calib_tokens_from_text([short], tok, 64)
  with pytest.raises(FileNotFoundError):
    calib_tokens_from_text([tmp_path / "missing.txt"], tok, 8)
  with pytest.raises(ValueError, match="tokenizer"):
    calib_tokens_from_text([short], None, 8)
  binary = tmp_path / "b.txt"
  binary.write_bytes(b"\xff\xfe\x00abc")
  with pytest.raises(ValueError, match="not UTF-8"):
    calib_tokens_from_text([binary], tok, 2)


def test_long_documents_are_encoded_in_pieces(tmp_path, tok, monkeypatch):
  from lrjax.text import calib

  monkeypatch.setattr(calib, "PIECE_CHARS", 200)
  got = calib_tokens_from_text([CORPUS], tok, 16)
  body = open(CORPUS, encoding="utf-8").read()
  assert got[0, 0] == tok.bos_id and (got == tok.bos_id).sum() == 1  # one document, one BOS
  decoded = tok.decode(got.reshape(-1).tolist())
  assert len(decoded) > len(body) - 200 and body.startswith(decoded)  # no text lost or added
