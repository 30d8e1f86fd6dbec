# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""torchtitan 0.3's vision-language models (qwen3_5, kimi_k2_5) under Seq1F1B.

torchtitan pipelines them with ``pipeline_vlm``: the vision encoder joins the
first stage, whose forward embeds the tokens, encodes the batch's images and
writes one feature row per image token (``_prepare_multimodal_embeds``).
Under Seq1F1B a segment holds only some image tokens, so
:func:`segment_aware_images` makes that step the segment-aware scatter of
:mod:`torchtitan_seq1f1b.vision` (each image encoded once per microbatch, its
gradient summed over the segments that use it); the trainer computes every
image token's feature row on whole sequences (:func:`image_index_kwargs`) and
the schedule cuts that map with the segments. Beside it:

- a text batch brings no image or video token ids, which the model's
  forward wants: :func:`text_only_inputs` hands it ids no token has;
- the registries' multimodal dataloader imports torchvision when loaded, which
  a CPU torch stack may lack (PyPI's torchvision pins its own torch build):
  :func:`torchvision_stand_in` lets the registry load, and raises on any use.
"""

import contextlib
import functools
import importlib.machinery
import importlib.util
import inspect
import sys
import types
from collections.abc import Iterator

import torch
import torch.nn as nn

from torchtitan_seq1f1b.integration.titan_0_3.release import FOLDED
from torchtitan_seq1f1b.vision import image_feature_index, SegmentAwareImageScatter

__all__ = [
    "IMAGE_KWARGS",
    "brings_images",
    "image_index_kwargs",
    "segment_aware_images",
    "text_only_inputs",
    "torchvision_stand_in",
    "vision_problems",
]

# The model compares tokens with these ids only where a batch brings images.
NO_VISION_TOKENS = {"image_id": -1, "video_id": -1}
# What torchtitan 0.3's image and video utilities import.
TORCHVISION_MODULES = ("torchvision", "torchvision.io", "torchvision.transforms",
                       "torchvision.transforms.v2", "torchvision.transforms.v2.functional")


class _Missing(types.ModuleType):
    """A torchvision module that is not there: any attribute raises, saying so."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        raise ModuleNotFoundError(
            f"{self.__name__}.{name}: torchvision is not installed; images and video need "
            "it, a text-only job does not"
        )


@contextlib.contextmanager
def torchvision_stand_in() -> Iterator[None]:
    """While open, ``import torchvision...`` gives modules whose attributes raise, if
    torchvision is not installed; once closed, the import fails again as it should.
    Modules imported meanwhile keep the stand-ins."""
    if importlib.util.find_spec("torchvision") is not None:
        yield
        return
    stand_ins = {}
    for name in TORCHVISION_MODULES:
        module = stand_ins[name] = _Missing(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)
        parent, _, child = name.rpartition(".")
        if parent:
            # ``import a.b`` binds ``a``; ``a.b`` is then an attribute lookup.
            setattr(stand_ins[parent], child, module)
    sys.modules.update(stand_ins)
    try:
        yield
    finally:
        for name in TORCHVISION_MODULES:
            sys.modules.pop(name, None)


