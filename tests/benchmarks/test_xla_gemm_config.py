"""CPU tests of benchmarks/xla_gemm_config.py's HLO reading (the GPU run is its own check)."""

import pytest

# The two forms XLA writes a Triton GEMM's tiles in: the legacy emitter's triton_gemm_config
# and the generic emitter's block_level_fusion_config. Shortened optimized HLO text; here the
# ·V GEMM is a cuBLAS custom call.
LEGACY = r"""HloModule jit_f, entry_computation_layout={(bf16[64,8192]{1,0})->bf16[64,8192]{1,0}}

%gemm_fusion_dot_computation (parameter_0: bf16[64,8192], parameter_1: bf16[8192,2456]) -> bf16[64,2456] {
  %parameter_0 = bf16[64,8192]{1,0} parameter(0)
  %parameter_1 = bf16[8192,2456]{1,0} parameter(1)
  ROOT %dot.1 = bf16[64,2456]{1,0} dot(%parameter_0, %parameter_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main.9 (Arg_0.1: bf16[64,8192], Arg_1.2: bf16[8192,2456], Arg_2.3: bf16[2456,8192]) -> bf16[64,8192] {
  %Arg_0.1 = bf16[64,8192]{1,0} parameter(0)
  %Arg_1.2 = bf16[8192,2456]{1,0} parameter(1)
  %Arg_2.3 = bf16[2456,8192]{1,0} parameter(2)
  %gemm_fusion_dot = bf16[64,2456]{1,0} fusion(%Arg_0.1, %Arg_1.2), kind=kCustom, calls=%gemm_fusion_dot_computation, backend_config={"operation_queue_id":"0","wait_on_operation_queues":[],"fusion_backend_config":{"kind":"__triton_gemm","triton_gemm_config":{"block_m":"64","block_n":"64","block_k":"128","split_k":"2","num_stages":"4","num_warps":"4","num_ctas":"1"}},"force_earliest_schedule":false}
  ROOT %custom-call.1 = (bf16[64,8192]{1,0}, s8[4194304]{0}) custom-call(%gemm_fusion_dot, %Arg_2.3), custom_call_target="__cublas$lt$matmul", backend_config={"operation_queue_id":"0","gemm_backend_config":{"alpha_real":1,"selected_algorithm":"7"}}
}
"""  # noqa: E501

# The generic emitter's split-K GEMM and the reduction that finishes it, rebuilt from what
# jax 0.11.2 wrote on an H200 (session 35's results/gpu_xla_gemm_config_h200.json keeps the
# fields, not the text); HLO text marks every fifth operand of a long list /*index=N*/.
NESTED = r"""HloModule jit_f

%gemm_fusion_dot_computation (parameter_0: bf16[128,8,1024], parameter_1: bf16[8,1024,2048]) -> f32[8,128,2048] {
  %parameter_0 = bf16[128,8,1024]{2,1,0} parameter(0)
  %parameter_1 = bf16[8,1024,2048]{2,1,0} parameter(1)
  ROOT %dot.2 = f32[8,128,2048]{2,1,0} dot(%parameter_0, %parameter_1), lhs_batch_dims={1}, lhs_contracting_dims={2}, rhs_batch_dims={0}, rhs_contracting_dims={1}
}

ENTRY %main.9 (Arg_0.1: bf16[128,8192], Arg_1.2: bf16[8192,2048], Arg_2.3: bf16[8192,2048], Arg_3.4: bf16[8192,2048], Arg_4.5: bf16[8192,2048], /*index=5*/Arg_5.6: bf16[8192,2048]) -> bf16[128,2048] {
  %Arg_0.1 = bf16[128,8192]{1,0} parameter(0)
  %Arg_1.2 = bf16[8192,2048]{1,0} parameter(1)
  %bitcast.1 = bf16[128,8,1024]{2,1,0} bitcast(%Arg_0.1)
  %bitcast.2 = bf16[8,1024,2048]{2,1,0} bitcast(%Arg_1.2)
  %gemm_fusion_dot = f32[8,128,2048]{2,1,0} fusion(%bitcast.1, %bitcast.2), kind=kCustom, calls=%gemm_fusion_dot_computation, backend_config={"fusion_backend_config":{"block_level_fusion_config":{"group_size":0,"is_tma_allowed":true,"num_ctas":1,"num_stages":3,"num_warps":"4","output_tiles":[{"sizes":["1","128","64"]}]},"kind":"__triton_nested_gemm_fusion"}}
  ROOT %loop_reduce_fusion.10 = bf16[128,2048]{1,0} fusion(%gemm_fusion_dot), kind=kCustom, calls=%fused_reduce, backend_config={"fusion_backend_config":{"block_level_fusion_config":{"num_warps":"4","output_tiles":[{"sizes":["1","256"]}]},"kind":"__triton"}}
}
"""  # noqa: E501


