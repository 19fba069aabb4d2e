"""`lrjax serve`'s HTTP API through real HTTP on 127.0.0.1, with the openai client and httpx:
completions and chat, streaming and not, every bad request, 429, disconnects, metrics, and
SIGTERM on a subprocess."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from lrjax.serving import Engine, Request, SamplingParams
from lrjax.serving.server import ServerThread, create_app
from lrjax.text import GenerationDefaults, TextStream

openai = pytest.importorskip("openai")

ENGINE = dict(max_slots=4, max_len=96, buckets=(16, 32, 64), attend_buckets=(96,))
NAME = "tiny-chat"


@pytest.fixture(scope="module")
def ref(chat_model):
  """Requests run alone, on an engine of the server's shapes (its compiled steps too)."""
  eng = Engine(chat_model, **ENGINE)

  def alone(ids, n, eos=()):
    [r] = eng.generate([Request(ids, SamplingParams(max_new_tokens=n, stop_tokens=tuple(eos)))])
    return r.tokens

  return alone


@pytest.fixture(scope="module")
def server(chat_model, chat_text):
  tok, gen = chat_text
  engine = Engine(chat_model, **ENGINE)
  engine.warmup()
  meta = {"fusion": engine.fusion_report()}
  app = create_app(engine, model_name=NAME, tokenizer=tok, defaults=gen, max_queue=8, metadata=meta)
  with ServerThread(app) as srv:
    srv.engine, srv.tok, srv.gen = engine, tok, gen
    yield srv


@pytest.fixture(scope="module")
def client(server):
  return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def _text(tok, ids, toks, eos):
  ts = TextStream(tok, ids, eos_ids=eos)
  return "".join(ts.push(t) for t in toks) + ts.finish()


# ---- happy paths --------------------------------------------------------------------------------
def test_completion(server, client, ref):
  tok, eos = server.tok, server.gen.eos_ids
  prompt = "The river runs past the"
  ids = tok.encode(prompt)
  out = client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0)
  want = ref(ids, 12, eos)
  assert out.choices[0].text == _text(tok, ids, want, eos)
  reason = "stop" if want[-1] in eos else "length"
  assert out.choices[0].finish_reason == reason and out.object == "text_completion"
  assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == len(want)
  assert out.usage.total_tokens == len(ids) + len(want)


def test_completion_stream_equals_non_stream(server, client):
  kw = dict(model=NAME, prompt="Once upon a time there", max_tokens=20, temperature=0)
  whole = client.completions.create(**kw)
  chunks = list(
    client.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
  )
  assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
  assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
  assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 20
  assert len([c for c in chunks if c.choices and c.choices[0].text]) > 3  # really streamed


def test_token_ids_and_ids_prompt(server, ref):
  ids = server.tok.encode("Question: What colour is the sky")
  r = httpx.post(
    server.url + "/v1/completions",
    json={"prompt": ids, "max_tokens": 8, "temperature": 0, "return_token_ids": True},
  )
  assert r.status_code == 200
  c = r.json()["choices"][0]
  assert c["token_ids"] == ref(ids, 8, server.gen.eos_ids)


def test_chat(server, client, ref):
  tok, eos = server.tok, server.gen.eos_ids
  msgs = [{"role": "user", "content": "What is the capital of France?"}]
  ids = tok.encode_chat(msgs)
  out = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=16, temperature=0)
  want = ref(ids, 16, eos)
  assert out.choices[0].message.role == "assistant" and out.object == "chat.completion"
  assert out.choices[0].message.content == _text(tok, ids, want, eos)
  chunks = list(
    client.chat.completions.create(
      model=NAME, messages=msgs, max_tokens=16, temperature=0, stream=True
    )
  )
  assert chunks[0].choices[0].delta.role == "assistant"
  streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
  assert streamed == out.choices[0].message.content
  assert chunks[-1].choices[0].finish_reason == out.choices[0].finish_reason


