"""Experiment configuration: frozen dataclasses, validated on construction.

Gin lives only at the edge: every class here is `@gin.configurable`, so a gin file or a
`--gin_param` binding can set any field, but library code receives plain config objects.
Every field is checked when the object is built; an error names the field, the value and
the allowed range.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Sequence

import gin

LAYER_KINDS = ("K", "M")  # K: Kimi Delta Attention, M: gated multi-head latent attention


def _fail(cls: str, field: str, value: Any, allowed: str) -> None:
    raise ValueError(f"{cls}.{field} must be {allowed}, got {value!r}")


def _check_in(cls: str, field: str, value: Any, options: Sequence[Any]) -> None:
    if value not in options:
        _fail(cls, field, value, "one of " + ", ".join(repr(o) for o in options))


def _check_positive(cls: str, **fields: Any) -> None:
    for name, value in fields.items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            _fail(cls, name, value, "a positive integer")


def _check_non_negative(cls: str, **fields: Any) -> None:
    for name, value in fields.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            _fail(cls, name, value, "a non-negative integer")


def _check_range(cls: str, field: str, value: float, lo: float, hi: float,
                 lo_open: bool = False, hi_open: bool = False) -> None:
    ok_lo = value > lo if lo_open else value >= lo
    ok_hi = value < hi if hi_open else value <= hi
    if not (ok_lo and ok_hi):
        _fail(cls, field, value, f"in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}")


@gin.configurable
@dataclasses.dataclass(frozen=True)
class KDAConfig:
    """Kimi Delta Attention layer (DESIGN §3.1)."""

    num_heads: int = 4
    num_v_heads: int | None = None  # grouped value heads; None = num_heads
    head_dim: int = 64
    v_head_dim: int | None = None  # None = head_dim
    conv_width: int = 4
    gate: str = "bounded"  # "bounded": g = g_min·sigmoid(·); "softplus": the unbounded original
    g_min: float = -5.0
    chunk_size: int = 64
    backend: str = "auto"
    # Run the whole layer (projections, convolutions, gates, scan, output) over consecutive sequence pieces of this
    # many tokens, each rematerialised, the state and the convolution's halo carried from one to the next: the
    # backward then holds one piece's buffers instead of T's. None = one pass. A multiple of chunk_size; exact.
    # Not used under context parallelism, where each sequence shard is already a piece of the row.
    seq_chunk: int | None = None

    def __post_init__(self):
        name = "KDAConfig"
        _check_positive(name, num_heads=self.num_heads, head_dim=self.head_dim,
                        conv_width=self.conv_width, chunk_size=self.chunk_size)
        if self.num_v_heads is not None:
            _check_positive(name, num_v_heads=self.num_v_heads)
            if self.num_v_heads % self.num_heads:
                _fail(name, "num_v_heads", self.num_v_heads,
                      f"a multiple of num_heads={self.num_heads}")
        if self.v_head_dim is not None:
            _check_positive(name, v_head_dim=self.v_head_dim)
        _check_in(name, "gate", self.gate, ("bounded", "softplus"))
        _check_range(name, "g_min", self.g_min, -20.0, 0.0, hi_open=True)
        if self.chunk_size % 16:
            _fail(name, "chunk_size", self.chunk_size, "a positive multiple of 16")
        if self.seq_chunk is not None and (self.seq_chunk <= 0 or self.seq_chunk % self.chunk_size):
            _fail(name, "seq_chunk", self.seq_chunk, f"None or a positive multiple of chunk_size={self.chunk_size}")
        _check_in(name, "backend", self.backend, ("auto", "reference", "xla", "pallas", "interpret", "pallas_tpu",
                                                  "interpret_tpu"))

    @property
    def value_heads(self) -> int:
        return self.num_v_heads or self.num_heads

    @property
    def value_dim(self) -> int:
        return self.v_head_dim or self.head_dim

    @property
    def bound(self) -> float | None:
        """The decay bound promised to the kernel: g_min for the bounded gate, else None."""
        return self.g_min if self.gate == "bounded" else None


@gin.configurable
@dataclasses.dataclass(frozen=True)
class MLAConfig:
    """Gated multi-head latent attention (DESIGN §3.2). q_lora_rank=0 means no q compression."""

    num_heads: int = 4
    q_lora_rank: int = 0
    kv_lora_rank: int = 64
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16
    v_head_dim: int = 32
    use_rope: bool = False  # NoPE by default: KDA layers carry position
    rope_base: float = 10000.0
    output_gate: bool = True
    # "xla" (reference), "cudnn" (GPU), "pallas" (TPU: splash to 64K tokens, index-masked flash beyond),
    # "pallas_flash" (TPU, index-masked flash at any length); "*_interpret": Pallas' TPU interpreter
    backend: str = "xla"
    # cudnn backend: documents per row it can express (rows with more come back NaN). cuDNN's packed
    # backward keeps a workspace per segment slot, about 6 KiB per token and slot at 8 heads x 192:
    # 256 slots are 1.5 MiB per token, so long single-document stages want a handful.
    max_segments: int = 256

    def __post_init__(self):
        name = "MLAConfig"
        _check_positive(name, num_heads=self.num_heads, kv_lora_rank=self.kv_lora_rank,
                        qk_nope_head_dim=self.qk_nope_head_dim, v_head_dim=self.v_head_dim)
        _check_non_negative(name, q_lora_rank=self.q_lora_rank, qk_rope_head_dim=self.qk_rope_head_dim)
        if self.rope_base <= 1.0:
            _fail(name, "rope_base", self.rope_base, "> 1")
        if self.use_rope and self.qk_rope_head_dim % 2:
            _fail(name, "qk_rope_head_dim", self.qk_rope_head_dim, "even when use_rope=True")
        _check_in(name, "backend", self.backend, ("xla", "cudnn", "pallas", "pallas_interpret",
                                                        "pallas_flash", "pallas_flash_interpret"))
        _check_positive(name, max_segments=self.max_segments)


@gin.configurable
@dataclasses.dataclass(frozen=True)
class RouterConfig:
    """Router choice and its options (DESIGN §3.3); options unused by a router are ignored by it."""

    name: str = "bias_sign"
    alpha: float = 1e-2  # softmax_topk_aux: auxiliary-loss coefficient
    gamma: float = 1e-3  # bias_sign: bias step
    window: int = 4  # quantile / expert_threshold: statistics window in steps
    rate: float = 1.0  # quantile: EMA blend of the new bias (1 = exact rule)
    stats: str = "exact"  # quantile: "exact" ring buffer or "histogram"
    bins: int = 256  # quantile histogram bins
    k_max: int = 0  # expert_threshold: cap on experts per token (0 = 2·top_k)

    def __post_init__(self):
        name = "RouterConfig"
        _check_in(name, "name", self.name,
                  ("softmax_topk_aux", "bias_sign", "quantile", "expert_threshold"))
        _check_range(name, "alpha", self.alpha, 0.0, 1.0)
        _check_range(name, "gamma", self.gamma, 0.0, 1.0)
        _check_positive(name, window=self.window, bins=self.bins)
        _check_range(name, "rate", self.rate, 0.0, 1.0, lo_open=True)
        _check_in(name, "stats", self.stats, ("exact", "histogram"))
        _check_non_negative(name, k_max=self.k_max)

    def options(self) -> dict[str, Any]:
        """Keyword options for `routing.make_router`, only those the chosen router takes."""
        by_router = {
            "softmax_topk_aux": {"alpha": self.alpha},
            "bias_sign": {"gamma": self.gamma},
            "quantile": {"window": self.window, "rate": self.rate, "stats": self.stats,
                         "bins": self.bins},
            "expert_threshold": {"window": self.window,
                                 **({"k_max": self.k_max} if self.k_max else {})},
        }
        return by_router[self.name]


@gin.configurable
@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Mixture-of-experts feed-forward (DESIGN §3.3)."""

    num_experts: int = 8
    top_k: int = 2
    num_shared_experts: int = 1
    expert_width: int = 256
    activation: str = "swiglu"  # or "situ": β₁tanh(g/β₁)σ(g) · β₂tanh(u/β₂)
    score_fn: str = "sigmoid"
    routed_scaling: float = 1.0
    capacity_factor: float = 1.25  # capacity dispatch: slots per expert = ceil(cf · N · k / E)
    dispatch: str = "capacity"
    # dropless only: run the expert dispatch over chunks of this many tokens, each rematerialised, so
    # the dispatch's buffers (token copies, expert activations) scale with the chunk, not with B·T;
    # 0 runs all tokens at once. Routing and its statistics always see every token.
    dispatch_chunk: int = 0
    first_k_dense: int = 0  # the first k layers use a dense FFN of width dense_width
    dense_width: int = 1024
    latent_dim: int = 0  # 0: experts work at d_model; >0: down-project, experts, norm, up-project

    def __post_init__(self):
        name = "MoEConfig"
        _check_positive(name, num_experts=self.num_experts, top_k=self.top_k,
                        expert_width=self.expert_width, dense_width=self.dense_width)
        _check_non_negative(name, num_shared_experts=self.num_shared_experts,
                            first_k_dense=self.first_k_dense, latent_dim=self.latent_dim)
        if self.top_k > self.num_experts:
            _fail(name, "top_k", self.top_k, f"in [1, num_experts={self.num_experts}]")
        _check_in(name, "activation", self.activation, ("swiglu", "situ"))
        _check_in(name, "score_fn", self.score_fn, ("sigmoid", "softmax"))
        _check_range(name, "routed_scaling", self.routed_scaling, 0.0, 100.0, lo_open=True)
        _check_range(name, "capacity_factor", self.capacity_factor, 0.0, 1e6, lo_open=True)
        _check_in(name, "dispatch", self.dispatch, ("capacity", "dropless"))
        _check_non_negative(name, dispatch_chunk=self.dispatch_chunk)
        if self.dispatch_chunk and self.dispatch != "dropless":
            _fail(name, "dispatch_chunk", self.dispatch_chunk,
                  "0 unless dispatch='dropless' (capacity slots are assigned over all tokens at once)")


