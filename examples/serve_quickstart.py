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
import tempfile

from demo import FIXTURE, TEXT, run, serve_and_chat  # examples/demo.py, beside this file


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--hf", default=FIXTURE, help="the HF model directory")
  ap.add_argument("--calib-text", default=TEXT, help="text to calibrate on")
  ap.add_argument("--ratio", default="0.3", help="fraction of each projection's params removed")
  ap.add_argument("--block", default="8", help="ranks are multiples of this")
  ap.add_argument("--port", type=int, default=None, help="default: a free port")
  a = ap.parse_args()
  work = tempfile.mkdtemp(prefix="lrjax-quickstart-")
  ckpt = os.path.join(work, "lr")
  env = dict(os.environ, RAYON_NUM_THREADS=os.environ.get("RAYON_NUM_THREADS", "1"))
  try:
    run("convert", "--hf", a.hf, "--out", ckpt, "--ratio", a.ratio, "--block", a.block,
        "--calib-text", a.calib_text, "--calib-seq-len", "64", env=env)  # fmt: skip
    serve_and_chat(ckpt, env, port=a.port, max_tokens=48)
  finally:
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
  main()