def test_stop_string(server, client):
  kw = dict(model=NAME, prompt="To make tea, boil the water", max_tokens=30, temperature=0)
  full = client.completions.create(**kw).choices[0].text
  cut = full[len(full) // 3 : len(full) // 3 + 3]
  assert cut.strip(), full
  for stream in (False, True):
    if stream:
      chunks = list(client.completions.create(stop=[cut, "\x00zz"], stream=True, **kw))
      text = "".join(c.choices[0].text for c in chunks)
      reason = chunks[-1].choices[0].finish_reason
    else:
      c = client.completions.create(stop=[cut, "\x00zz"], **kw).choices[0]
      text, reason = c.text, c.finish_reason
    assert text == full[: full.index(cut)] and reason == "stop"
  _wait_idle(server)


def test_eos_id_stops_with_reason_stop(chat_model, chat_text, ref):
  """The generation config's eos ids end a request (finish_reason "stop"); its text is not
  emitted."""
  tok, _ = chat_text
  ids = tok.encode("The baker opens the shop")
  greedy = ref(ids, 10)
  eos = greedy[4]  # pretend the 5th token is the model's eos
  engine = Engine(chat_model, **ENGINE)
  app = create_app(
    engine, model_name=NAME, tokenizer=tok, defaults=GenerationDefaults(eos_ids=(eos,))
  )
  with ServerThread(app) as srv:
    r = httpx.post(
      srv.url + "/v1/completions",
      json={"prompt": "The baker opens the shop", "max_tokens": 10, "temperature": 0},
    ).json()
  first = greedy.index(eos)
  assert r["choices"][0]["finish_reason"] == "stop"
  assert r["choices"][0]["text"] == tok.decode(greedy[:first])
  assert r["usage"]["completion_tokens"] == first + 1


def test_ids_only_model(chat_model):
  engine = Engine(chat_model, **ENGINE)
  app = create_app(engine, model_name=NAME)
  with ServerThread(app) as srv:
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 3})
    assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 3
    assert r.json()["choices"][0]["text"] == ""
    for path, body, param in (
      ("/v1/completions", {"prompt": "text"}, "prompt"),
      ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "messages"),
    ):
      r = httpx.post(srv.url + path, json=body)
      assert r.status_code == 400 and r.json()["error"]["param"] == param
      assert "tokenizer" in r.json()["error"]["message"]


def test_models_health_metrics(server, client):
  ms = client.models.list()
  assert [m.id for m in ms.data] == [NAME]
  raw = httpx.get(server.url + "/v1/models").json()["data"][0]["lrjax"]
  assert raw["fusion"]["fused"] and raw["fusion"]["ops"].get("lr_xuv", 0) > 0
  h = httpx.get(server.url + "/health")
  assert h.status_code == 200 and h.json()["status"] == "ok"
  client.completions.create(model=NAME, prompt="Numbers: 0 1 2", max_tokens=5, stream=False)
  m = httpx.get(server.url + "/metrics")
  assert m.status_code == 200 and m.headers["content-type"].startswith("text/plain")
  text = m.text
  for name in (
    "lrjax_time_to_first_token_seconds_count",
    "lrjax_inter_token_latency_seconds_bucket",
    "lrjax_queue_depth",
    "lrjax_running_requests",
    "lrjax_generated_tokens_total",
    'lrjax_requests_total{finish_reason="length"}',
  ):
    assert name in text, name
  count = [ln for ln in text.splitlines() if ln.startswith("lrjax_generated_tokens_total")]
  assert float(count[0].split()[-1]) >= 5


# ---- bad requests -------------------------------------------------------------------------------
LONG = list(range(5, 5 + 100))  # 100 tokens: more than the 95 a 96-token context takes


