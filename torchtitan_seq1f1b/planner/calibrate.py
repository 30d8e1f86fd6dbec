# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Time a model's blocks and head on the job's device, segment by segment, and fit a :class:`TimeModel`.

A chain of :class:`~torchtitan_seq1f1b.planner.llama_block.LlamaBlock` of the
job's dims, as many as a pipeline rank holds (up to
:data:`MAX_CHAINED_BLOCKS`), runs the units of uniform plans with k = 1, 2, 4,
8, 16 segments through a K/V store exactly as a pipeline stage runs them
(forwards in order, then backwards last segment first), once with whole
backwards (B) and once split into input and weight gradients (I, W) the way
torch's zero-bubble stages split them. The final norm, LM head and summed
cross-entropy are timed the same way. Blocks are timed
as a chain because a block's time depends on the blocks chained with it, and
each unit keeps its fastest of several passes because a shared host's speed
drifts. Where pipeline ranks share one host's CPU cores, :class:`HostProbes`
(the CPU benchmark's) time units inside pipeline steps instead and add the
runtime's own cost per action. The fit is cached per (shape, seq_len, device,
dtype, backend, chain, torch), so a job pays for it once.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from hashlib import sha256
from pathlib import Path

import torch
import torch.nn as nn
from torch.autograd.graph import saved_tensors_hooks

from torchtitan_seq1f1b._torch_compat import stage_backward_input, stage_backward_weight
from torchtitan_seq1f1b.actions import Unit
from torchtitan_seq1f1b.attention import bind_attention
from torchtitan_seq1f1b.kv_store import KVStore, RunningUnit
from torchtitan_seq1f1b.planner.llama_block import BlockChain, OutputHead, summed_cross_entropy
from torchtitan_seq1f1b.planner.time_model import (
    fit_unit_time,
    KINDS,
    PROBED_SEGMENT_COUNTS,
    RuntimeOverhead,
    TimeModel,
    UnitTime,
)
from torchtitan_seq1f1b.segmenting import SegmentPlan, TransformerCost

__all__ = [
    "CACHE_ENV",
    "CalibrationTarget",
    "HostProbes",
    "HEAD_LOGITS_BYTES",
    "MAX_CHAINED_BLOCKS",
    "block_bytes_per_token",
    "calibrate",
    "calibration_bytes",
    "cached_calibration",
    "chain_within",
    "head_tokens",
    "rank_chain_length",
]

CACHE_ENV = "SEQ1F1B_CALIBRATION_CACHE"
# Bumped when what is measured changes, so older cached fits are measured again.
_METHOD = 7
MAX_CHAINED_BLOCKS = 4
"""The chain's time and memory come on top of the job's on its device and grow with its
length; past four blocks a block's unit times barely move (docs/planner.md)."""
HEAD_LOGITS_BYTES = 2**31
"""Bytes of logits (and their fp32 copies) the head is timed with at most (:func:`head_tokens`)."""
_Samples = dict[str, list[tuple[int, int, float]]]  # per kind: (length, end, seconds)


@dataclass(frozen=True)
class CalibrationTarget:
    """What to calibrate: a model shape at a sequence length on a device and dtype.

    Args:
        shape: the model's dims.
        seq_len: tokens per sequence; calibration segments are cut from it.
        device: where the job computes.
        dtype: the dtype activations are computed in (bf16 on GPU).
        microbatch_size: sequences per microbatch.
        attention_backend: :class:`SegmentAwareAttention` backend the job uses.
        repeats: timed passes per plan (each unit's fastest is kept), after one warm-up,
            where units are timed alone.
        contenders: pipeline ranks that share this host's CPU cores during a
            step (``device`` "cpu"); more than one needs :class:`HostProbes`.
        chained_blocks: blocks timed as one chain, whose unit times are split
            evenly among them; a job chains as many as a rank holds
            (:func:`rank_chain_length`).
    """

    shape: TransformerCost
    seq_len: int
    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    microbatch_size: int = 1
    attention_backend: str = "auto"
    repeats: int = 7
    contenders: int = 1
    chained_blocks: int = 1

    def __post_init__(self):
        if self.chained_blocks < 1:
            raise ValueError(f"chained_blocks must be at least 1, got {self.chained_blocks}")
        if self.contenders < 1:
            raise ValueError(f"contenders must be at least 1, got {self.contenders}")
        if self.contenders > 1 and torch.device(self.device).type != "cpu":
            raise ValueError(
                f"contenders={self.contenders} times units in pipeline steps on local CPU "
                f"ranks, but device is {self.device!r}: ranks on their own GPUs do not "
                "share cores; leave contenders at 1"
            )

    def key(self) -> dict:
        """Everything the measured times depend on, as JSON-able values."""
        device = torch.device(self.device)
        if device.type == "cuda":
            hardware = torch.cuda.get_device_name(device)
        else:
            threads = torch.get_num_threads()
            hardware = f"{platform.processor() or platform.machine()}, {threads} thread(s)"
        return {
            "shape": {
                name: getattr(self.shape, name)
                for name in ("n_layers", "dim", "n_heads", "n_kv_heads", "ffn_hidden_dim", "vocab_size")
            },
            "seq_len": self.seq_len,
            "device": f"{device.type}: {hardware}",
            "dtype": str(self.dtype).removeprefix("torch."),
            "microbatch_size": self.microbatch_size,
            "attention_backend": self.attention_backend,
            "contenders": self.contenders,
            "chained_blocks": self.chained_blocks,
            "repeats": self.repeats,
            "method": _METHOD,
            "torch": torch.__version__,
        }