@gin.configurable
@dataclasses.dataclass(frozen=True)
class AttnResConfig:
    """Residual mode between sublayers (DESIGN §3.4)."""

    mode: str = "none"  # "none": pre-norm residual; "block": Block AttnRes; "full": every output a source
    block_size: int = 4  # layers per block in "block" mode
    final: str = "attn_res"  # final hidden state: a last AttnRes mix, or the running "stream"

    def __post_init__(self):
        name = "AttnResConfig"
        _check_in(name, "mode", self.mode, ("none", "block", "full"))
        _check_positive(name, block_size=self.block_size)
        _check_in(name, "final", self.final, ("attn_res", "stream"))


@gin.configurable
@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The hybrid language model (DESIGN §3.5)."""

    vocab_size: int = 259  # 256 bytes + BOS, EOS, PAD
    d_model: int = 256
    num_layers: int = 4
    layer_pattern: str = "KKKM"  # repeated to num_layers
    last_layer_mla: bool = True  # force the final layer to MLA (the published layouts end on one)
    kda: KDAConfig = dataclasses.field(default_factory=KDAConfig)
    mla: MLAConfig = dataclasses.field(default_factory=MLAConfig)
    moe: MoEConfig = dataclasses.field(default_factory=MoEConfig)
    router: RouterConfig = dataclasses.field(default_factory=RouterConfig)
    attn_res: AttnResConfig = dataclasses.field(default_factory=AttnResConfig)
    tie_embeddings: bool = False
    norm_eps: float = 1e-6
    dtype: str = "bfloat16"  # activation / compute dtype
    param_dtype: str = "float32"
    # "none"; "full": rematerialise each attention sublayer in the backward pass; "all": the FFN/MoE
    # sublayers too (long context, where the expert buffers of every layer would not fit); "group"
    # (scan_layers only): "all" inside each scanned group, and the group itself rematerialised, so
    # the backward pass keeps one [B, T, d] input per group instead of one per sublayer.
    remat: str = "none"
    # Run the layers as a scan over groups of `layer_pattern` (parameters stacked on a leading axis,
    # under "layers"): one group is compiled, and its backward buffers are reused by every group
    # (on the CPU, unrolled remat'd KDA layers grow ~38 KiB per token per layer; scanned, flat —
    # benchmarks/notes_long_context.md). Needs AttnRes mode "none", no dense first layers and
    # num_layers a multiple of the pattern (with last_layer_mla, a pattern that ends in M).
    scan_layers: bool = False

    def __post_init__(self):
        name = "ModelConfig"
        _check_positive(name, vocab_size=self.vocab_size, d_model=self.d_model,
                        num_layers=self.num_layers)
        bad = sorted(set(self.layer_pattern) - set(LAYER_KINDS))
        if not self.layer_pattern or bad:
            _fail(name, "layer_pattern", self.layer_pattern,
                  "a non-empty string of letters in {K, M}")
        _check_in(name, "dtype", self.dtype, ("bfloat16", "float32"))
        _check_in(name, "param_dtype", self.param_dtype, ("bfloat16", "float32"))
        _check_in(name, "remat", self.remat, ("none", "full", "all", "group"))
        if self.remat == "group" and not self.scan_layers:
            _fail(name, "remat", self.remat, "'none', 'full' or 'all' unless scan_layers=True")
        _check_range(name, "norm_eps", self.norm_eps, 0.0, 1e-2, lo_open=True)
        if self.moe.first_k_dense > self.num_layers:
            _fail("MoEConfig", "first_k_dense", self.moe.first_k_dense,
                  f"in [0, num_layers={self.num_layers}]")
        if self.scan_layers:
            groups = self.num_layers // len(self.layer_pattern)
            if self.attn_res.mode != "none":
                _fail("AttnResConfig", "mode", self.attn_res.mode,
                      '"none" with ModelConfig.scan_layers=True (residual sources differ per layer)')
            if self.moe.first_k_dense:
                _fail("MoEConfig", "first_k_dense", self.moe.first_k_dense,
                      "0 with ModelConfig.scan_layers=True (every group must be alike)")
            if self.layer_kinds != self.layer_pattern * groups:
                _fail(name, "num_layers", self.num_layers,
                      f"a multiple of len(layer_pattern)={len(self.layer_pattern)} with scan_layers=True, "
                      f"and layer_pattern={self.layer_pattern!r} ending in M when last_layer_mla=True")

    @property
    def layer_kinds(self) -> str:
        """One letter per layer: the pattern repeated and cut to num_layers."""
        reps = -(-self.num_layers // len(self.layer_pattern))
        kinds = (self.layer_pattern * reps)[: self.num_layers]
        if self.last_layer_mla:
            kinds = kinds[:-1] + "M"
        return kinds


@gin.configurable
@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Training data. source="stdlib": the running Python's own standard library, byte tokens."""

    source: str = "stdlib"  # or "array_record": shards written by experiments.prepare_data
    path: str = ""  # array_record: directory of shards
    seq_len: int = 512
    batch_size: int = 8
    seed: int = 0
    validation_fraction: float = 0.05
    skip_bad_records: bool = False
    tokenizer: str = "bytes"  # "bytes" or the path of a `tokenizers` JSON file

    def __post_init__(self):
        name = "DataConfig"
        _check_in(name, "source", self.source, ("stdlib", "array_record"))
        if self.source == "array_record" and not self.path:
            _fail(name, "path", self.path, "a directory of ArrayRecord shards when source='array_record'")
        _check_positive(name, seq_len=self.seq_len, batch_size=self.batch_size)
        _check_range(name, "validation_fraction", self.validation_fraction, 0.0, 0.5, lo_open=True)