@pytest.mark.parametrize(
  "path,body,param,status",
  [
    ("c", {"prompt": LONG, "max_tokens": 1}, "prompt", 400),
    ("c", {"prompt": "hi", "max_tokens": 0}, "max_tokens", 400),
    ("c", {"prompt": "hi", "max_tokens": -3}, "max_tokens", 400),
    ("c", {"prompt": "hi", "max_tokens": 500}, "max_tokens", 400),
    ("c", {"prompt": "hi", "max_tokens": "ten"}, "max_tokens", 400),
    ("c", {"prompt": "hi", "temperature": 2.5}, "temperature", 400),
    ("c", {"prompt": "hi", "temperature": -0.1}, "temperature", 400),
    ("c", {"prompt": "hi", "temperature": "hot"}, "temperature", 400),
    ("c", {"prompt": "hi", "top_p": 0}, "top_p", 400),
    ("c", {"prompt": "hi", "top_p": 1.5}, "top_p", 400),
    ("c", {"prompt": "hi", "top_k": -2}, "top_k", 400),
    ("c", {"prompt": "hi", "seed": -1}, "seed", 400),
    ("c", {"prompt": "hi", "seed": 2**70}, "seed", 400),
    ("c", {"prompt": "hi", "model": "gpt-4"}, "model", 400),
    ("c", {"prompt": "hi", "n": 2}, "n", 400),
    ("c", {"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, "stop", 400),
    ("c", {"prompt": "hi", "stop": 5}, "stop", 400),
    ("c", {"prompt": "hi", "logprobs": 2}, "logprobs", 400),
    ("c", {"prompt": "hi", "stream": "yes"}, "stream", 400),
    ("c", {"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options", 400),
    ("c", {"prompt": [1, 99999]}, "prompt", 400),
    ("c", {"prompt": ["a", "b"]}, "prompt", 400),
    ("c", {"prompt": ""}, "prompt", 400),
    ("c", {"prompt": 3.5}, "prompt", 400),
    ("c", {}, "prompt", 400),
    ("c", [1, 2], None, 400),
    ("h", {"messages": []}, "messages", 400),
    ("h", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", 400),
    ("h", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, None, 400),
    ("h", {"messages": "hello"}, "messages", 400),
    ("h", {"messages": [{"role": "user", "content": "x" * 400}]}, "messages", 400),
    ("h", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, None, 400),
  ],
)
def test_bad_requests_get_400_naming_the_field(server, path, body, param, status):
  url = server.url + ("/v1/completions" if path == "c" else "/v1/chat/completions")
  r = httpx.post(url, json=body)
  assert r.status_code == status, r.text
  err = r.json()["error"]
  assert err["type"] == "invalid_request_error" and err["message"]
  if param is not None:
    assert err["param"] == param, err
  _wait_idle(server)


def test_malformed_json_and_limits_in_messages(server):
  for raw in (b"{bad", b"", b"\xff\xfe", b'{"prompt": "hi", "max_tokens": 1,}'):
    r = httpx.post(server.url + "/v1/completions", content=raw)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
  r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 500})
  msg = r.json()["error"]["message"]
  assert "500" in msg and "room for" in msg and "96" in msg  # names the limit
  r = httpx.post(server.url + "/v1/completions", json={"prompt": LONG})
  assert "at most 95" in r.json()["error"]["message"]
  assert httpx.get(server.url + "/v1/nothing").status_code == 404


def test_openai_client_sees_bad_request_error(client):
  with pytest.raises(openai.BadRequestError) as e:
    client.completions.create(model=NAME, prompt="hi", max_tokens=0)
  assert e.value.body["param"] == "max_tokens"
  with pytest.raises(openai.BadRequestError):
    client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])


# ---- admission, disconnects ---------------------------------------------------------------------
class _Gate:
  """Holds the engine thread before its next step until opened."""

  def __init__(self, engine):
    self.engine, self.open_ = engine, threading.Event()
    self.real = engine.step_events

  def __enter__(self):
    self.engine.step_events = lambda: (self.open_.wait(), self.real())[1]
    return self

  def __exit__(self, *exc):
    self.open_.set()
    del self.engine.step_events


def _wait_idle(server, timeout=30):
  t0 = time.monotonic()
  while server.engine.busy or server.engine.free_slots != server.engine.max_slots:
    assert time.monotonic() - t0 < timeout, "the engine did not go idle"
    time.sleep(0.01)


def _metric(server, name):
  for ln in httpx.get(server.url + "/metrics").text.splitlines():
    if ln.startswith(name):
      return float(ln.split()[-1])
  return 0.0


def test_full_queue_gets_429(chat_model, chat_text):
  tok, gen = chat_text
  engine = Engine(chat_model, max_slots=1, max_len=96, buckets=(16, 32, 64), attend_buckets=(96,))
  app = create_app(engine, model_name=NAME, tokenizer=tok, defaults=gen, max_queue=2)
  with ServerThread(app) as srv:

    async def go():
      async with httpx.AsyncClient(timeout=60) as c:
        body = {"prompt": "The wind", "max_tokens": 4, "temperature": 0}
        with _Gate(engine) as gate:
          held = [
            asyncio.ensure_future(c.post(srv.url + "/v1/completions", json=body)) for _ in range(3)
          ]
          while engine.num_waiting < 3:  # one for the free slot, two for the queue
            await asyncio.sleep(0.01)
          over = await c.post(srv.url + "/v1/completions", json=body)
          gate.open_.set()
          return over, await asyncio.gather(*held)

    over, ok = asyncio.run(go())
    assert over.status_code == 429
    err = over.json()["error"]
    assert err["type"] == "rate_limit_error" and "waiting" in err["message"]
    assert [r.status_code for r in ok] == [200, 200, 200]
    texts = {r.json()["choices"][0]["text"] for r in ok}
    assert len(texts) == 1  # same greedy request, same answer
    assert "lrjax_rejected_requests_total" in httpx.get(srv.url + "/metrics").text


