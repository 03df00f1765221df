"""Synthetic long-context tasks (RULER-style, DESIGN §3.6), scored by teacher-forced answer accuracy.

An example is a prompt of exactly `length` tokens: BOS, then the haystack (the validation split's
documents back to back, from a random document's start) with needles inserted, then a query; and
the answer tokens that complete the query. The needles the answer comes from (the "anchor") start
at fraction `depth` of the haystack: 0 right after BOS, 1 right before the query. Distractors and
variable-tracking hops go elsewhere. The models read Python source, so the tasks look like code:

  niah_single         MAGIC_KEY = 1234567                  ... assert MAGIC_KEY ==  -> 1234567
  niah_multikey       the same among 3 distractor MAGIC_* lines at random depths
  niah_multivalue     MAGIC_KEY.append(v) × 4, together    ... assert MAGIC_KEY == [  -> v1, v2, v3, v4
  variable_tracking   v_a = 12345, then v_b = v_a, ... (4 hops, in order, after it)
                                                           ... assert v_e ==  -> 12345
  associative_recall  lookup_t = {'abc': 1234, ...} (12 pairs) ... assert lookup_t['abc'] ==  -> 1234

An example is a function of (task, length, seed, index) and the depth only moves the needles, so
the cells of a length × depth heat map compare the same keys, values and filler. Needles go in at
the exact token position (mid-line if it falls there; each needle is a line of its own) so that
the depth is exact at every length.

Scoring feeds prompt + answer (padded to the widest answer of the length) and takes the argmax of
the logits at the answer positions: per-token accuracy and whole-answer exact match. The predict
function is jitted once per evaluation; batches keep one shape per length, so it compiles once
per length. Padding rows in the last batch are copies of a real example (masked out of the
scores); with capacity-dispatch MoE the batch's other rows can still change an example's routing.
"""

from __future__ import annotations

import dataclasses
import json
import numbers
import zlib
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from hybridmoe.config import DataConfig, ModelConfig
from hybridmoe.data.corpus import Corpus, load_corpus
from hybridmoe.data.tokenizer import Tokenizer, make_tokenizer
from hybridmoe.model import build_model

# (variables, tokens [B, T], segment_ids [B, T]) -> logits [B, T, V]
LogitsFn = Callable[[Any, jax.Array, jax.Array], jax.Array]

NUM_KEYS = 4  # niah_multikey: the queried key and 3 distractors
NUM_VALUES = 4  # niah_multivalue
NUM_HOPS = 4  # variable_tracking: assignments after the one that holds the value
NUM_PAIRS = 12  # associative_recall
UPPER, LOWER = "ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz"


# ---------------------------------------------------------------------------------------------
# The haystack


@dataclasses.dataclass(frozen=True, eq=False)
class Haystack:
    tokens: np.ndarray  # [N] the documents' text tokens back to back (no BOS/EOS)
    doc_starts: np.ndarray  # [D] where each document begins in `tokens`
    tokenizer: Tokenizer  # encodes needles and queries the way the documents were encoded

    def take(self, doc: int, n: int) -> np.ndarray:
        """n tokens from document `doc`'s start on, wrapping around the stream's end."""
        idx = (self.doc_starts[doc] + np.arange(n)) % len(self.tokens)
        return self.tokens[idx].astype(np.int32)


def haystack_from_corpus(corpus: Corpus, tokenizer: Tokenizer) -> Haystack:
    """The corpus stream with its BOS/EOS removed; text tokens are always < bos_id."""
    if tokenizer.bos_id != corpus.bos_id or tokenizer.vocab_size != corpus.vocab_size:
        raise ValueError(f"tokenizer (bos_id={tokenizer.bos_id}, vocab_size={tokenizer.vocab_size}) "
                         f"does not match the corpus (bos_id={corpus.bos_id}, vocab_size="
                         f"{corpus.vocab_size})")
    text = corpus.tokens[corpus.tokens < corpus.bos_id]
    if not len(text):
        raise ValueError("the haystack corpus holds no text tokens (every document is empty)")
    # Document i's first text token follows i BOS/EOS pairs and its own BOS.
    starts = corpus.doc_starts - 2 * np.arange(corpus.num_documents)
    return Haystack(text, starts, tokenizer)


