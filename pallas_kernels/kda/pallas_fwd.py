"""Forward KDA kernels, the per-chunk part (parallel over chunks), and the launch parameters (Tuning) and helpers
that every GPU kernel shares; the inter-chunk state scan is in pallas_scan.

Layouts: every array is split into chunks, [B * N, C, ...] (inputs: a free reshape of [B, T, ...]); intermediates
are per chunk and value head, [B * N, HV, C, D] (bf16 for bf16 inputs), so the scan reads each chunk as one
contiguous tile. The per-chunk kernels then never see T: their compiled code is the same for every sequence length
and batch size.
"""

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from pallas_kernels.kda import pallas_blocks as blk
from pallas_kernels.kda.pallas_chunk import (ChunkIn, CumulativeGates, chunk_core, chunk_forward, chunk_gates,
                                            key_outputs, mask_scores, partial_scores, q_base, unit_lower_inverse,
                                            value_outputs)

_F32 = jnp.float32


WARPS = (1, 2, 4, 8, 16)  # warps per program that Triton accepts (a power of two, at most 16)
GATED_INPUTS = ("bounded", "both", "none")  # Tuning.gated_inputs: for which gates
SOLVE_OPERANDS = ("tf32", "bf16")  # Tuning.solve_operands


@dataclasses.dataclass(frozen=True)
class Tuning:
    """Launch parameters of the kernels. The defaults are the fastest measured on the H200 (and H100) at B=1,
    T=32768, H=16, K=V=128 (`experiments/trace_kda.py`, `experiments/bench_kda.py`; benchmarks/notes_kda.md, v5-v8)."""

    # Value columns per program of the forward scan (more programs, less work each); the backward scan's, 0: the same.
    state_tile: int = 32
    state_grad_tile: int = 16
    # Key channels per program of the input backward (elementwise in the key channel after the score gradients) and
    # of the state-side backward (dqp, dw, dkd: [C, V] x [V, Kt] products from the stored states).
    key_tile: int = 32
    state_side_tile: int = 64
    # Key and value channels per step of the forward's per-chunk work, which loops over channel tiles (scores summed
    # over key tiles, then w, qp, kd per key tile and u, ol per value tile) so that only [C, tile] input tiles and the
    # [C, C] scores are live. 0: the whole-tile kernel (every [C, K] tile at once).
    intra_tile: int = 32
    # Forward per-chunk work as three kernels: scores and solve per chunk (stored), then w, qp, kd per (chunk, key
    # tile) and u, ol per (chunk, value tile) in small kernels of `output_warps` warps. False: one kernel.
    split_intra: bool = True
    output_warps: int = 4
    # Channels per program of the split forward's output kernels (0: intra_tile; at most K and V). Wider tiles read
    # the chunk's [C, C] scores and inverse fewer times (once per tile) at the cost of more live registers.
    output_tile: int = 64
    intra_warps: int = 4
    score_bwd_warps: int = 4
    input_bwd_warps: int = 4
    state_side_warps: int = 4
    state_warps: int = 4
    # Software-pipelining depth of the scans' chunk loops (Triton num_stages); at most 2 for fp32 intermediates (fp32
    # inputs), whose three-stage reverse scan asked for 254 KB of shared memory on the H100 (227 KB per SM).
    state_stages: int = 3
    # Scan only the states and compute o = ol + qp S from the stored states in a kernel parallel over chunks: two
    # matmuls and three loads per step on the serial path instead of three and five. Costs memory without a backward:
    # every chunk's state is written (transiently; about twice q's bytes at K = V = 128 in bf16), which the training
    # forward keeps anyway.
    separate_output: bool = True
    # Multiply in the scans with the state (and v_new, dS) rounded to the stored intermediates' dtype (bf16 for bf16
    # inputs), accumulating in fp32; the state itself stays fp32. False: TF32 products of fp32 operands.
    scan_low_precision: bool = True
    # The state scans (forward and reverse) with the state carried transposed, S^T [Vt, K]
    # (pallas_scan._states_kernel_transposed, pallas_bwd._state_grad_kernel_transposed).
    scan_transposed: bool = False
    # Split forward with K = V: the scores kernel also writes the gated inputs of each key tile while it has their
    # cumulative gates, qg = Q e^Gamma and kb = diag(beta) K e^Gamma on the rows that read S0, kd and D, so that the
    # outputs kernel is w = T kb, qp = qg - Aqk w, u = T diag(beta) V, ol = Aqk u, and the inference forward's o is
    # qg S + Aqk v_new: neither reads g, q or k again. For which gates: "bounded" (default), "both" or "none". On the
    # H200 at T = 32768 it takes the bounded forward from 2.81 to 2.60 ms (kernel time); the unbounded gate's score
    # kernel, already the slowest, grows by more (3.59 -> 4.28 ms) than its output kernels save (benchmarks/notes_kda.md
    # v11).
    gated_inputs: str = "bounded"
    # The split forward's scores kernel with each score as one product per key tile: row block i's rows selected in
    # the left operand and the row blocks' operands side by side along the contraction (pallas_chunk.partial_scores),
    # instead of one masked [C, C] product per row block, each held in registers until it is masked and added; and
    # the scores stored before the solve. In the local sm_90a compile (bounded, 4 warps) the kernel's spills go from
    # 276-280 B to none (249 registers). Same run on an H100 (benchmarks/results/kda_v12_h100/): bounded forward at
    # 1 x 32768 2.86 -> 2.68 ms, forward+backward 9.43 -> 9.24 (benchmarks/notes_kda.md v12).
    fused_scores: bool = True
    # The state scans, forward (states alone, Tuning.separate_output) and reverse, as Mosaic GPU kernels
    # (mosaic_scan.py: warpgroup MMAs on shared-memory operands, a TMA pipeline one chunk ahead, state_tile and
    # state_grad_tile value channels per program: 16, 32 or 64) instead of the Triton lowering; bf16 inputs with
    # scan_low_precision, C and K multiples of 64 (else the Triton kernels run). They lower for CUDA and match the
    # Triton kernels in interpret mode (Mosaic GPU's interpreter). Same run on an H100 with fused_scores: bounded
    # forward at 1 x 32768 2.68 -> 2.42 ms, forward+backward 9.24 -> 9.17 (benchmarks/notes_kda.md v12).
    mosaic_scan: bool = True
    # The inference forward's scan with o computed inside it (mosaic_scan.states_output_scan), for the gated inputs
    # with mosaic_scan's conditions: o = qg S + Aqk v_new while S and v_new are in shared memory, so that the chunk
    # states and v_new are never written out and the per-chunk output kernel does not run. On the H200 (benchmarks/
    # results/kda_v12_h200/) the bounded forward at 4 x 8192 goes 2.12 -> 1.99 ms, but every B = 1 shape is slower
    # (1 x 32768: 2.29 -> 2.38; the scan's 64 programs leave SMs idle and o lengthens its serial path). Hence
    # mosaic_output_programs: only where the scan has at least that many programs (B x HV x V / state_tile; 0:
    # always), so that computing o inside it does not lengthen the serial path of a scan that leaves SMs idle. 256 is
    # the smallest count measured faster (4 x 8192 x 16 heads); 64 (B = 1) was slower, 128 was not measured.
    mosaic_output: bool = True
    mosaic_output_programs: int = 256
    # Matmul operands of the forward's per-chunk kernels for 16-bit inputs: "tf32" (fp32 tiles), "bf16_scores" (bf16
    # in the decayed-score products only) or "bf16" (every product). fp32
    # accumulation throughout. "bf16" puts o at 0.9-1.0 of its bar (relative RMS 4.4e-3 at K = 128 on the H200,
    # 5.0e-3 at K = 32), so the forward defaults to "bf16_scores" (benchmarks/notes_kda.md, v8).
    intra_operands: str = "bf16_scores"
    # The same for the backward's per-chunk kernels (score and input gradients); "" : as intra_operands. Their
    # gradients stay at or under 0.66 of the bars with bf16 operands, which take the input backward from 5.4 to 4.1 ms
    # (H200, T = 32768).
    backward_operands: str = "bf16"
    # Forward without a backward (inference): the states scanned alone and o = (Q e^Gamma) S + Aqk v_new in a kernel
    # parallel over chunks, as fla orders it, so the outputs kernel writes w, kd, u only (no qp, ol). The training
    # forward keeps qp (the reverse scan reads it). Channel-tiled forward only (intra_tile > 0), and K = V when split;
    # unsplit, one kernel per chunk writes w, kd, u and Aqk (the inverse stays in the program; slower on the H200).
    # 16-bit inputs only (pallas_op.lean_forward: with fp32 ones the output kernel needs too much shared memory).
    output_from_scores: bool = True
    # Matmul operands of the split forward's solve, T = (I + diag(beta) Akk)^-1 (ten dependent [C, C] x [C, C]
    # products), for 16-bit inputs: "bf16" or "tf32" (intra_operands' choice for it: TF32 under bf16_scores). In the
    # bounded scores kernel's sm_90a compile, bf16 halves the solve's warpgroup MMA instructions (96 -> 56 in the
    # kernel) and, since a 16-bit MMA result becomes the next product's operand without the shared-memory round trip
    # a TF32 one takes, cuts warp shuffles 516 -> 196 and shared stores 427 -> 107. Event-timed on an H100
    # (benchmarks/results/kda_v15_h100/): bounded forward 7-9% faster at all four shapes (1 x 32768: 2.263 ->
    # 2.098 ms), forward+backward 1-3%; verify_kda passes every bar with it (errors within 1e-4 of TF32's in the
    # interpret-mode run, benchmarks/results/kda_verify_cpu/interpret_solve_bf16.txt).
    solve_operands: str = "bf16"
    # The split forward's scores kernel reads the gates' prefix sums within each chunk from a small kernel of their
    # own (chunk_cumsum: one more pass over g, read and written in fp32), so that per key tile it loads the four
    # anchor rows and the last row instead of forming the prefix sum and extracting them by reductions across the
    # tile (2 scans and 14 reductions in its sm_90a compile). Leaving that work out of the bounded scores kernel
    # took 0.39 ms off the forward at 4 x 8192 on an H100 (benchmarks/results/kda_v15_h100/, no_gate_sums). The
    # backward forms the prefix sums once more, for its channel-tiled score kernel and its row-block input kernel
    # (pallas_bwd.intra_grads), whose block anchors and last rows become loads too.
    cumulative_gates: bool = False
    # The inference forward with the gated inputs: w = T kb and u = T diag(beta) V formed in the scores kernel after
    # the solve (_scores_outputs_kernel), kb from the gates' prefix sums (chunk_cumsum, as cumulative_gates) per key
    # tile, instead of storing T (fp32) and kb and running the per-tile output kernel, which reads them back (T once
    # per tile). Saves about 80 KB of memory traffic per chunk and head (0.65 GB at 4 x 8192) and a launch, at the
    # cost of more work in the scores kernel. Not yet timed on a GPU.
    fused_outputs: bool = False
    # The inference forward's Mosaic state scan (where o is not formed inside it, mosaic_output) with one warpgroup
    # MMA latency per chunk on its serial path instead of two (mosaic_scan.states_scan_lookahead: v_n from the
    # previous step's S and v_new through A_n = w_n diag(d_(n-1)) and B_n = w_n kd_(n-1)^T, formed in parallel over
    # chunks beforehand). For the B = 1 shapes, whose scan has too few programs to fill the GPU and runs on its
    # latency. Not yet timed on a GPU.
    scan_lookahead: bool = False
    # Warps of the forward's per-chunk score kernel for the unbounded gate (intra_warps: the bounded one's). Its exact
    # diagonal blocks (pallas_blocks.pairwise_levels, a second pass over the key tiles) compile without spills at 8
    # (4: 768 B) and run 6% faster there (H100).
    pairwise_warps: int = 8
    # Unbounded gate, split forward: the exact diagonal blocks of Aqk and Akk in a kernel of their own, parallel over
    # 16-row blocks (diagonal_scores: per column, the row block's decayed products with that key, as fla's
    # token-parallel kernel does, elementwise in fp32 with every factor <= 1), which the scores kernel then adds,
    # and their gradients likewise (pallas_bwd.diagonal_grads), instead of pairwise_levels' four masked whole-chunk
    # products per key tile in a second pass of the scores kernel. On the H200 at 1 x 32768 (benchmarks/results/
    # kda_v12_h200/): unbounded forward 5.14 -> 3.84 ms, forward+backward 13.92 -> 12.73 (diagonal_warps=8 in both
    # passes), and the saturated gate's dg error halves. False: pairwise_levels.
    diagonal_kernel: bool = True
    # Warps of the forward diagonal kernel (H200 kernel time at 1 x 32768: 2 warps 1.78 ms, 4 2.88, 8 1.15, 16 1.33)
    # and of its backward (4 warps 1.43 ms, 8 2.20, 16 2.59).
    diagonal_warps: int = 8
    diagonal_bwd_warps: int = 4
    # Input backward: "rows" (one 16-row block at a time: [R, C] x [C, Kt] products, a quarter of the masked whole-tile
    # ones' multiply-adds, [R, Kt] results live), "tiles" (whole [C, Kt] tiles: masked [C, C] x [C, Kt] products,
    # which Triton issues as warpgroup MMAs) or "auto": rows for the unbounded gate (the pairwise diagonal's
    # gradients are per block anyway) and for bf16 backward operands, tiles otherwise (the faster of the two in each
    # case on the H100/H200, benchmarks/notes_kda.md v7); always tiles for fp32 inputs (see input_bwd_rows).
    input_bwd: str = "auto"

    def __post_init__(self):
        if self.gated_inputs not in GATED_INPUTS:
            raise ValueError(f"Tuning.gated_inputs must be one of {GATED_INPUTS}, got {self.gated_inputs!r}")
        if self.solve_operands not in SOLVE_OPERANDS:
            raise ValueError(f"Tuning.solve_operands must be one of {SOLVE_OPERANDS}, got {self.solve_operands!r}")
        if not isinstance(self.mosaic_output_programs, int) or self.mosaic_output_programs < 0:
            raise ValueError("Tuning.mosaic_output_programs must be an integer >= 0 (0: always), got "
                             f"{self.mosaic_output_programs!r}")
        for field in dataclasses.fields(self):
            warps = getattr(self, field.name)
            if field.name.endswith("_warps") and warps not in WARPS:
                raise ValueError(f"Tuning.{field.name} must be one of {WARPS} (warps per program), got {warps!r}")

    @classmethod
    def from_string(cls, text):
        """'base' (or '') -> the defaults; 'field=value,field=value' -> those fields changed (bools as 0/1)."""
        tuning = cls()
        if text.strip() in ("", "base"):
            return tuning
        fields = {f.name for f in dataclasses.fields(cls)}
        changes = {}
        for item in text.split(","):
            name, _, value = (part.strip() for part in item.partition("="))
            if name not in fields:
                raise ValueError(f"Tuning: unknown field {name!r} in {text!r}; allowed: {sorted(fields)}")
            default = getattr(tuning, name)
            changes[name] = bool(int(value)) if isinstance(default, bool) else type(default)(value)
        return dataclasses.replace(tuning, **changes)


