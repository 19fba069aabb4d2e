"""The inter-CTA flags of the one-launch kernels, read in their PTX (compiled for the H200 on
the CPU): a stage that waits for another's results must read the flag with acquire
semantics, and the stage that publishes them must release. (A relaxed, volatile poll
followed by an unused ``atomic_add(flag, 0, sem="acquire")`` loses its acquire: Triton 3.6
drops the unused atomic when it lowers to LLVM.)
Runs wherever triton is installed, GPU or not."""

import importlib.util
import textwrap

import pytest
from triton_offline import STUB, run_script

pytestmark = pytest.mark.skipif(
  importlib.util.find_spec("triton") is None,
  reason="needs triton (pip install 'lrjax[cuda]') to compile the kernels for the H200",
)


def test_every_wait_reads_its_flag_with_acquire_and_every_signal_releases():
  """One planned configuration of each kernel (kernel_resources.planned: the persistent and
  phase-1-only X·U·V decode kernel, the grouped one, the tiled and persistent SwiGLU decode
  kernels, the two prefill kernels, the ·V launch, the decode attention's two launches): every
  kernel with a second stage releases a flag and polls one with ``ld.global.gpu.acquire``,
  never with a relaxed or volatile load; phase 1 alone, the ·V launch and the decode
  attention's launches (each ordered after the one before by the launch) do neither."""
  out = run_script(
    STUB
    + textwrap.dedent("""
    import re
    from lrjax.custom_calls.triton import xuv_decode_pv
    seen, waits = set(), 0
    for name, kernel, meta, warps, stages in kernel_resources.planned():
      key = (kernel, meta.get("PV", True))
      if key in seen:
        continue
      seen.add(key)
      ptx = kernel_resources.compile_for_sm90(kernel, meta, warps, stages).asm["ptx"]
      assert "ld.volatile" not in ptx, name  # a poll without ordering
      releases = len(re.findall(r"atom\\.global\\.gpu\\.(release|acq_rel)\\.", ptx))
      acquires = len(re.findall(r"ld\\.global\\.gpu\\.acquire\\.b32", ptx))
      if kernel is xuv_decode_pv._xuv_decode_pv_kernel or "decode attention" in name:
        # one stage a launch (the merge is a launch of its own): the launch order is the sync
        assert releases == 0 and acquires == 0, (name, releases, acquires)
      elif meta.get("PV", True):  # each of these kernels publishes some stage's results
        assert releases >= 1 and acquires >= 1, (name, releases, acquires)
        waits += 1
      else:  # phase 1 alone (pv="xla", P left as f32 sums): no stage to publish to or wait on
        assert not meta["P16"] and releases == 0 and acquires == 0, (name, releases, acquires)
    assert waits >= 6, waits
    print(waits, "ok")
  """),
    interpret=False,
  )
  assert int(out.split()[-2]) >= 6, out
