"""lrjax.custom_calls: per-platform kernels behind the lrjax primitives.

Installed as ``lrjax.custom_calls`` (on disk: ``custom_calls/``). Rooms:
``triton/`` (CUDA, via jax-triton), ``cpu/`` (C++ XLA FFI, W4A8), ``nki/`` (Trainium).
Nothing here imports triton or NKI at import time; kernels register lazily
through :mod:`lrjax.lowering.registry`.
"""
