"""64 concurrent clients (mixed lengths, kinds and stream modes) against `lrjax serve` over real
HTTP: every greedy response equals the same request run alone; none lost, duplicated or cut
short. The same run as benchmarks/serve_cpu.py, which records the latencies."""

import importlib.util
import os
import time

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "serve_cpu.py")


def _bench():
  spec = importlib.util.spec_from_file_location("serve_cpu", SCRIPT)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def test_64_clients_every_response_exact(chat_model):
  t0 = time.perf_counter()
  summary, problems, times = _bench().run(chat_model, clients=64, slots=16, max_len=128, seed=1)
  elapsed = time.perf_counter() - t0
  assert not problems, "\n".join(problems[:10])
  c = summary["client"]
  assert c["requests"] == c["ok"] == 64 and c["errors"] == 0
  assert 16 < c["streams"] < 48  # both modes really mixed
  assert summary["engine"]["requests"] == 64  # the engine returned each request once
  print(f"64 clients: load {times['load_s']:.1f} s, whole test {elapsed:.1f} s")
  assert times["load_s"] < 120  # bounded: a hang fails here, not in CI's global timeout