def _no_vision_tokens(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    kwargs.setdefault("special_tokens", NO_VISION_TOKENS)
    return args, kwargs


def text_only_inputs(parallelize_fn):
    """``parallelize_fn`` whose model (or pipeline part), if its forward takes
    ``special_tokens``, gets :data:`NO_VISION_TOKENS` there when a batch brings
    none (a text dataloader's)."""

    @functools.wraps(parallelize_fn)
    def parallelize(model: nn.Module, **kwargs) -> nn.Module:
        takes_tokens = "special_tokens" in inspect.signature(type(model).forward).parameters
        model = parallelize_fn(model, **kwargs)
        if takes_tokens:
            model.register_forward_pre_hook(_no_vision_tokens, with_kwargs=True)
        return model

    return parallelize


def brings_images(dataloader) -> bool:
    """Whether a dataloader config's batches hold images: torchtitan's multimodal
    dataloader's or the shipped image-text corpus' (on main: their collators)."""
    module = type(getattr(dataloader, "collator", dataloader)).__module__
    return module.startswith("torchtitan.hf_datasets.multimodal") or module in IMAGE_DATA_MODULES


def vision_problems(model_name: str, dataloader, cp: int) -> list[str]:
    """Why a Seq1F1B job of ``model_name`` cannot read ``dataloader``'s images at CP
    degree ``cp``."""
    if not brings_images(dataloader):
        return []
    if cp == 1:
        return []
    return [
        f"parallelism.context_parallel_degree={cp} with images for {model_name!r}: the "
        "image features are scattered into whole segments on one rank; set "
        "--parallelism.context_parallel_degree 1, or train on text (--seq1f1b.data recall)"
    ]


# The shipped corpus' dataloader on 0.3 and its collator on main.
IMAGE_DATA_MODULES = tuple(f"torchtitan_seq1f1b.integration.titan_0_3.{name}"
                           for name in ("image_dataloader", "image_grain"))
# Whole-batch image inputs: not cut with the segments, whatever their shapes.
IMAGE_KWARGS = ("pixel_values", "grid_thw", "pixel_values_videos", "grid_thw_videos")
# special_tokens' key carrying the segment's feature rows into the embedding step.
_INDEX_KEY = "seq1f1b_image_index"


def image_index_kwargs(tokens: torch.Tensor, kwargs: dict) -> dict:
    """``kwargs`` (a batch's model inputs beside ``tokens`` (B, T), on main (T,)) with
    ``image_index`` of the tokens' shape, each image token's feature row, if the
    batch brings images."""
    if kwargs.get("pixel_values") is None:
        return kwargs
    image_id = kwargs["special_tokens"]["image_id"]
    return {**kwargs, "image_index": image_feature_index(tokens == image_id)}


def _take_image_index(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    # The model's forward takes no image_index: it travels in special_tokens.
    index = kwargs.pop("image_index", None)
    if index is not None:
        kwargs["special_tokens"] = {**kwargs["special_tokens"], _INDEX_KEY: index}
    return args, kwargs


def _tokens_per_item(encoder: nn.Module, grid_thw: torch.Tensor) -> torch.Tensor:
    """(items,) merged tokens of each image: qwen3_5 merges spatial_merge_unit patches
    (over time too), kimi_k2_5 pools time and merges its kernel's patches."""
    if hasattr(encoder, "spatial_merge_unit"):
        return grid_thw.prod(-1) // encoder.spatial_merge_unit
    kh, kw = encoder.merge_kernel_size
    return (grid_thw[:, 1] // kh) * (grid_thw[:, 2] // kw)


def _encoded_rows(encoder: nn.Module, pixel_values: torch.Tensor, grid_thw: torch.Tensor):
    """(N, dim): the images' feature rows, in image order: main's encoder packs them,
    0.3's pads them, (items, max_tokens, dim), each image's first tokens_per_item."""
    encoded = encoder(pixel_values.to(encoder.patch_embed.weight.dtype), grid_thw=grid_thw)
    if FOLDED:
        return encoded
    counts = _tokens_per_item(encoder, grid_thw)
    kept = torch.arange(encoded.shape[1], device=encoded.device) < counts[:, None]
    return encoded[kept]


def _segment_aware_embeds(
    self,
    tokens: torch.Tensor,
    *,
    pixel_values: torch.Tensor | None,
    grid_thw: torch.Tensor | None,
    pixel_values_videos: torch.Tensor | None = None,
    grid_thw_videos: torch.Tensor | None = None,
    special_tokens: dict,
) -> torch.Tensor:
    """The model's ``_prepare_multimodal_embeds`` on a segment: (B, L) tokens ->
    (B, L, dim) embeddings (on main (L,) -> (L, dim)) with the segment's image
    tokens' features written in."""
    if pixel_values_videos is not None:
        raise NotImplementedError(
            "a batch brings videos: Seq1F1B scatters image features only; train on images"
        )
    embeds = self.tok_embeddings(tokens)
    if pixel_values is None or grid_thw is None:
        return embeds
    index = special_tokens.get(_INDEX_KEY)
    if index is None:  # whole rows: no schedule cut them
        index = image_feature_index(tokens == special_tokens["image_id"])
    encode = functools.partial(_encoded_rows, self.vision_encoder, pixel_values, grid_thw)
    if FOLDED:  # the scatter takes (batch, len) rows: main's segment is a batch of one
        return self.image_scatter(embeds[None], encode, index[None])[0]
    return self.image_scatter(embeds, encode, index)


def segment_aware_images(part: nn.Module) -> None:
    """Make a pipeline part of a VLM take ``image_index`` (:func:`image_index_kwargs`,
    cut with the segments), and, if it holds the vision encoder, scatter each
    segment's image features through a segment-aware scatter."""
    part.register_forward_pre_hook(_take_image_index, with_kwargs=True)
    if getattr(part, "vision_encoder", None) is None:
        return
    part.image_scatter = SegmentAwareImageScatter()
    part._prepare_multimodal_embeds = types.MethodType(_segment_aware_embeds, part)
