# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""The recall corpus: text that can only be predicted by attending far back.

Every document is ``n`` distinct random pseudo-words, the marker ``<recall>``,
then the same ``n`` words again. The first half is unpredictable (about
ln 2044 = 7.6 nats a word); each word of the second half is fully determined
by the word ``n + 1`` positions earlier.

torchtitan's HuggingFaceTextDataset packs ``bos + doc + eos`` back to back and
cuts windows of ``seq_len + 1`` tokens. A document of ``doc_tokens = 2n + 3 =
seq_len + 1`` tokens therefore fills exactly one window: every window starts
at a BOS, all its copied words have their source in the window, and the copy
distance ``n + 1 = seq_len / 2`` is at least the segment length of a uniform
plan for every k >= 2. A model whose attention stops at segment boundaries
cannot predict any copied word.

Packed windows: when ``doc_tokens`` divides ``seq_len + 1`` (43 at seq_len
128), every window holds ``(seq_len + 1) / doc_tokens`` whole documents
back to back, the layout block-causal attention (``attn_mask_type =
"block_causal"``) is for: documents cross segment boundaries, and a token
needs the earlier segments' part of its own document and nothing of the
documents before it. Documents are independent, so masking the earlier ones
out costs nothing. With other sizes the documents drift across windows,
every row of a batch with its own layout: copies whose source fell into the
previous window are lost (about a quarter at seq_len 512 with 257-token
documents), and the rest may or may not cross a segment boundary.

