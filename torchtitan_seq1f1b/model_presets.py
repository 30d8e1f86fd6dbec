# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Named transformer shapes for the pipeline simulator.

Two families:

- ``paper-*``: the GPT models of the Seq1F1B paper (arXiv 2406.03488), as the
  authors' Megatron-LM launch scripts define them (``exp.sh``: layers, hidden
  size, heads; everything else is Megatron's default): MHA, a GeLU MLP of width
  ``4 * dim``, LayerNorm and linear layers with biases, the GPT-2 BPE
  vocabulary (50257 tokens, padded by Megatron to a multiple of ``128 * tp``),
  untied input and output embeddings (``--untie-embeddings-and-output-weights``).
- ``llama3-*``: the Llama 3 8B / 70B shapes torchtitan trains: GQA with 8 K/V
  heads, SwiGLU MLP, RMSNorm, no biases, untied embeddings, vocabulary 128256.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from torchtitan_seq1f1b.segmenting import TransformerCost

__all__ = ["MODEL_PRESETS", "ModelShape", "get_preset"]


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer's shape, enough for FLOPs, parameters and activations.

    Args:
        name: label used in reports.
        n_layers, dim, n_heads, n_kv_heads, ffn_hidden_dim, vocab_size, gated_mlp:
            as in :class:`~torchtitan_seq1f1b.segmenting.TransformerCost`.
        bias: linear layers carry biases (Megatron GPT) or not (Llama).
        layernorm: LayerNorm (weight and bias) rather than RMSNorm (weight only).
        tied_embeddings: the LM head reuses the input embedding. Under pipeline
            parallelism the last stage still holds its own copy.
        vocab_multiple: Megatron pads the vocabulary to a multiple of
            ``vocab_multiple * tp`` (its ``--make-vocab-size-divisible-by``);
            1 means no padding (torchtitan).
    """

    name: str
    n_layers: int
    dim: int
    n_heads: int
    n_kv_heads: int
    ffn_hidden_dim: int
    vocab_size: int
    gated_mlp: bool
    bias: bool = False
    layernorm: bool = False
    tied_embeddings: bool = False
    vocab_multiple: int = 1

    def __post_init__(self) -> None:
        # TransformerCost validates every dimension and divisibility.
        self.cost()
        if self.vocab_multiple < 1:
            raise ValueError(f"vocab_multiple={self.vocab_multiple} must be >= 1")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_dim(self) -> int:
        """Width of one of K or V: ``n_kv_heads * head_dim``."""
        return self.n_kv_heads * self.head_dim

    def cost(self) -> TransformerCost:
        """The FLOP model the segment partitioner uses: this shape's fields of the same names."""
        return TransformerCost(**{f.name: getattr(self, f.name) for f in fields(TransformerCost)})

    def padded_vocab(self, tp: int) -> int:
        """Vocabulary rows actually allocated (Megatron pads for TP-even shards)."""
        multiple = self.vocab_multiple * tp if self.vocab_multiple > 1 else 1
        return -(-self.vocab_size // multiple) * multiple

    def layer_params(self, tp: int) -> int:
        """Parameters of one transformer block held by one TP rank.

        Matrices and their column-parallel biases are split ``tp`` ways; norms and
        the row-parallel output biases are replicated on every TP rank.
        """
        h, f, kv = self.dim, self.ffn_hidden_dim, self.kv_dim
        mlp_mats = 3 if self.gated_mlp else 2
        split = 2 * h * h + 2 * h * kv + mlp_mats * h * f
        replicated = (4 if self.layernorm else 2) * h
        if self.bias:
            split += h + 2 * kv + f  # QKV and MLP-in biases (column parallel)
            replicated += 2 * h  # attention-out and MLP-out biases (row parallel)
        return -(-split // tp) + replicated

    def embedding_params(self, tp: int) -> int:
        """One vocabulary-parallel embedding (input table or LM head) on one TP rank."""
        return self.padded_vocab(tp) * self.dim // tp

    def final_norm_params(self) -> int:
        return (2 if self.layernorm else 1) * self.dim


def _paper_gpt(name: str, n_layers: int, dim: int, n_heads: int) -> ModelShape:
    return ModelShape(
        name=name,
        n_layers=n_layers,
        dim=dim,
        n_heads=n_heads,
        n_kv_heads=n_heads,
        ffn_hidden_dim=4 * dim,
        vocab_size=50257,
        gated_mlp=False,
        bias=True,
        layernorm=True,
        vocab_multiple=128,
    )


MODEL_PRESETS: dict[str, ModelShape] = {
    "paper-2.7b": _paper_gpt("paper-2.7b", 32, 2560, 32),
    "paper-7b": _paper_gpt("paper-7b", 32, 4096, 32),
    "paper-13b": _paper_gpt("paper-13b", 40, 5120, 40),
    "paper-30b": _paper_gpt("paper-30b", 64, 6144, 64),
    "llama3-8b": ModelShape(
        name="llama3-8b", n_layers=32, dim=4096, n_heads=32, n_kv_heads=8,
        ffn_hidden_dim=14336, vocab_size=128256, gated_mlp=True,
    ),
    "llama3-70b": ModelShape(
        name="llama3-70b", n_layers=80, dim=8192, n_heads=64, n_kv_heads=8,
        ffn_hidden_dim=28672, vocab_size=128256, gated_mlp=True,
    ),
}


def get_preset(name: str) -> ModelShape:
    """The preset called ``name`` (case-insensitive)."""
    try:
        return MODEL_PRESETS[name.lower()]
    except KeyError:
        raise ValueError(
            f"unknown model preset {name!r}; choose one of {sorted(MODEL_PRESETS)}"
        ) from None
