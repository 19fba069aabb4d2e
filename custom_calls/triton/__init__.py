"""lrjax.custom_calls.triton: the CUDA kernels (Triton, launched through jax-triton).

One op a module, each with its ``BlockSizes``, kernels, wrapper and reference:
``xuv_decode`` (with ``xuv_decode_group`` and the ·V launch ``xuv_decode_pv``), ``xuv_prefill``,
``mlp_decode``, ``mlp_prefill`` and ``kv_attention``. ``lowering`` registers them with the
lrjax primitives (light: it imports no triton); ``planner`` cuts their tiles, ``policy`` reads
the device's tuning table (``tuning/policy_*.json``), ``launch`` and ``launch_modes`` launch
them. The wrappers are plain functions, traced where they are called (inside lrjax's lowering
or a caller's jit): the tuning table and the launch switches are read then, so a jit of their
own would freeze those choices in its cache.
"""
