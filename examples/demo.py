"""The main job (`make demo`): a user's whole journey, on the committed tiny chat model.

An HF directory in (tests/fixtures/hf/llama_chat: a 2-layer Llama with a BPE tokenizer and a
chat template), then, each step as the command line a user types:

1. ``lrjax convert --calib-text``: compress it (whitened SVD calibrated on text), and again
   with ``--quantize w4a8`` for the CPU kernels;
2. ``lrjax eval``: perplexity of the HF model and both checkpoints on the same text;
3. ``lrjax generate``: text from the W4A8 checkpoint, through lrjax.fuse and the C++ kernels;
4. ``lrjax serve``: the OpenAI API; a chat completion streamed with the ``openai`` client, then
   SIGTERM;
5. ``lrjax export``: both HF formats, loaded by transformers, logits compared with lrjax's.

About two minutes on a 2-core CPU. The tiny model's text is not meant to read well.

    python examples/demo.py [--workdir DIR] [--hf DIR --calib-text FILE --ratio R --block B]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURE = os.path.join(REPO, "tests", "fixtures", "hf", "llama_chat")
TEXT = os.path.join(REPO, "tests", "fixtures", "text", "corpus.txt")


def lrjax_cmd() -> list[str]:
  """The installed ``lrjax`` script beside this interpreter, else ``python -m lrjax.cli``."""
  script = os.path.join(os.path.dirname(sys.executable), "lrjax")
  return [script] if os.path.exists(script) else [sys.executable, "-m", "lrjax"]


def run(*args: str, env=None) -> str:
  """Runs ``lrjax ARGS`` as a user would, echoing the command and its output."""
  print(f"\n$ lrjax {' '.join(args)}", flush=True)
  r = subprocess.run(lrjax_cmd() + list(args), capture_output=True, text=True, env=env)
  print((r.stdout + r.stderr).rstrip(), flush=True)
  if r.returncode != 0:
    raise SystemExit(f"lrjax {args[0]} failed with exit code {r.returncode}")
  return r.stdout


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def serve_and_chat(ckpt: str, env, port: int | None = None, max_tokens: int = 32) -> dict:
  """Starts ``lrjax serve``, streams one chat completion, sends SIGTERM; returns the reply, its
  finish reason and the server's exit code."""
  import httpx
  import openai

  port = port or free_port()
  args = ["serve", "--ckpt", ckpt, "--port", str(port), "--max-len", "256", "--slots", "4"]
  print(f"\n$ lrjax {' '.join(args)} &", flush=True)
  server = subprocess.Popen(lrjax_cmd() + args, env=env)
  url = f"http://127.0.0.1:{port}"
  try:
    t0 = time.monotonic()
    while True:  # the port opens once every step is compiled
      if server.poll() is not None:
        raise SystemExit(f"lrjax serve exited with {server.returncode}")
      try:
        if httpx.get(url + "/health", timeout=1).status_code == 200:
          break
      except httpx.TransportError:
        time.sleep(0.5)
      if time.monotonic() - t0 > 600:
        raise SystemExit("lrjax serve did not come up in 10 minutes")
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
    model = client.models.list().data[0].id
    question = "What is the capital of France?"
    print(f"user: {question}\nassistant: ", end="", flush=True)
    reply, finish = [], None
    stream = client.chat.completions.create(
      model=model,
      messages=[{"role": "user", "content": question}],
      max_tokens=max_tokens,
      temperature=0,
      stream=True,
    )
    for chunk in stream:
      if not chunk.choices:
        continue
      piece = chunk.choices[0].delta.content or ""
      finish = chunk.choices[0].finish_reason or finish
      reply.append(piece)
      print(piece, end="", flush=True)
    print(f"  [finish_reason: {finish}]")
  finally:
    server.send_signal(signal.SIGTERM)  # stops admission, drains, exits 0
    rc = server.wait(timeout=120)
    print(f"lrjax serve exited with {rc} after SIGTERM")
  if rc != 0:
    raise SystemExit(f"lrjax serve exited with {rc}")
  return {"reply": "".join(reply), "finish_reason": finish, "exit_code": rc}


