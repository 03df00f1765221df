"""Kimi Delta Attention (DESIGN 3.1): the token-by-token reference, the chunked XLA version, gates and decode step.

    o, state = chunk_kda(q, k, v, g, beta, g_min=-5.0, output_final_state=True)
"""

from pallas_kernels.kda.api import chunk_kda, recurrent_kda
from pallas_kernels.kda.gates import bounded_gate, softplus_gate
from pallas_kernels.kda.testing import relative_rms_error
from pallas_kernels.kda.tiling import kda_diagonal_path

__all__ = [
    "bounded_gate",
    "chunk_kda",
    "kda_diagonal_path",
    "recurrent_kda",
    "relative_rms_error",
    "softplus_gate",
]