ADVANCE_RULES = ("never", "plateau")
# The synthetic retrieval tasks a stage can train on: hybridmoe.eval.long_context.TASKS' names
# (tests/data/test_retrieval_rows.py checks that the two lists agree).
RETRIEVAL_TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "variable_tracking",
                   "associative_recall")


@gin.configurable
@dataclasses.dataclass(frozen=True)
class StageConfig:
    """One stage of a context-length curriculum (DESIGN §3.6); `TrainConfig.stages` runs them in order.

    Rows per step: an explicit `batch_size` (rows per process, as DataConfig.batch_size), else
    `tokens_per_step` (global) / seq_len / processes, where tokens_per_step=0 means the base
    config's DataConfig.batch_size × processes × DataConfig.seq_len: by default every stage trains
    on as many tokens per step as the base config, in fewer, longer rows. Set at most one of the two.

    `long_doc_share` of each batch's rows are whole windows of a single document at least
    seq_len + 1 tokens long, the rest rows of the packed stream (hybridmoe/data/pipeline.py).
    `retrieval_share` of each batch's rows are synthetic retrieval rows (hybridmoe/data/retrieval.py):
    the long-context evaluator's needles and query (one of `retrieval_tasks`, at a random depth)
    in a haystack of train-split documents, followed by the answer, so the LM loss teaches copying;
    the answer's targets weigh `retrieval_answer_weight` in the loss (a few targets among a row's
    seq_len otherwise carry almost none of it; the training loss is then a weighted mean, the
    validation loss stays plain text).
    long_doc_share + retrieval_share is at most 1; the rest are rows of the packed stream.
    `eval_lengths` are the context lengths the long-context evaluator scores after this stage.
    `advance_if="plateau"` ends the stage before `steps` once `patience` validations in a row
    have not beaten the stage's best validation loss by more than `min_delta`.
    """

    seq_len: int = 512
    steps: int = 100
    batch_size: int = 0  # rows per process; 0: from tokens_per_step
    tokens_per_step: int = 0  # global; 0: the base config's (see above)
    long_doc_share: float = 0.0
    retrieval_share: float = 0.0
    retrieval_tasks: tuple[str, ...] = RETRIEVAL_TASKS
    retrieval_answer_weight: float = 1.0
    eval_lengths: tuple[int, ...] = ()
    advance_if: str = "never"  # or "plateau"
    patience: int = 3  # plateau: validations without progress before the stage ends
    min_delta: float = 0.0  # plateau: the least loss decrease (nats) that counts as progress

    def __post_init__(self):
        name = "StageConfig"
        _check_positive(name, seq_len=self.seq_len, steps=self.steps, patience=self.patience)
        _check_non_negative(name, batch_size=self.batch_size, tokens_per_step=self.tokens_per_step)
        if self.batch_size and self.tokens_per_step:
            _fail(name, "tokens_per_step", self.tokens_per_step,
                  f"0 when batch_size is set (batch_size={self.batch_size}): set one of the two")
        if self.tokens_per_step % self.seq_len:
            _fail(name, "tokens_per_step", self.tokens_per_step,
                  f"a multiple of seq_len={self.seq_len} (whole rows per step)")
        _check_range(name, "long_doc_share", self.long_doc_share, 0.0, 1.0)
        _check_range(name, "retrieval_share", self.retrieval_share, 0.0, 1.0)
        if self.long_doc_share + self.retrieval_share > 1.0:
            _fail(name, "retrieval_share", self.retrieval_share,
                  f"at most 1 - long_doc_share = {1.0 - self.long_doc_share:g} (the two shares "
                  f"split one batch)")
        _check_range(name, "retrieval_answer_weight", self.retrieval_answer_weight, 0.0, 1e6,
                     lo_open=True)
        object.__setattr__(self, "retrieval_tasks", tuple(self.retrieval_tasks))
        if not self.retrieval_tasks or len(set(self.retrieval_tasks)) != len(self.retrieval_tasks):
            _fail(name, "retrieval_tasks", self.retrieval_tasks, "a non-empty tuple without repeats")
        for task in self.retrieval_tasks:
            _check_in(name, "retrieval_tasks", task, RETRIEVAL_TASKS)
        object.__setattr__(self, "eval_lengths", tuple(self.eval_lengths))  # gin gives lists
        if not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in self.eval_lengths):
            _fail(name, "eval_lengths", self.eval_lengths, "a tuple of positive integers")
        _check_in(name, "advance_if", self.advance_if, ADVANCE_RULES)
        _check_range(name, "min_delta", self.min_delta, 0.0, 1e6)

    def rows_per_process(self, data: DataConfig, processes: int) -> int:
        """This stage's batch size per process (see the class docstring), checked to be whole."""
        if self.batch_size:
            return self.batch_size
        tokens = self.tokens_per_step or data.batch_size * processes * data.seq_len
        rows, rest = divmod(tokens, self.seq_len * processes)
        if rest or rows < 1:
            source = (f"{self.tokens_per_step}" if self.tokens_per_step else
                      f"0 (the base DataConfig.batch_size={data.batch_size} × {processes} processes × "
                      f"DataConfig.seq_len={data.seq_len} = {tokens} tokens)")
            raise ValueError(
                f"StageConfig.tokens_per_step must give a whole number ≥ 1 of rows of "
                f"seq_len={self.seq_len} for each of {processes} processes, got {source}; "
                f"set StageConfig.batch_size or a multiple of {self.seq_len * processes}")
        return rows


