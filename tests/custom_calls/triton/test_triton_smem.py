"""Shared memory of the kernels' default tiles, checked on the CPU: each kernel is compiled for
the H200 (sm_90, with the 16-byte pointer alignment jax-triton declares; kernel_resources.py)
and Triton's metadata gives the bytes one CTA asks for. More than the H200's opt-in limit and
the kernel does not launch; planned shapes that once asked for more: the persistent SwiGLU
kernel at Llama-3-70B and at 64 rows, the grouped q/k/v kernel at 32 rows, the grouped
kernel's phase 1 alone at 128 rows with 4 stages (262144 B). Runs wherever triton is
installed, GPU or not."""

import importlib.util
import textwrap

import pytest
from triton_offline import STUB, run_script

pytestmark = pytest.mark.skipif(
  importlib.util.find_spec("triton") is None,
  reason="needs triton (pip install 'lrjax[cuda]') to compile the kernels for the H200",
)

_CHECK = STUB + textwrap.dedent("""
  n = 0
  for name, kernel, meta, warps, stages in kernel_resources.planned():
    rec = kernel_resources.compile_sm90(kernel, meta, warps, stages, ptxas=n == 0)
    assert rec["shared"] <= kernel_resources.H200_SMEM_OPTIN, (name, rec)
    if n == 0:  # ptxas -v read back (the benchmark's registers and spills)
      assert 0 < rec["registers"] <= 255 and rec["spill_store_bytes"] >= 0, rec
    n += 1
  print(n, "ok")
""")


def test_planned_tiles_fit_a_cta_of_the_h200():
  """Llama-3 8B / 70B and 3.2-1B shapes at 40 % removed, the 70B's and Qwen2.5-7B's q/k/v at
  their models' ranks, and Qwen2.5-7B's SwiGLU, whose stage-B slices outnumber the SMs
  (kernel_resources.planned): the
  grouped q/k/v kernel at 1-64 rows (its phase 1 alone at 64 and 128, also on one_branch
  plans), the persistent X·U·V kernel (with phase 2, or phase 1
  alone from 64 rows) and the tiled and persistent SwiGLU kernels at 1-128 rows, the ·V
  launch at 32-128 rows, the two prefill kernels at 1024 and 4096 tokens, lrjax's decode
  attention (and its RoPE-and-append launch) and both its merges at batch 1-64 and 1024-8192
  keys; the norm in the kernels and the residual epilogue at Llama-3-8B's shapes; each on its
  default tiles."""
  out = run_script(_CHECK, interpret=False)
  assert int(out.split()[-2]) == 134, out  # every configuration was compiled


_RESIDENT = STUB + textwrap.dedent("""
  n = 0
  for name, kernel, meta, warps, stages in kernel_resources.planned():
    if name in CASES:
      rec = kernel_resources.compile_sm90(kernel, meta, warps, stages)
      assert rec["ctas_per_sm"] == CASES[name], (name, rec)
      n += 1
  print(n, "ok")
""")


def test_swiglu_decode_ctas_a_sm_are_the_measured_ones():
  """The parked default at T <= 16 (5 stages) rests on one CTA an SM, so the stage-B slices
  spread over all SMs: at 3-4 stages two or three shared one and it was 2-9 % slower than
  unparked. That holds at one token too where D_ff has more 128-column
  slices than the SMs (Qwen2.5-7B's 148, Llama-3-70B's 224). On six such shapes two CTAs an
  SM (4 stages) were 4-21 % slower than one on five, 1 % faster on Qwen2.5-7B
  (benchmarks/results/gpu_mlp_decode_park_waves_h200.json)."""
  cases = {
    "mlp decode T=1 D=3584 F=18944 r=2048": 1,
    "mlp decode T=1 D=8192 F=28672 r=3824": 1,
    "mlp decode T=16 D=3584 F=18944 r=2048": 1,
    "mlp decode T=1 D=4096 F=14336 r=2560": 1,
    "mlp decode T=16 D=4096 F=14336 r=2560": 1,
  }
  out = run_script(f"CASES = {cases!r}\n" + _RESIDENT, interpret=False)
  assert int(out.split()[-2]) == len(cases), out  # every case found in planned() and checked


