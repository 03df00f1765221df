"""Long-context tasks: exact lengths, answers derivable from the prompt, depth placement,
determinism, and teacher-forced scoring (fake logits functions and a tiny real model)."""

import ast
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax import linen as nn

from hybridmoe import build_model
from hybridmoe.config import DataConfig
from hybridmoe.data.corpus import build_corpus
from hybridmoe.data.tokenizer import BYTE_BOS_ID, BYTE_PAD_ID, ByteTokenizer
from hybridmoe.eval import long_context as lc
from tests.model_utils import small_config

ALL_TASKS = tuple(lc.TASKS)


@pytest.fixture(scope="module")
def haystack():
    return lc.load_haystack(DataConfig())


def text(ids) -> str:
    return ByteTokenizer().decode(ids)


def solve(task: str, prompt: str) -> str:
    """Answers the prompt from its text alone, the way the task defines it."""
    if task in ("niah_single", "niah_multikey"):
        key = re.search(r"\nassert (MAGIC_[A-Z]+) == $", prompt).group(1)
        (value,) = re.findall(rf"\n{key} = (\d+)\n", prompt)  # exactly one needle holds the key
        return value
    if task == "niah_multivalue":
        key = re.search(r"\nassert (MAGIC_[A-Z]+) == \[$", prompt).group(1)
        return ", ".join(re.findall(rf"\n{key}\.append\((\d+)\)\n", prompt))
    if task == "variable_tracking":
        name = re.search(r"\nassert (v_[a-z]+) == $", prompt).group(1)
        lines = {m.group(1): (m.group(2), m.start()) for m in
                 re.finditer(r"\n(v_[a-z]{5}) = (v_[a-z]{5}|\d+)\n", prompt)}
        where = len(prompt)
        while not name.isdigit():  # follow the chain back; each assignment precedes its use
            name, start = lines[name]
            assert start < where
            where = start
        return name
    table, key = re.search(r"\nassert (lookup_[a-z]+)\['([a-z]{3})'\] == $", prompt).groups()
    (literal,) = re.findall(rf"\n{table} = (\{{[^}}]*\}})\n", prompt)
    return str(ast.literal_eval(literal)[key])


@pytest.mark.parametrize("task", ALL_TASKS)
def test_prompts_are_exact_length_and_answers_follow_from_them(haystack, task):
    for length, depth, index in ((301, 0.0, 0), (1000, 0.37, 1), (2049, 1.0, 2)):
        ex = lc.make_example(haystack, task, length, depth, seed=5, index=index)
        assert ex.prompt.shape == (length,) and ex.prompt.dtype == np.int32
        assert ex.prompt[0] == BYTE_BOS_ID and (ex.prompt[1:] < BYTE_BOS_ID).all()
        assert text(ex.prompt[ex.query_start:]).startswith("\nassert ")
        assert text(ex.answer) == ", ".join(ex.values) == solve(task, text(ex.prompt))
        for value, start in zip(ex.values, ex.value_starts):  # the recorded positions hold them
            assert text(ex.prompt[start:start + len(value)]) == value
        assert len(ex.values) == (lc.NUM_VALUES if task == "niah_multivalue" else 1)


def test_single_needle_sits_at_the_requested_depth(haystack):
    length = 2048
    ex0, ex_half, ex1 = (lc.make_example(haystack, "niah_single", length, d, seed=0)
                         for d in (0.0, 0.5, 1.0))
    needle = ex0.value_starts[0] + len(ex0.answer) + 1 - ex0.needle_start  # "\nMAGIC_X = v\n"
    filler = ex0.query_start - 1 - needle
    assert ex0.needle_start == 1  # right after BOS
    assert ex1.needle_start + needle == ex1.query_start  # right before the query
    assert abs(ex_half.needle_start - 1 - 0.5 * filler) <= 0.5


@pytest.mark.parametrize("task", ALL_TASKS)
def test_anchor_moves_with_depth_over_the_same_content(haystack, task):
    depths = np.linspace(0, 1, 5)
    examples = [lc.make_example(haystack, task, 4096, d, seed=1) for d in depths]
    starts = [(e.needle_start - 1) / (e.query_start - 1) for e in examples]
    assert np.all(np.diff(starts) > 0)
    np.testing.assert_allclose(starts, depths, atol=0.06)  # needles are < 250 of 4096 tokens
    for e in examples[1:]:  # depth only moves needles: same values, same tokens overall
        assert e.values == examples[0].values
        np.testing.assert_array_equal(np.sort(e.prompt), np.sort(examples[0].prompt))