@gin.configurable
@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Optimisation, checkpointing and logging.

    `stages`: a context-length curriculum run in order by one `train` call (StageConfig); empty:
    one stage of DataConfig.seq_len × DataConfig.batch_size for `steps` steps. With stages,
    `steps` must be their total: it is the length of the learning-rate schedule, which spans the
    whole curriculum (a stage that ends early on a plateau shortens the run, not the schedule).
    """

    steps: int = 600
    optimizer: str = "adamw"  # or "muon" (embeddings, norms, gate biases stay on AdamW)
    learning_rate: float = 3e-3
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    grad_clip: float = 1.0
    grad_accum: int = 1
    seed: int = 0
    on_nonfinite: str = "skip"  # "skip" the step (counted) or "stop"
    checkpoint_every: int = 100
    keep_checkpoints: int = 3
    eval_every: int = 100
    eval_batches: int = 8
    log_every: int = 10
    peak_tflops: float = 0.0  # 0: measure-free default per platform (see metrics.peak_flops)
    stages: tuple[StageConfig, ...] = ()

    def __post_init__(self):
        name = "TrainConfig"
        _check_positive(name, steps=self.steps, grad_accum=self.grad_accum,
                        checkpoint_every=self.checkpoint_every, keep_checkpoints=self.keep_checkpoints,
                        eval_every=self.eval_every, eval_batches=self.eval_batches,
                        log_every=self.log_every)
        _check_non_negative(name, warmup_steps=self.warmup_steps)
        _check_in(name, "optimizer", self.optimizer, ("adamw", "muon"))
        _check_range(name, "learning_rate", self.learning_rate, 0.0, 1.0, lo_open=True)
        _check_range(name, "min_lr_ratio", self.min_lr_ratio, 0.0, 1.0)
        _check_range(name, "weight_decay", self.weight_decay, 0.0, 1.0)
        _check_range(name, "b1", self.b1, 0.0, 1.0, hi_open=True)
        _check_range(name, "b2", self.b2, 0.0, 1.0, hi_open=True)
        _check_range(name, "grad_clip", self.grad_clip, 0.0, 1e6)
        _check_in(name, "on_nonfinite", self.on_nonfinite, ("skip", "stop"))
        _check_range(name, "peak_tflops", self.peak_tflops, 0.0, 1e6)
        self._check_stages()

    def _check_stages(self) -> None:
        object.__setattr__(self, "stages", tuple(self.stages))  # frozen and hashable: gin gives lists
        for stage in self.stages:
            if not isinstance(stage, StageConfig):
                _fail("TrainConfig", "stages", stage, "a tuple of StageConfig")
        total = sum(stage.steps for stage in self.stages)
        if self.stages and self.steps != total:
            _fail("TrainConfig", "steps", self.steps,
                  f"the stages' total {total} when stages are set (the learning-rate schedule's length)")


MESH_AXES = ("data", "fsdp", "expert", "tensor", "sequence")

# Logical axis name -> mesh axes (DESIGN §3.5, §3.7). Flax semantics: rules are tried in order and a rule
# applies only if its mesh axes are still free in that array; a name may appear twice as a fallback.
# "batch"/"length" are the activation axes (tokens); the rest name parameter dimensions. Dense weights are
# FSDP-sharded over fsdp × expert (the expert axis holds a data shard of the batch too); expert stacks
# [E, d, F] take `expert` for E first, so their d falls back to fsdp alone.
DEFAULT_RULES = (
    ("batch", ("data", "fsdp", "expert")),
    ("length", "sequence"),
    ("vocab", "tensor"),
    ("expert", "expert"),
    ("embed", ("fsdp", "expert")),
    ("embed", "fsdp"),
    ("latent", "fsdp"),
    ("heads", "tensor"),
    ("heads_x_dim", "tensor"),
    ("mlp", "tensor"),
    ("q_lora", None),
    ("kv_lora", None),
    ("head_dim", None),
    ("conv", None),
    ("norm", None),
)


def _check_rules(rules: Any) -> None:
    ok_rule = lambda r: (isinstance(r, (tuple, list)) and len(r) == 2 and isinstance(r[0], str)
                         and (r[1] is None or r[1] in MESH_AXES
                              or (isinstance(r[1], (tuple, list))
                                  and all(a in MESH_AXES for a in r[1]))))
    if not isinstance(rules, (tuple, list)):
        _fail("MeshConfig", "rules", rules, "a tuple of (logical name, mesh axes) pairs")
    for rule in rules:
        if not ok_rule(rule):
            _fail("MeshConfig", "rules", rule,
                  f"a pair (logical name, None | mesh axis | tuple of mesh axes) with mesh axes in "
                  f"{MESH_AXES}")


@gin.configurable
@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Named device mesh; one axis may be -1 for "all remaining devices"; `rules` map logical axes to it."""

    data: int = -1
    fsdp: int = 1
    expert: int = 1
    tensor: int = 1
    sequence: int = 1
    rules: tuple = DEFAULT_RULES

    def __post_init__(self):
        sizes = self.sizes()
        for axis, size in sizes.items():
            if not isinstance(size, int) or (size <= 0 and size != -1):
                _fail("MeshConfig", axis, size, "a positive integer or -1")
        if list(sizes.values()).count(-1) > 1:
            _fail("MeshConfig", "-1 axes", [a for a, s in sizes.items() if s == -1], "at most one")
        _check_rules(self.rules)
        # Frozen and hashable (it keys compiled-step caches): lists from gin become tuples.
        object.__setattr__(self, "rules", tuple(
            (name, tuple(axes) if isinstance(axes, list) else axes) for name, axes in self.rules))

    def sizes(self) -> dict[str, int]:
        return {axis: getattr(self, axis) for axis in MESH_AXES}

    def resolve(self, num_devices: int) -> dict[str, int]:
        """Axis sizes with the -1 axis filled in; their product must equal num_devices."""
        sizes = self.sizes()
        known = math.prod(s for s in sizes.values() if s != -1)
        spelled = " × ".join(f"{a}={s}" for a, s in sizes.items())
        for axis, size in sizes.items():
            if size == -1:
                if num_devices % known:
                    _fail("MeshConfig", axis, -1, f"resolvable: {num_devices} devices are not a "
                          f"multiple of the other axes' product {known} ({spelled})")
                sizes[axis] = num_devices // known
        if math.prod(sizes.values()) != num_devices:
            _fail("MeshConfig", "sizes", spelled,
                  f"axis sizes whose product equals the device count {num_devices}")
        return sizes


