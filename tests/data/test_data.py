# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""The embedded recall corpus and tokenizer, through torchtitan's own data path."""

import itertools
import math
from collections import Counter, defaultdict

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torchtitan.components.tokenizer import HuggingFaceTokenizer, build_hf_tokenizer
from torchtitan.config import ConfigManager
from torchtitan.hf_datasets.text_datasets import (
    DATASETS,
    HuggingFaceTextDataset,
    build_text_dataloader,
    build_text_validation_dataloader,
)

from torchtitan_seq1f1b.data import (
    DATASET_NAMES,
    TOKENIZER_DIR,
    VOCAB_SIZE,
    RecallSpec,
    dependent_mask,
    full_attention_bound,
    load_recall,
    no_cross_segment_bound,
    recall_document,
    register_datasets,
    resolve_hf_assets_path,
)
from torchtitan_seq1f1b.data.make_tokenizer import (
    BOS_ID,
    EOS_ID,
    RECALL,
    RECALL_ID,
    UNK,
    pseudo_words,
    write_tokenizer,
)


@pytest.fixture(scope="module")
def tokenizer():
    return HuggingFaceTokenizer(str(TOKENIZER_DIR))


@pytest.fixture(scope="module", autouse=True)
def registered():
    register_datasets()


def windows(name, n, tokenizer, seq_len, path=None, dp_rank=0, dp_world_size=1):
    """The first n (input, label) windows of torchtitan's own packing: (n, seq_len) each."""
    dataset = HuggingFaceTextDataset(
        name, path, tokenizer, seq_len=seq_len, dp_rank=dp_rank, dp_world_size=dp_world_size
    )
    pairs = [pair for pair, _ in zip(dataset, range(n))]
    return torch.stack([x["input"] for x, _ in pairs]), torch.stack([y for _, y in pairs])


# --- tokenizer -------------------------------------------------------------


def test_shipped_tokenizer_files_are_what_the_script_writes(tmp_path):
    write_tokenizer(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / name).read_bytes() == (TOKENIZER_DIR / name).read_bytes(), (
            f"{name} is stale: run python -m torchtitan_seq1f1b.data.make_tokenizer"
        )


def test_tokenizer_round_trip_vocab_and_special_ids(tokenizer):
    assert tokenizer.vocab_size == VOCAB_SIZE <= 2048  # llama3 debugmodel's vocab_size
    assert (tokenizer.bos_id, tokenizer.eos_id) == (BOS_ID, EOS_ID)
    assert tokenizer.token_to_id(RECALL) == RECALL_ID
    assert len(set(pseudo_words())) == VOCAB_SIZE - 4
    # No post-processor: BOS/EOS come only when asked, and only once.
    assert tokenizer.encode("") == []

    text = recall_document(RecallSpec(), "train", 0)
    ids = tokenizer.encode(text, add_bos=True, add_eos=True)
    assert ids[0] == BOS_ID and ids[-1] == EOS_ID and ids.count(BOS_ID) == 1
    assert tokenizer.token_to_id(UNK) not in ids
    assert len(ids) == RecallSpec().doc_tokens
    assert max(ids) < VOCAB_SIZE
    assert tokenizer.decode(ids) == text  # specials skipped, words space-joined
    every_word = " ".join(pseudo_words())
    assert tokenizer.decode(tokenizer.encode(every_word)) == every_word


# --- corpus ----------------------------------------------------------------


def test_documents_are_deterministic_and_splits_differ():
    spec = RecallSpec()
    train = load_recall(None, "train")
    assert len(train) == 1 << 20 and len(load_recall(None, "validation")) == 512
    first = [train[i]["text"] for i in range(4)]
    assert first == [load_recall("", "train")[i]["text"] for i in range(4)]
    assert first[0] == recall_document(spec, "train", 0)
    assert len(set(first)) == 4
    assert recall_document(spec, "validation", 0) != first[0]
    assert recall_document(RecallSpec(seed=1), "train", 0) != first[0]
    # A document does not depend on the corpus size.
    assert load_recall("docs=3", "train")[2]["text"] == first[2]

    words = first[0].split()
    n = spec.half_words
    assert len(words) == 2 * n + 1 and words[n] == RECALL
    assert words[:n] == words[n + 1 :] and len(set(words[:n])) == n


def test_spec_paths():
    spec = RecallSpec.parse(" doc_tokens=513, seed=3,words=300")
    assert (spec.doc_tokens, spec.seed, spec.words, spec.half_words) == (513, 3, 300, 255)
    assert RecallSpec.parse(spec.to_path()) == spec
    assert RecallSpec.parse(None) == RecallSpec.parse("") == RecallSpec()
    for bad in ("doc_tokens=256", "doc_tokens=3", "seq_len=256", "seed", "words=100,doc_tokens=513"):
        with pytest.raises(ValueError):
            RecallSpec.parse(bad)