INPUT_BWD = ("auto", "rows", "tiles")


def input_bwd_rows(tuning, dense, dtype=jnp.bfloat16):
    """Whether the input backward runs by 16-row blocks (Tuning.input_bwd) for inputs of this dtype. "auto" never
    picks rows for fp32 inputs: their three-pass TF32 products need more shared memory than an H100/H200 SM has
    (254 KB requested of 227 KB, measured), and the whole-tile kernel fits."""
    if tuning.input_bwd not in INPUT_BWD:
        raise ValueError(f"Tuning.input_bwd must be one of {INPUT_BWD}, got {tuning.input_bwd!r}")
    if tuning.input_bwd == "auto":
        sixteen_bit = dtype in (jnp.bfloat16, jnp.float16)
        return sixteen_bit and (not dense or (tuning.backward_operands or tuning.intra_operands) != "tf32")
    return tuning.input_bwd == "rows"


INTRA_OPERANDS = {"tf32": None, "bf16_scores": blk.BF16_SCORES, "bf16": blk.BF16_OPERANDS}


def intra_precision(tuning, precision, dtype, backward=False):
    """The matmul precision of the per-chunk kernels: Tuning.intra_operands (backward: Tuning.backward_operands) for
    16-bit inputs, else `precision`."""
    for name in ("intra_operands", "backward_operands"):
        value = getattr(tuning, name)
        allowed = sorted(INTRA_OPERANDS) + ([""] if name == "backward_operands" else [])
        if value not in allowed:
            raise ValueError(f"Tuning.{name} must be one of {allowed}, got {value!r}")
    operands = (tuning.backward_operands or tuning.intra_operands) if backward else tuning.intra_operands
    if dtype in (jnp.bfloat16, jnp.float16):
        return INTRA_OPERANDS[operands] or precision
    return precision