_CHAINED = STUB + textwrap.dedent("""
  half = 1 << 17  # launch_modes.SCRATCH_MIN_HALF: the second call of a chain works here
  n = 0
  for name, kernel, meta, warps, stages in kernel_resources.planned():
    if name in CASES:
      assert [q.is_constexpr for q in kernel.params if q.name == "WORK_OFF"] == [True], name
      alone = kernel_resources.compile_sm90(kernel, meta, warps, stages)
      chained = kernel_resources.compile_sm90(kernel, {**meta, "WORK_OFF": half}, warps, stages)
      regs = chained.pop("registers") - alone.pop("registers")
      assert chained == alone and regs <= 8, (name, alone, chained, regs)  # ptxas's own jitter
      n += 1
  print(n, "ok")
""")


def test_a_chained_call_compiles_to_the_unchained_resources():
  """The offset of a decode call's half of a scratch chain (launch.py) is a constexpr, and a
  call working in the second half gets the same shared memory, spills and CTAs an SM as one
  working at the scratch's start, and registers within 8 (ptxas's jitter). As a runtime
  argument the offset gave these kernels at 64 rows up to twice the registers (the grouped
  q/k/v 98-122 -> 216-230; the 8B step at batch 64 6 % slower)."""
  cases = (
    "group M=64 K=8192 r=2456/544/544",
    "group M=64 K=8192 r=2432/576/576",
    "mlp decode T=64 D=4096 F=14336 r=2560",
    "xuv decode M=64 4096->1024->14336",
    "mlp decode persistent T=16 D=4096 F=14336 r=2560",
  )
  out = run_script(f"CASES = {cases!r}\n" + _CHAINED, interpret=False)
  assert int(out.split()[-2]) >= len(cases), out  # every case found in planned() and checked