def test_register_datasets_is_idempotent():
    register_datasets()
    configs = {name: DATASETS[name] for name in DATASET_NAMES}
    register_datasets()
    assert set(DATASET_NAMES) == {"seq1f1b_recall", "seq1f1b_recall_validation"}
    for name, config in configs.items():
        assert DATASETS[name].path == config.path == RecallSpec().to_path()
    assert "c4_test" in DATASETS  # torchtitan's own entries stay


def test_resolve_hf_assets_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a working dir without the checkout
    for spelling in ("torchtitan_seq1f1b/assets/tokenizer", "./torchtitan_seq1f1b/assets/tokenizer/"):
        assert resolve_hf_assets_path(spelling) == str(TOKENIZER_DIR)
    assert resolve_hf_assets_path(str(tmp_path)) == str(tmp_path)
    assert resolve_hf_assets_path("./elsewhere") == "./elsewhere"


def _conditional_entropy(spec, segment_lengths):
    """Mean over labels of H(label | position, inputs of its segment up to it),
    by enumerating every window of the corpus (tiny specs only). A window
    holds (seq_len + 1) / doc_tokens documents back to back."""
    n, seq_len = spec.half_words, sum(segment_lengths)
    starts = [sum(segment_lengths[:j]) for j in range(len(segment_lengths))]
    documents = [
        [BOS_ID, *words, RECALL_ID, *words, EOS_ID]
        for words in itertools.permutations(range(4, 4 + spec.words), n)
    ]
    windows = [
        sum(docs, [])
        for docs in itertools.product(documents, repeat=(seq_len + 1) // spec.doc_tokens)
    ]
    total = 0.0
    for t in range(seq_len):
        start = max(s for s in starts if s <= t)
        by_context = defaultdict(Counter)
        for window in windows:
            by_context[tuple(window[start : t + 1])][window[t + 1]] += 1
        for labels in by_context.values():
            count = sum(labels.values())
            total += sum(c * math.log(count / c) for c in labels.values()) / len(windows)
    return total / seq_len


@pytest.mark.parametrize(
    "half_words,words,segment_lengths",
    [(2, 4, [3, 3]), (2, 4, [2, 2, 2]), (3, 5, [5, 3]), (3, 5, [2, 2, 2, 2]), (3, 4, [1, 4, 3]),
     (3, 6, [8]),
     # packed: two or three documents per window, segments across their borders
     (2, 4, [13]), (2, 4, [6, 7]), (2, 4, [4, 5, 4]), (2, 3, [8, 6, 6]), (3, 4, [10, 7])],
)
def test_bounds_equal_the_exact_conditional_entropy(half_words, words, segment_lengths):
    spec = RecallSpec(doc_tokens=2 * half_words + 3, words=words)
    expected = _conditional_entropy(spec, segment_lengths)
    assert no_cross_segment_bound(spec, segment_lengths) == pytest.approx(expected, rel=1e-12)
    if len(segment_lengths) == 1:
        seq_len = segment_lengths[0]
        assert full_attention_bound(spec, seq_len) == pytest.approx(expected, rel=1e-12)
        if seq_len + 1 == spec.doc_tokens:
            assert full_attention_bound(spec) == full_attention_bound(spec, seq_len)


def test_bounds_of_the_debug_job():
    spec = RecallSpec.parse("doc_tokens=257,words=256")
    blind = no_cross_segment_bound(spec, [64] * 4)
    assert full_attention_bound(spec) < blind - 2.5 < math.log(256)
    assert no_cross_segment_bound(spec, [256]) == full_attention_bound(spec)
    with pytest.raises(ValueError, match="257 tokens per document \\(doc_tokens=257\\) must divide 129"):
        no_cross_segment_bound(spec, [64, 64])


def test_bounds_of_packed_windows():
    """Three 43-token documents per 129-token window: the per-document loss is
    that of a lone document, spread over seq_len labels with two free BOS labels."""
    spec = RecallSpec.parse("doc_tokens=43,words=64")
    lone = full_attention_bound(spec)  # per label of a 42-label window
    assert full_attention_bound(spec, 128) == pytest.approx(3 * 42 * lone / 128, rel=1e-12)
    # Segments that cut documents cost attention across them; their borders matter.
    blind = no_cross_segment_bound(spec, [32] * 4)
    assert full_attention_bound(spec, 128) + 0.5 < blind
    assert no_cross_segment_bound(spec, [43, 43, 42]) == full_attention_bound(spec, 128)
    with pytest.raises(ValueError, match="43 tokens per document \\(doc_tokens=43\\) must divide 128"):
        no_cross_segment_bound(spec, [64, 63])


# --- through torchtitan ----------------------------------------------------


def test_torchtitan_dataloaders_yield_aligned_recall_windows():
    config = ConfigManager().parse_args([
        "--model.hf_assets_path", str(TOKENIZER_DIR),
        "--training.dataset", "seq1f1b_recall",
        "--training.seq_len", "256",
        "--training.local_batch_size", "4",
        "--validation.dataset", "seq1f1b_recall_validation",
        "--validation.seq_len", "256",
        "--validation.local_batch_size", "4",
    ])  # fmt: skip
    tokenizer = build_hf_tokenizer(config)
    train = build_text_dataloader(1, 0, tokenizer, config)
    (inputs, labels), = [batch for batch, _ in zip(train, range(1))]
    inputs = inputs["input"]
    assert inputs.shape == labels.shape == (4, 256)
    assert torch.equal(inputs[:, 1:], labels[:, :-1])
    # doc_tokens = seq_len + 1: every window is one document.
    assert (inputs[:, 0] == BOS_ID).all() and (labels[:, -1] == EOS_ID).all()
    assert (labels[:, 127] == RECALL_ID).all()
    assert torch.equal(labels[:, 128:255], labels[:, :127])
    expected = torch.zeros_like(labels, dtype=torch.bool)
    expected[:, 128:255] = True
    assert torch.equal(dependent_mask(labels), expected)

    validation = build_text_validation_dataloader(1, 0, tokenizer, config)
    (val_inputs, _), = [batch for batch, _ in zip(validation, range(1))]
    assert not torch.equal(val_inputs["input"], inputs)

    # DP ranks read disjoint documents.
    rank0, _ = windows("seq1f1b_recall", 2, tokenizer, 256, dp_rank=0, dp_world_size=2)
    rank1, _ = windows("seq1f1b_recall", 2, tokenizer, 256, dp_rank=1, dp_world_size=2)
    assert not set(map(tuple, rank0.tolist())) & set(map(tuple, rank1.tolist()))


def test_packed_windows_hold_whole_documents(tokenizer):
    """doc_tokens dividing seq_len + 1 packs whole documents (3 of 43 tokens per
    129-token window), each starting at a BOS; other sizes drift, so the rows
    of one batch hold documents at different places."""
    inputs, labels = windows("seq1f1b_recall", 4, tokenizer, 128, path="doc_tokens=43,words=64")
    assert (inputs[:, [0, 43, 86]] == BOS_ID).all() and ((inputs == BOS_ID).sum(1) == 3).all()
    assert (labels[:, [41, 84, 127]] == EOS_ID).all() and ((labels == EOS_ID).sum(1) == 3).all()
    expected = torch.zeros_like(labels, dtype=torch.bool)
    for offset in (0, 43, 86):  # a document's copied words are labels 21..40 of it
        expected[:, offset + 21 : offset + 41] = True
        assert torch.equal(labels[:, offset + 21 : offset + 41], labels[:, offset : offset + 20])
    assert torch.equal(dependent_mask(labels), expected)

    drifting, _ = windows("seq1f1b_recall", 4, tokenizer, 128, path="doc_tokens=41,words=64")
    layouts = {tuple((row == BOS_ID).nonzero().flatten().tolist()) for row in drifting}
    assert len(layouts) == 4 and all(len(starts) >= 3 for starts in layouts)


def test_resume_from_state_dict(tokenizer):
    dataset = HuggingFaceTextDataset("seq1f1b_recall", None, tokenizer, seq_len=512)
    stream = iter(dataset)
    for _ in range(3):  # docs of 257 tokens: the buffer holds a partial document
        next(stream)
    state = dataset.state_dict()
    expected = next(stream)
    resumed = HuggingFaceTextDataset("seq1f1b_recall", None, tokenizer, seq_len=512)
    resumed.load_state_dict(state)
    got = next(iter(resumed))
    assert torch.equal(got[0]["input"], expected[0]["input"]) and torch.equal(got[1], expected[1])


def test_dependent_mask_matches_packing_oracle(tokenizer):
    """Misaligned windows (seq_len 512, 257-token documents): rebuild torchtitan's
    packing by hand, label every token with its copy source, and compare."""
    spec, seq_len, n_windows = RecallSpec(), 512, 40
    _, labels = windows("seq1f1b_recall", n_windows, tokenizer, seq_len)

    stream, source = [], []  # source[p]: stream position that token p copies, or None
    index = 0
    while len(stream) < n_windows * (seq_len + 1):
        ids = tokenizer.encode(recall_document(spec, "train", index), add_bos=True, add_eos=True)
        start, n = len(stream), spec.half_words
        stream += ids
        source += [None] * (n + 2) + [start + 1 + i for i in range(n)] + [None]
        index += 1
    expected = torch.zeros_like(labels, dtype=torch.bool)
    for w in range(n_windows):
        first_label = w * (seq_len + 1) + 1
        assert labels[w].tolist() == stream[first_label : first_label + seq_len]
        for t in range(seq_len):
            src = source[first_label + t]
            expected[w, t] = src is not None and src >= first_label
    assert torch.equal(dependent_mask(labels), expected)
    assert 0.35 < expected.float().mean() < 0.5
    # Every dependent label repeats the label 128 positions earlier.
    rows, cols = expected.nonzero(as_tuple=True)
    assert torch.equal(labels[rows, cols], labels[rows, cols - spec.half_words - 1])

    # A row with a marker but neither BOS nor EOS gives no n: nothing is claimed.
    assert not dependent_mask(torch.tensor([[5, 6, RECALL_ID, 5, 6]])).any()


# --- the point of the corpus: long-range structure --------------------------


class InductionLM(nn.Module):
    """One causal attention layer whose keys also see the previous token.

    tokens (batch, seq_len) -> logits (batch, seq_len, vocab_size).
    This "smeared key" model forms an induction head (find where the current
    token occurred before, copy what followed) within ~100 steps, where a
    plain 2-layer transformer plateaus for several hundred: that keeps the test
    cheap. Logits are tied to the embedding, so copying needs no per-word
    output weights.
    """

    def __init__(self, vocab_size: int, dim: int):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, dim)
        nn.init.normal_(self.embedding.weight)
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(2 * dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embedding(tokens)  # (b, s, d)
        previous = F.pad(h, (0, 0, 1, 0))[:, :-1]
        q, k, v = self.wq(h), self.wk(torch.cat([h, previous], dim=-1)), self.wv(h)
        out = F.scaled_dot_product_attention(q[:, None], k[:, None], v[:, None], is_causal=True)
        return out[:, 0] @ self.embedding.weight.T / math.sqrt(h.shape[-1])


def train_and_eval(train_windows, val_windows, num_segments, steps=150, batch=8):
    """Dependent-token loss on val_windows after training on train_windows.

    num_segments=1 is full causal attention; k > 1 feeds each of the k segments
    as its own sequence, so no token sees an earlier segment.
    """

    def logits(model, tokens):
        b, s = tokens.shape
        return model(tokens.reshape(b * num_segments, s // num_segments)).reshape(b, s, -1)

    (x, y), (val_x, val_y) = train_windows, val_windows
    torch.manual_seed(0)
    model = InductionLM(VOCAB_SIZE, dim=64)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(steps):
        rows = slice(step * batch, (step + 1) * batch)
        loss = F.cross_entropy(logits(model, x[rows]).flatten(0, 1), y[rows].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        losses = F.cross_entropy(
            logits(model, val_x).flatten(0, 1), val_y.flatten(), reduction="none"
        ).view(val_y.shape)
    return losses[dependent_mask(val_y)].mean().item()


def test_long_range_structure_needs_attention_across_segments(tokenizer):
    """Windows of 256 tokens cut into k=2 segments of 128: every copied word's
    source is in the other segment. Seeing it drives the loss on copied words
    near 0; not seeing it leaves them at chance (ln 2044 = 7.6 nats)."""
    steps, batch, seq_len, k = 150, 8, 256, 2
    train = windows("seq1f1b_recall", steps * batch, tokenizer, seq_len)
    val = windows("seq1f1b_recall_validation", 32, tokenizer, seq_len)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # faster for these sizes, and kinder to a shared machine
    try:
        full = train_and_eval(train, val, num_segments=1, steps=steps, batch=batch)
        split = train_and_eval(train, val, num_segments=k, steps=steps, batch=batch)
    finally:
        torch.set_num_threads(threads)
    print(f"dependent-token loss: full attention {full:.3f}, {k} separate segments {split:.3f}")
    chance = math.log(len(pseudo_words()))
    assert split > chance - 0.5, (full, split)
    assert full < 0.5 * split and full < 1.0, (full, split)


def test_bounds_of_documents_shifted_one_by_one():
    """torchtitan main's packing: each 42-label document on its own, three per 126-token
    row, no BOS label; documents in segments of their own see all they need."""
    spec = RecallSpec.parse("doc_tokens=43,words=64")
    lone = full_attention_bound(spec)
    assert full_attention_bound(spec, 126, shifted_per_document=True) == pytest.approx(lone)
    assert no_cross_segment_bound(spec, [42] * 3, shifted_per_document=True) == pytest.approx(lone)
    blind = no_cross_segment_bound(spec, [32, 32, 32, 30], shifted_per_document=True)
    assert lone + 0.5 < blind
    with pytest.raises(ValueError, match="42 tokens per document \\(doc_tokens=43\\) must divide 128"):
        no_cross_segment_bound(spec, [64, 64], shifted_per_document=True)