def test_generation_is_deterministic_and_seeded(haystack):
    a, b = (lc.make_example(haystack, "niah_multikey", 700, 0.25, seed=3, index=4) for _ in "ab")
    np.testing.assert_array_equal(a.prompt, b.prompt)
    np.testing.assert_array_equal(a.answer, b.answer)
    assert (a.value_starts, a.needle_start) == (b.value_starts, b.needle_start)
    for other in (lc.make_example(haystack, "niah_multikey", 700, 0.25, seed=4, index=4),
                  lc.make_example(haystack, "niah_multikey", 700, 0.25, seed=3, index=5)):
        assert other.values != a.values and not np.array_equal(other.prompt, a.prompt)


def test_haystack_strips_specials_and_wraps():
    docs = [np.frombuffer(b, np.uint8) for b in (b"ab", b"", b"cde")]
    corpus = build_corpus(docs, byte_counts=np.zeros(256, np.int64), vocab_size=259,
                          bos_id=BYTE_BOS_ID, eos_id=257, pad_id=BYTE_PAD_ID)
    hay = lc.haystack_from_corpus(corpus, ByteTokenizer())
    assert text(hay.tokens) == "abcde" and hay.doc_starts.tolist() == [0, 2, 2]
    assert text(hay.take(2, 7)) == "cdeabcd"


@pytest.mark.parametrize("kwargs, message", [
    (dict(task="niah"), "task must be one of niah_single, "),
    (dict(length=0), "length must be a positive integer, got 0"),
    (dict(depth=1.5), r"depth must be a number in \[0, 1\], got 1.5"),
    (dict(task="associative_recall", length=150), "length must be at least 2"),
    (dict(seed=-1), "seed must be a non-negative integer, got -1"),
])
def test_bad_example_inputs_name_the_field(haystack, kwargs, message):
    args = dict(task="niah_single", length=256, depth=0.5, seed=0) | kwargs
    with pytest.raises(ValueError, match=message):
        lc.make_example(haystack, **args)


@pytest.mark.parametrize("kwargs, message", [
    (dict(lengths=[]), "lengths must be a non-empty list"),
    (dict(lengths=[256, -1]), r"lengths\[1\] must be a positive integer, got -1"),
    (dict(depths=[0.5, 2]), r"depths\[1\] must be a number in \[0, 1\], got 2"),
    (dict(tasks=["niah_single", "ruler"]), r"tasks\[1\] must be one of"),
    (dict(num_examples=0), "num_examples must be a positive integer, got 0"),
])
def test_bad_evaluation_grid_names_the_field(haystack, kwargs, message):
    args = dict(lengths=[256], depths=[0.5], tasks=["niah_single"], num_examples=1) | kwargs
    with pytest.raises(ValueError, match=message):
        lc.evaluate_with(oracle, None, haystack, **args)


def test_teacher_forced_batch_layout(haystack):
    exs = [lc.make_example(haystack, t, 300, 0.5, seed=0) for t in ("niah_single", "niah_multivalue")]
    width = len(exs[1].answer)
    batch = lc.teacher_forced_batch(exs, BYTE_PAD_ID, width)
    n = len(exs[0].answer)
    assert batch["tokens"].shape == (2, 300 + width)
    np.testing.assert_array_equal(batch["tokens"][0, :300 + n], np.r_[exs[0].prompt, exs[0].answer])
    assert (batch["tokens"][0, 300 + n:] == BYTE_PAD_ID).all()
    assert batch["segment_ids"][0].tolist() == [1] * (300 + n) + [0] * (width - n)
    assert batch["answer_mask"].sum(axis=1).tolist() == [n, width]
    with pytest.raises(ValueError, match=r"examples\[1\] has length 300 and an answer of"):
        lc.teacher_forced_batch(exs, BYTE_PAD_ID, n)


# Fake models: (variables, tokens [B, T], segment_ids [B, T]) -> logits [B, T, V].
def oracle(variables, tokens, segment_ids):
    """Looks one token ahead: predicts every next token, answers included."""
    return jax.nn.one_hot(jnp.roll(tokens, -1, axis=1), 259)


def constant(variables, tokens, segment_ids):
    return jnp.zeros(tokens.shape + (259,)).at[..., 0].set(1.0)