def score_dtype(precision):
    """Storage of a [C, C] per-chunk matrix (the forward's saved scores and inverse, the backward's score gradients)
    under this matmul precision: bf16 when every product rounds its operands to bf16 anyway (BF16_OPERANDS: "bf16"
    operands with 16-bit inputs), else fp32."""
    return jnp.bfloat16 if precision == blk.BF16_OPERANDS else _F32


def compiler_params(warps, stages=None):
    return pl_triton.CompilerParams(num_warps=warps, num_stages=stages)


def scan_params(tuning, dtype):
    """Launch parameters of the scans over chunks of intermediates of this dtype (see Tuning.state_stages)."""
    stages = tuning.state_stages if jnp.dtype(dtype).itemsize <= 2 else min(tuning.state_stages, 2)
    return compiler_params(tuning.state_warps, stages)


def ref_chunk(q_ref, k_ref, v_ref, g_ref, beta_ref, doc_ref, prev_ref, *, scale, doc_row_ref=None):
    """A ChunkIn of a kernel's [C, D] input tiles (v_ref may be None).

    Vector layout: beta and doc [C], prev_ref [C] (the incoming document is its first entry); or, with doc_row_ref
    (the Mosaic TPU kernels: no rank-1 values), beta and doc [C, 1], doc_row_ref [1, C], prev_ref [1, 1]."""
    size = q_ref.shape[0]
    load = lambda ref: ref[...].astype(_F32)  # noqa: E731
    doc = doc_ref[...]
    if doc_row_ref is None:
        vectors = dict(beta=load(beta_ref)[:, None], doc_in=blk.element(prev_ref[...], 0),
                       doc_last=blk.element(doc, size - 1))
    else:
        vectors = dict(beta=load(beta_ref), doc_in=prev_ref[...], doc_last=blk.row(doc, size - 1)[None, :],
                       doc_row=doc_row_ref[...])
    return ChunkIn(q=load(q_ref) * scale, k=load(k_ref), v=None if v_ref is None else load(v_ref), g=load(g_ref),
                   doc=doc, **vectors)


def operand_cast(low):
    """In a scan: rounds a carried fp32 operand to the dtype of the tile it meets (low precision), or leaves it."""
    return (lambda x, ref: x.astype(ref.dtype)) if low else (lambda x, ref: x)


def scan_load(low):
    """In a scan: a stored chunk tile as a matmul operand, in its stored dtype (low precision) or in fp32."""
    return (lambda ref, n: ref[n]) if low else (lambda ref, n: ref[n].astype(_F32))


def with_precision(kernel):
    """Runs a kernel body under its `precision` keyword (see pallas_blocks.matmul_precision)."""

    @functools.wraps(kernel)
    def body(*refs, precision, **kw):
        with blk.matmul_precision(precision):
            kernel(*refs, **kw)

    return body


@with_precision
def _intra_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, doc_ref, prev_ref, w_ref, qp_ref, kd_ref, u_ref, ol_ref, d_ref,
                  *score_refs, scale, dense):
    x = ref_chunk(q_ref, k_ref, v_ref, g_ref, beta_ref, doc_ref, prev_ref, scale=scale)
    core = chunk_core(x, dense=dense)
    out = chunk_forward(x, core)
    for name, ref in dict(w=w_ref, qp=qp_ref, kd=kd_ref, u=u_ref, ol=ol_ref).items():
        ref[...] = out[name].astype(ref.dtype)
    d_ref[...] = out["d"][0]
    for ref, value in zip(score_refs, (core.aqk, core.akk, core.t)):  # the backward's residuals
        ref[...] = value


def _chunk_rows(beta_ref, doc_ref, prev_ref):
    """What every key tile of a chunk shares: beta [C, 1], doc [C], the incoming state's and the last token's
    documents (loaded once per program, not once per tile)."""
    doc = doc_ref[...]
    return beta_ref[...].astype(_F32)[:, None], doc, blk.element(prev_ref[...], 0), blk.element(doc, doc.shape[0] - 1)


