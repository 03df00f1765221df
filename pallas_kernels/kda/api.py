"""Public KDA ops: argument checks, the backend table, padding to whole chunks, and the one-token decode step."""

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.kda.chunked_xla import chunk_kda_xla
from pallas_kernels.kda.layout import expand_heads
from pallas_kernels.kda.pallas_op import kda_pallas
from pallas_kernels.kda.pallas_tpu import kda_pallas_tpu
from pallas_kernels.kda.reference import kda_reference, kda_step
from pallas_kernels.kda.tiling import kda_diagonal_path


def _reference_backend(q, k, v, g, beta, initial_state, segment_ids, *, scale, chunk_size, diagonal):
    del chunk_size, diagonal  # the oracle has no tiling: it runs at any length, token by token
    return kda_reference(q, k, v, g, beta, initial_state, segment_ids, scale=scale)


def _whole_chunks(backend):
    """Wraps a chunked backend: pads T to a multiple of chunk_size and cuts o back to T.

    Padded tokens leave the state untouched (g = 0: no decay; beta = 0, k = 0: no write) and continue the last
    document, so neither o[:, :T] nor the final state change.
    """

    def run(q, k, v, g, beta, initial_state, segment_ids, *, scale, chunk_size, diagonal):
        seq_len = q.shape[1]
        pad = -seq_len % chunk_size
        if pad:
            (q, k, v, g, beta), segment_ids = _pad_time((q, k, v, g, beta), segment_ids, pad)
        o, state = backend(q, k, v, g, beta, initial_state, segment_ids, scale=scale, chunk_size=chunk_size,
                           diagonal=diagonal)
        return (o[:, :seq_len] if pad else o), state

    return run


@functools.partial(jax.jit, static_argnames="pad")
def _pad_time(arrays, segment_ids, pad):
    """Appends pad zero steps to each [B, T, ...] array; segment_ids [B, T] (or None) repeat their last id."""
    def zeros_after(x):
        return jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))

    if segment_ids is not None:
        segment_ids = jnp.pad(segment_ids, [(0, 0), (0, pad)], mode="edge")
    return tuple(map(zeros_after, arrays)), segment_ids


def _jit(backend):
    # Compiled per shape and tiling even when called eagerly (notebooks, tests): lengths padded to the same number of
    # chunks, and g_min values with the same tiling, share one executable. Inside a caller's jit this is inlined;
    # JAX_DISABLE_JIT=1 runs it line by line.
    return jax.jit(backend, static_argnames=("chunk_size", "diagonal"))


_KERNEL_STATIC = ("scale", "chunk_size", "diagonal")  # a kernel cannot close over a traced scale

# Every backend takes (q, k, v, g, beta, initial_state [B, HV, K, V] fp32, segment_ids [B, T] or None, *, scale,
# chunk_size, diagonal = kda_diagonal_path(g_min, chunk_size)) and returns (o [B, T, HV, V], final state fp32).
# A new backend is one entry here.
def _kda_pallas_here(*args, **kw):
    """The Pallas kernels of the platform being compiled for: Mosaic TPU kernels on TPU, the GPU ones elsewhere."""
    return (kda_pallas_tpu if jax.default_backend() == "tpu" else kda_pallas)(*args, **kw)


BACKENDS = {
    "reference": _jit(_reference_backend),
    "xla": _whole_chunks(_jit(chunk_kda_xla)),
    "pallas": _whole_chunks(jax.jit(_kda_pallas_here, static_argnames=_KERNEL_STATIC)),
    "interpret": _whole_chunks(jax.jit(functools.partial(kda_pallas, interpret=True),
                                       static_argnames=_KERNEL_STATIC)),
    # The Mosaic TPU kernels (pallas_tpu.py) by name, and in Pallas' TPU interpreter (any platform).
    "pallas_tpu": _whole_chunks(jax.jit(kda_pallas_tpu, static_argnames=_KERNEL_STATIC)),
    "interpret_tpu": _whole_chunks(jax.jit(functools.partial(kda_pallas_tpu, interpret=True),
                                           static_argnames=_KERNEL_STATIC)),
}
# "auto": the kernels where they have been compiled and verified on the hardware, the chunked XLA version elsewhere.
# TPU: the Mosaic TPU kernels pass the interpreter's tests and lower for TPU targets, but no TPU compiler has built
# them yet, so "auto" stays on XLA there; backend="pallas" (KDAConfig.backend) opts in.
AUTO_BACKEND = {"gpu": "pallas"}
FALLBACK_BACKEND = "xla"