_PARK_RULE = STUB + textwrap.dedent("""
  import dataclasses
  from lrjax.custom_calls.triton import mlp_decode
  get = mlp_decode.BlockSizes.get_default
  shapes = {"8b": (4096, 14336, 2560), "qwen": (3584, 18944, 2048), "70b": (8192, 28672, 3840),
            "1b": (2048, 8192, 1280)}
  parked = {(name, m): get(m, d, f, r, d).park_h for name, (d, f, r) in shapes.items()
            for m in (1, 2, 16, 17)}
  # one token: parked where stage B takes 128-wide slices (all but the 1B's 64 wider ones)
  assert parked == {(n, m): m > 1 or n != "1b" for n in shapes for m in (1, 2, 16, 17)}, parked
  # stage H in about four tiles an SM where D_ff's slices outnumber the SMs (Qwen's 148 and
  # the 70B's 224 of 132), up to 64 tokens; elsewhere the plan's one tile an SM
  kw = dict(gated=True, act="silu", bias_mask=(False,) * 3)
  splits = {(name, m): mlp_decode.launch_plan(m, d, r, f, r, d, bs=get(m, d, f, r, d),
                                              **kw)["meta"]["H_SPLITS"]
            for name, (d, f, r) in shapes.items() for m in (1, 16, 64, 128)}
  # up to 64 tokens 4 x 8 and 4 x 4 splits asked of Qwen's 148 and the 70B's 224 slices (30
  # and 16 result), but at 33-64 tokens 8 of the 70B's (one 256-column tile an SM: the wide
  # rule below); at one tile an SM 6 of the 8B's 112 and 13 of the 1B's 64 (unparked at
  # one token: 1)
  assert splits == {("qwen", 1): 30, ("qwen", 16): 30, ("qwen", 64): 30, ("qwen", 128): 8,
                    ("70b", 1): 16, ("70b", 16): 16, ("70b", 64): 8, ("70b", 128): 4,
                    ("8b", 1): 6, ("8b", 16): 6, ("8b", 64): 6, ("8b", 128): 6,
                    ("1b", 1): 1, ("1b", 16): 13, ("1b", 64): 13, ("1b", 128): 13}, splits
  d, f, r = shapes["qwen"]
  meta = mlp_decode.launch_plan(16, d, r, f, r, d, bs=get(16, d, f, r, d), **kw)["meta"]
  assert meta["F_PER"] == 640, meta  # 5 slices a split
  # the splits follow the down rank the plan is given: r_d 1024 has half the stage-H column
  # blocks of 2048, so twice the splits asked (4 x 16; 50 result)
  meta = mlp_decode.launch_plan(16, d, r, f, 1024, d, bs=get(16, d, f, r, d), **kw)["meta"]
  assert meta["H_SPLITS"] == 50, meta
  for name, (d, f, r) in shapes.items():
    for m in (2, 16):
      assert get(m, d, f, r, d).num_stages == 5, (name, m)  # one CTA an SM
      old = mlp_decode._default_blocks(m, d, f, r, d, park_small=False)
      assert not old.park_h and old.num_stages in (3, 4), (name, m, old)
  bs = get(4, 4096, 14336, 2560, 4096)
  V = mlp_decode.Variant
  for bad, var, match in ((dict(), V(cols_f=129), "cols_f"),
                          (dict(park_h=False), V(h_inline=True), "park_h"),
                          (dict(h_splits=1), V(h_inline=True, cols_f=64), "at most"),
                          (dict(), V(prefetch=96), "power of two"),
                          (dict(block_n=32), V(prefetch_c=64), "block_n=32")):
    try:
      mlp_decode.launch_plan(4, 4096, 2560, 14336, 2560, 4096, bs=dataclasses.replace(bs, **bad),
                             variant=var, **kw)
    except ValueError as e:
      assert match in str(e), (bad, var, e)
    else:
      raise AssertionError(f"{bad} {var} was accepted")
  # h_inline: splits of ceil(r_d / block_h) slices, no stage-H CTAs of their own
  inl = mlp_decode.launch_plan(4, 4096, 2560, 14336, 2560, 4096,
                               bs=dataclasses.replace(bs, block_h=256), variant=V(h_inline=True),
                               **kw)
  sep = mlp_decode.launch_plan(4, 4096, 2560, 14336, 2560, 4096, bs=bs, **kw)
  assert inl["meta"]["F_PER"] == 10 * 128 and inl["meta"]["H_SPLITS"] == 12, inl["meta"]
  n_h = sep["meta"]["H_SPLITS"] * 2560 // bs.block_h
  assert sep["grid"] - inl["grid"] == n_h, (sep["grid"], inl["grid"], n_h)
  print("ok")
""")


_STAGE_A_RULE = STUB + textwrap.dedent("""
  from lrjax.custom_calls.triton import mlp_decode, planner
  get, sms = mlp_decode.BlockSizes.get_default, planner.H200.num_sms
  kw = dict(gated=True, act="silu", bias_mask=(False,) * 3)
  shapes = {"1b": (2048, 8192, 1280), "8b-r1024": (4096, 14336, 1024),
            "qwen": (3584, 18944, 2048), "8b": (4096, 14336, 2560), "70b": (8192, 28672, 3840)}
  ctas, chunks, p16 = {}, {}, {}
  for name, (d, f, r) in shapes.items():
    for m in (1, 16, 32):
      meta = mlp_decode.launch_plan(m, d, r, f, r, d, bs=get(m, d, f, r, d), **kw)["meta"]
      ctas[name, m] = planner.cdiv(r, meta["BLOCK_R"]) * meta["SPLIT_K"]
      chunks[name, m] = meta["A_CHUNKS"]
      p16[name, m] = meta["P16"]
      assert meta["K_PER"] >= 2 * meta["BLOCK_K"], (name, m, meta)  # >= 2 K steps a CTA
  # T <= 16: one wave that fills the SMs where the K-step rule left them idle (the 1B's 40,
  # 8B r=1024's 64, Qwen's 112); two waves (8B r=2560's 160, the 70B's 270) stay
  assert ctas == {("1b", 1): 110, ("1b", 16): 110, ("1b", 32): 80,
                  ("8b-r1024", 1): 128, ("8b-r1024", 16): 128, ("8b-r1024", 32): 128,
                  ("qwen", 1): 128, ("qwen", 16): 128, ("qwen", 32): 112,
                  ("8b", 1): 160, ("8b", 16): 160, ("8b", 32): 160,
                  ("70b", 1): 270, ("70b", 16): 270, ("70b", 32): 270}, ctas
  assert all(v <= sms for (n, m), v in ctas.items() if m <= 16 and n in ("1b", "qwen"))
  # T <= 16: stage B takes Pg/Pu in one chunk after one wave of stage A, in two after two
  # waves; from 17 tokens in four, but in two where D_ff's slices are >= 1.5x the SMs (the
  # 70B's 224; not Qwen's 148)
  assert chunks == {k: (1 if ctas[k] <= sms else 2) if k[1] <= 16 else 2 if k[0] == "70b"
                    else 4 for k in ctas}, chunks
  assert sorted(set(chunks.values())) == [1, 2, 4], chunks
  # and reads Pg/Pu in f32 after one wave (no rounding tail), the bf16 copy otherwise
  assert p16 == {k: not (k[1] <= 16 and ctas[k] <= sms) for k in ctas}, p16
  print("ok")
""")