UnitFits = tuple[dict[str, UnitTime], dict[str, UnitTime]]
"""A block's and the head's unit time per kind (F, B, I, W)."""


@dataclass(frozen=True)
class HostProbes:
    """Measurements for pipeline ranks that compute on one host's CPU cores.

    Off such a host (a job on GPUs) units are timed alone, and the runtime's
    host work overlaps the device's. The CPU benchmark (``benchmarks/``)
    supplies both.

    Args:
        unit_fits: times the target's units inside pipeline steps on
            ``target.contenders`` local ranks.
        runtime_overhead: the runtime's own cost per action around the units.
    """

    unit_fits: Callable[[CalibrationTarget], UnitFits]
    runtime_overhead: Callable[[CalibrationTarget], RuntimeOverhead]


def head_tokens(target: CalibrationTarget) -> int:
    """Tokens the LM head and loss are timed over.

    The whole sequence unless its logits (in the compute dtype, with an fp32
    copy for the loss and the fp32 gradient) would pass
    :data:`HEAD_LOGITS_BYTES`: at 128k tokens and a 128k vocabulary those
    alone are 168 GB. The head has no attention, so its time is linear in
    tokens and plans over fewer tokens fit it as well.
    """
    per_token = target.microbatch_size * target.shape.vocab_size * (target.dtype.itemsize + 8)
    tokens = target.seq_len
    while tokens > max(PROBED_SEGMENT_COUNTS) and tokens * per_token > HEAD_LOGITS_BYTES:
        tokens //= 2
    return tokens


def calibration_bytes(target: CalibrationTarget) -> dict[str, int]:
    """Device bytes calibration needs beyond the weights, from shapes (an estimate).

    ``blocks``: the chain's saved activations and K/V over the whole sequence
    (every segment of a microbatch is alive until its backward); ``head``:
    the head's logits and their fp32 copies over :func:`head_tokens`.
    """
    shape, itemsize = target.shape, target.dtype.itemsize
    per_block_token = block_bytes_per_token(shape, target.dtype)
    head_per_token = shape.vocab_size * (itemsize + 8)
    rows = target.microbatch_size
    return {
        "blocks": target.chained_blocks * per_block_token * target.seq_len * rows,
        "head": head_per_token * head_tokens(target) * rows,
    }


def chain_within(target: CalibrationTarget, budget_bytes: int | None) -> CalibrationTarget:
    """``target`` with as many of its chained blocks as :func:`calibration_bytes` fits in
    ``budget_bytes`` (one at least; all of them without a budget)."""
    while (
        budget_bytes is not None
        and target.chained_blocks > 1
        and sum(calibration_bytes(target).values()) > budget_bytes
    ):
        target = dataclasses.replace(target, chained_blocks=target.chained_blocks - 1)
    return target


def block_bytes_per_token(shape: TransformerCost, dtype: torch.dtype) -> int:
    """A llama block's saved activations and K/V per token, estimated from its dims.

    Norm inputs and outputs, q, attention output, projection and residual
    (dim each), K and V (and the store's copy), and three FFN-wide tensors.
    """
    kv_dim = shape.dim // shape.n_heads * shape.n_kv_heads
    return (7 * shape.dim + 4 * kv_dim + 3 * shape.ffn_hidden_dim) * dtype.itemsize


