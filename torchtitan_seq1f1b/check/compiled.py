# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""One llama-shaped block compiled with ``fullgraph=True``, run segment by segment.

The block (:class:`LlamaBlock`, attention one registered op per layer) runs
one microbatch cut into k segments on a K/V store, as a Seq1F1B stage runs
it. Its output and gradients (parameters and input) are compared with the
eager block run unsplit: on CPU in float64, where only summation order
differs; on CUDA in bf16 against the eager float32 block, within twice what
the eager bf16 block is off by (the stack check's rule). The row also
reports how many graphs dynamo built (lengths turn dynamic at the first
recompile: 2 for uneven segments), the compile seconds (the first pass less
a steady one) and the steady forward+backward time of the compiled block
against the eager one, both segmented.

CUDA compiles with inductor. CPU compiles with ``aot_eager``: dynamo's
fullgraph capture and AOTAutograd's joint graph with dynamic lengths, without
inductor's C++ builds (minutes on 2 cores; the test suite runs those).
"""

import copy
import dataclasses
import statistics
import time

import torch
import torch.nn as nn

from torchtitan_seq1f1b._torch_compat.compile_counts import compiled_graphs
from torchtitan_seq1f1b.check import relative_error, Result, Task, worst
from torchtitan_seq1f1b.check.perf import CPU_SHAPE, GPU_SHAPE, PerfShape, segmented_pass, UnitClock
from torchtitan_seq1f1b.check.stack import BF16_FACTOR, CPU_LENGTHS, tf32_off
from torchtitan_seq1f1b.segmenting import SegmentPlan

__all__ = ["CompiledShape", "compiled_task"]

# float64 against float64: fused kernels and segments reorder sums, nothing else differs.
FLOAT64_BOUND = 1e-10


@dataclasses.dataclass(frozen=True)
class CompiledShape:
    """The block (``perf``'s model dims, one block, in ``perf.dtype``), its microbatch
    of ``batch`` x ``plan.seq_len`` tokens, the dtype of the eager reference, the
    compile backend, and how many steady passes are timed."""

    perf: PerfShape
    plan: SegmentPlan
    batch: int
    reference_dtype: torch.dtype
    backend: str
    repeats: int

    @property
    def name(self) -> str:
        dtype = str(self.perf.dtype).removeprefix("torch.")
        return (
            f"compiled block ({self.backend}, {self.perf.name}) {dtype} "
            f"{self.plan.seq_len} tokens k={self.plan.num_segments}"
        )

    def block(self, dtype: torch.dtype, device: torch.device) -> nn.Module:
        """The block in ``dtype`` (seed 0): (batch, seq_len, dim) at positions
        (1, seq_len) -> the same shape."""
        return dataclasses.replace(self.perf, dtype=dtype).stage("none", device).layers["0"]


def default_shape(device: torch.device) -> CompiledShape:
    """On CUDA a llama3-8B block at 8k tokens in 4 balanced segments, bf16 against
    float32; on CPU the small ``--perf`` block on the stack check's uneven segments, float64."""
    if device.type == "cuda":
        perf = dataclasses.replace(GPU_SHAPE, blocks=1)
        plan = SegmentPlan.balanced(8192, 4, perf.stage_args("none").cost(), perf.align)
        return CompiledShape(perf, plan, 1, torch.float32, backend="inductor", repeats=5)
    perf = dataclasses.replace(CPU_SHAPE, blocks=1, dtype=torch.float64)
    plan = SegmentPlan.from_lengths(CPU_LENGTHS)
    return CompiledShape(perf, plan, 2, torch.float64, backend="aot_eager", repeats=3)


def _taken_grads(block: nn.Module, x_grad: torch.Tensor) -> dict[str, torch.Tensor]:
    """The block's parameter gradients and the input's; the block's are reset."""
    grads = {n: p.grad for n, p in block.named_parameters()} | {"input": x_grad}
    block.zero_grad(set_to_none=True)
    return grads


def _unsplit(block: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Output (batch, seq_len, dim) and gradients ({parameter name or "input": grad})
    of one pass of x (batch, seq_len, dim) back-propagating ``grad`` (x's shape)."""
    x = x.detach().clone().requires_grad_()
    out = block(x, torch.arange(x.shape[1], device=x.device)[None])
    out.backward(grad)
    return out.detach(), _taken_grads(block, x.grad)


def _segmented(fn: nn.Module, block: nn.Module, x, grad, plan) -> tuple[torch.Tensor, dict]:
    """As :func:`_unsplit`, segment by segment through ``fn`` (``block`` compiled or itself)."""
    run = segmented_pass(fn, x, grad, plan)
    return run.output(), _taken_grads(block, run.grads()[0])


def _errors(found: tuple, expected: tuple) -> tuple[float, float]:
    """Relative errors of the output and of the worst gradient, (output, grads) each."""
    (out, grads), (expected_out, expected_grads) = found, expected
    grad_errors = [relative_error(grads[name], expected_grads[name]) for name in expected_grads]
    return relative_error(out, expected_out), worst(grad_errors)


def _seconds(model: nn.Module, x: torch.Tensor, grad: torch.Tensor, shape: CompiledShape) -> float:
    """Median forward+backward seconds of a segmented pass (device time on CUDA)."""
    passes = []
    for _ in range(shape.repeats):
        clock = UnitClock(x.device)
        segmented_pass(model, x, grad, shape.plan, clock)
        model.zero_grad(set_to_none=True)
        passes.append(sum(clock.seconds()))
    return statistics.median(passes)


def _synchronized_seconds(started: float, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


def check_compiled(device: torch.device, shape: CompiledShape) -> Result:
    """The compiled block segmented against the eager block unsplit, with its
    compile cost and speed."""
    gen = torch.Generator().manual_seed(0)
    size = (shape.batch, shape.plan.seq_len, shape.perf.model.dim)
    x, grad = (torch.randn(size, generator=gen, dtype=torch.float64).to(device) for _ in range(2))
    reference = shape.block(shape.reference_dtype, device)
    expected = _unsplit(reference, x.to(shape.reference_dtype), grad.to(shape.reference_dtype))
    x, grad = x.to(shape.perf.dtype), grad.to(shape.perf.dtype)
    if shape.perf.dtype == shape.reference_dtype:
        eager, bound = reference, FLOAT64_BOUND
    else:
        eager = shape.block(shape.perf.dtype, device)
        bound = BF16_FACTOR * worst(_errors(_unsplit(eager, x, grad), expected))
    block = copy.deepcopy(eager)
    compiled = torch.compile(block, fullgraph=True, backend=shape.backend)
    graphs = compiled_graphs()
    started = time.perf_counter()
    found = _segmented(compiled, block, x, grad, shape.plan)
    first_pass = _synchronized_seconds(started, device)
    out_error, grad_error = _errors(found, expected)
    _segmented(eager, eager, x, grad, shape.plan)  # warm-up
    eager_s, compiled_s = _seconds(eager, x, grad, shape), _seconds(compiled, x, grad, shape)
    return Result.bounded(
        shape.name,
        worst([out_error, grad_error]),
        bound,
        error_out=out_error,
        error_grads=grad_error,
        graphs=compiled_graphs() - graphs,
        compile_s=round(max(first_pass - compiled_s, 0.0), 2),
        eager_ms=round(eager_s * 1e3, 3),
        compiled_ms=round(compiled_s * 1e3, 3),
        speedup=round(eager_s / compiled_s, 3),
    )


def compiled_task(device: torch.device, shape: CompiledShape | None = None) -> Task:
    """The compiled-block row (default shape: :func:`default_shape`)."""
    shape = shape or default_shape(device)

    def run() -> list[Result]:
        with tf32_off():
            return [check_compiled(device, shape)]

    return Task((shape.name,), run)
