# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Build the shipped word-level tokenizer of the embedded recall corpus.

    python -m torchtitan_seq1f1b.data.make_tokenizer   # rewrites assets/tokenizer/

The vocabulary is 4 fixed tokens and 2044 pseudo-words ("bako", "tifu", ...),
2048 ids in all: exactly the vocab_size of torchtitan's llama3 "debugmodel"
flavor, which never reads the size from the tokenizer. Everything is derived
from a fixed string seed, so running this again gives the same bytes, and
tests check that the committed files are what this script writes.
"""

import functools
import json
import random
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

__all__ = [
    "BOS",
    "BOS_ID",
    "EOS",
    "EOS_ID",
    "RECALL",
    "RECALL_ID",
    "TOKENIZER_DIR",
    "UNK",
    "VOCAB_SIZE",
    "build_tokenizer",
    "pseudo_words",
    "write_tokenizer",
]

TOKENIZER_DIR = Path(__file__).resolve().parent.parent / "assets" / "tokenizer"
"""Directory holding tokenizer.json and tokenizer_config.json (point hf_assets_path here)."""

VOCAB_SIZE = 2048
UNK = "<unk>"
BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
# An ordinary word, not a special token: decode keeps it, so text round-trips.
RECALL = "<recall>"
_FIXED = (UNK, BOS, EOS, RECALL)  # ids 0..3
BOS_ID, EOS_ID, RECALL_ID = (_FIXED.index(t) for t in (BOS, EOS, RECALL))
_SPECIAL = (UNK, BOS, EOS)

_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"
_SEED = "torchtitan-seq1f1b/pseudo-words/v1"


@functools.cache
def pseudo_words() -> tuple[str, ...]:
    """The 2044 distinct two-syllable pseudo-words, in id order (ids 4..2047)."""
    syllables = [c + v for c in _CONSONANTS for v in _VOWELS]
    candidates = [a + b for a in syllables for b in syllables]  # 4900, all distinct
    return tuple(random.Random(_SEED).sample(candidates, VOCAB_SIZE - len(_FIXED)))


def build_tokenizer() -> Tokenizer:
    """Whitespace-split word-level tokenizer; decode joins tokens with single spaces.

    There is no post-processor: torchtitan's HuggingFaceTokenizer adds BOS/EOS
    itself when the dataset asks (add_bos=True, add_eos=True), and would add
    them twice otherwise.
    """
    vocab = {token: i for i, token in enumerate(_FIXED + pseudo_words())}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # Already in the vocab, so their ids stay 0..2; this marks them special.
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in _SPECIAL])
    assert tokenizer.get_vocab_size() == VOCAB_SIZE
    return tokenizer


def tokenizer_config() -> dict:
    """tokenizer_config.json: HuggingFaceTokenizer reads bos/eos from here."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "unk_token": UNK,
        # Explicit, so encode() adds nothing unless asked (the dataset asks).
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": 1 << 20,
        "added_tokens_decoder": {
            str(_FIXED.index(t)): {
                "content": t,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "single_word": False,
                "special": True,
            }
            for t in _SPECIAL
        },
    }


def write_tokenizer(directory: str | Path = TOKENIZER_DIR) -> Path:
    """Write tokenizer.json and tokenizer_config.json into ``directory``; returns it."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    build_tokenizer().save(str(directory / "tokenizer.json"), pretty=True)
    with open(directory / "tokenizer_config.json", "w") as f:
        json.dump(tokenizer_config(), f, indent=2)
        f.write("\n")
    return directory


if __name__ == "__main__":
    print(f"wrote {write_tokenizer()}")