def last_answer_token_wrong(variables, tokens, segment_ids):
    """The oracle, except that the prediction of each row's last real token is PAD."""
    last = jnp.sum(segment_ids > 0, axis=1) - 1
    wrong = jnp.arange(tokens.shape[1])[None] == (last - 1)[:, None]
    return jnp.where(wrong[..., None], jax.nn.one_hot(BYTE_PAD_ID, 259), oracle(None, tokens, None))


def test_scoring_with_fake_models(haystack):
    grid = dict(lengths=[256, 333], depths=[0.0, 1.0], tasks=ALL_TASKS, num_examples=2,
                max_batch_tokens=2048)
    perfect = lc.evaluate_with(oracle, None, haystack, **grid)
    assert len(perfect) == 2 * 2 * len(ALL_TASKS)
    assert [(c.length, c.task, c.depth) for c in perfect[:3]] == [
        (256, ALL_TASKS[0], 0.0), (256, ALL_TASKS[0], 1.0), (256, ALL_TASKS[1], 0.0)]
    assert all(c.token_accuracy == c.exact_match == 1.0 and c.num_examples == 2 for c in perfect)
    assert all(c.token_accuracy == c.exact_match == 0.0
               for c in lc.evaluate_with(constant, None, haystack, **grid))
    for c in lc.evaluate_with(last_answer_token_wrong, None, haystack, **grid):
        n = len(lc.make_example(haystack, c.task, c.length, c.depth, seed=0).answer)
        assert c.exact_match == 0.0 and c.token_accuracy == pytest.approx((n - 1) / n)


def test_predict_compiles_once_per_length(haystack):
    traces = []

    def counting(variables, tokens, segment_ids):
        traces.append(tokens.shape)
        return oracle(variables, tokens, segment_ids)

    # 2 tasks × 2 depths × 3 examples = 12 a length: batches of 5, 5, 2 (padded) at 200, 3 at 300.
    cells = lc.evaluate_with(counting, None, haystack, [200, 300], [0.2, 0.8],
                             ["niah_single", "niah_multivalue"], 3, max_batch_tokens=1000)
    width = len(lc.make_example(haystack, "niah_multivalue", 200, 0.2, 0).answer)
    assert traces == [(5, 200 + width), (3, 300 + width)]
    assert all(c.exact_match == 1.0 for c in cells)


def random_variables(cfg, seed=0):
    """HybridLM variables drawn at random: jitting model.init costs ~15 s of CPU compile here."""
    shapes = jax.eval_shape(build_model(cfg).init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    rng = np.random.default_rng(seed)
    params = jax.tree_util.tree_map(lambda s: (0.2 * rng.standard_normal(s.shape)).astype(s.dtype),
                                    nn.meta.unbox(shapes["params"]))
    router = jax.tree_util.tree_map(lambda s: np.zeros(s.shape, s.dtype), shapes["router"])
    return {"params": params, "router": router}


def test_tiny_model_smoke_and_reports(tmp_path):
    cfg = small_config(num_layers=2)
    variables = random_variables(cfg)
    cells = lc.evaluate(variables, cfg, lengths=[128], depths=[0.0, 1.0],
                        tasks=["niah_single", "variable_tracking"], num_examples=2, seed=0)
    assert [(c.task, c.length, c.depth, c.num_examples) for c in cells] == [
        ("niah_single", 128, 0.0, 2), ("niah_single", 128, 1.0, 2),
        ("variable_tracking", 128, 0.0, 2), ("variable_tracking", 128, 1.0, 2)]
    assert all(0.0 <= c.token_accuracy <= 1.0 and 0.0 <= c.exact_match <= 1.0 for c in cells)

    md, js = lc.write_results(cells, str(tmp_path / "lc"), {"step": 0})
    with open(js) as f:
        saved = json.load(f)
    assert saved["meta"] == {"step": 0}
    assert [lc.Cell(**c) for c in saved["cells"]] == cells
    table = open(md).read()
    assert "| niah_single | 128 |" in table and "| all tasks | 128 |" in table
    lc.plot_heat_map(cells, str(tmp_path / "lc.png"), "tiny, step 0")
    assert (tmp_path / "lc.png").stat().st_size > 1000


def test_evaluate_rejects_a_model_smaller_than_the_tokenizer():
    cfg = small_config(vocab_size=100)
    with pytest.raises(ValueError, match="ModelConfig.vocab_size must be at least the tokenizer's 259"):
        lc.evaluate(None, cfg, [128], [0.5])