def rank_chain_length(n_layers: int, num_ranks: int) -> int:
    """Blocks to calibrate as one chain for ``n_layers`` over ``num_ranks`` pipeline ranks.

    The blocks a rank holds when they are spread evenly (rounded down),
    whatever its stages: that depth predicts a V's steps best
    (docs/planner.md). At most :data:`MAX_CHAINED_BLOCKS`.
    """
    return max(1, min(n_layers // num_ranks, MAX_CHAINED_BLOCKS))


class _Head(nn.Module):
    """Final norm, LM head and summed cross-entropy: (batch, seq_len, dim) -> loss."""

    def __init__(self, shape: TransformerCost):
        super().__init__()
        self.head = OutputHead(shape)

    def forward(self, h: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return summed_cross_entropy(self.head(h), target)


class _Clock:
    """Wall time of a region, waiting for the device's queued work on both sides."""

    def __init__(self, device: torch.device):
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def __enter__(self) -> _Clock:
        self.sync()
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.sync()
        self.seconds = time.perf_counter() - self.start


class _SavedBytes(saved_tensors_hooks):
    """Distinct storages autograd saves for backward while active, in bytes."""

    def __init__(self):
        self.storages: dict[int, int] = {}

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            storage = tensor.untyped_storage()
            self.storages[storage.data_ptr()] = storage.nbytes()
            return tensor

        super().__init__(pack, lambda tensor: tensor)

    @property
    def nbytes(self) -> int:
        return sum(self.storages.values())


def _run_plan(
    component: nn.Module,
    plan: SegmentPlan,
    inputs: torch.Tensor,
    extra: torch.Tensor,
    split_backward: bool,
    clock: _Clock,
    samples: _Samples,
) -> None:
    """Run one microbatch's units of ``plan`` through ``component`` and record each unit's time.

    inputs: (batch, seq_len, dim) hidden states; extra: positions (1, seq_len)
    for a block, targets (batch, seq_len) for the head.
    """
    store = KVStore()
    bind_attention(component, store)
    params = list(component.parameters())
    pending = []
    for segment, cut in enumerate(plan.slices()):
        unit = RunningUnit(Unit(0, segment), plan)
        x = inputs[:, cut].detach().requires_grad_()
        with store.running_unit(unit), clock:
            y = component(x, extra[:, cut])
        samples["F"].append((plan.lengths[segment], plan.ends[segment], clock.seconds))
        pending.append((unit, x, y))
    for unit, x, y in reversed(pending):
        grad = None if y.dim() == 0 else torch.ones_like(y)  # the head returns its loss
        span = (plan.lengths[unit.unit.segment], plan.ends[unit.unit.segment])
        with store.running_unit(unit):
            if not split_backward:
                with clock:
                    y.backward(grad)
                samples["B"].append((*span, clock.seconds))
                continue
            with clock:
                _, groups = stage_backward_input([y], None if grad is None else [grad], [x], iter(params))
            samples["I"].append((*span, clock.seconds))
            with clock:
                stage_backward_weight(iter(params), groups)
            samples["W"].append((*span, clock.seconds))
    store.clear()


def _measure(
    component: nn.Module, target: CalibrationTarget, extra: torch.Tensor, seq_len: int
) -> _Samples:
    """Units of uniform plans over ``seq_len`` tokens; extra: (batch, seq_len) or (1, seq_len)."""
    device = torch.device(target.device)
    clock = _Clock(device)
    inputs = torch.randn(
        target.microbatch_size, seq_len, target.shape.dim, device=device, dtype=target.dtype
    )
    plans = [SegmentPlan.uniform(seq_len, k) for k in PROBED_SEGMENT_COUNTS if k <= seq_len]
    warmup: _Samples = {kind: [] for kind in KINDS}
    for split in (False, True):
        _run_plan(component, plans[0], inputs, extra, split, clock, warmup)
    runs: list[_Samples] = []
    for _ in range(target.repeats):
        run: _Samples = {kind: [] for kind in KINDS}
        for plan in plans:
            for split in (False, True):
                _run_plan(component, plan, inputs, extra, split, clock, run)
        runs.append(run)
    # Same units in the same order in every run: keep each unit's fastest time.
    return {
        kind: [
            (n, end, min(run[kind][i][2] for run in runs))
            for i, (n, end, _) in enumerate(runs[0][kind])
        ]
        for kind in KINDS
    }


def _activation_bytes(
    component: nn.Module, inputs: torch.Tensor, extra: torch.Tensor
) -> tuple[float, float]:
    """(activation bytes, K/V store bytes) per token position of a whole-sequence unit.

    inputs: (batch, seq_len, dim); extra: positions (1, seq_len) or targets (batch, seq_len).
    """
    seq_len = inputs.shape[1]
    plan = SegmentPlan.uniform(seq_len, 1)
    store = KVStore()
    bind_attention(component, store)
    saved = _SavedBytes()
    with store.running_unit(RunningUnit(Unit(0, 0), plan)), saved:
        component(inputs.detach().requires_grad_(), extra)
    # Attention saves views of the K/V store: those bytes are the store's, not activations.
    kv = store.nbytes
    store.clear()
    return (saved.nbytes - kv) / seq_len, kv / seq_len


def _direct_fits(
    target: CalibrationTarget, chain: nn.Module, positions: torch.Tensor
) -> tuple[dict[str, UnitTime], dict[str, UnitTime]]:
    """A block's and the head's unit times from the chain and head timed alone on the device."""
    device = torch.device(target.device)
    head = _Head(target.shape).to(device, target.dtype)
    tokens = head_tokens(target)
    targets = torch.randint(
        0, target.shape.vocab_size, (target.microbatch_size, tokens), device=device
    )
    block_samples = _measure(chain, target, positions, target.seq_len)
    head_samples = _measure(head, target, targets, tokens)
    count = target.chained_blocks
    return (
        {
            kind: fit_unit_time([(n, end, t / count) for n, end, t in block_samples[kind]])
            for kind in KINDS
        },
        {kind: fit_unit_time(head_samples[kind], with_pairs=False) for kind in KINDS},
    )


def calibrate(target: CalibrationTarget, probes: HostProbes | None = None) -> TimeModel:
    """Time a chain of blocks and the head on ``target.device`` and fit a block's and the head's
    unit times: alone on the device, or with ``probes`` where ranks share a host's cores."""
    if target.contenders > 1 and probes is None:
        raise ValueError(
            f"contenders={target.contenders} needs HostProbes that time units inside "
            "pipeline steps on that many local ranks (benchmarks/planner_probes)"
        )
    device = torch.device(target.device)
    shape = target.shape
    count = target.chained_blocks
    chain = BlockChain(shape, count, target.attention_backend).to(device, target.dtype)
    positions = torch.arange(target.seq_len, device=device)[None]
    if target.contenders > 1:
        block, head = probes.unit_fits(target)
    else:
        block, head = _direct_fits(target, chain, positions)
    inputs = torch.randn(
        target.microbatch_size, target.seq_len, shape.dim, device=device, dtype=target.dtype
    )
    tokens = head_tokens(target)
    targets = torch.randint(0, shape.vocab_size, (target.microbatch_size, tokens), device=device)
    chain_bytes, chain_kv_bytes = _activation_bytes(chain, inputs, positions)
    block_bytes, kv_bytes = chain_bytes / count, chain_kv_bytes / count
    head_bytes, _ = _activation_bytes(
        _Head(shape).to(device, target.dtype), inputs[:, :tokens], targets
    )
    del chain, positions, inputs, targets
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the job allocates next; leave it the device
    return TimeModel(
        block=block,
        head=head,
        block_activation_bytes=block_bytes,
        head_activation_bytes=head_bytes,
        kv_bytes=kv_bytes,
        # KVStore banks prefix gradients in fp32 (or wider) whatever the K/V dtype.
        kv_grad_bytes=kv_bytes * max(4, target.dtype.itemsize) / target.dtype.itemsize,
        runtime=RuntimeOverhead() if probes is None else probes.runtime_overhead(target),
        calibrated_for=_measured_for(target, probes),
    )


def _cache_dir() -> Path:
    configured = os.environ.get(CACHE_ENV)
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "torchtitan_seq1f1b" / "calibration"


def _measured_for(target: CalibrationTarget, probes: HostProbes | None) -> dict:
    return {**target.key(), "host_probes": probes is not None}


def cached_calibration(
    target: CalibrationTarget, refresh: bool = False, probes: HostProbes | None = None
) -> tuple[TimeModel, Path, bool]:
    """``calibrate(target, probes)``, read from the cache when it was measured before.

    Returns the model, its cache file and whether it came from the cache. The
    directory is ``$SEQ1F1B_CALIBRATION_CACHE``, else
    ``~/.cache/torchtitan_seq1f1b/calibration``. ``refresh`` measures again
    (e.g. the cached run shared the machine with other work).
    """
    key = _measured_for(target, probes)
    digest = sha256(repr(sorted(key.items())).encode()).hexdigest()[:16]
    path = _cache_dir() / f"{digest}.json"
    if path.exists() and not refresh:
        model = TimeModel.from_json(path.read_text())
        if model.calibrated_for == key:
            return model, path, True
    model = calibrate(target, probes)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(model.to_json())
    partial.replace(path)  # atomic: ranks calibrating at once never read half a file
    return model, path, False