def compare_exports(ckpt: str, exports: dict[str, str]) -> dict[str, float]:
  """Loads each export with transformers and returns its logits' max relative difference from
  lrjax's model of the same checkpoint (W4A8 weights dequantized, as the export writes them)."""
  import jax.numpy as jnp
  import numpy as np
  import torch
  import transformers

  from lrjax import checkpoint
  from lrjax.checkpoint import quantized

  model = checkpoint.load(ckpt)
  if quantized.is_quantized(model):
    model = quantized.for_export(model)
  tokens = np.random.default_rng(0).integers(0, model.cfg.vocab_size, (2, 12))
  want = np.asarray(model(jnp.asarray(tokens)), np.float32)
  out = {}
  for fmt, path in exports.items():
    kw = {"trust_remote_code": True} if fmt == "hf-lowrank" else {}
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kw)
    with torch.no_grad():
      got = hf.eval()(torch.tensor(tokens)).logits.numpy()
    out[fmt] = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
    print(
      f"transformers loads the {fmt} export ({type(hf).__name__}): max |Δlogit| / max "
      f"|logit| = {out[fmt]:.1e}"
    )
  return out


def journey(argv=None) -> dict:
  """Runs the five steps; returns what each produced (tests check it)."""
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--workdir", help="where the checkpoints go (default: a new temp dir)")
  ap.add_argument("--hf", default=FIXTURE, help="the HF model directory")
  ap.add_argument("--calib-text", default=TEXT, help="text to calibrate and evaluate on")
  ap.add_argument("--ratio", default="0.3", help="fraction of each projection's params removed")
  ap.add_argument("--block", default="8", help="ranks are multiples of this")
  a = ap.parse_args(argv)
  work = a.workdir or tempfile.mkdtemp(prefix="lrjax_demo_")
  os.makedirs(work, exist_ok=True)
  env = dict(os.environ, RAYON_NUM_THREADS=os.environ.get("RAYON_NUM_THREADS", "1"))
  t0 = time.perf_counter()
  ck, ck_w4a8 = os.path.join(work, "lr"), os.path.join(work, "lr_w4a8")
  convert = ["convert", "--hf", a.hf, "--ratio", a.ratio, "--block", a.block, "--overwrite"]
  convert += ["--calib-text", a.calib_text, "--calib-seq-len", "64"]

  print("== 1. compress the HF model, calibrating on text (and once more as W4A8)")
  run(*convert, "--out", ck, env=env)
  run(*convert, "--out", ck_w4a8, "--quantize", "w4a8", "--group", "32", env=env)

  print("\n== 2. perplexity of each on the same text")
  evaluation = os.path.join(work, "eval.json")
  run("eval", "--hf", a.hf, "--ckpt", ck, "--ckpt", ck_w4a8, "--text", a.calib_text,
      "--seq-len", "64", "--out", evaluation, "--overwrite", env=env)  # fmt: skip

  print("\n== 3. text from the W4A8 checkpoint (fused: the C++ W4A8 kernels on CPU)")
  generated = run(
    "generate", "--ckpt", ck_w4a8, "--prompt", "The river", "--max-new-tokens", "16", env=env
  )

  print("\n== 4. serve the low-rank checkpoint; stream a chat completion")
  chat = serve_and_chat(ck, env)

  print("\n== 5. export both formats; transformers loads them")
  exports = {fmt: os.path.join(work, f"export_{fmt}") for fmt in ("hf-lowrank", "hf-dense")}
  for fmt, path in exports.items():
    run("export", "--ckpt", ck_w4a8, "--out", path, "--format", fmt, "--overwrite", env=env)
  diffs = compare_exports(ck_w4a8, exports)

  with open(evaluation) as fh:
    rows = json.load(fh)["results"]
  print(f"\n== done in {time.perf_counter() - t0:.0f} s; checkpoints in {work}")
  for r in rows:
    print(f"  {r['label']:<40} perplexity {r['perplexity']:8.3f}")
  for fmt, d in diffs.items():
    print(f"  {fmt} export vs lrjax: {d:.1e} relative logit difference")
  return {"workdir": work, "eval": rows, "generated": generated, "chat": chat, "exports": diffs}


def main(argv=None) -> int:
  journey(argv)
  return 0


if __name__ == "__main__":
  sys.exit(main())
