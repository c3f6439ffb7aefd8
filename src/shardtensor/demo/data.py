"""The demo's text: the Python standard library's own source files (on every machine that runs
Python, read at run time, nothing downloaded) or the user's file, as a character-level corpus."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch

__all__ = ["Corpus", "load_corpus", "standard_library_text", "batch_for_step"]

DEFAULT_BYTES = 400_000


def standard_library_text(limit: int = DEFAULT_BYTES) -> str:
    """About `limit` characters of ASCII from the standard library's top-level .py files, in name order."""
    root = Path(os.__file__).parent
    parts, total = [], 0
    for path in sorted(root.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="ignore")
        text = "".join(character for character in text if character == "\n" or " " <= character <= "~")
        parts.append(text)
        total += len(text)
        if total >= limit:
            break
    return "".join(parts)[:limit]


@dataclasses.dataclass(frozen=True)
class Corpus:
    """A text as token ids, with its sorted character vocabulary."""

    name: str
    characters: tuple[str, ...]
    tokens: torch.Tensor

    @property
    def vocab_size(self) -> int:
        return len(self.characters)

    def encode(self, text: str) -> torch.Tensor:
        index = {character: position for position, character in enumerate(self.characters)}
        return torch.tensor([index[character] for character in text if character in index], dtype=torch.long, device="cpu")

    def decode(self, tokens) -> str:
        return "".join(self.characters[int(token)] for token in tokens)


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
    return Corpus(name, characters, tokens)


def batch_for_step(corpus: Corpus, step: int, batch_size: int, block_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of a step, the same on every rank and after a resume: random windows of the
    text as inputs, the same windows shifted by one character as targets."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, corpus.tokens.numel() - block_size - 1, (batch_size,), generator=generator, device="cpu")
    windows = torch.stack([corpus.tokens[start : start + block_size + 1] for start in starts.tolist()])
    return windows[:, :-1], windows[:, 1:]
