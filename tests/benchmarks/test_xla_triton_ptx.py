"""CPU tests of benchmarks/xla_triton_ptx.py's PTX reading: entries of a module, the opcode
counts, and ptxas on a module whose PTX ISA Triton's ptxas does not know."""

import textwrap

import pytest
from triton_offline import STUB, run_script

triton = pytest.importorskip("triton", reason="the tool reads PTX with Triton's ptxas")

MODULE = """\
.version {version}
.target sm_90a
.address_size 64

.visible .entry first(
\t.param .u64 first_param_0
)
{{
\t.reg .pred %p<2>;
\t.reg .b32 %r<4>;
\t.reg .b64 %rd<3>;
\tld.param.u64 %rd1, [first_param_0];
\tcvta.to.global.u64 %rd2, %rd1;
\tmov.u32 %r1, %tid.x;
\tsetp.lt.u32 %p1, %r1, 4;
\tgriddepcontrol.wait;
\t@%p1 ld.global.v4.b32 {{%r1, %r2, %r3, %r1}}, [%rd2];
\t@%p1 st.global.b32 [%rd2], %r2;
\tred.global.add.f32 [%rd2], 1.0;
\tret;
}}

.visible .entry second(
\t.param .u64 second_param_0
)
{{
\tret;
}}
"""


def _run(body: str) -> None:
  """``body`` with the tool imported as ``xp`` and MODULE defined, in a fresh Python (the tool
  imports the kernel modules, which need jax-triton's stub; triton_offline)."""
  run_script(
    STUB
    + textwrap.dedent(f"""
      import xla_triton_ptx as xp
      MODULE = {MODULE!r}
  """)
    + textwrap.dedent(body)
    + "\nprint('ok')\n",
    interpret=False,
  )


def test_entries_and_their_opcodes():
  _run("""
      found = xp.entries(MODULE.format(version="8.0"))
      assert sorted(found) == ["first", "second"], sorted(found)
      assert found["first"].startswith(".entry first(")
      assert "griddepcontrol.wait" in found["first"] and "griddepcontrol" not in found["second"]
      h = xp.histogram(found["first"])
      # a predicated op counted by its opcode; directives, labels and braces skipped
      ops, cls = h["opcodes"], h["classes"]
      assert ops["ld.global.v4.b32"] == 1 and ops["st.global.b32"] == 1, ops
      assert ops["griddepcontrol.wait"] == 1 and ops["ret"] == 1, ops
      assert ".reg" not in ops and "{" not in ops and "}" not in ops, ops
      assert cls["ld.global"] == 1 and cls["st.global"] == 1 and cls["setp"] == 1, cls
      assert cls["red"] == 1 and cls["atom"] == 0 and cls["mma"] == 0, cls
  """)


def test_ptxas_of_one_entry_and_of_an_isa_it_does_not_know():
  _run("""
      b = dict(ptx=MODULE.format(version="8.0"), shared=0, warps=4, entry="first")
      info = xp._ptxas(b)
      assert info["registers"] >= 1 and info["spill_store_bytes"] == 0, info
      assert "assembled_as" not in info, info
      newer = xp._ptxas(dict(b, ptx=MODULE.format(version="99.0")))
      assert newer["registers"] == info["registers"], newer
      assert newer["assembled_as"].startswith("PTX ISA "), newer
      missing = xp._ptxas(dict(b, entry="third"))
      assert "third" in missing["error"], missing
  """)
