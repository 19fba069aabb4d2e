"""How a compiled kernel rounds, read in its PTX (compiled for the H200 on the CPU): the
append attention kernel's RoPE must round each product and the sum to bf16, as XLA rounds the
models' code, so the key rows it writes into the cache equal the reference's bit for bit.
Runs wherever triton is installed, GPU or not."""

import importlib.util
import textwrap

import pytest
from triton_offline import STUB, run_script

pytestmark = pytest.mark.skipif(
  importlib.util.find_spec("triton") is None,
  reason="needs triton (pip install 'lrjax[cuda]') to compile the kernels for the H200",
)


def test_append_kernel_rounds_ropes_products_before_their_sum():
  """decode_attention_append's RoPE (``_rope_rows``) compiled with the kernel's
  ``COMPILE_OPTIONS``: two rounded bf16 products and a rounded bf16 sum, no FMA; compiled with
  Triton's default (contraction on) the sum is an FMA, so the check sees the option."""
  out = run_script(
    STUB
    + textwrap.dedent("""
    from lrjax.custom_calls.triton import decode_attention_append as dap
    print("ours", kernel_resources.rope_bf16_ops(**dap.COMPILE_OPTIONS))
    print("default", kernel_resources.rope_bf16_ops())
    print("ok")
    """),
    interpret=False,
  )
  lines = dict(ln.split(" ", 1) for ln in out.splitlines() if " " in ln)
  assert lines["ours"] == "['add.rn.bf16', 'mul.rn.bf16']", out
  assert "fma.rn.bf16" in lines["default"], out
