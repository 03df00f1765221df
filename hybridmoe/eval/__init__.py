"""Evaluations of trained models beyond validation loss: synthetic long-context tasks (DESIGN §3.6)."""

from hybridmoe.eval.long_context import (TASKS, Cell, Example, Haystack, evaluate, evaluate_with,
                                         haystack_from_corpus, load_haystack, make_example,
                                         markdown_table, model_logits_fn, plot_heat_map,
                                         teacher_forced_batch, write_results)

__all__ = [
    "TASKS", "Cell", "Example", "Haystack", "evaluate", "evaluate_with", "haystack_from_corpus",
    "load_haystack", "make_example", "markdown_table", "model_logits_fn", "plot_heat_map",
    "teacher_forced_batch", "write_results",
]
