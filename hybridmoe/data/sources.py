"""Where documents come from: the running Python's standard library, or .txt / .jsonl files.

A document has a `key` that names it in errors ("dir/a.jsonl:12") and decides its split through a
stable hash, so the same file (and line) lands in the same split on every machine and run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
import sysconfig
from typing import Iterator

SPLITS = ("train", "validation")
SKIP_HINT = ("set DataConfig.skip_bad_records=True (prepare_data: --skip_bad_records) to skip "
             "and count it")


class BadRecordError(ValueError):
    """A record that cannot be read; the message names the file and the line."""


@dataclasses.dataclass(frozen=True)
class Document:
    key: str  # relative path, plus ":line" for a JSONL record
    text: str


@dataclasses.dataclass
class SkipLog:
    """Bad records skipped: their keys (which give their split) and the first few messages."""

    keys: list[str] = dataclasses.field(default_factory=list)
    examples: list[str] = dataclasses.field(default_factory=list)

    def add(self, key: str, message: str) -> None:
        self.keys.append(key)
        if len(self.examples) < 20:
            self.examples.append(message)

    def count(self, split: str, validation_fraction: float) -> int:
        return sum(split_of(k, validation_fraction) == split for k in self.keys)


def split_of(key: str, validation_fraction: float) -> str:
    """"validation" for a stable-hash share `validation_fraction` of keys, else "train"."""
    digest = hashlib.sha256(key.encode("utf-8")).digest()
    u = int.from_bytes(digest[:8], "big") / 2.0**64
    return "validation" if u < validation_fraction else "train"


def stdlib_root() -> pathlib.Path:
    return pathlib.Path(sysconfig.get_paths()["stdlib"])


def stdlib_documents() -> tuple[list[Document], SkipLog]:
    """Every .py file of the standard library (site-packages excluded), sorted by relative path.

    Files that are not valid UTF-8 (the stdlib ships a few on purpose, as test data) are skipped
    and counted; they are part of the source's definition, not an error.
    """
    root = stdlib_root()
    skipped = SkipLog()
    docs = []
    paths = sorted((p.relative_to(root).as_posix(), p) for p in root.rglob("*.py"))
    for rel, path in paths:
        parts = rel.split("/")
        if "site-packages" in parts or "dist-packages" in parts or not path.is_file():
            continue
        try:
            docs.append(Document(rel, path.read_bytes().decode("utf-8")))
        except UnicodeDecodeError as e:
            skipped.add(rel, f"{path}: not valid UTF-8 ({e.reason} at byte {e.start})")
    if not docs:
        raise ValueError(f"DataConfig.source='stdlib' found no .py files under {str(root)!r}")
    return docs, skipped


def input_files(input_dir: str) -> list[pathlib.Path]:
    """The .txt and .jsonl files under `input_dir` (recursively), sorted."""
    root = pathlib.Path(input_dir)
    if not root.is_dir():
        raise ValueError(f"input_dir must be an existing directory, got {input_dir!r}")
    files = sorted(p for p in root.rglob("*") if p.suffix in (".txt", ".jsonl") and p.is_file())
    if not files:
        raise ValueError(f"input_dir={input_dir!r} holds no .txt or .jsonl files")
    return files


def text_documents(input_dir: str, *, skip_bad_records: bool, skipped: SkipLog
                   ) -> Iterator[Document]:
    """Documents of the .txt (one per file) and .jsonl (one per line, field "text") files.

    A bad record (undecodable bytes, bad JSON, missing or non-string "text") raises
    BadRecordError naming file and line, or is skipped and added to `skipped`.
    """
    root = pathlib.Path(input_dir)
    for path in input_files(input_dir):
        rel = path.relative_to(root).as_posix()
        records = _txt_records(path, rel) if path.suffix == ".txt" else _jsonl_records(path, rel)
        for record in records:
            if isinstance(record, Document):
                yield record
            elif skip_bad_records:
                skipped.add(*record)
            else:
                raise BadRecordError(f"{record[1]}; {SKIP_HINT}")


# The readers yield a Document, or (key, message) for a bad record.
def _txt_records(path: pathlib.Path, rel: str) -> Iterator[Document | tuple[str, str]]:
    data = path.read_bytes()
    try:
        yield Document(rel, data.decode("utf-8"))
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        yield rel, f"{path}:{line}: not valid UTF-8 ({e.reason} at byte {e.start})"


def _jsonl_records(path: pathlib.Path, rel: str) -> Iterator[Document | tuple[str, str]]:
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue  # blank lines (a trailing newline) are not records
            key, where = f"{rel}:{lineno}", f"{path}:{lineno}"
            try:
                record = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as e:
                yield key, f"{where}: not valid UTF-8 ({e.reason} at byte {e.start} of the line)"
                continue
            except json.JSONDecodeError as e:
                yield key, f"{where}: invalid JSON ({e.msg} at column {e.colno})"
                continue
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                yield key, f"{where}: needs a JSON object with a string field 'text'"
                continue
            try:
                record["text"].encode("utf-8")
            except UnicodeEncodeError as e:  # a lone surrogate escaped in the JSON
                yield key, f"{where}: 'text' is not valid Unicode ({e.reason} at {e.start})"
                continue
            yield Document(key, record["text"])