_WIDE_RULE = STUB + textwrap.dedent("""
  from lrjax.custom_calls.triton import mlp_decode
  get = mlp_decode.BlockSizes.get_default
  shapes = {"70b": (8192, 28672, 3840), "qwen32b": (5120, 27648, 3072),
            "gemma7b": (3072, 24576, 1664), "qwen7b": (3584, 18944, 2048),
            "8b": (4096, 14336, 2560)}
  got = {(n, m): (b.a_chunks, b.block_h, b.num_stages, b.h_per_sm)
         for n, (d, f, r) in shapes.items() for m in (16, 17, 32, 33, 64, 65)
         for b in [get(m, d, f, r, d)]}
  for (n, m), v in got.items():
    if n in ("70b", "qwen32b") and 17 <= m <= 64:  # >= 1.5x the SMs in 128-column slices
      assert v == ((2, 256, 5, 4) if m <= 32 else (2, 256, 4, 1)), (n, m, v)
    else:  # the parked defaults: 256-column stage-H tiles nowhere else
      assert v[1] == 128, (n, m, v)
      if m > 16:
        assert v[0] == 4 and v[2] == (4 if m <= 64 else 3), (n, m, v)
  print("ok")
""")


def test_swiglu_decode_wide_rule_at_17_to_64_tokens():
  """The wide rule: where D_ff's 128-column slices are >= 1.5x the SMs (Llama-3-70B, Qwen2.5-32B),
  17-64 tokens take two chunks of Pg/Pu, 256-column stage-H tiles, and 5 stages up to 32 rows
  or one stage-H tile an SM above; fewer slices (Gemma-7B's 192, Qwen2.5-7B's 148, the 8B's
  112), T <= 16 and T > 64 keep their blocks."""
  run_script(_WIDE_RULE, interpret=False)


def test_swiglu_decode_stage_a_fills_the_sms_in_one_wave():
  """The T <= 16 stage-A rule: where stage A's splits (>= 8 K steps a CTA) leave SMs idle in
  their one wave, D is split finer (>= 2 K steps a CTA) to fill them, and stage B then takes
  Pg/Pu in one chunk (all complete at once); where stage A already takes two waves, its
  splits stay and stage B takes two chunks. After one wave stage B reads Pg/Pu in f32 (p16
  off)."""
  run_script(_STAGE_A_RULE, interpret=False)


def test_swiglu_decode_parks_h_where_it_measured_faster():
  """The T <= 16 parking rule: h parked with 5 stages from 2 tokens, and at one token where
  stage B takes 128-wide slices; stage H in four times the splits where those slices
  outnumber the SMs; ``_default_blocks(park_small=False)`` gives the unparked blocks. And the
  plan refuses slices wider than their block, ``h_inline`` without parked h, and ``h_inline``
  splits of more CTAs than the GPU holds at once (they wait for each other)."""
  run_script(_PARK_RULE, interpret=False)


