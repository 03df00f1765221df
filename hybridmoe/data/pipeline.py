"""The training-data pipeline: grain datasets of packed rows, eval batches and the unigram baseline.

Batches are dicts of numpy arrays, [B, T] each (B = DataConfig.batch_size per process,
T = DataConfig.seq_len):
  tokens       int32    inputs
  targets      int32    tokens shifted by one (the next token of the stream)
  segment_ids  int32    documents numbered from 1 inside each row, 0 = padding
  loss_mask    float32  1 where the target belongs to its input's document, else 0
"""

from __future__ import annotations

import functools
import hashlib

import grain
import numpy as np

from hybridmoe.config import RETRIEVAL_TASKS, DataConfig
from hybridmoe.data.corpus import Corpus, load_corpus
from hybridmoe.data.packing import long_document_windows, num_rows, pack_rows, pack_windows
from hybridmoe.data.retrieval import (RETRIEVAL_MARK, check_tasks, pack_retrieval_rows,
                                      train_haystack)

# Rows are packed per batch with vectorised numpy: two threads keep up with an accelerator, and a
# short buffer bounds host memory at large batch sizes.
READ_OPTIONS = grain.ReadOptions(num_threads=2, prefetch_buffer_size=4)


def _check_shard(shard_index: int, shard_count: int) -> None:
    if not isinstance(shard_count, int) or shard_count <= 0:
        raise ValueError(f"shard_count must be a positive integer, got {shard_count!r}")
    if not isinstance(shard_index, int) or not 0 <= shard_index < shard_count:
        raise ValueError(f"shard_index must be in [0, shard_count={shard_count}), "
                         f"got {shard_index!r}")


def _shuffle_seed(seed: int, stream: str) -> int:
    # grain shuffles epoch e with seed + e; hashing keeps runs with nearby seeds from sharing
    # permutations one epoch apart (and the long-window stream from sharing the rows' order).
    return int.from_bytes(hashlib.sha256(f"{stream}:{seed}".encode()).digest()[:4], "big")


def _shuffled_forever(items: grain.MapDataset, seed: int, stream: str) -> grain.MapDataset:
    return items.shuffle(seed=_shuffle_seed(seed, stream)).repeat()


def _long_windows(corpus: Corpus, config: DataConfig, shard_index: int, shard_count: int,
                  share: float) -> grain.MapDataset:
    """This shard's long-document windows (packing.long_document_windows), shuffled, forever."""
    windows = long_document_windows(corpus, config.seq_len)
    if len(windows) < shard_count:
        raise ValueError(f"StageConfig.long_doc_share={share} needs train documents of at least "
                         f"seq_len + 1 = {config.seq_len + 1} tokens, one window per process: the "
                         f"train split has {len(windows)} windows for {shard_count} processes; "
                         f"lower long_doc_share or seq_len")
    ds = grain.MapDataset.source(windows)[shard_index::shard_count]
    return _shuffled_forever(ds, config.seed, "long-windows")


def _retrieval_items(shard_index: int, shard_count: int) -> grain.MapDataset:
    """This shard's retrieval rows k ≡ shard_index (mod shard_count), in order, as items
    RETRIEVAL_MARK - k (never exhausted in practice: 2^40 rows)."""
    ks = grain.MapDataset.range(shard_index, 2 ** 40, shard_count)
    return ks.map(lambda k: RETRIEVAL_MARK - k)


def train_row_starts(config: DataConfig, corpus: Corpus, *, long_doc_share: float = 0.0,
                     retrieval_share: float = 0.0, shard_index: int = 0,
                     shard_count: int = 1) -> grain.MapDataset:
    """Infinite MapDataset of the stream positions where this shard's train rows start.

    Rows of the packed stream start at r·T for r ≡ shard_index (mod shard_count); each epoch
    visits every one once, in an order drawn from DataConfig.seed and the epoch number. With
    `long_doc_share` > 0 (a curriculum stage's mixture), exactly that share of positions, at a
    fixed rhythm, are instead windows inside single long documents, drawn the same way. With
    `retrieval_share` > 0, that share of items are synthetic retrieval rows instead
    (hybridmoe/data/retrieval.py): item RETRIEVAL_MARK - k (≤ -2) is retrieval row k, this
    shard's rows k ≡ shard_index (mod shard_count) taken in order.
    """
    _check_shard(shard_index, shard_count)
    if long_doc_share + retrieval_share > 1.0:
        raise ValueError(f"StageConfig.retrieval_share must be at most 1 - long_doc_share = "
                         f"{1.0 - long_doc_share:g}, got {retrieval_share!r}")
    rows = num_rows(corpus.num_tokens, config.seq_len)
    if rows < shard_count:
        raise ValueError(f"DataConfig.seq_len={config.seq_len} gives the train split only {rows} "
                         f"rows, fewer than shard_count={shard_count}: lower seq_len or add data")
    parts, weights = [], []
    packed_share = 1.0 - long_doc_share - retrieval_share
    if packed_share > 0.0:
        starts = grain.MapDataset.range(0, rows * config.seq_len, config.seq_len)
        parts.append(_shuffled_forever(starts[shard_index::shard_count], config.seed, "train-rows"))
        weights.append(packed_share)
    if long_doc_share > 0.0:
        parts.append(_long_windows(corpus, config, shard_index, shard_count, long_doc_share))
        weights.append(long_doc_share)
    if retrieval_share > 0.0:
        parts.append(_retrieval_items(shard_index, shard_count))
        weights.append(retrieval_share)
    return parts[0] if len(parts) == 1 else grain.MapDataset.mix(parts, weights)


