"""Data that needs no download.

* Text: character-level Python source — the standard library's own ``*.py`` files, found
  wherever Python runs. Files are sorted by name; every 10th goes to validation, so the split
  is by file (no document straddles it) and deterministic for a given Python.
* Recall: multi-query associative recall (MQAR, Arora et al. 2023, "Zoology"): key–value
  pairs, then queries of keys seen earlier; the answer is the value paired with the key. The
  pairs are random per sequence, so only attention to the right earlier position solves it.
"""

from __future__ import annotations

import math
import re
import string
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

IGNORE = -100  # cross-entropy ignore_index: positions that carry no prediction target

# -- text --------------------------------------------------------------------------------------

# A fixed alphabet rather than one read off the corpus, so token ids mean the same thing on
# every machine and Python version: printable ASCII, tab and newline, and one unknown symbol.
CHARS = "\t\n" + "".join(c for c in string.printable if c.isprintable() and c not in "\t\n")
UNK = len(CHARS)
VOCAB_SIZE = len(CHARS) + 1
_TABLE = np.full(128, UNK, dtype=np.int64)
_TABLE[[ord(c) for c in CHARS]] = np.arange(len(CHARS))


def encode(text: str) -> Tensor:
    """str → int64 token ids; characters outside the alphabet map to ``UNK``."""
    cps = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32).astype(np.int64)
    ids = np.where(cps < 128, _TABLE[np.minimum(cps, 127)], UNK)
    return torch.from_numpy(ids)


def decode(ids: Tensor | list[int]) -> str:
    return "".join(CHARS[i] if i < UNK else "\N{REPLACEMENT CHARACTER}" for i in
                   (ids.tolist() if isinstance(ids, Tensor) else ids))