def chunk_kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False, g_min=None,
              chunk_size=64, backend="auto", segment_ids=None):
    """Kimi Delta Attention over a whole sequence (DESIGN 3.1). Differentiable in every array argument.

    q, k: [B, T, H, K] (not normalised here: the layer L2-normalises them); v: [B, T, HV, V], HV a multiple of H, value
    head j reading q/k head j // (HV // H); g: [B, T, HV, K] per-step log decay <= 0 (not cumulative); beta:
    [B, T, HV] in (0, 1); initial_state: [B, HV, K, V] or None (zeros), it seeds the first document only;
    segment_ids: [B, T] int or None, the state restarts from zero wherever the id changes from the previous token.
    scale multiplies q (default K^-0.5). g_min promises g >= g_min and lets the diagonal blocks run as dense matmuls
    (see kda_diagonal_path); a broken promise overflows, so pass None for an unbounded gate. chunk_size: a power of
    two in [8, 256]; T need not be a multiple of it. backend: "auto" or a key of BACKENDS ("reference" is the fp32
    token loop, the oracle).
    Returns (o [B, T, HV, V] in v's dtype, final state [B, HV, K, V] fp32 if output_final_state else None).
    """
    run = _backend(backend)
    diagonal = kda_diagonal_path(g_min, chunk_size)  # also validates both
    _check_shapes("chunk_kda", ("B", "T"), q, k, v, g, beta, initial_state)
    if segment_ids is not None:
        _check_segment_ids(segment_ids, q.shape[:2])
    batch, _, _, key_dim = q.shape
    num_value_heads, value_dim = v.shape[2:]
    scale = key_dim ** -0.5 if scale is None else scale
    if initial_state is None:
        initial_state = jnp.zeros((batch, num_value_heads, key_dim, value_dim), jnp.float32)
    o, state = run(q, k, v, g, beta, initial_state.astype(jnp.float32), segment_ids, scale=scale,
                   chunk_size=chunk_size, diagonal=diagonal)
    return o.astype(v.dtype), (state if output_final_state else None)


def recurrent_kda(q, k, v, g, beta, state, *, scale=None):
    """One decoding step, the same math as the reference's token step.

    q, k: [B, H, K]; v: [B, HV, V]; g: [B, HV, K]; beta: [B, HV]; state: [B, HV, K, V] fp32.
    Returns (o [B, HV, V] in v's dtype, new state [B, HV, K, V] fp32).
    """
    _check_shapes("recurrent_kda", ("B",), q, k, v, g, beta, state)
    f32 = jnp.float32
    num_value_heads = v.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q = expand_heads(q.astype(f32), num_value_heads) * scale
    k = expand_heads(k.astype(f32), num_value_heads)
    state, o = kda_step(state.astype(f32), q, k, v.astype(f32), g.astype(f32), beta.astype(f32))
    return o.astype(v.dtype), state


def _backend(name):
    allowed = ("auto", *BACKENDS)
    if name not in allowed:
        raise ValueError(f"chunk_kda: backend must be one of {allowed}, got {name!r}")
    if name == "auto":
        name = AUTO_BACKEND.get(jax.default_backend(), FALLBACK_BACKEND)
    return BACKENDS[name]


def _check_shapes(fn, lead, q, k, v, g, beta, state):
    """Checks the layouts; lead names the leading axes: ("B", "T") for sequences, ("B",) for one decode step."""
    axes = ", ".join(lead)
    n = len(lead)
    if q.ndim != n + 2:
        raise ValueError(f"{fn}: q must have shape [{axes}, H, K], got {q.shape}")
    *lead_dims, heads, key_dim = q.shape
    if v.ndim != n + 2 or list(v.shape[:n]) != lead_dims:
        raise ValueError(f"{fn}: v must have shape [{axes}, HV, V] with [{axes}] = {tuple(lead_dims)}, got {v.shape}")
    num_value_heads, value_dim = v.shape[n:]
    if num_value_heads % heads:
        raise ValueError(f"{fn}: value heads HV = v.shape[{n}] must be a multiple of q/k heads H = {heads}, "
                         f"got HV = {num_value_heads}")
    _expect_shape(fn, "k", k, q.shape, f"[{axes}, H, K]")
    _expect_shape(fn, "g", g, (*lead_dims, num_value_heads, key_dim), f"[{axes}, HV, K]")
    _expect_shape(fn, "beta", beta, (*lead_dims, num_value_heads), f"[{axes}, HV]")
    if state is not None:
        name = "initial_state" if fn == "chunk_kda" else "state"
        _expect_shape(fn, name, state, (lead_dims[0], num_value_heads, key_dim, value_dim), "[B, HV, K, V]")


def _expect_shape(fn, name, x, shape, layout):
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{fn}: {name} must have shape {layout} = {tuple(shape)}, got {tuple(x.shape)}")


def _check_segment_ids(segment_ids, batch_and_time):
    _expect_shape("chunk_kda", "segment_ids", segment_ids, batch_and_time, "[B, T]")
    if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
        raise ValueError(f"chunk_kda: segment_ids must have an integer dtype, got {segment_ids.dtype}")
