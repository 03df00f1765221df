"""Synthetic retrieval rows for the training mixture (StageConfig.retrieval_share).

Row k of a run (k = 0, 1, ...; DataConfig.seed fixes the run) is one of the long-context
evaluator's examples (hybridmoe/eval/long_context.py: the same needle lines, queries and
interleaving code) followed by its answer and a newline, seq_len + 1 tokens in all, so that
the next-token loss on the answer teaches copying the value the query asks for:

  BOS  train-split code ... MAGIC_KEY = 1234567 ... code  \\nassert MAGIC_KEY == 1234567\\n

The task (one of StageConfig.retrieval_tasks) and the needle's depth (uniform in [0, 1]) are
drawn per row. Every target of the row carries loss (haystack, needles, query and answer alike);
the answer's targets weigh `answer_weight` (StageConfig.retrieval_answer_weight, default 1) in
the loss mask, so that the few copying targets are not drowned by the row's language modelling.

No evaluation example can be trained on:
  * the haystack is the TRAIN split (the evaluator's is validation; a document goes to one split
    or the other by a hash of its key, hybridmoe/data/sources.split_of), and
  * the keys, values and filler offsets come from make_example's "train" stream, whose seed
    words carry a leading tag the evaluator's "eval" stream never has (and the task and depth from
    a seed sequence tagged apart from both).
tests/data/test_retrieval_rows.py checks that no needle (key = value line) of the benchmark's
evaluation grid appears among the training rows.
"""

from __future__ import annotations

import functools
import zlib
from typing import Sequence

import numpy as np

from hybridmoe.config import DataConfig, RETRIEVAL_TASKS

# Items of train_row_starts at or below this mark are retrieval rows: item = RETRIEVAL_MARK - k
# is row k (stream positions are >= 0 and -1 is an empty row).
RETRIEVAL_MARK = -2
_PICK_TAG = zlib.crc32(b"hybridmoe/train-retrieval-pick")


@functools.lru_cache(maxsize=2)
def train_haystack(config: DataConfig):
    """The train split as a haystack (text tokens back to back), shared by every batch."""
    from hybridmoe.data.corpus import load_corpus
    from hybridmoe.data.tokenizer import make_tokenizer
    from hybridmoe.eval.long_context import haystack_from_corpus
    return haystack_from_corpus(load_corpus(config, "train"), make_tokenizer(config.tokenizer))


def retrieval_example(haystack, tasks: Sequence[str], seq_len: int, seed: int, index: int):
    """The long_context.Example behind retrieval row `index`, its prompt length chosen so that
    prompt + answer + newline is seq_len + 1 tokens (when the answer length allows)."""
    from hybridmoe.eval import long_context as lc
    rng = np.random.default_rng([_PICK_TAG, seed, index])
    task = tasks[int(rng.integers(len(tasks)))]
    depth = float(rng.random())
    tail = len(haystack.tokenizer.encode("\n"))
    length = seq_len + 1 - tail
    for _ in range(3):  # the answer's length can depend on the example (BPE): settle it
        ex = lc.make_example(haystack, task, length, depth, seed, index, stream="train")
        want = seq_len + 1 - tail - len(ex.answer)
        if want == length:
            break
        length = want
    return ex


def _row_and_answer(haystack, tasks: Sequence[str], seq_len: int, seed: int, index: int
                    ) -> tuple[np.ndarray, slice]:
    """retrieval_row's row and the slice of its TARGETS (row[1:]) that are the answer."""
    ex = retrieval_example(haystack, tasks, seq_len, seed, index)
    row = np.concatenate([ex.prompt, ex.answer, haystack.tokenizer.encode("\n").astype(np.int32)])
    out = np.full(seq_len + 1, haystack.tokenizer.pad_id, np.int32)
    out[:min(len(row), seq_len + 1)] = row[:seq_len + 1]
    # Row position len(prompt) + j (answer token j) is target position len(prompt) - 1 + j.
    start = len(ex.prompt) - 1
    return out, slice(min(start, seq_len), min(start + len(ex.answer), seq_len))


def retrieval_row(haystack, tasks: Sequence[str], seq_len: int, seed: int, index: int
                  ) -> np.ndarray:
    """[seq_len + 1] int32: BOS, haystack with needles, query, answer, newline (PAD-padded or cut
    if the answer's length could not be settled)."""
    return _row_and_answer(haystack, tasks, seq_len, seed, index)[0]


def pack_retrieval_rows(haystack, tasks: Sequence[str], indices: np.ndarray, seq_len: int,
                        seed: int, answer_weight: float = 1.0) -> dict[str, np.ndarray]:
    """Batch dict of [B, seq_len] (as packing.pack_windows) of retrieval rows `indices`; the
    answer's targets weigh `answer_weight` in loss_mask, every other real target 1."""
    made = [_row_and_answer(haystack, tasks, seq_len, seed, int(i)) for i in indices]
    rows = np.stack([r for r, _ in made])
    seg = (rows != haystack.tokenizer.pad_id).astype(np.int32)
    seg_in, seg_out = seg[:, :-1], seg[:, 1:]
    mask = ((seg_in == seg_out) & (seg_out > 0)).astype(np.float32)
    for b, (_, answer) in enumerate(made):
        mask[b, answer] *= answer_weight
    return {"tokens": rows[:, :-1], "targets": rows[:, 1:], "segment_ids": seg_in,
            "loss_mask": mask}


def check_tasks(tasks: Sequence[str]) -> tuple[str, ...]:
    tasks = tuple(tasks)
    if not tasks or any(t not in RETRIEVAL_TASKS for t in tasks):
        raise ValueError(f"StageConfig.retrieval_tasks must be a non-empty tuple of "
                         f"{', '.join(RETRIEVAL_TASKS)}, got {tasks!r}")
    return tasks