def _tile_input(q_ref, k_ref, g_ref, beta_ref, doc_ref, prev_ref, cols, *, scale, rows=None, cumulative=False):
    """A ChunkIn of the key channels `cols` of a chunk's input tiles (no v); rows: _chunk_rows, if already loaded;
    cumulative: g_ref holds the gates' prefix sums within the chunk (chunk_cumsum), whose anchor rows and last row
    are loaded as such (ChunkIn.cumulative)."""
    beta, doc, doc_in, doc_last = rows or _chunk_rows(beta_ref, doc_ref, prev_ref)
    load = lambda ref: ref[:, cols].astype(_F32)  # noqa: E731
    g, gates = load(g_ref), None
    if cumulative:
        size = g_ref.shape[0]
        load_row = lambda r: g_ref[pl.ds(r, 1), cols].astype(_F32)  # noqa: E731
        g, gates = None, CumulativeGates(g, [load_row(blk.ROWS * i) for i in range(size // blk.ROWS)],
                                         load_row(size - 1))
    return ChunkIn(q=load(q_ref) * scale, k=load(k_ref), v=None, g=g, beta=beta, doc=doc, doc_in=doc_in,
                   doc_last=doc_last, cumulative=gates)


def _write_gated(x, gates, cols, qg_ref, kb_ref, kd_ref, d_ref):
    """The gated inputs of the key channels `cols` (Tuning.gated_inputs): qg = Q e^Gamma and kb = diag(beta) K e^Gamma
    on the rows that read S0, kd = K e^(g_last - Gamma) on the last document's rows, d = e^g_last (0 if a document
    starts inside the chunk)."""
    qg_ref[:, cols] = q_base(x, gates.dec.gam).astype(qg_ref.dtype)
    if kb_ref is not None:  # None: w is formed in the same kernel (Tuning.fused_outputs)
        kb_ref[:, cols] = (x.beta * gates.k_base).astype(kb_ref.dtype)
    kd_ref[:, cols] = (x.k * gates.kd_scale).astype(kd_ref.dtype)
    d_ref[cols] = gates.carried[0]


def _masked_scores(q_ref, k_ref, g_ref, beta_ref, doc_ref, prev_ref, *, scale, dense, tile, gated_refs=None,
                   fused=False, diagonal_refs=None, cumulative=False):
    """Aqk, Akk (masked) [C, C] of a chunk, summing the scores over key tiles; with gated_refs (the qg, kb, kd, d
    refs), also the gated inputs of each key tile (_write_gated); fused: pallas_chunk.partial_scores(fused=True).
    Unbounded: the exact diagonal blocks in a second pass over the key tiles (pallas_blocks.pairwise_levels), so that
    nothing of the first is live beside them, or read from diagonal_refs (diagonal_scores' Aqk and Akk blocks).
    cumulative: g_ref holds the gates' prefix sums (_tile_input)."""
    size, key_dim = q_ref.shape
    rows = _chunk_rows(beta_ref, doc_ref, prev_ref)
    tile_input = lambda j, rows=None: _tile_input(q_ref, k_ref, g_ref, beta_ref, doc_ref, prev_ref,  # noqa: E731
                                                  pl.ds(j * tile, tile), scale=scale, rows=rows,
                                                  cumulative=cumulative)

    def add_scores(j, acc):
        x = tile_input(j, rows)
        gates = chunk_gates(x)
        if gated_refs:
            _write_gated(x, gates, pl.ds(j * tile, tile), *gated_refs)
        aqk, akk = partial_scores(x, gates.dec, dense=dense, with_diagonal=False, fused=fused)
        return acc[0] + aqk, acc[1] + akk

    def add_diagonal(j, acc):
        x = tile_input(j)
        gam = blk.cumsum_rows(x.g) if x.cumulative is None else x.cumulative.gam
        diag_qk, diag_kk = blk.pairwise_levels((x.q, x.k), x.k, gam)
        return acc[0] + diag_qk, acc[1] + diag_kk

    zeros = jnp.zeros((size, size), _F32)
    aqk, akk = lax.fori_loop(0, key_dim // tile, add_scores, (zeros, zeros))
    if diagonal_refs is not None:
        aqk, akk = aqk + block_diagonal(diagonal_refs[0][...]), akk + block_diagonal(diagonal_refs[1][...])
    elif not dense:
        aqk, akk = lax.fori_loop(0, key_dim // tile, add_diagonal, (aqk, akk))
    return mask_scores(doc_ref[...], aqk, akk)  # loaded again: nothing of the first pass lives through the second


def _solve(beta_ref, akk, bf16=False):
    """T = (I + diag(beta) Akk)^-1 [C, C]; bf16: its products on bf16 operands (Tuning.solve_operands)."""
    with blk.matmul_precision(blk.BF16_OPERANDS) if bf16 else contextlib.nullcontext():
        return unit_lower_inverse(beta_ref[...].astype(_F32)[:, None] * akk)


def _solved_scores(q_ref, k_ref, g_ref, beta_ref, doc_ref, prev_ref, **kw):
    """Aqk, Akk (_masked_scores) and T = (I + diag(beta) Akk)^-1 [C, C]."""
    aqk, akk = _masked_scores(q_ref, k_ref, g_ref, beta_ref, doc_ref, prev_ref, **kw)
    return aqk, akk, _solve(beta_ref, akk)


def _write_key_tile(inputs, cols, aqk, t, w_ref, qp_ref, kd_ref, d_ref, *, scale):
    """w, qp, kd and D of the key channels `cols`; aqk and qp_ref None: w, kd and D only."""
    x = _tile_input(*inputs, cols, scale=scale)
    out = key_outputs(x, chunk_gates(x), aqk, t)
    for name, ref in dict(w=w_ref, qp=qp_ref, kd=kd_ref).items():
        if ref is not None:
            ref[:, cols] = out[name].astype(ref.dtype)
    d_ref[cols] = out["d"][0]


def _write_value_tile(v_ref, beta_ref, cols, aqk, t, u_ref, ol_ref):
    """u and ol of the value channels `cols`; aqk and ol_ref None: u only."""
    out = value_outputs(v_ref[:, cols].astype(_F32), beta_ref[...].astype(_F32)[:, None], aqk, t)
    u_ref[:, cols] = out["u"].astype(u_ref.dtype)
    if ol_ref is not None:
        ol_ref[:, cols] = out["ol"].astype(ol_ref.dtype)


def _write_output_tiles(inputs, v_ref, aqk, t, key_refs, value_refs, *, scale, tile):
    """The one-kernel forward's output passes: w, qp, kd, D per `tile` key channels (key_refs), then u, ol per value
    tile (value_refs); aqk None with the qp and ol refs None: w, kd, D and u only."""
    key_dim, value_dim = inputs[0].shape[1], v_ref.shape[1]

    def write_keys(j, carry):
        _write_key_tile(inputs, pl.ds(j * tile, tile), aqk, t, *key_refs, scale=scale)
        return carry

    def write_values(j, carry):
        _write_value_tile(v_ref, inputs[3], pl.ds(j * tile, tile), aqk, t, *value_refs)
        return carry

    lax.fori_loop(0, key_dim // tile, write_keys, 0)
    lax.fori_loop(0, value_dim // tile, write_values, 0)


@with_precision
def _tiled_intra_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, doc_ref, prev_ref, w_ref, qp_ref, kd_ref, u_ref, ol_ref,
                        d_ref, *score_refs, scale, dense, tile):
    """The per-chunk forward, `tile` key (then value) channels at a time: pass 1 sums the decayed scores over key
    tiles, then T = (I + diag(beta) Akk)^-1, pass 2 writes w, qp, kd per key tile, pass 3 u, ol per value tile."""
    inputs = (q_ref, k_ref, g_ref, beta_ref, doc_ref, prev_ref)
    aqk, akk, t = _solved_scores(*inputs, scale=scale, dense=dense, tile=tile)
    _write_output_tiles(inputs, v_ref, aqk, t, (w_ref, qp_ref, kd_ref, d_ref), (u_ref, ol_ref), scale=scale, tile=tile)
    for ref, value in zip(score_refs, (aqk, akk, t)):  # the backward's residuals
        ref[...] = value


@with_precision
def _tiled_lean_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, doc_ref, prev_ref, w_ref, kd_ref, u_ref, d_ref, aqk_ref, *,
                       scale, dense, tile):
    """The inference forward's per-chunk work in one program (Tuning.output_from_scores without split_intra): the
    scores and the solve, then only what the state scan and o read: w, kd, D per key tile, u per value tile, Aqk.
    The inverse never leaves the program, and the second pass re-reads the chunk's tiles while they are cached."""
    inputs = (q_ref, k_ref, g_ref, beta_ref, doc_ref, prev_ref)
    aqk, _, t = _solved_scores(*inputs, scale=scale, dense=dense, tile=tile)
    aqk_ref[...] = aqk.astype(aqk_ref.dtype)
    _write_output_tiles(inputs, v_ref, None, t, (w_ref, None, kd_ref, d_ref), (u_ref, None), scale=scale, tile=tile)


@with_precision
def _score_kernel(q_ref, k_ref, g_ref, beta_ref, doc_ref, prev_ref, *refs, scale, dense, tile, squares, gated,
                  fused, diagonal, solve_bf16=False, cumulative=False):
    """Split forward, part 1 (grid chunks x value heads): the chunk's scores and the solve. refs: with `diagonal`
    first the diagonal blocks of Aqk and Akk (diagonal_scores); then the outputs: Aqk, Akk, T (squares = 3; Akk is
    kept for the backward only) or Aqk, T (squares = 2), then with `gated` the qg, kb, kd, d refs of the gated
    inputs. fused (Tuning.fused_scores): each score one product per key tile, and the scores stored before the solve,
    so that their registers are free during it. cumulative: g_ref holds the gates' prefix sums (chunk_cumsum)."""
    diagonal_refs, out_refs = (refs[:2], refs[2:]) if diagonal else (None, refs)
    aqk, akk = _masked_scores(q_ref, k_ref, g_ref, beta_ref, doc_ref, prev_ref, scale=scale, dense=dense, tile=tile,
                              gated_refs=out_refs[squares:] if gated else None, fused=fused,
                              diagonal_refs=diagonal_refs, cumulative=cumulative)
    t_ref = out_refs[squares - 1]

    def store_scores():
        for ref, value in zip(out_refs[:squares - 1], (aqk, akk)):
            ref[...] = value.astype(ref.dtype)

    if fused:
        store_scores()
    t = _solve(beta_ref, akk, solve_bf16)
    if not fused:
        store_scores()
    t_ref[...] = t.astype(t_ref.dtype)


@with_precision
def _scores_outputs_kernel(q_ref, k_ref, g_ref, beta_ref, doc_ref, prev_ref, v_ref, *refs, scale, dense, tile, fused,
                           diagonal, solve_bf16=False):
    """The inference forward's scores kernel with its outputs (Tuning.fused_outputs): _score_kernel's Aqk, qg, kd and
    d, then, while T is in registers, w = T diag(beta) K e^Gamma per key tile and u = T diag(beta) V per value tile,
    instead of storing T and kb for _gated_lean_outputs_kernel. g_ref holds the gates' prefix sums (chunk_cumsum), so
    that kb is a load and an exponential per tile. refs: with `diagonal` first diagonal_scores' Aqk and Akk blocks;
    then the outputs Aqk, qg, kd, d, w, u."""
    diagonal_refs, out_refs = (refs[:2], refs[2:]) if diagonal else (None, refs)
    aqk_ref, qg_ref, kd_ref, d_ref, w_ref, u_ref = out_refs
    aqk, akk = _masked_scores(q_ref, k_ref, g_ref, beta_ref, doc_ref, prev_ref, scale=scale, dense=dense, tile=tile,
                              gated_refs=(qg_ref, None, kd_ref, d_ref), fused=fused, diagonal_refs=diagonal_refs,
                              cumulative=True)
    aqk_ref[...] = aqk.astype(aqk_ref.dtype)
    t = _solve(beta_ref, akk, solve_bf16)
    beta, doc, doc_in, _ = _chunk_rows(beta_ref, doc_ref, prev_ref)
    reads = (doc == doc_in)[:, None]

    def write_w(j, carry):
        cols = pl.ds(j * tile, tile)
        kb = jnp.where(reads, beta * k_ref[:, cols].astype(_F32) * jnp.exp(g_ref[:, cols].astype(_F32)), 0.0)
        w_ref[:, cols] = blk.mm(t, kb).astype(w_ref.dtype)
        return carry

    def write_u(j, carry):
        _write_value_tile(v_ref, beta_ref, pl.ds(j * tile, tile), None, t, u_ref, None)
        return carry

    lax.fori_loop(0, k_ref.shape[1] // tile, write_w, 0)
    lax.fori_loop(0, v_ref.shape[1] // tile, write_u, 0)


@with_precision
def _key_output_kernel(q_ref, k_ref, g_ref, beta_ref, doc_ref, prev_ref, aqk_ref, t_ref, w_ref, qp_ref, kd_ref, d_ref,
                       *, scale):
    """Split forward, part 2 (grid chunks x value heads x key tiles): w, qp, kd and D of one key tile."""
    inputs = (q_ref, k_ref, g_ref, beta_ref, doc_ref, prev_ref)
    _write_key_tile(inputs, slice(None), aqk_ref[...].astype(_F32), t_ref[...].astype(_F32), w_ref, qp_ref, kd_ref,
                    d_ref, scale=scale)


@with_precision
def _value_output_kernel(v_ref, beta_ref, aqk_ref, t_ref, u_ref, ol_ref):
    """Split forward, part 3 (grid chunks x value heads x value tiles): u and ol of one value tile."""
    _write_value_tile(v_ref, beta_ref, slice(None), aqk_ref[...].astype(_F32), t_ref[...].astype(_F32), u_ref,
                      ol_ref)


@with_precision
def _tile_outputs_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, doc_ref, prev_ref, aqk_ref, t_ref, w_ref, qp_ref, kd_ref,
                         d_ref, u_ref, ol_ref, *, scale):
    """Split forward, parts 2 and 3 in one program (grid chunks x value heads x channel tiles, K = V): key tile j's
    w, qp, kd, D and value tile j's u, ol, reading the chunk's scores and inverse once for both."""
    inputs = (q_ref, k_ref, g_ref, beta_ref, doc_ref, prev_ref)
    aqk, t = aqk_ref[...].astype(_F32), t_ref[...].astype(_F32)
    _write_key_tile(inputs, slice(None), aqk, t, w_ref, qp_ref, kd_ref, d_ref, scale=scale)
    _write_value_tile(v_ref, beta_ref, slice(None), aqk, t, u_ref, ol_ref)


@with_precision
def _lean_outputs_kernel(k_ref, v_ref, g_ref, beta_ref, doc_ref, prev_ref, t_ref, w_ref, kd_ref, d_ref, u_ref):
    """Inference forward, parts 2 and 3 (grid chunks x value heads x channel tiles, K = V): what the state scan reads
    and nothing for o: key tile j's w, kd, D and value tile j's u."""
    t = t_ref[...].astype(_F32)
    inputs = (k_ref, k_ref, g_ref, beta_ref, doc_ref, prev_ref)  # no q: k stands in for it, unread
    _write_key_tile(inputs, slice(None), None, t, w_ref, None, kd_ref, d_ref, scale=1.0)
    _write_value_tile(v_ref, beta_ref, slice(None), None, t, u_ref, None)


def _write_key_products(kb_ref, qg_ref, aqk, t, w_ref, qp_ref):
    """From the gated inputs: w = T kb and (qp_ref not None) qp = qg - Aqk w for a tile of key channels."""
    w = blk.mm(t, kb_ref[...].astype(_F32))
    w_ref[...] = w.astype(w_ref.dtype)
    if qp_ref is not None:
        qp_ref[...] = (qg_ref[...].astype(_F32) - blk.mm(aqk, w)).astype(qp_ref.dtype)


@with_precision
def _gated_outputs_kernel(qg_ref, kb_ref, v_ref, beta_ref, aqk_ref, t_ref, w_ref, qp_ref, u_ref, ol_ref):
    """_tile_outputs_kernel from the gated inputs (Tuning.gated_inputs): key tile j's w, qp and value tile j's u,
    ol."""
    aqk, t = aqk_ref[...].astype(_F32), t_ref[...].astype(_F32)
    _write_key_products(kb_ref, qg_ref, aqk, t, w_ref, qp_ref)
    _write_value_tile(v_ref, beta_ref, slice(None), aqk, t, u_ref, ol_ref)


@with_precision
def _gated_lean_outputs_kernel(kb_ref, v_ref, beta_ref, t_ref, w_ref, u_ref):
    """_lean_outputs_kernel from the gated inputs (Tuning.gated_inputs): w = T kb for key tile j and
    u = T diag(beta) V for value tile j."""
    t = t_ref[...].astype(_F32)
    _write_key_products(kb_ref, None, None, t, w_ref, None)
    _write_value_tile(v_ref, beta_ref, slice(None), None, t, u_ref, None)


def output_tile(tuning, key_dim, value_dim):
    """Channels per program of the split forward's output kernels (Tuning.output_tile, 0: intra_tile; at most K, V)."""
    tile = min(tuning.output_tile or tuning.intra_tile, key_dim, value_dim)
    if tile < 1 or key_dim % tile or value_dim % tile:
        raise ValueError(f"Tuning.output_tile must divide the key and value dimensions ({key_dim}, {value_dim}), "
                         f"got {tile}")
    return tile


def _cumsum_kernel(g_ref, gam_ref):
    gam_ref[...] = blk.cumsum_rows(g_ref[...].astype(_F32))


def chunk_cumsum(g, *, interpret, warps=4):
    """The gates' inclusive prefix sums within each chunk (Tuning.cumulative_gates): g [BN, C, HV, K] -> fp32, same
    layout, one [C, K] tile per program."""
    chunks, chunk, value_heads, key_dim = g.shape
    spec = pl.BlockSpec((None, chunk, None, key_dim), lambda n, h: (n, 0, h, 0))
    return pl.pallas_call(_cumsum_kernel, grid=(chunks, value_heads), in_specs=[spec], out_specs=spec,
                          out_shape=jax.ShapeDtypeStruct(g.shape, _F32), compiler_params=compiler_params(warps),
                          interpret=interpret, name="kda_gate_cumsum")(g)


def diagonal_columns(q_ref, k_ref, g_ref, body, init, *, scale, strict):
    """The column loop of the diagonal-block kernels (forward and backward) over one 16-row block: with q (scaled), k
    [R, K] fp32 and gam the cumulative gate within the block, body(c, carry, q, k, decay, key) for each column c, where
    decay[r] = e^(gam_r - gam_c) on rows r >= c (r > c if strict; 0 elsewhere: every exponent <= 0) and key = k_c
    decay, k_c loaded from its ref. Returns the final carry."""
    rows = q_ref.shape[0]
    q = q_ref[...].astype(_F32) * scale
    k = k_ref[...].astype(_F32)
    gam = blk.cumsum_rows(g_ref[...].astype(_F32))
    row = lax.broadcasted_iota(jnp.int32, (rows, 1), 0)

    def column(c, state):
        carry, gam_c = state
        gam_c = gam_c + g_ref[pl.ds(c, 1), :].astype(_F32)  # the running cumulative gate, row c
        decay = jnp.exp(jnp.where(row > c if strict else row >= c, gam - gam_c, -jnp.inf))
        key = k_ref[pl.ds(c, 1), :].astype(_F32) * decay
        return body(c, carry, q, k, decay, key), gam_c

    carry, _ = lax.fori_loop(0, rows, column, (init, jnp.zeros((1, q.shape[1]), _F32)))
    return carry


def diagonal_call(kernel, q, k, g, *extra, extra_specs, out_specs, out_shape, warps, interpret, name):
    """pallas_call of a diagonal-block kernel: grid (chunks, value heads, 16-row blocks), the block's q, k, g rows
    first, then `extra` with their specs."""
    chunks, chunk, heads, key_dim = q.shape
    value_heads = g.shape[2]
    group, rows = value_heads // heads, blk.ROWS
    qk = pl.BlockSpec((None, rows, None, key_dim), lambda n, h, b: (n, b, h // group, 0))
    gate = pl.BlockSpec((None, rows, None, key_dim), lambda n, h, b: (n, b, h, 0))
    return pl.pallas_call(
        kernel,
        grid=(chunks, value_heads, chunk // rows),
        in_specs=[qk, qk, gate, *extra_specs],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=compiler_params(warps),
        interpret=interpret,
        name=name,
    )(q, k, g, *extra)


def _diagonal_kernel(q_ref, k_ref, g_ref, aqk_ref, akk_ref, *, scale):
    """One 16-row block's diagonal block of Aqk and Akk [R, R], exact for any decay: column c is
    sum_d x[r, d] k[c, d] e^(gam[r, d] - gam[c, d]) for rows r >= c (0 above). Elementwise fp32 over [R, K] tiles
    (diagonal_columns)."""
    rows = q_ref.shape[0]
    col = lax.broadcasted_iota(jnp.int32, (rows, rows), 1)

    def body(c, carry, q, k, decay, key):
        aqk, akk = carry
        here = col == c
        return (jnp.where(here, jnp.sum(q * key, axis=1, keepdims=True), aqk),
                jnp.where(here, jnp.sum(k * key, axis=1, keepdims=True), akk))

    zeros = jnp.zeros((rows, rows), _F32)
    aqk_ref[...], akk_ref[...] = diagonal_columns(q_ref, k_ref, g_ref, body, (zeros, zeros), scale=scale,
                                                  strict=False)


def diagonal_scores(q, k, g, *, scale, warps, interpret):
    """The diagonal 16-row blocks of Aqk and Akk (unmasked, exact for any decay; Tuning.diagonal_kernel): q, k
    [BN, C, H, K], g [BN, C, HV, K] -> two [BN, HV, C, R] fp32 arrays, row r's block in its R columns (block_diagonal
    spreads them)."""
    chunks, chunk, rows = q.shape[0], q.shape[1], blk.ROWS
    out = pl.BlockSpec((None, None, rows, rows), lambda n, h, b: (n, h, b, 0))
    blocks = jax.ShapeDtypeStruct((chunks, g.shape[2], chunk, rows), _F32)
    return diagonal_call(functools.partial(_diagonal_kernel, scale=scale), q, k, g, extra_specs=[],
                         out_specs=[out, out], out_shape=[blocks, blocks], warps=warps, interpret=interpret,
                         name="kda_diagonal_fwd")


def block_diagonal(blocks):
    """[C, R] diagonal blocks (diagonal_scores) -> the [C, C] matrix holding them, zero elsewhere: a product with a
    one-hot [R, C] spread in IEEE fp32 (exact: every sum has one non-zero term), then the block mask."""
    size, rows = blocks.shape
    spread = (lax.broadcasted_iota(jnp.int32, (rows, size), 1) % rows
              == lax.broadcasted_iota(jnp.int32, (rows, size), 0)).astype(_F32)
    full = lax.dot_general(blocks, spread, (((1,), (0,)), ((), ())), precision=lax.Precision.HIGHEST,
                           preferred_element_type=_F32)
    same = (lax.broadcasted_iota(jnp.int32, (size, size), 0) // rows
            == lax.broadcasted_iota(jnp.int32, (size, size), 1) // rows)
    return jnp.where(same, full, 0.0)


def _scores_launch(q, k, g, *, scale, dense, tuning, interpret, precision):
    """What the split forward's two scores kernels (_score_kernel, _scores_outputs_kernel) share: the diagonal
    blocks' kernel outputs, if it runs (extra inputs), the keyword arguments of the kernel body, and its warps."""
    chunk = q.shape[1]
    diagonal = not dense and tuning.diagonal_kernel and chunk % blk.ROWS == 0
    extra = diagonal_scores(q, k, g, scale=scale, warps=tuning.diagonal_warps, interpret=interpret) if diagonal else ()
    kernel_kw = dict(scale=scale, dense=dense, precision=precision, tile=tuning.intra_tile, fused=tuning.fused_scores,
                     diagonal=diagonal,
                     solve_bf16=tuning.solve_operands == "bf16" and q.dtype in (jnp.bfloat16, jnp.float16))
    return extra, kernel_kw, tuning.intra_warps if dense or diagonal else tuning.pairwise_warps


def _split_intra_forward(q, k, v, g, beta, doc, doc_prev, *, scale, dense, tuning, interpret, precision, store_dtype,
                         save_scores, lean=False):
    """intra_forward as three kernels: scores and solve per chunk, then outputs per (chunk, channel tile)."""
    precision = intra_precision(tuning, precision, q.dtype)
    chunks, chunk, heads, key_dim = q.shape
    value_heads, value_dim = v.shape[2:]
    group = value_heads // heads
    specs = input_specs(chunk, key_dim, value_dim, group)
    square = jax.ShapeDtypeStruct((chunks, value_heads, chunk, chunk), score_dtype(precision))
    lean = lean and key_dim == value_dim
    gated = key_dim == value_dim and tuning.gated_inputs in (("bounded", "both") if dense else ("both",))
    if lean and gated and tuning.fused_outputs:
        return _fused_lean_forward(q, k, v, g, beta, doc, doc_prev, scale=scale, dense=dense, tuning=tuning,
                                   interpret=interpret, precision=precision, store_dtype=store_dtype)
    squares = 2 if lean else 3  # Aqk, (Akk,) T
    out_specs, out_shape = [chunk_tile(chunk, chunk)] * squares, [square] * squares
    extra, kernel_kw, warps = _scores_launch(q, k, g, scale=scale, dense=dense, tuning=tuning, interpret=interpret,
                                             precision=precision)
    if gated:  # then qg, kb, kd [BN, HV, C, K] and d [BN, HV, K]
        out_specs += [chunk_tile(chunk, key_dim)] * 3 + [chunk_vector(key_dim)]
        out_shape += [jax.ShapeDtypeStruct((chunks, value_heads, chunk, key_dim), store_dtype)] * 3 + [
            jax.ShapeDtypeStruct((chunks, value_heads, key_dim), _F32)]
    outs = pl.pallas_call(
        functools.partial(_score_kernel, squares=squares, gated=gated, cumulative=tuning.cumulative_gates,
                          **kernel_kw),
        grid=(chunks, value_heads),
        in_specs=[specs[0], specs[1], specs[3], specs[4], specs[5], specs[6]] + [
            chunk_tile(chunk, blk.ROWS)] * len(extra),
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=compiler_params(warps),
        interpret=interpret,
        name="kda_scores_fwd",
    )(q, k, chunk_cumsum(g, interpret=interpret) if tuning.cumulative_gates else g, beta, doc, doc_prev, *extra)
    (aqk, t), akk = (outs[:2], None) if lean else (outs[0:3:2], outs[1])
    return _split_outputs(q, k, v, g, beta, doc, doc_prev, outs, aqk, akk, t, scale=scale, tuning=tuning,
                          interpret=interpret, precision=precision, store_dtype=store_dtype, save_scores=save_scores,
                          lean=lean, gated=gated, squares=squares)


def _fused_lean_forward(q, k, v, g, beta, doc, doc_prev, *, scale, dense, tuning, interpret, precision, store_dtype):
    """The split inference forward with its outputs in the scores kernel (Tuning.fused_outputs): one kernel after
    the gates' prefix sums, writing w, kd, u, d, Aqk and qg."""
    chunks, chunk, heads, key_dim = q.shape
    value_heads, value_dim = v.shape[2:]
    specs = input_specs(chunk, key_dim, value_dim, value_heads // heads)
    extra, kernel_kw, warps = _scores_launch(q, k, g, scale=scale, dense=dense, tuning=tuning, interpret=interpret,
                                             precision=precision)
    tiles = lambda d: jax.ShapeDtypeStruct((chunks, value_heads, chunk, d), store_dtype)  # noqa: E731
    aqk, qg, kd, d, w, u = pl.pallas_call(
        functools.partial(_scores_outputs_kernel, **kernel_kw),
        grid=(chunks, value_heads),
        in_specs=[specs[0], specs[1], specs[3], specs[4], specs[5], specs[6], specs[2]] + [
            chunk_tile(chunk, blk.ROWS)] * len(extra),
        out_specs=[chunk_tile(chunk, chunk)] + [chunk_tile(chunk, key_dim)] * 2 + [chunk_vector(key_dim)] + [
            chunk_tile(chunk, key_dim), chunk_tile(chunk, value_dim)],
        out_shape=[jax.ShapeDtypeStruct((chunks, value_heads, chunk, chunk), score_dtype(precision))] + [
            tiles(key_dim)] * 2 + [jax.ShapeDtypeStruct((chunks, value_heads, key_dim), _F32), tiles(key_dim),
                                   tiles(value_dim)],
        compiler_params=compiler_params(warps),
        interpret=interpret,
        name="kda_scores_outputs_fwd",
    )(q, k, chunk_cumsum(g, interpret=interpret), beta, doc, doc_prev, v, *extra)
    return w, None, kd, u, None, d, aqk, qg


def _split_outputs(q, k, v, g, beta, doc, doc_prev, outs, aqk, akk, t, *, scale, tuning, interpret, precision,
                   store_dtype, save_scores, lean, gated, squares):
    """The split forward's per-(chunk, channel tile) output kernels, after the scores kernel (outs)."""
    chunks, chunk, heads, key_dim = q.shape
    value_heads, value_dim = v.shape[2:]
    group = value_heads // heads
    tile = output_tile(tuning, key_dim, value_dim)
    qk = pl.BlockSpec((None, chunk, None, tile), lambda n, h, j: (n, 0, h // group, j))
    per_head = pl.BlockSpec((None, chunk, None, tile), lambda n, h, j: (n, 0, h, j))
    rows = pl.BlockSpec((None, chunk, None), lambda n, h, j: (n, 0, h))
    doc_spec = pl.BlockSpec((None, chunk), lambda n, h, j: (n, 0))
    scores = pl.BlockSpec((None, None, chunk, chunk), lambda n, h, j: (n, h, 0, 0))
    out_tile = pl.BlockSpec((None, None, chunk, tile), lambda n, h, j: (n, h, 0, j))
    shape = lambda d: jax.ShapeDtypeStruct((chunks, value_heads, chunk, d), store_dtype)  # noqa: E731
    key_shapes = [shape(key_dim)] * 3 + [jax.ShapeDtypeStruct((chunks, value_heads, key_dim), _F32)]
    key_specs = [out_tile] * 3 + [pl.BlockSpec((None, None, tile), lambda n, h, j: (n, h, j))]
    if gated:
        qg, kb, kd, d = outs[squares:]
        call = functools.partial(pl.pallas_call, grid=(chunks, value_heads, key_dim // tile),
                                 compiler_params=compiler_params(tuning.output_warps), interpret=interpret)
        if lean:
            w, u = call(functools.partial(_gated_lean_outputs_kernel, precision=precision),
                        in_specs=[out_tile, per_head, rows, scores], out_specs=[out_tile] * 2,
                        out_shape=[shape(key_dim)] * 2, name="kda_lean_outputs_fwd")(kb, v, beta, t)
            return w, None, kd, u, None, d, aqk, qg
        w, qp, u, ol = call(functools.partial(_gated_outputs_kernel, precision=precision),
                            in_specs=[out_tile, out_tile, per_head, rows, scores, scores],
                            out_specs=[out_tile] * 4, out_shape=[shape(key_dim)] * 4,
                            name="kda_outputs_fwd")(qg, kb, v, beta, aqk, t)
        return (w, qp, kd, u, ol, d) + ((aqk, akk, t) if save_scores else ())
    if lean:
        w, kd, d, u = pl.pallas_call(
            functools.partial(_lean_outputs_kernel, precision=precision),
            grid=(chunks, value_heads, key_dim // tile),
            in_specs=[qk, per_head, per_head, rows, doc_spec, doc_spec, scores],
            out_specs=[out_tile] * 2 + [key_specs[3], out_tile],
            out_shape=[shape(key_dim)] * 2 + [key_shapes[3], shape(value_dim)],
            compiler_params=compiler_params(tuning.output_warps),
            interpret=interpret,
            name="kda_lean_outputs_fwd",
        )(k, v, g, beta, doc, doc_prev, t)
        return w, None, kd, u, None, d, aqk
    if key_dim == value_dim:
        w, qp, kd, d, u, ol = pl.pallas_call(
            functools.partial(_tile_outputs_kernel, scale=scale, precision=precision),
            grid=(chunks, value_heads, key_dim // tile),
            in_specs=[qk, qk, per_head, per_head, rows, doc_spec, doc_spec, scores, scores],
            out_specs=key_specs + [out_tile] * 2,
            out_shape=key_shapes + [shape(value_dim)] * 2,
            compiler_params=compiler_params(tuning.output_warps),
            interpret=interpret,
            name="kda_outputs_fwd",
        )(q, k, v, g, beta, doc, doc_prev, aqk, t)
        return (w, qp, kd, u, ol, d) + ((aqk, akk, t) if save_scores else ())
    w, qp, kd, d = pl.pallas_call(
        functools.partial(_key_output_kernel, scale=scale, precision=precision),
        grid=(chunks, value_heads, key_dim // tile),
        in_specs=[qk, qk, per_head, rows, doc_spec, doc_spec, scores, scores],
        out_specs=key_specs,
        out_shape=key_shapes,
        compiler_params=compiler_params(tuning.output_warps),
        interpret=interpret,
        name="kda_key_out_fwd",
    )(q, k, g, beta, doc, doc_prev, aqk, t)
    u, ol = pl.pallas_call(
        functools.partial(_value_output_kernel, precision=precision),
        grid=(chunks, value_heads, value_dim // tile),
        in_specs=[per_head, rows, scores, scores],
        out_specs=[out_tile] * 2,
        out_shape=[shape(value_dim)] * 2,
        compiler_params=compiler_params(tuning.output_warps),
        interpret=interpret,
        name="kda_value_out_fwd",
    )(v, beta, aqk, t)
    return (w, qp, kd, u, ol, d) + ((aqk, akk, t) if save_scores else ())


def input_specs(chunk, key_dim, value_dim, group):
    """BlockSpecs of chunked (q, k, v, g, beta, doc, doc_prev) for a grid (B * N, HV)."""
    qk = pl.BlockSpec((None, chunk, None, key_dim), lambda n, h: (n, 0, h // group, 0))
    per_head = lambda d: pl.BlockSpec((None, chunk, None, d), lambda n, h: (n, 0, h, 0))  # noqa: E731
    beta = pl.BlockSpec((None, chunk, None), lambda n, h: (n, 0, h))
    doc = pl.BlockSpec((None, chunk), lambda n, h: (n, 0))
    return [qk, qk, per_head(value_dim), per_head(key_dim), beta, doc, doc]


def chunk_tile(chunk, d):
    """One chunk's tile of a [B * N, HV, C, D] array, grid (B * N, HV)."""
    return pl.BlockSpec((None, None, chunk, d), lambda n, h: (n, h, 0, 0))


def chunk_vector(d):
    """One chunk's row of a [B * N, HV, D] array, grid (B * N, HV)."""
    return pl.BlockSpec((None, None, d), lambda n, h: (n, h, 0))


def intra_forward(q, k, v, g, beta, doc, doc_prev, *, scale, dense, tuning, interpret, precision, store_dtype,
                  save_scores, lean=False):
    """Per-chunk quantities. q, k: [BN, C, H, K]; v: [BN, C, HV, V]; g: [BN, C, HV, K]; beta: [BN, C, HV];
    doc, doc_prev: [BN, C] int32. Returns w, qp, kd: [BN, HV, C, K]; u, ol: [BN, HV, C, V] (store_dtype); d:
    [BN, HV, K] fp32; and if save_scores Aqk, Akk, T = (I + L)^-1: [BN, HV, C, C] fp32. lean (the inference forward,
    Tuning.output_from_scores): qp and ol are None and Aqk follows, then, with Tuning.gated_inputs, qg = Q e^Gamma
    [BN, HV, C, K].
    """
    chunks, chunk, heads, key_dim = q.shape
    value_heads, value_dim = v.shape[2:]
    shape = lambda d, dtype=store_dtype: jax.ShapeDtypeStruct((chunks, value_heads, chunk, d), dtype)  # noqa: E731
    saved = 3 if save_scores else 0
    tile = tuning.intra_tile
    tiled = tile and key_dim % tile == 0 and value_dim % tile == 0
    if tiled and tuning.split_intra:
        return _split_intra_forward(q, k, v, g, beta, doc, doc_prev, scale=scale, dense=dense, tuning=tuning,
                                    interpret=interpret, precision=precision, store_dtype=store_dtype,
                                    save_scores=save_scores, lean=lean)
    precision = intra_precision(tuning, precision, q.dtype)
    if tiled and lean:
        w, kd, u, d, aqk = pl.pallas_call(
            functools.partial(_tiled_lean_kernel, scale=scale, dense=dense, precision=precision, tile=tile),
            grid=(chunks, value_heads),
            in_specs=input_specs(chunk, key_dim, value_dim, value_heads // heads),
            out_specs=[chunk_tile(chunk, key_dim)] * 2 + [chunk_tile(chunk, value_dim), chunk_vector(key_dim),
                                                          chunk_tile(chunk, chunk)],
            out_shape=[shape(key_dim)] * 2 + [shape(value_dim), jax.ShapeDtypeStruct((chunks, value_heads, key_dim),
                                                                                     _F32),
                                              shape(chunk, score_dtype(precision))],
            compiler_params=compiler_params(tuning.intra_warps),
            interpret=interpret,
            name="kda_lean_intra_fwd",
        )(q, k, v, g, beta, doc, doc_prev)
        return w, None, kd, u, None, d, aqk
    if tiled:
        kernel = functools.partial(_tiled_intra_kernel, scale=scale, dense=dense, precision=precision, tile=tile)
    else:
        kernel = functools.partial(_intra_kernel, scale=scale, dense=dense, precision=precision)
    return pl.pallas_call(
        kernel,
        grid=(chunks, value_heads),
        in_specs=input_specs(chunk, key_dim, value_dim, value_heads // heads),
        out_specs=[chunk_tile(chunk, key_dim)] * 3 + [chunk_tile(chunk, value_dim)] * 2 + [chunk_vector(key_dim)] + [
            chunk_tile(chunk, chunk)] * saved,
        out_shape=[shape(key_dim)] * 3 + [shape(value_dim)] * 2 + [
            jax.ShapeDtypeStruct((chunks, value_heads, key_dim), _F32)] + [shape(chunk, _F32)] * saved,
        compiler_params=compiler_params(tuning.intra_warps),
        interpret=interpret,
        name="kda_intra_fwd",
    )(q, k, v, g, beta, doc, doc_prev)