@gin.configurable
@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)


def load_config(gin_files: Sequence[str], bindings: Sequence[str] = ()) -> ExperimentConfig:
    """Parses gin files and bindings (in that order) and builds the experiment config."""
    return load_config_and_text(gin_files, bindings)[0]


def _config_root(path: str) -> str:
    """Gin files include each other as 'configs/x.gin': the directory that holds configs/."""
    parts = path.split(os.sep)
    if "configs" in parts[:-1]:
        last = len(parts) - 2 - parts[-2::-1].index("configs")
        return os.sep.join(parts[:last]) or os.sep
    return os.getcwd()


def load_config_and_text(gin_files: Sequence[str],
                         bindings: Sequence[str] = ()) -> tuple[ExperimentConfig, str]:
    """The experiment config and the full gin text it was built from.

    Gin's global bindings are cleared before and after, even on error: gin-configurable classes
    built later (by library code, tests, notebooks) never see a previous experiment's bindings.
    """
    gin.clear_config()
    paths = [os.path.abspath(p) for p in gin_files]
    root = _config_root(paths[0]) if paths else os.getcwd()
    previous = os.getcwd()
    os.chdir(root)
    try:
        gin.parse_config_files_and_bindings(paths, list(bindings))
        config = ExperimentConfig()
        return config, gin.config_str()
    finally:
        os.chdir(previous)
        gin.clear_config()
