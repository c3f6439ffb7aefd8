"""The demo's text: the Python standard library's own source files (on every machine that runs
Python, read at run time, nothing downloaded) or the user's file, as a character-level corpus."""

from __future__ import annotations

import ast
import dataclasses
import os
from pathlib import Path

import torch

__all__ = ["Corpus", "INDENT", "load_corpus", "code_lines", "indent_as_tabs", "standard_library_text", "batch_for_step"]

DEFAULT_BYTES = 400_000


INDENT = "    "  # one level of indentation, written in the default corpus as one tab character


def indent_as_tabs(line: str) -> str:
    """`line` with each `INDENT` of its leading spaces as one tab: a small model counts indentation
    levels far more easily than runs of spaces (which it otherwise continues without end)."""
    stripped = line.lstrip(" ")
    levels, rest = divmod(len(line) - len(stripped), len(INDENT))
    return "\t" * levels + " " * rest + stripped


def code_lines(source: str) -> str:
    """`source`'s code without its docstrings, comment lines and blank lines, in ASCII, indentation as
    tabs (`indent_as_tabs`): what a model learning to write Python should see (the standard library's
    docstrings are mostly English, `_pydecimal`'s alone a fifth of its first 400 kB). Empty if it does
    not parse."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return ""
    docstring_lines = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and _has_docstring(node):
            docstring_lines.update(range(node.body[0].lineno, node.body[0].end_lineno + 1))
    kept = []
    for number, line in enumerate(source.splitlines(), start=1):
        if number in docstring_lines or not line.strip() or line.lstrip().startswith("#"):
            continue
        kept.append(indent_as_tabs("".join(character for character in line.rstrip() if " " <= character <= "~")))
    return "\n".join(kept) + "\n"


def _has_docstring(node: ast.AST) -> bool:
    first = node.body[0] if node.body else None
    return isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str)


def standard_library_text(limit: int = DEFAULT_BYTES) -> str:
    """About `limit` characters of code from the standard library's top-level .py files, in name order
    (`code_lines` of each)."""
    root = Path(os.__file__).parent
    parts, total = [], 0
    for path in sorted(root.glob("*.py")):
        text = code_lines(path.read_text(encoding="utf-8", errors="ignore"))
        parts.append(text)
        total += len(text)
        if total >= limit:
            break
    return "".join(parts)[:limit]


@dataclasses.dataclass(frozen=True)
class Corpus:
    """A text as token ids, with its sorted character vocabulary. With `tab_indents` (the default
    corpus), text is encoded with its indentation as tabs and decoded with tabs as `INDENT`."""

    name: str
    characters: tuple[str, ...]
    tokens: torch.Tensor
    tab_indents: bool = False

    @property
    def vocab_size(self) -> int:
        return len(self.characters)

    def encode(self, text: str) -> torch.Tensor:
        if self.tab_indents:
            text = "\n".join(indent_as_tabs(line) for line in text.split("\n"))
        index = {character: position for position, character in enumerate(self.characters)}
        return torch.tensor([index[character] for character in text if character in index], dtype=torch.long, device="cpu")

    def decode(self, tokens) -> str:
        text = "".join(self.characters[int(token)] for token in tokens)
        return text.replace("\t", INDENT) if self.tab_indents else text


def _data_error(path: Path, problem: str) -> ValueError:
    return ValueError(f"--data {path}: {problem}; give a UTF-8 text file of at least a few thousand characters")


def load_corpus(path: str | None, block_size: int) -> Corpus:
    """The user's text file, or the standard library's source."""
    if path is None:
        text, name = standard_library_text(), f"Python {os.sys.version.split()[0]} standard library source"
    else:
        file = Path(path)
        if not file.is_file():
            raise _data_error(file, "no such file")
        text, name = file.read_text(encoding="utf-8", errors="replace"), str(file)
        if len(text) <= block_size + 1:
            raise _data_error(file, f"it holds {len(text)} characters, fewer than one block of {block_size + 1}")
    characters = tuple(sorted(set(text)))
    index = {character: position for position, character in enumerate(characters)}
    tokens = torch.tensor([index[character] for character in text], dtype=torch.long, device="cpu")
    return Corpus(name, characters, tokens, tab_indents=path is None)


def batch_for_step(corpus: Corpus, step: int, batch_size: int, block_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of a step, the same on every rank and after a resume: random windows of the
    text as inputs, the same windows shifted by one character as targets."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, corpus.tokens.numel() - block_size - 1, (batch_size,), generator=generator, device="cpu")
    windows = torch.stack([corpus.tokens[start : start + block_size + 1] for start in starts.tolist()])
    return windows[:, :-1], windows[:, 1:]