def load_haystack(data_config: DataConfig) -> Haystack:
    """The validation split of the run's data: documents the model was not trained on."""
    return haystack_from_corpus(load_corpus(data_config, "validation"),
                                make_tokenizer(data_config.tokenizer))


# ---------------------------------------------------------------------------------------------
# Tasks


@dataclasses.dataclass(frozen=True)
class Needle:
    before: str
    value: str = ""  # an answer value, between `before` and `after`; "" for a needle without one
    after: str = ""


@dataclasses.dataclass(frozen=True)
class Layout:
    anchor: tuple[Needle, ...]  # inserted together at the depth; their values are the answer
    others: tuple[tuple[float, Needle], ...]  # (fraction of the filler, needle)
    query: str


def _distinct_ints(rng: np.random.Generator, n: int, lo: int, hi: int) -> list[int]:
    return [lo + int(i) for i in rng.choice(hi - lo, size=n, replace=False)]


def _words(rng: np.random.Generator, n: int, size: int, alphabet: str) -> list[str]:
    base = len(alphabet)
    return ["".join(alphabet[c // base ** j % base] for j in range(size))
            for c in _distinct_ints(rng, n, 0, base ** size)]


def _numbers(rng: np.random.Generator, n: int, digits: int) -> list[str]:
    return [str(v) for v in _distinct_ints(rng, n, 10 ** (digits - 1), 10 ** digits)]


def _magic(key: str, value: str) -> Needle:
    return Needle(f"\nMAGIC_{key} = ", value, "\n")


def _niah_single(rng: np.random.Generator, depth: float) -> Layout:
    del depth  # the anchor alone carries the depth
    (key,), (value,) = _words(rng, 1, 6, UPPER), _numbers(rng, 1, 7)
    return Layout((_magic(key, value),), (), f"\nassert MAGIC_{key} == ")


def _niah_multikey(rng: np.random.Generator, depth: float) -> Layout:
    del depth  # distractors go anywhere
    keys, values = _words(rng, NUM_KEYS, 6, UPPER), _numbers(rng, NUM_KEYS, 7)
    others = tuple((float(f), Needle(f"\nMAGIC_{k} = {v}\n"))
                   for f, k, v in zip(rng.random(NUM_KEYS - 1), keys[1:], values[1:]))
    return Layout((_magic(keys[0], values[0]),), others, f"\nassert MAGIC_{keys[0]} == ")


def _niah_multivalue(rng: np.random.Generator, depth: float) -> Layout:
    del depth
    (key,), values = _words(rng, 1, 6, UPPER), _numbers(rng, NUM_VALUES, 7)
    anchor = tuple(Needle(f"\nMAGIC_{key}.append(", v, ")\n") for v in values)
    return Layout(anchor, (), f"\nassert MAGIC_{key} == [")


def _variable_tracking(rng: np.random.Generator, depth: float) -> Layout:
    names = [f"v_{w}" for w in _words(rng, NUM_HOPS + 1, 5, LOWER)]
    (value,) = _numbers(rng, 1, 5)
    # The hops follow the first assignment in program order, so the chain reads as valid code.
    fractions = depth + np.sort(rng.random(NUM_HOPS)) * (1.0 - depth)
    hops = tuple((float(f), Needle(f"\n{b} = {a}\n"))
                 for f, a, b in zip(fractions, names, names[1:]))
    return Layout((Needle(f"\n{names[0]} = ", value, "\n"),), hops, f"\nassert {names[-1]} == ")


def _associative_recall(rng: np.random.Generator, depth: float) -> Layout:
    del depth
    keys, values = _words(rng, NUM_PAIRS, 3, LOWER), _numbers(rng, NUM_PAIRS, 4)
    (table,) = _words(rng, 1, 5, LOWER)
    q = int(rng.integers(NUM_PAIRS))
    items = [f"'{k}': {v}" for k, v in zip(keys, values)]
    before = f"\nlookup_{table} = {{" + "".join(i + ", " for i in items[:q]) + f"'{keys[q]}': "
    after = "".join(", " + i for i in items[q + 1:]) + "}\n"
    return Layout((Needle(before, values[q], after),), (),
                  f"\nassert lookup_{table}['{keys[q]}'] == ")


TASKS: dict[str, Callable[[np.random.Generator, float], Layout]] = {
    "niah_single": _niah_single,
    "niah_multikey": _niah_multikey,
    "niah_multivalue": _niah_multivalue,
    "variable_tracking": _variable_tracking,
    "associative_recall": _associative_recall,
}


# ---------------------------------------------------------------------------------------------
# Examples


@dataclasses.dataclass(frozen=True, eq=False)
class Example:
    task: str
    length: int
    depth: float
    prompt: np.ndarray  # [length] int32: BOS, haystack with needles, the query last
    answer: np.ndarray  # [A] int32: tokens of ", ".join(values), which complete the query
    values: tuple[str, ...]  # the answer's values, in the order the prompt holds them
    value_starts: tuple[int, ...]  # prompt position of each value's tokens
    needle_start: int  # prompt position where the anchor needles begin
    query_start: int  # prompt position where the query begins


def _check_choice(field: str, value: Any, options: Sequence[str]) -> None:
    if value not in options:
        raise ValueError(f"{field} must be one of {', '.join(options)}, got {value!r}")


def _check_int(field: str, value: Any, minimum: int = 1) -> None:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < minimum:
        kind = "a positive" if minimum == 1 else "a non-negative"
        raise ValueError(f"{field} must be {kind} integer, got {value!r}")


def _check_depth(field: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{field} must be a number in [0, 1], got {value!r}")


def _encode_needles(encode: Callable[[str], np.ndarray], needles: Sequence[Needle]
                    ) -> tuple[np.ndarray, list[int]]:
    """Tokens of the needles back to back, and the offset of each value among them."""
    parts, offsets, n = [], [], 0
    for needle in needles:
        for text, is_value in ((needle.before, False), (needle.value, True), (needle.after, False)):
            if is_value and needle.value:
                offsets.append(n)
            ids = encode(text)
            parts.append(ids)
            n += len(ids)
    return np.concatenate(parts).astype(np.int32), offsets


# The random streams examples are drawn from. "eval" is the evaluator's (and the only one it
# uses); "train" is the training mixture's synthetic retrieval rows (StageConfig.retrieval_share,
# hybridmoe/data/retrieval.py), whose seed words carry an extra leading tag, so the two never share
# a seed sequence. Training draws its filler from the train split, the evaluator from validation.
STREAMS = ("eval", "train")
_STREAM_TAG = {"train": zlib.crc32(b"hybridmoe/train-retrieval")}


def make_example(haystack: Haystack, task: str, length: int, depth: float, seed: int,
                 index: int = 0, *, stream: str = "eval") -> Example:
    """Example `index` of (task, length, seed) with its anchor at `depth`; the same inputs give
    the same example, and other depths give the same keys, values and filler. `stream` picks the
    random stream (STREAMS): leave it at "eval" for evaluation."""
    _check_choice("task", task, tuple(TASKS))
    _check_int("length", length)
    _check_depth("depth", depth)
    _check_int("seed", seed, minimum=0)
    _check_int("index", index, minimum=0)
    _check_choice("stream", stream, STREAMS)
    words = [zlib.crc32(task.encode()), length, seed, index]
    rng = np.random.default_rng(words if stream == "eval" else [_STREAM_TAG[stream]] + words)
    layout = TASKS[task](rng, float(depth))
    encode = haystack.tokenizer.encode
    anchor, value_offsets = _encode_needles(encode, layout.anchor)
    inserts = [(float(depth), anchor)] + [(f, _encode_needles(encode, [n])[0]) for f, n in layout.others]
    query = encode(layout.query).astype(np.int32)
    needed = 1 + len(query) + sum(len(t) for _, t in inserts)
    if length < needed:
        raise ValueError(f"length must be at least {needed} for task {task!r} (BOS, needles and "
                         f"query), got {length}")
    filler = haystack.take(int(rng.integers(len(haystack.doc_starts))), length - needed)
    prompt, starts = _interleave(haystack.tokenizer.bos_id, filler, inserts, query)
    values = tuple(n.value for n in layout.anchor if n.value)
    return Example(task, length, float(depth), prompt, encode(", ".join(values)).astype(np.int32),
                   values, tuple(starts[0] + o for o in value_offsets), starts[0],
                   length - len(query))


def _interleave(bos_id: int, filler: np.ndarray, inserts: list[tuple[float, np.ndarray]],
                query: np.ndarray) -> tuple[np.ndarray, list[int]]:
    """BOS, filler with each insert at its fraction of the filler, query; and each insert's start.

    Inserts that fall on the same filler position keep their list order (the anchor first, then
    variable-tracking hops in program order)."""
    cuts = [int(np.floor(f * len(filler) + 0.5)) for f, _ in inserts]
    parts, starts, prev, pos = [np.array([bos_id], np.int32)], [0] * len(inserts), 0, 1
    for i in sorted(range(len(inserts)), key=cuts.__getitem__):
        parts.append(filler[prev:cuts[i]])
        pos += cuts[i] - prev
        starts[i] = pos
        parts.append(inserts[i][1])
        pos += len(inserts[i][1])
        prev = cuts[i]
    parts += [filler[prev:], query]
    return np.concatenate(parts), starts


# ---------------------------------------------------------------------------------------------
# Scoring


def teacher_forced_batch(examples: Sequence[Example], pad_id: int, width: int
                         ) -> dict[str, np.ndarray]:
    """Inputs for teacher-forced scoring of examples of one length L, answers padded to `width`.

    tokens, segment_ids [B, L + width]: prompt, answer, PAD (segment 1, padding 0);
    answers [B, width] (PAD-padded) and answer_mask [B, width] (1 on real answer tokens).
    """
    length = examples[0].length
    b = len(examples)
    tokens = np.full((b, length + width), pad_id, np.int32)
    segment_ids = np.zeros((b, length + width), np.int32)
    answers = np.full((b, width), pad_id, np.int32)
    mask = np.zeros((b, width), bool)
    for i, ex in enumerate(examples):
        n = len(ex.answer)
        if ex.length != length or n > width:
            raise ValueError(f"examples[{i}] has length {ex.length} and an answer of {n} tokens; "
                             f"a batch needs length {length} and answers of at most {width}")
        tokens[i, :length + n] = np.concatenate([ex.prompt, ex.answer])
        segment_ids[i, :length + n] = 1
        answers[i, :n] = ex.answer
        mask[i, :n] = True
    return {"tokens": tokens, "segment_ids": segment_ids, "answers": answers, "answer_mask": mask}


def _predictor(logits_fn: LogitsFn):
    """jit((variables, tokens, segment_ids, answers [B, W]) -> argmax hits [B, W] bool).

    The logits at position L-1+j predict answer token j; with T = L + W inputs those are the
    positions [T-W-1, T-1)."""
    def hits(variables, tokens, segment_ids, answers):
        width = answers.shape[1]
        logits = logits_fn(variables, tokens, segment_ids)
        return jnp.argmax(logits[:, -width - 1:-1], axis=-1) == answers
    return jax.jit(hits)


def model_logits_fn(model_config: ModelConfig) -> LogitsFn:
    """HybridLM's logits; variables = {"params", "router"} (routing reads the trained biases)."""
    model = build_model(model_config)

    def logits(variables, tokens, segment_ids):
        return model.apply(variables, tokens, segment_ids=segment_ids)[0]
    return logits


def _score_length(predict, variables, examples: list[Example], pad_id: int, batch_size: int,
                  bar: tqdm) -> np.ndarray:
    """Correct answer tokens per example."""
    width = max(len(e.answer) for e in examples)
    correct = np.zeros(len(examples), np.int64)
    for lo in range(0, len(examples), batch_size):
        chunk = examples[lo:lo + batch_size]
        rows = chunk + [chunk[-1]] * (batch_size - len(chunk))  # one shape: one compile per length
        batch = teacher_forced_batch(rows, pad_id, width)
        hits = np.asarray(predict(variables, batch["tokens"], batch["segment_ids"],
                                  batch["answers"]))
        correct[lo:lo + len(chunk)] = (hits & batch["answer_mask"])[:len(chunk)].sum(axis=1)
        bar.update(1)
    return correct


# ---------------------------------------------------------------------------------------------
# Evaluation


@dataclasses.dataclass(frozen=True)
class Cell:
    task: str
    length: int
    depth: float
    num_examples: int
    token_accuracy: float  # correct answer tokens / answer tokens
    exact_match: float  # share of examples with every answer token correct


def _check_grid(lengths, depths, tasks, num_examples, max_batch_tokens) -> None:
    for field, values in (("lengths", lengths), ("depths", depths), ("tasks", tasks)):
        if not len(values) or len(set(values)) != len(values):
            raise ValueError(f"{field} must be a non-empty list without repeats, got {values!r}")
    for i, length in enumerate(lengths):
        _check_int(f"lengths[{i}]", length)
    for i, depth in enumerate(depths):
        _check_depth(f"depths[{i}]", depth)
    for i, task in enumerate(tasks):
        _check_choice(f"tasks[{i}]", task, tuple(TASKS))
    _check_int("num_examples", num_examples)
    _check_int("max_batch_tokens", max_batch_tokens)


def _cells(grid: list[tuple[str, float, int]], length: int, correct: np.ndarray,
           examples: list[Example]) -> list[Cell]:
    groups: dict[tuple[str, float], list[tuple[int, int]]] = {}
    for (task, depth, _), c, ex in zip(grid, correct, examples):
        groups.setdefault((task, depth), []).append((int(c), len(ex.answer)))
    return [Cell(task, length, depth, len(r), sum(c for c, _ in r) / sum(n for _, n in r),
                 sum(c == n for c, n in r) / len(r)) for (task, depth), r in groups.items()]


def evaluate_with(logits_fn: LogitsFn, variables: Any, haystack: Haystack, lengths: Sequence[int],
                  depths: Sequence[float], tasks: Sequence[str] = tuple(TASKS),
                  num_examples: int = 4, seed: int = 0, *, max_batch_tokens: int = 65536,
                  progress: bool = False) -> list[Cell]:
    """One Cell per (length, task, depth), in that order, scored with any logits function.

    A batch holds max_batch_tokens // length examples (at least one), so long lengths run one
    example at a time instead of running out of memory."""
    _check_grid(lengths, depths, tasks, num_examples, max_batch_tokens)
    predict = _predictor(logits_fn)
    pad_id = haystack.tokenizer.pad_id
    grid = [(t, float(d), i) for t in tasks for d in depths for i in range(num_examples)]
    sizes = {n: max(1, min(len(grid), max_batch_tokens // n)) for n in lengths}
    cells: list[Cell] = []
    with tqdm(total=sum(-(-len(grid) // b) for b in sizes.values()), unit="batch",
              disable=not progress, dynamic_ncols=True) as bar:
        for length in lengths:
            bar.set_description(f"length {length}")
            examples = [make_example(haystack, t, length, d, seed, i) for t, d, i in grid]
            correct = _score_length(predict, variables, examples, pad_id, sizes[length], bar)
            cells += _cells(grid, length, correct, examples)
    return cells


def evaluate(variables: Any, model_config: ModelConfig, lengths: Sequence[int],
             depths: Sequence[float], tasks: Sequence[str] = tuple(TASKS), num_examples: int = 4,
             seed: int = 0, *, data_config: DataConfig | None = None,
             max_batch_tokens: int = 65536, progress: bool = False) -> list[Cell]:
    """HybridLM with `variables` ({"params", "router"}) on the tasks; the haystack is the
    validation split of `data_config` (default: the embedded standard-library corpus)."""
    haystack = load_haystack(data_config or DataConfig())
    vocab = haystack.tokenizer.vocab_size
    if model_config.vocab_size < vocab:
        raise ValueError(f"ModelConfig.vocab_size must be at least the tokenizer's {vocab} "
                         f"(DataConfig.tokenizer={haystack.tokenizer.name!r}), got "
                         f"{model_config.vocab_size}")
    return evaluate_with(model_logits_fn(model_config), variables, haystack, lengths, depths,
                         tasks, num_examples, seed, max_batch_tokens=max_batch_tokens,
                         progress=progress)


# ---------------------------------------------------------------------------------------------
# Reports


def _mean_over_tasks(cells: Sequence[Cell]) -> list[Cell]:
    """An "all tasks" cell per (length, depth): the tasks' scores averaged, each task equal."""
    groups: dict[tuple[int, float], list[Cell]] = {}
    for c in cells:
        groups.setdefault((c.length, c.depth), []).append(c)
    return [Cell("all tasks", n, d, sum(c.num_examples for c in g),
                 float(np.mean([c.token_accuracy for c in g])),
                 float(np.mean([c.exact_match for c in g]))) for (n, d), g in groups.items()]


def _axes(cells: Sequence[Cell]) -> tuple[list[str], list[int], list[float]]:
    tasks = list(dict.fromkeys(c.task for c in cells))
    return tasks, sorted({c.length for c in cells}), sorted({c.depth for c in cells})


def markdown_table(cells: Sequence[Cell]) -> str:
    """Rows (task, length), one column per depth and their mean: "exact match / token accuracy"."""
    cells = list(cells) + _mean_over_tasks(cells)
    tasks, lengths, depths = _axes(cells)
    by_key = {(c.task, c.length, c.depth): c for c in cells}
    lines = ["| task | length | " + " | ".join(f"depth {d:g}" for d in depths) + " | mean |",
             "|---|---:|" + "---:|" * (len(depths) + 1)]
    for task in tasks:
        for length in lengths:
            row = [by_key[task, length, d] for d in depths if (task, length, d) in by_key]
            if not row:
                continue
            mean = (np.mean([c.exact_match for c in row]), np.mean([c.token_accuracy for c in row]))
            lines.append(f"| {task} | {length} | "
                         + " | ".join(f"{c.exact_match:.2f} / {c.token_accuracy:.2f}" for c in row)
                         + f" | {mean[0]:.2f} / {mean[1]:.2f} |")
    return "\n".join(lines) + "\n"


def write_results(cells: Sequence[Cell], stem: str, meta: dict[str, Any]) -> tuple[str, str]:
    """stem.md (title from meta, then the table) and stem.json ({"meta", "cells"}); their paths."""
    md, js = stem + ".md", stem + ".json"
    title = ", ".join(f"{k}={v}" for k, v in meta.items())
    with open(md, "w", encoding="utf-8") as f:
        f.write(f"# Long-context evaluation\n\n{title}\n\nCells: exact match / answer-token "
                f"accuracy.\n\n{markdown_table(cells)}")
    with open(js, "w", encoding="utf-8") as f:
        json.dump({"meta": meta, "cells": [dataclasses.asdict(c) for c in cells]}, f, indent=1)
    return md, js


def plot_heat_map(cells: Sequence[Cell], path: str, title: str) -> None:
    """Exact match on a length × depth grid, one panel per task and one for their mean."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = list(cells) + _mean_over_tasks(cells)
    tasks, lengths, depths = _axes(cells)
    by_key = {(c.task, c.length, c.depth): c.exact_match for c in cells}
    size = (len(tasks) * (0.9 * len(depths) + 2.2), 0.5 * len(lengths) + 1.8)
    fig, axes = plt.subplots(1, len(tasks), figsize=size, squeeze=False)
    for ax, task in zip(axes[0], tasks):
        grid = np.array([[by_key.get((task, n, d), np.nan) for d in depths] for n in lengths])
        im = ax.imshow(grid, origin="lower", aspect="auto", cmap="viridis", vmin=0, vmax=1)
        for (i, j), v in np.ndenumerate(grid):
            if np.isfinite(v):
                ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7,
                        color="white" if v < 0.5 else "black")
        ax.set_title(task, fontsize=9)
        ax.set_xticks(range(len(depths)))
        ax.set_xticklabels([f"{d:g}" for d in depths], fontsize=7)
        ax.set_yticks(range(len(lengths)))
        ax.set_yticklabels([str(n) for n in lengths], fontsize=7)
        ax.set_xlabel("needle depth")
    axes[0][0].set_ylabel("context length (tokens)")
    fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8, label="exact match")
    fig.suptitle(title, fontsize=10, y=1.04)  # above the panel titles
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
