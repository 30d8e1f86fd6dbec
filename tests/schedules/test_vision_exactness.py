# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""A vision-language model (images encoded on the first stage, their features written at
the image tokens) under every Seq1F1B schedule, against unsplit training in float64.

Two microbatches of two rows with 2 and 3 images of 3 tokens each, pre-split as
torchtitan's trainer passes them (their image counts differ); at k = 2 and 4 an image
straddles a cut, and at k = 4 segment 0 of microbatch 0 (whose backward runs the
encoder's) and segment 3 of microbatch 1 hold no image token. mrope-style positions
(batch, seq_len, 3) go to every stage, cut with the segments. PP = 2 under all four
schedules at k = 1, 2 and 4, full checkpointing (the image scatter recomputed too) on
Seq1F1B and on the zero-bubble schedule, whose first stage runs its whole backward in W
steps; every backward on a fresh thread, as on CUDA (and once on the calling thread).
qwen3_5's shape, three GatedDeltaNet blocks to a softmax one, under every schedule at k = 4.
Every parameter gradient (the encoder's included), each microbatch's loss and the eval
logits equal the unsplit reference's (rtol 1e-10); the encoder runs once per microbatch
in a step and in eval (and once more, outside the units, in torch's metadata inference
before each); nothing outlives the step.

Negative control: the features' gradient taken from the last segment's backward only
must fail.
"""

import dataclasses
import functools
from unittest import mock

import pytest
import torch

from torchtitan_seq1f1b.check.device_thread import backward_on_fresh_thread
from torchtitan_seq1f1b.check.exactness import build_schedule, holds_last_stage
from torchtitan_seq1f1b.examples.tiny_transformer import token_sum_cross_entropy
from torchtitan_seq1f1b.examples.tiny_vlm import TinyVLM, TinyVLMArgs
from torchtitan_seq1f1b.vision import ImageFeatures, image_feature_index

from tests.harness import Case, cases_and_control, SCHEDULES

RTOL, ATOL = 1e-10, 1e-14
PLANS = {1: (16,), 2: (7, 9), 4: (4, 4, 5, 3)}
PATCHES = 3  # tokens per image
# Per microbatch, (row, first token) of each image, row-major.
IMAGES = (((0, 5), (1, 12)), ((0, 2), (0, 9), (1, 6)))
INPUTS = ("positions", "pixel_values", "image_index")
QWEN3_5_INTERVAL = 4


@dataclasses.dataclass(frozen=True)
class VisionCase(Case):
    def model(self, device="cpu") -> TinyVLM:
        torch.manual_seed(0)
        args = TinyVLMArgs(**dataclasses.asdict(self.model_args))
        return TinyVLM(args).to(device=device, dtype=self.dtype)

    def microbatches(self) -> list[dict]:
        """Per microbatch: tokens, target (B, T); positions (B, T, 3); pixel_values
        (images, PATCHES, patch_dim); image_index (B, T)."""
        args, gen = TinyVLMArgs(), torch.Generator().manual_seed(1)
        shape = (self.microbatch_size, self.plan.seq_len)
        microbatches = []
        for images in IMAGES:
            tokens = torch.randint(0, args.image_token_id, shape, generator=gen)
            target = torch.randint(0, args.vocab_size, shape, generator=gen)
            target[torch.rand(shape, generator=gen) < 0.15] = -100
            # Text tokens at (t, t, t); an image's at (start, start, start + patch).
            positions = torch.arange(shape[1])[:, None].expand(*shape, 3).clone()
            for row, start in images:
                tokens[row, start : start + PATCHES] = args.image_token_id
                positions[row, start : start + PATCHES, :2] = start
            pixels = torch.randn(len(images), PATCHES, args.patch_dim, generator=gen)
            microbatches.append({
                "tokens": tokens,
                "target": target,
                "positions": positions,
                "pixel_values": pixels.to(self.dtype),
                "image_index": image_feature_index(tokens == args.image_token_id),
            })
        return microbatches


def _case(schedule: str, k: int, ac: str = "none", interval: int | None = None) -> VisionCase:
    two = schedule in ("InterleavedSeq1F1B", "Seq1F1BZBV")
    return VisionCase(
        len(IMAGES), PLANS[k], activation_checkpoint=ac, schedule=schedule,
        stages_per_rank=2 if two else 1, linear_attention_interval=interval,
    )


CASES = [_case(schedule, k) for schedule in SCHEDULES for k in PLANS] + [
    # qwen3_5's shape: three GatedDeltaNet blocks to one softmax block.
    *(_case(schedule, 4, interval=QWEN3_5_INTERVAL) for schedule in SCHEDULES),
    _case("Seq1F1BZeroBubble", 4, "full", QWEN3_5_INTERVAL),
    _case("Seq1F1B", 4, "full"),
    _case("Seq1F1BZeroBubble", 4, "full"),
    # The encoder's backward nested in the stage's on the calling thread, as on CPU.
    dataclasses.replace(_case("Seq1F1BZeroBubble", 4), device_thread=False),
]
CONTROL = _case("Seq1F1B", 4)
WORST: dict[str, float] = {}


def _case_id(case: VisionCase) -> str:
    thread = "" if case.device_thread else "-same_thread"
    gdn = "" if case.linear_attention_interval is None else "-gdn"
    return f"{case.schedule}-k{len(case.lengths)}-ac_{case.activation_checkpoint}{gdn}{thread}"


def _bank_last_segment_only(self, segment, index, grad):
    if self.grad is not None:  # a later segment banked already
        grad = torch.zeros_like(grad)
    _BANK_GRAD(self, segment, index, grad)


_BANK_GRAD = ImageFeatures.bank_grad


def _last_segment_only():
    """The features' gradient taken from the last segment's backward only."""
    return mock.patch.object(ImageFeatures, "bank_grad", _bank_last_segment_only)


def _pipelined(rank: int, world_size: int, case: VisionCase) -> dict:
    """One step and one eval() of ``case`` on this rank, counting encoder calls."""
    schedule, parts, indices = build_schedule(rank, world_size, case)
    has_last = holds_last_stage(case, world_size, indices)
    microbatches = case.microbatches()
    calls = []  # per encoder call: whether it ran in a unit (else torch's metadata inference)
    for part in parts:
        if part.vision_encoder is not None:
            scatter = part.image_scatter
            part.vision_encoder.register_forward_hook(
                lambda *_, scatter=scatter: calls.append(scatter.kv_store.running is not None)
            )
    inputs = dict(
        arg_mbs=[(mb["tokens"],) for mb in microbatches] if 0 in indices else None,
        kwarg_mbs=[{name: mb[name] for name in INPUTS} for mb in microbatches],
        target_mbs=[mb["target"] for mb in microbatches] if has_last else None,
    )
    losses: list = []
    with backward_on_fresh_thread(case.device_thread):
        schedule.step(losses=losses, **inputs)
    stores = [schedule.kv_stores[i] for i in indices]
    result = {
        "grads": {n: p.grad.clone() for part in parts for n, p in part.named_parameters()},
        "losses": losses,
        "step_encoder_calls": (sum(calls), len(calls) - sum(calls)),
        "left_after_step": sum(len(store) for store in stores),
    }
    calls.clear()
    with torch.no_grad():
        logits = schedule.eval(**inputs)
    result["logits"] = logits if has_last else None
    result["eval_encoder_calls"] = (sum(calls), len(calls) - sum(calls))
    result["left_after_eval"] = sum(len(store) for store in stores)
    return result


@pytest.fixture(scope="module")
def pipeline_runs():
    """Every case, then the negative control, in one launch: {case or "control": ranks}."""
    yield cases_and_control(_pipelined, CASES, CONTROL, _last_segment_only)
    for name, err in WORST.items():
        print(f"\n{name}: worst relative error {err:.2e}")


@functools.cache
def _reference(interval: int | None) -> dict:
    """The unsplit model, one microbatch at a time, not pipelined, without checkpointing
    (the same for every case of one layout): gradients, per-microbatch loss sums, logits,
    encoder calls."""
    case = _case("Seq1F1B", 1, interval=interval)
    model = case.model()
    calls = []
    model.vision_encoder.register_forward_hook(lambda *_: calls.append(1))
    microbatches = case.microbatches()
    valid = sum(int((mb["target"] != -100).sum()) for mb in microbatches)
    losses, logits = [], []
    for mb in microbatches:
        out = model(mb["tokens"], **{name: mb[name] for name in INPUTS})
        loss = token_sum_cross_entropy(out, mb["target"])
        (loss / valid).backward()
        losses.append(loss.detach())
        logits.append(out.detach())
    grads = {n: p.grad for n, p in model.named_parameters()}
    return {
        "grads": grads,
        "losses": torch.stack(losses),
        "logits": torch.cat(logits),
        "calls": len(calls),
    }


def _relative(found: torch.Tensor, expected: torch.Tensor) -> float:
    return ((found - expected).abs().max() / expected.abs().max()).item()


def _pairs(ranks: list[dict], reference: dict) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """name -> (pipelined, reference): every parameter gradient, the losses, the logits."""
    grads = {n: g for rank in ranks for n, g in rank["grads"].items()}
    assert grads.keys() == reference["grads"].keys()
    last = next(rank for rank in ranks if rank["logits"] is not None)
    pairs = {name: (grad, reference["grads"][name]) for name, grad in grads.items()}
    pairs["losses"] = (torch.stack(last["losses"]), reference["losses"])
    pairs["logits"] = (last["logits"], reference["logits"])
    return pairs


def test_cases_straddle_cuts_and_leave_segments_without_images():
    tokens = [mb["tokens"] == TinyVLMArgs().image_token_id for mb in CASES[0].microbatches()]
    assert [int(t.sum()) // PATCHES for t in tokens] == [len(images) for images in IMAGES]
    for lengths in (PLANS[2], PLANS[4]):
        cuts = torch.tensor(lengths[:-1]).cumsum(0).tolist()
        starts = [start for images in IMAGES for _, start in images]
        assert any(start < cut < start + PATCHES for start in starts for cut in cuts)
    segments = [t.split(PLANS[4], dim=1) for t in tokens]
    assert not segments[0][0].any() and not segments[1][3].any()


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_matches_unsplit_reference(pipeline_runs, case):
    ranks, reference = pipeline_runs[case], _reference(case.linear_attention_interval)
    pairs = _pairs(ranks, reference)
    assert any(name.startswith("vision_encoder.") for name in pairs)
    for name, (found, expected) in pairs.items():
        torch.testing.assert_close(found, expected, rtol=RTOL, atol=ATOL, msg=name)
    WORST[_case_id(case)] = max(_relative(*pair) for pair in pairs.values())
    assert reference["calls"] == len(IMAGES)
    # (in units, outside): once per microbatch, and once in torch's metadata inference
    # before the first step and again before eval (whole rows, placeholder gradients).
    for calls in ("step_encoder_calls", "eval_encoder_calls"):
        assert [rank[calls] for rank in ranks] == [(len(IMAGES), 1), (0, 0)]
    for rank in ranks:
        assert rank["left_after_step"] == 0 and rank["left_after_eval"] == 0


def test_features_gradient_of_the_last_segment_only_fails(pipeline_runs):
    """Negative control: the encoder backpropagated with one segment's rows is wrong."""
    pairs = _pairs(pipeline_runs["control"], _reference(CONTROL.linear_attention_interval))
    encoder = [
        _relative(*pair) for name, pair in pairs.items() if name.startswith("vision_encoder.")
    ]
    WORST["control (last segment's feature gradient only)"] = max(encoder)
    assert max(encoder) > 1e-3
