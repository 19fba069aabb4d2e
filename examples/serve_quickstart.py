"""Quickstart: serve your HF model. HF directory → `lrjax convert --calib-text` → `lrjax serve` →
a chat completion streamed with the openai client, then SIGTERM. Runs on CPU in about a minute
on the committed tiny chat fixture (a 2-layer Llama with a BPE tokenizer and a chat template):

  python examples/serve_quickstart.py
  python examples/serve_quickstart.py --hf /path/to/hf/model --ratio 0.4 --block 128

The same steps by hand:

  lrjax convert --hf tests/fixtures/hf/llama_chat --out /tmp/lr --ratio 0.3 --block 8 \\
      --calib-text tests/fixtures/text/corpus.txt --calib-seq-len 64
  lrjax serve --ckpt /tmp/lr --port 8000 &
  curl localhost:8000/v1/chat/completions -d '{"messages": [{"role": "user", "content": "Hi"}]}'
"""

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LRJAX = [sys.executable, "-c", "import sys; from lrjax.cli import main; sys.exit(main())"]


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--hf", default=os.path.join(REPO, "tests", "fixtures", "hf", "llama_chat"))
  ap.add_argument(
    "--calib-text", default=os.path.join(REPO, "tests", "fixtures", "text", "corpus.txt")
  )
  ap.add_argument("--ratio", default="0.3")
  ap.add_argument("--block", default="8")
  ap.add_argument("--port", type=int, default=8765)
  a = ap.parse_args()
  import httpx
  import openai

  work = tempfile.mkdtemp(prefix="lrjax-quickstart-")
  ckpt = os.path.join(work, "lr")
  env = dict(os.environ, RAYON_NUM_THREADS=os.environ.get("RAYON_NUM_THREADS", "1"))
  try:
    print(f"$ lrjax convert --hf {a.hf} --out {ckpt} --ratio {a.ratio} --calib-text ...")
    subprocess.run(
      LRJAX
      + ["convert", "--hf", a.hf, "--out", ckpt, "--ratio", a.ratio, "--block", a.block]
      + ["--calib-text", a.calib_text, "--calib-seq-len", "64"],
      check=True,
      env=env,
    )
    print(f"$ lrjax serve --ckpt {ckpt} --port {a.port}")
    server = subprocess.Popen(
      LRJAX + ["serve", "--ckpt", ckpt, "--port", str(a.port), "--max-len", "256"], env=env
    )
    url = f"http://127.0.0.1:{a.port}"
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
    stream = client.chat.completions.create(
      model=model,
      messages=[{"role": "user", "content": question}],
      max_tokens=48,
      temperature=0,
      stream=True,
    )
    for chunk in stream:
      print(chunk.choices[0].delta.content or "", end="", flush=True)
    print()
    server.send_signal(signal.SIGTERM)  # drains, then exits 0
    print(f"lrjax serve exited with {server.wait(timeout=120)}")
  finally:
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
  main()
