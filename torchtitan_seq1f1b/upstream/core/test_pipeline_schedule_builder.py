# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""pipeline_llm's ``schedule_builder``: an out-of-tree schedule over torchtitan's stages.

The split, the stage sizing and torch's schedule builder are mocked: the test
checks what pipeline_llm hands each builder, on CPU, without a process group.
"""

import unittest
from unittest import mock

import torch.nn as nn

from torchtitan.distributed import pipeline_parallel


class _Stage:
    def __init__(self, is_first: bool, is_last: bool):
        self.is_first, self.is_last, self.submod = is_first, is_last, None


def _pipeline_llm(**hook):
    """pipeline_llm over two fake stages; returns (its result, the stages, the
    parts as parallelized, the mocked _build_pipeline_schedule)."""
    stages = [_Stage(True, False), _Stage(False, True)]
    parts = [nn.Linear(2, 2), nn.Linear(2, 2)]
    parallelized = []

    def parallelize(part, **kwargs):
        parallelized.append(part)
        return part

    with mock.patch.multiple(
        pipeline_parallel,
        _get_pipeline_metadata=mock.Mock(return_value=(2, 2, 1, 1)),
        _generate_llm_fqn_per_model_part=mock.Mock(return_value=[["a"], ["b"]]),
        _pipeline_module_split=mock.Mock(return_value=(stages, list(parts))),
        _build_pipeline_schedule=mock.DEFAULT,
    ) as mocks:
        result = pipeline_parallel.pipeline_llm(
            nn.Module(),
            parallel_dims=mock.Mock(),
            training=mock.Mock(local_batch_size=4),
            parallelism=mock.Mock(
                module_fqns_per_model_part=None, num_pp_microbatches=4
            ),
            compile_config=mock.Mock(),
            ac_config=mock.Mock(),
            dump_folder="",
            device="cpu",
            model_config=mock.Mock(),
            parallelize_fn=parallelize,
            loss_fn=mock.sentinel.loss_fn,
            **hook,
        )
    return result, stages, parallelized, mocks["_build_pipeline_schedule"]


class TestScheduleBuilder(unittest.TestCase):
    def test_unset_builds_torch_schedule(self):
        result, stages, parallelized, default = _pipeline_llm()
        schedule, parts, has_first, has_last = result
        default.assert_called_once()
        self.assertIs(schedule, default.return_value)
        self.assertEqual(default.call_args.kwargs["stages"], stages)
        self.assertIs(default.call_args.kwargs["loss_fn"], mock.sentinel.loss_fn)
        self.assertEqual(parts, parallelized)
        self.assertTrue(has_first and has_last)

    def test_builder_gets_the_same_arguments(self):
        builder = mock.Mock()
        (schedule, parts, _, _), stages, parallelized, default = _pipeline_llm(
            schedule_builder=builder
        )
        default.assert_not_called()
        builder.assert_called_once()
        self.assertIs(schedule, builder.return_value)
        self.assertEqual(builder.call_args.kwargs["stages"], stages)
        # The parts the builder's stages run are the parallelized ones.
        self.assertEqual([stage.submod for stage in stages], parallelized)
        _, _, _, unhooked = _pipeline_llm()
        self.assertEqual(
            builder.call_args.kwargs.keys(), unhooked.call_args.kwargs.keys()
        )
        self.assertEqual(builder.call_args.args, unhooked.call_args.args)

    def test_pipeline_vlm_passes_it_through(self):
        builder = mock.Mock()
        with mock.patch.object(pipeline_parallel, "pipeline_llm") as pipeline_llm:
            pipeline_parallel.pipeline_vlm(
                mock.Mock(vision_encoder=None),
                parallel_dims=mock.Mock(),
                parallelism=mock.Mock(module_fqns_per_model_part=[["a"]]),
                model_config=mock.Mock(),
                schedule_builder=builder,
            )
        self.assertIs(pipeline_llm.call_args.kwargs["schedule_builder"], builder)


if __name__ == "__main__":
    unittest.main()
