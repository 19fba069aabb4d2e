"""lrjax.custom_calls.nki: NeuronMM's TrainiumFusion kernels as the ``neuron`` lowerings.

Files (one op per kernel file):
  planner.py      block planner: eq. 10 arithmetic intensity, eq. 11 SBUF, exact HBM traffic,
                  refuses plans that spill (pure Python, usable anywhere)
  xuv.py          XUV TrainiumFusion kernel (also the MLP's DownProjection)
  mlp_up_gate.py  UpGateProjection (Algorithm 2), writes Y^T
  mlp.py          the fused MLP chain (Algorithm 3), no transpose between the kernels
  xuv_naive.py    Algorithm 1's naive fusion, for the traffic comparison only
  lowering.py     KERNELS, register() (only with the Neuron SDK), would_serve() for explain
  _api.py         how kernel files get nki / nl / nisa (real NKI, or a test double)

Targets NKI 0.7 (AWS Neuron SDK 2.33). Verified on CPU against a numpy test double of
the NKI API (tests/custom_calls/nki/nki_double.py); not compiled or run on Trainium.
"""