def _pack_mixed(corpus: Corpus, items: np.ndarray, *, config: DataConfig,
                retrieval_tasks: tuple[str, ...], answer_weight: float = 1.0
                ) -> dict[str, np.ndarray]:
    """A batch of train_row_starts items: stream windows, and retrieval rows in their slots."""
    items = np.asarray(items, np.int64)
    is_retrieval = items <= RETRIEVAL_MARK
    batch = pack_windows(corpus, np.where(is_retrieval, -1, items), config.seq_len)
    if is_retrieval.any():
        synthetic = pack_retrieval_rows(train_haystack(config), retrieval_tasks,
                                        RETRIEVAL_MARK - items[is_retrieval], config.seq_len,
                                        config.seed, answer_weight)
        for key, value in synthetic.items():
            batch[key][is_retrieval] = value
    return batch


def train_dataset(config: DataConfig, *, long_doc_share: float = 0.0,
                  retrieval_share: float = 0.0, retrieval_tasks=RETRIEVAL_TASKS,
                  retrieval_answer_weight: float = 1.0, shard_index: int = 0,
                  shard_count: int = 1) -> grain.MapDataset:
    """Infinite MapDataset of train batches packed from `train_row_starts`; a batch may straddle
    two epochs. The answer targets of retrieval rows weigh `retrieval_answer_weight` in loss_mask."""
    if not retrieval_answer_weight > 0.0:
        raise ValueError(f"retrieval_answer_weight must be positive, got {retrieval_answer_weight!r}")
    corpus = load_corpus(config, "train")
    ds = train_row_starts(config, corpus, long_doc_share=long_doc_share,
                          retrieval_share=retrieval_share, shard_index=shard_index,
                          shard_count=shard_count)
    ds = ds.batch(config.batch_size, drop_remainder=True)
    if retrieval_share > 0.0:
        return ds.map(functools.partial(_pack_mixed, corpus, config=config,
                                        retrieval_tasks=check_tasks(retrieval_tasks),
                                        answer_weight=float(retrieval_answer_weight)))
    return ds.map(functools.partial(pack_windows, corpus, seq_len=config.seq_len))


def make_train_iterator(config: DataConfig, *, long_doc_share: float = 0.0,
                        retrieval_share: float = 0.0, retrieval_tasks=RETRIEVAL_TASKS,
                        retrieval_answer_weight: float = 1.0, shard_index: int = 0,
                        shard_count: int = 1) -> grain.DatasetIterator:
    """Iterator over train batches; `get_state()` / `set_state()` save and restore its position.

    The state is a small JSON-able dict (the next batch index): store it with the checkpoint
    (grain.checkpoint.CheckpointSave / CheckpointRestore for Orbax). Retrieval rows are a
    function of (DataConfig.seed, row number), so they resume with it.
    """
    ds = train_dataset(config, long_doc_share=long_doc_share, retrieval_share=retrieval_share,
                       retrieval_tasks=retrieval_tasks,
                       retrieval_answer_weight=retrieval_answer_weight, shard_index=shard_index,
                       shard_count=shard_count)
    return iter(ds.to_iter_dataset(READ_OPTIONS))


def make_eval_batches(config: DataConfig, num_batches: int, *, shard_index: int = 0,
                      shard_count: int = 1) -> list[dict[str, np.ndarray]]:
    """A fixed list of validation batches, the same for every seed and run.

    Rows are spread evenly over the validation stream (so over all its documents). A small
    split gives fewer than `num_batches` batches (never a repeated row): the last one is filled
    with empty rows whose loss_mask is 0. Every process gets the same number of batches.
    """
    if not isinstance(num_batches, int) or num_batches <= 0:
        raise ValueError(f"num_batches must be a positive integer, got {num_batches!r}")
    _check_shard(shard_index, shard_count)
    corpus = load_corpus(config, "validation")
    rows = num_rows(corpus.num_tokens, config.seq_len)
    per_step = config.batch_size * shard_count
    steps = min(num_batches, -(-rows // per_step))
    used = min(steps * per_step, rows)
    chosen = np.full(steps * per_step, -1, np.int64)
    chosen[:used] = np.arange(used) * rows // used  # distinct, evenly spaced
    mine = chosen.reshape(steps, shard_count, config.batch_size)[:, shard_index]
    return [pack_rows(corpus, r, config.seq_len) for r in mine]


def unigram_bits_per_byte(config: DataConfig) -> float:
    """Bits per byte of a unigram byte model fit on train, scored on validation.

    The model predicts what the LM predicts: the documents' bytes and one EOS per document
    (add-one smoothing over 257 symbols); the total is divided by the validation text bytes,
    as the LM's bits-per-byte is. A trained model must beat this.
    """
    train, val = load_corpus(config, "train"), load_corpus(config, "validation")
    counts = np.append(train.byte_counts, train.num_documents) + 1.0
    log2_p = np.log2(counts / counts.sum())
    val_counts = np.append(val.byte_counts, val.num_documents)
    return float(-(val_counts * log2_p).sum() / val.num_bytes)


def bytes_per_token(config: DataConfig, split: str = "validation") -> float:
    """UTF-8 text bytes per loss-carrying target (text tokens and EOS) of a split.

    bits_per_byte = loss_nats_per_token / ln 2 / bytes_per_token; for byte tokens it is just
    under 1 (each document's EOS is a target but not a byte).
    """
    corpus = load_corpus(config, split)
    return corpus.num_bytes / corpus.num_loss_tokens
