# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""GatedDeltaNet's fla recurrence in a segmented layer, against the exact path in float64.

One row of the kernel check (``kernel gdn-fla bfloat16 d64``): a GatedDeltaNet
layer shaped as qwen3_5's debug model (dim 256, 2 key and 4 value heads of
64) runs one microbatch of 3 rows x 320 tokens in 3 segments (96, 112, 112)
as a Seq1F1B stage runs it, in bf16 with ``recurrence_backend="fla"``. Row 0
has a document crossing both cuts and one starting inside the second segment;
row 1 a document starting at the first cut (its state resets there) and one
inside the second segment; row 2 one document over everything. The second
segment runs fla's varlen mode with carried and reset states, the third its
batch mode with carried states. The reference is the same layer unsplit with
``recurrence_backend="exact"`` in float64, on the bf16-rounded parameters and
inputs: output, input gradient and every parameter gradient are compared
norm-wise (:func:`~torchtitan_seq1f1b.check.relative_error`) against
:data:`BOUND`. The decay is slow (a state keeps ~30-300 tokens), so a state
dropped or misrouted at a cut is far outside the bound.
"""

import dataclasses

import torch

from torchtitan_seq1f1b.attention import bind_documents, KernelTarget
from torchtitan_seq1f1b.check import relative_error, Result, Task
from torchtitan_seq1f1b.check.device_thread import backward_on_fresh_thread
from torchtitan_seq1f1b.check.segmented import SegmentedRun
from torchtitan_seq1f1b.kv_store import KVStore
from torchtitan_seq1f1b.linear_attention import GatedDeltaNetConfig, SegmentAwareGatedDeltaNet
from torchtitan_seq1f1b.linear_attention.backends import RECURRENCE_BACKENDS
from torchtitan_seq1f1b.segmenting import SegmentPlan

__all__ = ["BOUND", "check_fla_layer", "fla_layer_errors", "fla_layer_task", "worst_error"]

CONFIG = GatedDeltaNetConfig(
    dim=256, n_key_heads=2, n_value_heads=4, key_head_dim=64, value_head_dim=64
)
SEGMENTS = (96, 112, 112)  # cuts at 96 and 208, neither on fla's 64-token chunks
DOCUMENTS = ((150, 170), (96, 80, 144), (320,))  # document lengths per row (module doc)
DTYPE = torch.bfloat16
# bf16 keeps 8 bits (~1e-3 norm-wise to round a result); the layer rounds every
# projection, and fla's chunks round their matmul operands to bf16 again: 2^-5
# leaves room for both, a wrong state at a cut is off by O(0.1-1).
BOUND = 2**-5
ROW = f"kernel gdn-fla {str(DTYPE).removeprefix('torch.')} d{CONFIG.key_head_dim}"


def worst_error(named_pairs) -> tuple[float, str]:
    """The largest :func:`relative_error` over (name, actual, expected) and its name;
    a NaN counts as the largest."""
    worst, where = 0.0, ""
    for name, actual, expected in named_pairs:
        error = relative_error(actual, expected)
        if not error <= worst:
            worst, where = error, name
    return worst, where


def document_ids(lengths_per_row=DOCUMENTS) -> torch.Tensor:
    """(rows, tokens) ids: row r holds documents of ``lengths_per_row[r]`` tokens."""
    return torch.stack([
        torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        for lengths in lengths_per_row
    ])


def _layers(device: torch.device, seed: int = 0):
    """The bf16 layer on fla and its float64 copy on the exact path, equal parameters."""
    generator = torch.Generator().manual_seed(seed)
    layer = SegmentAwareGatedDeltaNet(dataclasses.replace(CONFIG, recurrence_backend="fla"))
    with torch.no_grad():
        for name, parameter in layer.named_parameters():
            draw = torch.randn(parameter.shape, generator=generator, dtype=torch.float64)
            if name == "A_log":  # decay exp(A_log) in [0.005, 0.05]: slow, states matter
                draw = torch.empty(parameter.shape).uniform_(0.005, 0.05, generator=generator).log()
            elif name == "norm.weight":
                draw = 1 + 0.1 * draw
            elif name != "dt_bias":
                fan_in = parameter[0].numel()
                draw = draw / fan_in**0.5
            parameter.copy_(draw)
    layer = layer.to(device, DTYPE)
    exact = SegmentAwareGatedDeltaNet(dataclasses.replace(CONFIG, recurrence_backend="exact"))
    exact = exact.to(device, torch.float64)
    exact.load_state_dict({k: v.double() for k, v in layer.state_dict().items()})
    return layer, exact


def _grads(layer) -> dict[str, torch.Tensor]:
    return {name: p.grad for name, p in layer.named_parameters()}


def fla_layer_errors(device: torch.device) -> tuple[float, str]:
    """The worst norm-wise error of the segmented bf16 fla layer against the unsplit
    float64 exact one over output, input gradient and parameter gradients, and where."""
    layer, exact = _layers(device)
    generator = torch.Generator().manual_seed(1)
    shape = (len(DOCUMENTS), sum(SEGMENTS), CONFIG.dim)
    x, grad_out = (torch.randn(shape, generator=generator).to(device, DTYPE) for _ in range(2))
    ids = document_ids().to(device)
    with backward_on_fresh_thread():
        plan = SegmentPlan.from_lengths(SEGMENTS)
        run = SegmentedRun(layer, [x], plan, KVStore(), document_ids=ids)
        out, (grad_x,) = run.run(grad_out)
    bind_documents(exact, ids)
    leaf = x.double().requires_grad_()
    out64 = exact(leaf)
    out64.backward(grad_out.double())
    expected = _grads(exact)
    return worst_error([
        ("out", out, out64), ("grad of x", grad_x, leaf.grad),
        *((f"grad of {name}", grad, expected[name]) for name, grad in _grads(layer).items()),
    ])


def check_fla_layer(device: torch.device) -> Result:
    """The row: skipped with what fla lacks here (CUDA, fla-core), else bounded."""
    fla = RECURRENCE_BACKENDS["fla"]()
    unmet = fla.unmet_requirements(KernelTarget(device, DTYPE, CONFIG.key_head_dim))
    if unmet:
        return Result(ROW, "skip", reason="needs " + "; ".join(unmet))
    try:
        error, where = fla_layer_errors(device)
    except Exception as crash:  # noqa: BLE001 - reported as a failed row
        return Result(ROW, "fail", reason=f"{type(crash).__name__}: {crash}")
    return Result.bounded(ROW, error, BOUND, worst=where)


def fla_layer_task(device: torch.device) -> Task:
    return Task((ROW,), lambda: [check_fla_layer(device)])
