"""Synthetic .txt / .jsonl corpora for the data tests."""

import json

import numpy as np

ALPHABET = list("abcdefghij klmnop\n") + ["é", "→", "字"]


def random_text(rng: np.random.Generator, max_len: int = 60) -> str:
    return "".join(rng.choice(ALPHABET, size=int(rng.integers(0, max_len))))


def write_corpus(root, seed: int = 0, num_txt: int = 12, num_jsonl: int = 40) -> dict[str, str]:
    """Writes the files; returns {document key: text} as the sources name documents."""
    rng = np.random.default_rng(seed)
    (root / "sub").mkdir(parents=True)
    docs = {}
    for i in range(num_txt):
        docs[f"t{i:02d}.txt"] = random_text(rng)
        (root / f"t{i:02d}.txt").write_text(docs[f"t{i:02d}.txt"], encoding="utf-8")
    lines = []
    for i in range(num_jsonl):
        text = random_text(rng)
        lines.append(json.dumps({"text": text, "id": i}))
        docs[f"sub/d.jsonl:{i + 1}"] = text
    (root / "sub" / "d.jsonl").write_text("\n".join(lines) + "\n\n", encoding="utf-8")
    return docs