def test_append_kernel_apart_keeps_the_plain_kernels_shared_memory():
  """decode_attention_append with the new key attended apart (APART) compiles to the plain
  flash-decoding kernel's shared memory (its cache loop is that kernel's); spliced into the
  loop's tiles it asks for more (the tiles go through registers and back)."""
  out = run_script(
    STUB
    + textwrap.dedent("""
    from lrjax.custom_calls.triton import decode_attention as da
    from lrjax.custom_calls.triton import decode_attention_append as dap

    for b in (1, 16):
      bs = da.BlockSizes()
      meta = da.launch_plan(b, 32, 8, 2048, 128, 2048, None, bs)["meta"]
      got = [kernel_resources.compile_sm90(k, {**meta, **x}, bs.num_warps, bs.num_stages,
                                           ptxas=False)["shared"]
             for k, x in ((da._decode_attention_kernel, {}),
                          (dap._decode_attention_append_kernel, {"APART": True}),
                          (dap._decode_attention_append_kernel, {"APART": False}))]
      print(b, *got)
    print("ok")
    """),
    interpret=False,
  )
  rows = [[int(x) for x in ln.split()] for ln in out.splitlines() if ln != "ok"]
  assert len(rows) == 2, out
  for _, plain, apart, splice in rows:
    assert apart == plain < splice, out


_PDL = STUB + textwrap.dedent("""
  seen = set()
  n = 0
  for name, kernel, meta, warps, stages in kernel_resources.planned():
    if "PDL" not in kernel.arg_names or kernel.__name__ in seen or name not in CASES:
      continue
    seen.add(kernel.__name__)
    asm = {}
    for level in (0, 1, 2):
      c = kernel_resources.compile_for_sm90(kernel, {**meta, "PDL": level}, warps, stages)
      asm[level] = (c.asm["ptx"], c.metadata.shared)
    (p0, s0), (p1, s1), (p2, s2) = asm[0], asm[1], asm[2]
    assert "griddepcontrol" not in p0, name
    assert "griddepcontrol.wait" in p1 and "launch_dependents" not in p1, name
    wait, go = p2.index("griddepcontrol.wait"), p2.index("griddepcontrol.launch_dependents")
    assert wait < go, name  # the next launch may start only once this one's wait is over
    if CASES[name]:  # its first tile's prefetch comes before the wait, none at PDL 1 before it
      ahead = p2.find("prefetch.global.L2::evict_last")
      assert 0 <= ahead < wait, name
      assert not 0 <= p1.find("prefetch.global.L2::evict_last") < p1.index("griddepcontrol.wait")
    assert s0 == s1 == s2, (name, s0, s1, s2)  # the same shared memory: the same CTAs an SM
    n += 1
  print(n, "ok")
""")


def test_pdl_overlap_waits_then_lets_the_next_launch_start():
  """Under launch_modes.pdl_overlap (PDL=2) each kernel that may be launched as a
  programmatic dependent waits for the kernel ahead, then lets the next launch start
  (``griddepcontrol.wait`` before ``launch_dependents`` in its sm_90 PTX), and the GEMM-like
  kernels and the attention prefetch their first tile into L2 before the wait; at PDL=1 only
  the wait, at PDL=0 neither; the shared memory is the same at all three."""
  cases = {  # name in planned(): whether its first tile is prefetched before the wait
    "group M=1 K=4096 r=1216/512/512": True,
    "xuv decode M=1 4096->1024->14336": True,
    "mlp decode T=1 D=4096 F=14336 r=2560": True,
    "mlp decode persistent T=1 D=4096 F=14336 r=2560": True,
    "xuv pv launch M=32 152->4096": True,
    "decode attention B=1 T=1024": True,
    "decode attention append B=1 T=1024": True,
    "decode attention merge walk B=1 T=1024": False,
    "decode attention merge tile B=1 T=1024": False,
  }
  out = run_script(f"CASES = {cases!r}\n" + _PDL, interpret=False)
  assert int(out.split()[-2]) == len(cases), out  # every case found in planned() and checked
