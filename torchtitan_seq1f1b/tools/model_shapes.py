# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Named transformer shapes, and the parameters a shape puts on one TP rank.

Two families of :class:`~torchtitan_seq1f1b.segmenting.TransformerCost`:

- ``paper-*``: the GPT models of the Seq1F1B paper (arXiv 2406.03488), as the
  authors' Megatron-LM launch scripts define them (``exp.sh``: layers, hidden
  size, heads; everything else is Megatron's default): MHA, a GeLU MLP of width
  ``4 * dim``, LayerNorm and linear layers with biases, the GPT-2 BPE
  vocabulary (50257 tokens, padded by Megatron to a multiple of ``128 * tp``),
  untied input and output embeddings (``--untie-embeddings-and-output-weights``).
- ``llama3-*``: the Llama 3 8B / 70B shapes torchtitan trains: GQA with 8 K/V
  heads, SwiGLU MLP, RMSNorm, no biases, untied embeddings, vocabulary 128256.
"""

from torchtitan_seq1f1b.segmenting import TransformerCost

__all__ = [
    "MODEL_PRESETS",
    "embedding_params",
    "final_norm_params",
    "get_preset",
    "layer_params",
    "padded_vocab",
]


def padded_vocab(model: TransformerCost, tp: int) -> int:
    """Vocabulary rows actually allocated (Megatron pads for TP-even shards)."""
    multiple = model.vocab_multiple * tp if model.vocab_multiple > 1 else 1
    return -(-model.vocab_size // multiple) * multiple


def layer_params(model: TransformerCost, tp: int) -> int:
    """Parameters of one transformer block held by one TP rank.

    Matrices and their column-parallel biases are split ``tp`` ways; norms and
    the row-parallel output biases are replicated on every TP rank.
    """
    h, f, kv = model.dim, model.ffn_hidden_dim, model.kv_dim
    q, o = model.n_heads * model.head_dim, model.n_heads * model.value_head_dim
    mlp_mats = 3 if model.gated_mlp else 2
    experts = max(model.experts, 1)
    mlp = mlp_mats * h * (experts * f + model.shared_ffn_hidden_dim) + h * model.experts
    split = h * (q + o + kv + model.v_dim) + mlp
    replicated = (4 if model.layernorm else 2) * h
    if model.bias:
        split += q + kv + model.v_dim + f  # QKV and MLP-in biases (column parallel)
        replicated += 2 * h  # attention-out and MLP-out biases (row parallel)
    return -(-split // tp) + replicated


def embedding_params(model: TransformerCost, tp: int) -> int:
    """One vocabulary-parallel embedding (input table or LM head) on one TP rank."""
    return padded_vocab(model, tp) * model.dim // tp


def final_norm_params(model: TransformerCost) -> int:
    return (2 if model.layernorm else 1) * model.dim


def _paper_gpt(n_layers: int, dim: int, n_heads: int) -> TransformerCost:
    return TransformerCost(
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


MODEL_PRESETS: dict[str, TransformerCost] = {
    "paper-2.7b": _paper_gpt(32, 2560, 32),
    "paper-7b": _paper_gpt(32, 4096, 32),
    "paper-13b": _paper_gpt(40, 5120, 40),
    "paper-30b": _paper_gpt(64, 6144, 64),
    "llama3-8b": TransformerCost(
        n_layers=32, dim=4096, n_heads=32, n_kv_heads=8, ffn_hidden_dim=14336,
        vocab_size=128256, gated_mlp=True,
    ),
    "llama3-70b": TransformerCost(
        n_layers=80, dim=8192, n_heads=64, n_kv_heads=8, ffn_hidden_dim=28672,
        vocab_size=128256, gated_mlp=True,
    ),
}


def get_preset(name: str) -> TransformerCost:
    """The preset called ``name`` (case-insensitive)."""
    try:
        return MODEL_PRESETS[name.lower()]
    except KeyError:
        raise ValueError(
            f"unknown model preset {name!r}; choose one of {sorted(MODEL_PRESETS)}"
        ) from None
