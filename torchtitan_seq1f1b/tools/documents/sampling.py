# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Document ids of windows cut from a packed stream of documents, reproducibly."""

import random
from itertools import accumulate

import torch

from torchtitan_seq1f1b.segmenting import DocumentLengths

__all__ = ["sample_document_ids"]


def sample_document_ids(
    documents: DocumentLengths, rows: int, seq_len: int, seed: int = 0
) -> torch.Tensor:
    """Ids (rows, seq_len), int64, of windows cut at random points of a stream of documents.

    Like torchtitan's packed datasets, a window usually starts mid-document:
    the first document is drawn length-biased (a random token falls in a long
    document more often) and the window starts at a uniform point of it; the
    following documents are drawn from ``documents``. Ids start at 0 in each
    row. The same ``seed`` gives the same ids.
    """
    if rows < 1 or seq_len < 1:
        raise ValueError(f"rows={rows} and seq_len={seq_len} must be positive")
    rng = random.Random(seed)
    lengths = documents.lengths
    cumulative = list(accumulate(documents.probabilities))
    biased = list(accumulate(n * p for n, p in zip(lengths, documents.probabilities)))
    index, sizes = [], []  # every row's documents, in one flat list for one torch call
    for _ in range(rows):
        first = rng.choices(lengths, cum_weights=biased)[0]
        pieces = [first - rng.randrange(first)]
        covered = pieces[0]
        while covered < seq_len:
            pieces.append(rng.choices(lengths, cum_weights=cumulative)[0])
            covered += pieces[-1]
        pieces[-1] -= covered - seq_len
        index += range(len(pieces))
        sizes += pieces
    return torch.repeat_interleave(torch.tensor(index), torch.tensor(sizes)).view(rows, seq_len)
