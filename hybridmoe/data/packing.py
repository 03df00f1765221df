"""Cutting a corpus stream into training rows, vectorised over a batch of rows.

Row r holds the stream's tokens [r·T, r·T + T] (T + 1 tokens): inputs are the first T, targets
the last T. Consecutive rows overlap by one token, so over an epoch every stream token is an
input exactly once and every token after the first is a target exactly once: nothing is lost
at row boundaries and nothing is repeated. Positions past the stream's end are PAD.

segment_ids number the documents inside a row from 1 (a document cut by a row boundary goes on
as segment 1 of the next row); padding is 0. A target counts in the loss only when it belongs to
the same document as its input: so the step from one document's EOS to the next one's BOS, and
padding, carry no loss.

Long-context stages also draw rows from `long_document_windows`: windows of T + 1 tokens that lie
inside one long document, packed by the same code (`pack_windows`) from their start positions.
"""

from __future__ import annotations

import numpy as np

from hybridmoe.data.corpus import Corpus


def num_rows(num_tokens: int, seq_len: int) -> int:
    """Rows needed to use every target of a stream of `num_tokens` tokens once."""
    return -(-(num_tokens - 1) // seq_len)


def pack_rows(corpus: Corpus, rows: np.ndarray, seq_len: int) -> dict[str, np.ndarray]:
    """rows: [B] int row indices (-1: an empty, fully masked row) -> batch dict of [B, seq_len]."""
    rows = np.asarray(rows, np.int64)
    return pack_windows(corpus, np.where(rows >= 0, rows * seq_len, -1), seq_len)


def pack_windows(corpus: Corpus, starts: np.ndarray, seq_len: int) -> dict[str, np.ndarray]:
    """starts: [B] int stream positions of the rows' first tokens (-1: an empty, fully masked row)
    -> batch dict of [B, seq_len]; rows of the packed stream start at multiples of seq_len."""
    starts = np.asarray(starts, np.int64)
    pos = np.where(starts[:, None] >= 0, starts[:, None], -(seq_len + 1))
    pos = pos + np.arange(seq_len + 1)  # [B, T+1]
    valid = (pos >= 0) & (pos < corpus.num_tokens)
    ids = np.where(valid, corpus.tokens[np.clip(pos, 0, corpus.num_tokens - 1)], corpus.pad_id)
    doc = np.searchsorted(corpus.doc_starts, pos, side="right")  # [B, T+1] global document number
    seg = np.where(valid, doc - doc[:, :1] + 1, 0).astype(np.int32)
    seg_in, seg_out = seg[:, :-1], seg[:, 1:]
    return {
        "tokens": ids[:, :-1].astype(np.int32),
        "targets": ids[:, 1:].astype(np.int32),
        "segment_ids": seg_in,
        "loss_mask": ((seg_in == seg_out) & (seg_out > 0)).astype(np.float32),
    }


def long_document_windows(corpus: Corpus, seq_len: int) -> np.ndarray:
    """[W] int64 stream positions of every row-sized window that lies inside one document.

    A document of L stream tokens (BOS … EOS) holds ⌊(L − 1) / T⌋ windows of T + 1 tokens, taken
    from its BOS at stride T; documents shorter than T + 1 tokens hold none. Rows cut from these
    windows carry a full row of context from a single document and loss on every target.
    """
    ends = np.append(corpus.doc_starts[1:], corpus.num_tokens)
    counts = (ends - corpus.doc_starts - 1) // seq_len  # [D]
    first = np.repeat(np.cumsum(counts) - counts, counts)  # [W] index of each doc's first window
    index_in_doc = np.arange(int(counts.sum())) - first
    return np.repeat(corpus.doc_starts, counts) + index_in_doc * seq_len