def stdlib_files() -> list[Path]:
    """The standard library's top-level ``*.py`` files, sorted by name."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"), key=lambda p: p.name)
    if not files:
        raise FileNotFoundError(f"no *.py files under the standard library at {root}")
    return files


# a document starts at every top-level ``def`` / ``class`` / decorator: function- and
# class-sized pieces of a file, from a few lines to a few thousand characters
_DOC_START = re.compile(r"\n(?=(?:def |class |@|async def ))")


def split_documents(text: str) -> list[str]:
    """A source file cut into documents at its top-level definitions (the module header
    before the first is one more)."""
    return [d for d in _DOC_START.split(text) if d]


@dataclass
class TextCorpus:
    train: Tensor  # (N_train,) int64 token ids
    val: Tensor  # (N_val,)
    files: int
    train_docs: Tensor | None = None  # (D_train + 1,) offsets where documents start
    val_docs: Tensor | None = None

    @classmethod
    def load(cls, val_every: int = 10) -> TextCorpus:
        files = stdlib_files()
        train, val, train_len, val_len = [], [], [], []
        for i, f in enumerate(files):
            docs = split_documents(f.read_text(encoding="utf-8", errors="replace"))
            is_val = i % val_every == val_every - 1
            for d in docs:
                ids = encode(d)
                (val if is_val else train).append(ids)
                (val_len if is_val else train_len).append(len(ids))

        def offsets(lengths: list[int]) -> Tensor:
            return torch.cat([torch.zeros(1, dtype=torch.int64),
                              torch.tensor(lengths, dtype=torch.int64).cumsum(0)])
        return cls(torch.cat(train), torch.cat(val), len(files), offsets(train_len),
                   offsets(val_len))

    def packed_batch(self, split: str, batch: int, block: int, generator: torch.Generator
                     ) -> tuple[Tensor, Tensor, Tensor]:
        """Rows of whole documents laid end to end (random documents; the last one of a
        row cut at the row's end): x (B, T), y (B, T) and document ids (B, T), increasing
        along the flattened batch so that they give packed offsets directly. Every target
        lies inside its input's document (a document's last character is a target only)."""
        data, docs = (self.train, self.train_docs) if split == "train" else (self.val,
                                                                            self.val_docs)
        n_docs = len(docs) - 1
        xs, ys, ids, next_id = [], [], [], 0
        for _ in range(batch):
            row_x, row_y, row_id, filled = [], [], [], 0
            while filled < block:
                d = int(torch.randint(0, n_docs, (1,), generator=generator))
                a, b = int(docs[d]), int(docs[d + 1])
                take = min(b - a - 1, block - filled)  # x and its next-char target y
                if take <= 0:
                    continue
                row_x.append(data[a:a + take])
                row_y.append(data[a + 1:a + 1 + take])
                row_id.append(torch.full((take,), next_id))
                filled, next_id = filled + take, next_id + 1
            xs.append(torch.cat(row_x))
            ys.append(torch.cat(row_y))
            ids.append(torch.cat(row_id))
        return torch.stack(xs), torch.stack(ys), torch.stack(ids)

    def batch(self, split: str, batch: int, block: int, generator: torch.Generator
              ) -> tuple[Tensor, Tensor]:
        """Random windows: x (B, T) and the next-character targets y (B, T)."""
        data = self.train if split == "train" else self.val
        starts = torch.randint(0, len(data) - block - 1, (batch,), generator=generator)
        idx = starts[:, None] + torch.arange(block + 1)  # (B, T + 1)
        chunk = data[idx]
        return chunk[:, :-1], chunk[:, 1:]


def unigram_entropy(ids: Tensor, vocab_size: int = VOCAB_SIZE) -> float:
    """Entropy in nats of the character frequencies: the loss of the best model that ignores
    context, which a model that learned anything must beat."""
    p = torch.bincount(ids, minlength=vocab_size).double()
    p = p[p > 0] / p.sum()
    return float(-(p * p.log()).sum())


# -- multi-query associative recall ------------------------------------------------------------

@dataclass(frozen=True)
class RecallTask:
    """Sequences ``k1 v1 … kP vP  q1 … qQ``; keys are ids ``[0, num_keys)``, values
    ``[num_keys, num_keys + num_values)``, queries Q distinct keys of the P pairs in random
    order. The target at each query position is the value paired with that key.

    The answers are targets only, never inputs: with the answers in the sequence a model can
    score ``mean(1/k)`` by naming a value not yet answered, a shortcut it learns first and
    then sits on (we saw it stall at that accuracy for thousands of steps)."""

    num_keys: int = 16
    num_values: int = 16
    pairs: int = 4
    queries: int = 4

    def __post_init__(self) -> None:
        if self.pairs > self.num_keys:
            raise ValueError(f"pairs ({self.pairs}) needs distinct keys, but num_keys is "
                             f"{self.num_keys}")
        if not 0 < self.queries <= self.pairs:
            raise ValueError(f"queries must be in [1, pairs={self.pairs}], got {self.queries}")

    @property
    def vocab_size(self) -> int:
        return self.num_keys + self.num_values

    @property
    def seq_len(self) -> int:
        return 2 * self.pairs + self.queries

    @property
    def chance_loss(self) -> float:
        return math.log(self.num_values)

    def batch(self, batch: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        """x (B, T) token ids and y (B, T) targets, ``IGNORE`` except at query positions."""
        B, P, Q = batch, self.pairs, self.queries
        # distinct keys per sequence: the first P of a random permutation
        keys = torch.rand(B, self.num_keys, generator=generator).argsort(-1)[:, :P]  # (B, P)
        values = self.num_keys + torch.randint(0, self.num_values, (B, P), generator=generator)
        which = torch.rand(B, P, generator=generator).argsort(-1)[:, :Q]  # (B, Q) distinct
        ctx = torch.stack((keys, values), dim=-1).reshape(B, 2 * P)  # k1 v1 k2 v2 …
        x = torch.cat((ctx, keys.gather(1, which)), dim=1)  # (B, 2P + Q)
        y = torch.full_like(x, IGNORE)
        y[:, 2 * P:] = values.gather(1, which)
        return x, y


def recall_accuracy(logits: Tensor, y: Tensor) -> float:
    """Fraction of query positions whose argmax is the right value."""
    mask = y != IGNORE
    return float((logits.argmax(-1)[mask] == y[mask]).double().mean())
