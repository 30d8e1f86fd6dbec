# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""A small llama-style causal transformer that splits into pipeline stages.

It uses global RoPE positions, GQA, SwiGLU and RMSNorm like torchtitan's
llama3 (:class:`~torchtitan_seq1f1b.planner.llama_block.LlamaBlock`, whose attention op
is :class:`SegmentAwareAttention`), so the same
weights train unsplit (positions default to 0..L-1) and under Seq1F1B. With
``linear_attention_interval`` most blocks mix tokens through GatedDeltaNet
instead, in qwen3_5's pattern.
"""

import copy
import functools
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import (
    checkpoint,
    CheckpointPolicy,
    create_selective_checkpoint_contexts,
)

from torchtitan_seq1f1b.attention import attention_forward_ops
from torchtitan_seq1f1b.linear_attention import GatedDeltaNetConfig, SegmentAwareGatedDeltaNet
from torchtitan_seq1f1b.planner.llama_block import LlamaBlock
from torchtitan_seq1f1b.segmenting import TransformerCost

__all__ = [
    "ACTIVATION_CHECKPOINT_MODES",
    "BENCH_MODEL",
    "BENCH_SEQ_LEN",
    "LinearAttention",
    "TinyTransformer",
    "TinyTransformerArgs",
    "token_sum_cross_entropy",
]

# torchtitan's modes: "full" checkpoints every block, "selective_layer" every
# second block, "selective_op" every block but keeps matmul and attention
# outputs (recomputing the rest).
ACTIVATION_CHECKPOINT_MODES = ("none", "full", "selective_layer", "selective_op")


@dataclass(frozen=True)
class TinyTransformerArgs:
    vocab_size: int = 64
    dim: int = 32
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 4
    ffn_hidden_dim: int = 64
    rope_theta: float = 10000.0
    activation_checkpoint: str = "none"
    """One of ACTIVATION_CHECKPOINT_MODES."""
    attention_backend: str = "auto"
    compile: bool = False
    """Pipeline stages (:meth:`TinyTransformer.stage`) compile each block with
    ``fullgraph=True``, checkpointing inside, as torchtitan does."""
    window_left: int | None = None
    """Sliding-window attention in the even-numbered layers, as gpt_oss: each query
    sees itself and this many keys before it. None: every layer attends causally."""
    linear_attention_interval: int | None = None
    """qwen3_5's layer pattern: layer i is softmax attention when
    ``(i + 1) % interval == 0``, else GatedDeltaNet (:attr:`gated_delta_net`).
    None: every layer is softmax attention."""

    def __post_init__(self):
        if self.activation_checkpoint not in ACTIVATION_CHECKPOINT_MODES:
            raise ValueError(
                f"activation_checkpoint={self.activation_checkpoint!r}; choose one of "
                f"{ACTIVATION_CHECKPOINT_MODES}"
            )
        interval = self.linear_attention_interval
        if interval is not None and (interval < 1 or self.window_left is not None):
            raise ValueError(
                f"linear_attention_interval={interval!r} must be >= 1, without window_left"
            )

    def cost(self) -> TransformerCost:
        """Cost model for computation-balanced segment plans."""
        return TransformerCost(
            n_layers=self.n_layers,
            dim=self.dim,
            n_heads=self.n_heads,
            n_kv_heads=self.n_kv_heads,
            ffn_hidden_dim=self.ffn_hidden_dim,
            vocab_size=self.vocab_size,
            gated_mlp=True,
            window_layers=0 if self.window_left is None else len(self.window_layers),
            window=0 if self.window_left is None else self.window_left + 1,
            linear_layers=len(self.linear_layers),
        )

    @property
    def window_layers(self) -> range:
        """The layers with a sliding window (when ``window_left`` is set)."""
        return range(0, self.n_layers, 2)

    @property
    def linear_layers(self) -> list[int]:
        """The GatedDeltaNet layers (none without ``linear_attention_interval``)."""
        interval = self.linear_attention_interval
        if interval is None:
            return []
        return [i for i in range(self.n_layers) if (i + 1) % interval]

    @property
    def gated_delta_net(self) -> GatedDeltaNetConfig:
        """The GatedDeltaNet layers' shape: qwen3_5's two value heads per key head,
        as many value heads as K/V heads, of the attention's head dim."""
        head_dim = self.dim // self.n_heads
        return GatedDeltaNetConfig(
            dim=self.dim,
            n_key_heads=max(self.n_kv_heads // 2, 1),
            n_value_heads=self.n_kv_heads,
            key_head_dim=head_dim,
            value_head_dim=head_dim,
        )


# The CPU benchmark's model (benchmarks/) and the charts' default: one step of 1F1B at
# pp=2, m=2 is long enough on one core per rank for compute to dominate gloo and Python.
BENCH_MODEL = TinyTransformerArgs(
    vocab_size=2048, dim=256, n_layers=8, n_heads=8, n_kv_heads=2, ffn_hidden_dim=768,
    attention_backend="sdpa",
)
BENCH_SEQ_LEN = 1024


class TinyTransformer(nn.Module):
    """tokens (batch, seq_len) -> logits (batch, seq_len, vocab_size).

    Pipeline stages come from :meth:`stage`: a copy holding a contiguous range
    of layers, with the embedding on the first and norm/output on the last.
    Middle stages map hidden states (batch, seq_len, dim) to hidden states.
    """

    def __init__(self, args: TinyTransformerArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict(
            {
                str(i): LlamaBlock(args.cost(), args.rope_theta, args.attention_backend)
                for i in range(args.n_layers)
            }
        )
        if args.window_left is not None:
            for i in args.window_layers:
                self.layers[str(i)].attention.inner_attention.window_left = args.window_left
        for i in args.linear_layers:
            self.layers[str(i)].attention = LinearAttention(args.gated_delta_net)
        self.norm: nn.RMSNorm | None = nn.RMSNorm(args.dim)
        self.output: nn.Linear | None = nn.Linear(args.dim, args.vocab_size, bias=False)
        # Outside the module tree, so parameter names stay those of the unsplit model.
        self.compiled_blocks: dict[str, nn.Module] = {}

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        return self.decode(h, positions)

    def decode(self, h: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """This part's blocks, norm and output on hidden states h (batch, seq_len, dim)
        at positions (1 or batch, seq_len), 0..seq_len-1 if None."""
        if positions is None:
            positions = torch.arange(h.shape[1], device=h.device)[None]
        for name, block in self.layers.items():
            if name in self.compiled_blocks:
                h = self.compiled_blocks[name](h, positions)
            elif self._checkpointed(int(name)):
                h = checkpoint(
                    block, h, positions, use_reentrant=False, **self._checkpoint_kwargs()
                )
            else:
                h = block(h, positions)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h

    def _checkpointed(self, layer: int) -> bool:
        mode = self.args.activation_checkpoint
        if mode == "none" or not torch.is_grad_enabled():
            return False
        return mode != "selective_layer" or layer % 2 == 0

    def _checkpoint_kwargs(self) -> dict:
        if self.args.activation_checkpoint != "selective_op":
            return {}
        # Read at every forward: a kernel package imported later registers its ops then.
        saved = {torch.ops.aten.mm.default} | attention_forward_ops()
        policy = functools.partial(_keep_matmuls_and_attention, saved)
        return {"context_fn": functools.partial(create_selective_checkpoint_contexts, policy)}

    def stage(
        self, stage_index: int, num_stages: int, compile_blocks: bool | None = None
    ) -> "TinyTransformer":
        """This model's part for ``stage_index`` of ``num_stages`` (layers split evenly),
        its blocks compiled if ``compile_blocks`` (None: as ``args.compile`` says)."""
        if self.args.n_layers < num_stages:
            raise ValueError(
                f"n_layers={self.args.n_layers} cannot fill {num_stages} stages"
            )
        part = copy.deepcopy(self)
        bounds = [round(s * self.args.n_layers / num_stages) for s in range(num_stages + 1)]
        keep = {str(i) for i in range(bounds[stage_index], bounds[stage_index + 1])}
        for name in list(part.layers):
            if name not in keep:
                del part.layers[name]
        if stage_index > 0:
            part.tok_embeddings = None
        if stage_index < num_stages - 1:
            part.norm = None
            part.output = None
        if self.args.compile if compile_blocks is None else compile_blocks:
            part.compiled_blocks = {
                name: torch.compile(
                    _CheckpointedBlock(
                        block,
                        self._checkpoint_kwargs() if self._checkpointed(int(name)) else None,
                    ),
                    fullgraph=True,
                )
                for name, block in part.layers.items()
            }
        return part


class LinearAttention(nn.Module):
    """A block's GatedDeltaNet in the place of its attention, which it is called as:
    x (batch, seq_len, dim) at positions (unused: no RoPE) -> (batch, seq_len, dim)."""

    def __init__(self, config: GatedDeltaNetConfig):
        super().__init__()
        self.gdn = SegmentAwareGatedDeltaNet(config)
        # A in [0.05, 0.37], decays of about 0.9 per token (fla's A in [1, 16] forgets
        # within a token or two): the state then reaches across the segments.
        with torch.no_grad():
            self.gdn.A_log.uniform_(-3, -1)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.gdn(x)


class _CheckpointedBlock(nn.Module):
    """A block under activation checkpointing (``checkpoint_kwargs`` None: without),
    the module torchtitan compiles."""

    def __init__(self, block: nn.Module, checkpoint_kwargs: dict | None):
        super().__init__()
        self.block = block
        self.checkpoint_kwargs = checkpoint_kwargs

    def forward(self, h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.checkpoint_kwargs is None or not torch.is_grad_enabled():
            return self.block(h, positions)
        return checkpoint(self.block, h, positions, use_reentrant=False, **self.checkpoint_kwargs)


def _keep_matmuls_and_attention(saved, ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE


def token_sum_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Sum (not mean) of token cross-entropies; Seq1F1B normalises per step.

    logits: (batch, seq_len, vocab_size); target: (batch, seq_len), -100 ignored.
    """
    return F.cross_entropy(
        logits.flatten(0, 1).float() if logits.dtype in (torch.float16, torch.bfloat16) else logits.flatten(0, 1),
        target.flatten(0, 1),
        reduction="sum",
        ignore_index=-100,
    )