Documents are generated from their index when read (a ``with_transform`` on an
index column), so loading is instant at any size, row i is the same document
whatever the corpus size or DP sharding, and resuming at ``sample_idx`` works.
"""

import math
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
from datasets import Dataset

from torchtitan_seq1f1b.data.make_tokenizer import BOS_ID, EOS_ID, RECALL, RECALL_ID, pseudo_words

__all__ = [
    "RecallSpec",
    "dependent_mask",
    "full_attention_bound",
    "load_recall",
    "no_cross_segment_bound",
    "recall_document",
    "sample_text",
]

_SPLIT_DOCS = {"train": 1 << 20, "validation": 512}


@dataclass(frozen=True)
class RecallSpec:
    """What a dataset path such as ``"doc_tokens=513,seed=3"`` selects.

    doc_tokens: tokens per document including BOS and EOS; odd, >= 5. Use
        seq_len + 1 for one document per window, or a divisor of seq_len + 1
        for several whole documents per window (packed); either keeps windows
        aligned with documents.
    docs: number of documents; None means 2**20 for train, 512 for validation.
    seed: corpus seed; train and validation differ for every seed.
    words: draw words from the first ``words`` pseudo-words (<= 2044).
    """

    doc_tokens: int = 257
    docs: int | None = None
    seed: int = 0
    words: int = len(pseudo_words())

    def __post_init__(self):
        if self.doc_tokens < 5 or self.doc_tokens % 2 == 0:
            raise ValueError(f"doc_tokens must be odd and >= 5 (use seq_len + 1), got {self.doc_tokens}")
        if not 1 <= self.words <= len(pseudo_words()):
            raise ValueError(f"words must be in [1, {len(pseudo_words())}], got {self.words}")
        if self.half_words > self.words:
            n = self.half_words
            raise ValueError(f"{n} distinct words per document need words >= {n}, got {self.words}")
        if self.docs is not None and self.docs < 1:
            raise ValueError(f"docs must be >= 1, got {self.docs}")

    @property
    def half_words(self) -> int:
        """n: words in each half of a document."""
        return (self.doc_tokens - 3) // 2

    @classmethod
    def parse(cls, path: str | None) -> "RecallSpec":
        """Comma-separated ``key=value`` overrides of the defaults; "" or None for none."""
        keys = {f.name for f in fields(cls)}
        overrides: dict[str, int] = {}
        for item in filter(None, (s.strip() for s in (path or "").split(","))):
            key, sep, value = item.partition("=")
            key = key.strip()
            if not sep or key not in keys:
                raise ValueError(
                    f"bad recall dataset path item {item!r} in {path!r}: "
                    f"expected key=value with key in {sorted(keys)}"
                )
            overrides[key] = int(value)
        return cls(**overrides)

    def to_path(self) -> str:
        """Inverse of :meth:`parse`."""
        return ",".join(f"{k}={v}" for k, v in asdict(self).items() if v is not None)


def recall_document(spec: RecallSpec, split: str, index: int) -> str:
    """Text of document ``index``: ``w_1 .. w_n <recall> w_1 .. w_n`` (no BOS/EOS).

    Seeded by (split, seed, index) through a string seed, which Python hashes
    with SHA-512: identical on every platform and run, whatever PYTHONHASHSEED.
    The n words are distinct, so each copied word has exactly one source.
    """
    rng = random.Random(f"seq1f1b-recall/{split}/{spec.seed}/{index}")
    first = rng.sample(pseudo_words()[: spec.words], spec.half_words)
    return " ".join([*first, RECALL, *first])


class _Documents:
    """Dataset transform: a batch of indices -> their documents (picklable for workers)."""

    def __init__(self, spec: RecallSpec, split: str):
        self.spec, self.split = spec, split

    def __call__(self, batch: dict[str, list]) -> dict[str, list]:
        return {"text": [recall_document(self.spec, self.split, i) for i in batch["index"]]}


def split_size(spec: RecallSpec, split: str) -> int:
    """Documents in ``split`` ("train" or "validation") of the corpus ``spec`` selects."""
    if split not in _SPLIT_DOCS:
        raise ValueError(f"split must be one of {sorted(_SPLIT_DOCS)}, got {split!r}")
    return spec.docs if spec.docs is not None else _SPLIT_DOCS[split]


def load_recall(path: str | None, split: str = "train") -> Dataset:
    """torchtitan DatasetConfig loader: a map-style Dataset of {"text": str} rows."""
    spec = RecallSpec.parse(path)
    docs = split_size(spec, split)
    return Dataset.from_dict({"index": range(docs)}).with_transform(_Documents(spec, split))


def sample_text(sample: dict[str, Any]) -> str:
    """torchtitan DatasetConfig sample_processor."""
    return sample["text"]


def dependent_mask(labels: torch.Tensor) -> torch.Tensor:
    """Which labels are copied words whose source is inside the same window.

    labels: LongTensor (B, L), the window's ``x[1:]`` -> BoolTensor (B, L).

    Label t is dependent if it is the i-th word after a ``<recall>`` marker at
    label s and the i-th word of the same document's first half is itself a
    label (position s - n - 1 + i >= 0; the input's extra first token is left
    out so that an induction head also sees the word before the source). ``n``
    is read off the document's BOS, or its EOS if the BOS is cut off; with
    neither in the row nothing is claimed. Only earlier content predicts these
    labels: a model that cannot look back that far is at chance on them.
    Token ids are those of the shipped tokenizer.
    """
    mask = torch.zeros(labels.shape, dtype=torch.bool)
    for row, y in enumerate(labels.tolist()):
        for s in (j for j, token in enumerate(y) if token == RECALL_ID):
            before = [j for j in range(s) if y[j] in (BOS_ID, EOS_ID)]
            after = [j for j in range(s + 1, len(y)) if y[j] in (BOS_ID, EOS_ID)]
            if before and y[before[-1]] == BOS_ID:
                n = s - before[-1] - 1
            elif after and y[after[0]] == EOS_ID:
                n = after[0] - s - 1
            else:
                continue
            first_visible = max(1, n + 1 - s)
            mask[row, s + first_visible : min(s + n + 1, len(y))] = True
    return mask


def _label_losses(spec: RecallSpec, segment_starts: Sequence[int]) -> list[float]:
    """Lowest expected loss (nats) of every label of one document for a model
    that sees the inputs from the start of the label's segment onwards.

    The document is ``bos w_1 .. w_n <recall> w_1 .. w_n eos``; inputs are its
    first ``2n + 2`` tokens, labels the last; ``segment_starts`` are in its own
    positions (0 for a segment that starts at or before its BOS). The model is
    granted the generator, the label's absolute position and every visible
    input, so the bound holds for any model that cannot attend to earlier
    segments. The n words are a uniform sample without replacement from the
    pool, so given the visible (distinct) words, an unseen word is uniform over
    the others: ``ln(words - visible)``. A copied word whose source is visible,
    the marker and the EOS cost nothing.
    """
    n, pool = spec.half_words, spec.words
    losses = []
    for t in range(2 * n + 2):
        start = max(s for s in segment_starts if s <= t)
        if t < n:  # label w_{t+1}; visible words: inputs max(start, 1)..t
            losses.append(math.log(pool - max(0, t - max(start, 1) + 1)))
        elif t in (n, 2 * n + 1):  # <recall>, eos
            losses.append(0.0)
        else:  # label w_i, i = t - n, copied from input i
            i = t - n
            if i >= start:
                losses.append(0.0)
                continue
            first_half_seen = max(0, n - max(start, 1) + 1)
            second_half_seen = max(0, i - max(1, start - n - 1))
            losses.append(math.log(pool - first_half_seen - second_half_seen))
    return losses


def no_cross_segment_bound(
    spec: RecallSpec, segment_lengths: Sequence[int], shifted_per_document: bool = False
) -> float:
    """Lowest mean loss per label (nats) on this corpus for any model that cannot
    attend to earlier segments of its window, cut as ``segment_lengths``.

    Windows must hold whole documents: ``doc_tokens`` divides ``seq_len + 1``
    (``seq_len = sum(segment_lengths)``), as torchtitan packs them then. A
    label that predicts the BOS of a window's next document costs nothing (it
    always follows an EOS), and no document tells anything about another, so
    the bound also holds for block-causal models. The mean loss of
    torchtitan's training log is per label, so the two compare directly.
    ``shifted_per_document``: torchtitan main's packing, which shifts each
    document on its own (``doc_tokens - 1`` inputs and labels each, no label
    predicts a BOS); then ``doc_tokens - 1`` must divide ``seq_len``.
    """
    seq_len = sum(segment_lengths)
    stride, window = (spec.doc_tokens - 1, seq_len) if shifted_per_document else (
        spec.doc_tokens, seq_len + 1
    )
    if window % stride:
        raise ValueError(
            f"the bound needs windows of whole documents: {stride} tokens per document "
            f"(doc_tokens={spec.doc_tokens}) must divide {window}"
        )
    starts = [sum(segment_lengths[:j]) for j in range(len(segment_lengths))]
    losses = []
    for offset in range(0, window, stride):
        # Segment starts in the document's own positions; one before it starts at 0.
        losses += _label_losses(spec, [max(0, s - offset) for s in starts])
    # The labels that predict a later document's BOS add nothing but count.
    return math.fsum(losses) / seq_len


def full_attention_bound(
    spec: RecallSpec, seq_len: int | None = None, shifted_per_document: bool = False
) -> float:
    """Lowest mean loss per label (nats) on aligned windows of ``seq_len``
    (default ``doc_tokens - 1``, one document per window) for any model: the
    first half's words, whatever the model sees; copies, marker, EOS and BOS free."""
    length = spec.doc_tokens - 1 if seq_len is None else seq_len
    return no_cross_segment_bound(spec, [length], shifted_per_document)
