# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""qwen3_5, a vision-language model in torchtitan 0.3, trained as a text decoder.

torchtitan builds qwen3_5 with a vision encoder, pipelines it with
``pipeline_vlm`` (the encoder on the first stage) and feeds it from its
multimodal dataloader. A Seq1F1B job trains the decoder on text alone:

- the pipeline stages hold no vision encoder (the stage split names decoder
  modules only), and a job whose dataloader brings images is refused at
  start-up (:func:`image_problems`);
- the model's forward wants the tokenizer's image and video token ids even
  without images: :func:`text_only_inputs` hands it ids no token has;
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

import torch.nn as nn

__all__ = ["image_problems", "text_only_inputs", "torchvision_stand_in"]

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


def image_problems(model_name: str, dataloader) -> list[str]:
    """Why a Seq1F1B job of a vision-language model cannot read ``dataloader``:
    torchtitan's multimodal dataloader brings images for the vision encoder."""
    if not type(dataloader).__module__.startswith("torchtitan.hf_datasets.multimodal"):
        return []
    return [
        f"model {model_name!r} reads images ({type(dataloader).__qualname__}): Seq1F1B "
        "pipelines its text decoder only; the vision encoder runs on torchtitan's "
        "pipeline_vlm stages; train on text: --seq1f1b.data recall, or a text dataloader"
    ]