@pytest.fixture(scope="module")
def cfg(load_benchmark):
  return load_benchmark("xla_gemm_config")


def test_legacy_triton_gemm_and_cublas_call_are_read(cfg):
  gemms = cfg.hlo_gemms(LEGACY)
  assert [g["kind"] for g in gemms] == ["__triton_gemm", "__cublas$lt$matmul"]
  assert [g["computation"] for g in gemms] == ["main.9", "main.9"]
  xu = cfg.xu_gemm(gemms, 64, 2456)
  assert xu["name"] == "gemm_fusion_dot"
  assert xu["params"] == [["bf16", [64, 8192]], ["bf16", [8192, 2456]]]
  tiles = cfg.xla_tiles(xu, 64, 2456)
  assert tiles == dict(block_m=64, block_n=64, block_k=128, split_k=2, num_stages=4, num_warps=4)
  variant, not_copied = cfg.phase1_variant(64, 8192, 2456, tiles)
  assert variant == (
    "pv_xla:block_r=64,cols_r=64,block_k=128,k_per=4096,stages=4,warps=4,programs=78"
  )
  assert not_copied == ""
  assert gemms[1]["backend"]["gemm_backend_config"]["selected_algorithm"] == "7"
  assert cfg.xla_tiles(gemms[1], 64, 8192) is None  # cuBLAS: no tiles to copy


def test_generic_emitter_split_k_gemm_is_read_past_its_reduction(cfg):
  gemms = cfg.hlo_gemms(NESTED)
  assert [g["kind"] for g in gemms] == ["__triton_nested_gemm_fusion", "__triton"]
  assert gemms[0]["computation"] == "main.9"  # the /*index=5*/ header still opens ENTRY
  assert gemms[0]["params"] == [["bf16", [128, 8, 1024]], ["bf16", [8, 1024, 2048]]]
  xu = cfg.xu_gemm(gemms, 128, 2048)
  assert xu["name"] == "gemm_fusion_dot"
  # not the reduction, whose output is [128, 2048] too, wherever it stands
  assert cfg.xu_gemm(gemms[::-1], 128, 2048)["name"] == "gemm_fusion_dot"
  tiles = cfg.xla_tiles(xu, 128, 2048)
  assert tiles == dict(block_m=128, block_n=64, block_k=None, split_k=8, num_stages=3, num_warps=4)
  variant, not_copied = cfg.phase1_variant(128, 8192, 2048, tiles)
  assert variant == (
    "pv_xla:block_r=64,cols_r=64,block_k=64,k_per=1024,stages=3,warps=4,programs=256"
  )
  assert not_copied == "XLA's K step (not in its config; 64 kept)"
  assert "row blocks" in cfg.phase1_variant(128, 8192, 2048, dict(tiles, block_m=64))[1]


def test_a_module_without_gemms_gives_none(cfg):
  assert (
    cfg.hlo_gemms("ENTRY %e (p: f32[4]) -> f32[4] {\n  ROOT %p = f32[4]{0} parameter(0)\n}\n") == []
  )
  assert cfg.xu_gemm(cfg.hlo_gemms(LEGACY), 64, 512) is None