def test_disconnect_mid_stream_frees_the_slot(server):
  before = _metric(server, 'lrjax_requests_total{finish_reason="cancelled"}')
  body = {"prompt": "The river", "max_tokens": 80, "temperature": 0, "stream": True}
  with httpx.Client(timeout=30) as c:
    with c.stream("POST", server.url + "/v1/completions", json=body) as r:
      lines = r.iter_lines()
      got = [next(lines) for _ in range(6)]  # a few chunks, then hang up
  assert any(g.startswith("data: {") for g in got)
  _wait_idle(server)
  assert _metric(server, 'lrjax_requests_total{finish_reason="cancelled"}') == before + 1


def test_disconnect_while_waiting_non_stream(server):
  """A non-streaming client that gives up before its first token: cancelled, slot freed."""
  before = _metric(server, 'lrjax_requests_total{finish_reason="cancelled"}')
  with _Gate(server.engine) as gate:
    with pytest.raises(httpx.ReadTimeout):
      httpx.post(
        server.url + "/v1/completions",
        json={"prompt": "The fox", "max_tokens": 50},
        timeout=httpx.Timeout(5.0, read=0.5),
      )
    gate.open_.set()
  _wait_idle(server)
  assert _metric(server, 'lrjax_requests_total{finish_reason="cancelled"}') == before + 1


# ---- SIGTERM ------------------------------------------------------------------------------------
def test_sigterm_drains_and_exits_0(tmp_path, chat_model):
  from lrjax import checkpoint
  from lrjax.text import carried_files

  ckpt = tmp_path / "ck"
  with carried_files(
    os.path.join(os.path.dirname(__file__), "..", "fixtures", "hf", "llama_chat")
  ) as extra:
    checkpoint.save(chat_model, ckpt, extra_files=extra)
  port = _free_port()
  env = dict(os.environ, RAYON_NUM_THREADS="1")
  main = "import sys; from lrjax.cli import main; sys.exit(main())"
  cmd = [sys.executable, "-c", main, "serve", "--ckpt", str(ckpt), "--port", str(port)]
  cmd += ["--max-len", "64", "--slots", "2", "--drain-timeout", "20"]
  proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
  url = f"http://127.0.0.1:{port}"
  try:
    t0 = time.monotonic()
    while True:  # the port opens after warmup
      assert proc.poll() is None, proc.stderr.read()
      try:
        if httpx.get(url + "/health", timeout=1).status_code == 200:
          break
      except httpx.TransportError:
        pass
      assert time.monotonic() - t0 < 240, "server did not come up"
      time.sleep(0.2)
    body = {"prompt": "Once upon a time", "max_tokens": 40, "temperature": 0, "stream": True}
    chunks = []
    with httpx.Client(timeout=60) as c:
      with c.stream("POST", url + "/v1/completions", json=body) as r:
        it = r.iter_lines()
        chunks.append(next(it))
        proc.send_signal(signal.SIGTERM)  # mid-stream: the stream still finishes
        time.sleep(0.3)
        try:  # no new request is admitted while it drains
          late = httpx.post(url + "/v1/completions", json={"prompt": "x"}, timeout=5)
          assert late.status_code == 503, late.text
        except httpx.TransportError:
          pass  # or the port is already closed
        chunks += list(it)
    assert "data: [DONE]" in chunks
    last = [json.loads(x[6:]) for x in chunks if x.startswith("data: {")][-1]
    assert last["choices"][0]["finish_reason"] == "length"
    rc = proc.wait(timeout=60)
    assert rc == 0, proc.stderr.read()
    with pytest.raises(httpx.TransportError):  # admission stopped: the port is closed
      httpx.get(url + "/health", timeout=2)
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()


def _free_port():
  import socket

  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]
