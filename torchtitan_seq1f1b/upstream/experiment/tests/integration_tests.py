# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""GPU integration tests of the seq1f1b experiment, in torchtitan's format.

Each entry is one ``run_train.sh`` job of ``--module seq1f1b --config
seq1f1b_debug`` with overrides, run by torchtitan's
``tests.integration_tests.run_tests``; the exactness check against an
unpipelined run is ``test_seq1f1b.py`` (CPU, pytest).

    python -m torchtitan.experiments.seq1f1b.tests.integration_tests OUT_DIR --ngpu 4
"""

import argparse
import os

from tests.integration_tests import OverrideDefinitions
from tests.integration_tests.run_tests import run_tests

# Every run is the debug job (PP=2, k=4) for 10 steps unless it says otherwise.
BASE = ["--module seq1f1b", "--config seq1f1b_debug"]
STEPS = ["--training.steps 10"]


def build_seq1f1b_test_list() -> list[OverrideDefinitions]:
    """One job per Seq1F1B schedule on its stage layout, then PP with FSDP and TP."""
    return [
        OverrideDefinitions(
            [BASE + STEPS + ["--seq1f1b.schedule Seq1F1B"]],
            "Seq1F1B PP=2, k=4",
            "seq1f1b_pp2",
            ngpu=2,
        ),
        OverrideDefinitions(
            [
                BASE
                + STEPS
                + [
                    "--seq1f1b.schedule InterleavedSeq1F1B",
                    "--parallelism.pipeline_parallel_schedule Interleaved1F1B",
                ]
            ],
            "Interleaved Seq1F1B PP=2, 2 stages per rank",
            "seq1f1b_interleaved_pp2",
            ngpu=2,
        ),
        OverrideDefinitions(
            [BASE + STEPS + ["--seq1f1b.schedule Seq1F1BZeroBubble"]],
            "Seq1F1B zero bubble PP=2",
            "seq1f1b_zero_bubble_pp2",
            ngpu=2,
        ),
        OverrideDefinitions(
            [
                BASE
                + STEPS
                + [
                    "--seq1f1b.schedule Seq1F1BZBV",
                    "--parallelism.pipeline_parallel_schedule ZBVZeroBubble",
                ]
            ],
            "Seq1F1B ZBV PP=2",
            "seq1f1b_zbv_pp2",
            ngpu=2,
        ),
        OverrideDefinitions(
            [BASE + STEPS + ["--parallelism.data_parallel_shard_degree 2"]],
            "Seq1F1B PP=2 with FSDP=2",
            "seq1f1b_pp2_fsdp2",
            ngpu=4,
        ),
        OverrideDefinitions(
            [BASE + STEPS + ["--parallelism.tensor_parallel_degree 2"]],
            "Seq1F1B PP=2 with TP=2",
            "seq1f1b_pp2_tp2",
            ngpu=4,
        ),
        OverrideDefinitions(
            [
                BASE + STEPS + ["--checkpoint.enable", "--checkpoint.interval 5"],
                BASE + ["--checkpoint.enable", "--training.steps 15"],
            ],
            "Seq1F1B PP=2 checkpoint save, then resume",
            "seq1f1b_pp2_checkpoint_resume",
            ngpu=2,
        ),
    ]


_TEST_SUITES_FUNCTION = {
    "seq1f1b": build_seq1f1b_test_list,
}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("output_dir")
    parser.add_argument(
        "--test_name",
        default="all",
        help="test to run: a `test_name` of build_seq1f1b_test_list (default: all)",
    )
    parser.add_argument("--ngpu", default=4, type=int)
    args = parser.parse_args()

    if not os.path.exists(args.output_dir):
        os.makedirs(args.output_dir)
    if os.listdir(args.output_dir):
        raise RuntimeError("Please provide an empty output directory.")

    test_list = _TEST_SUITES_FUNCTION["seq1f1b"]()
    run_tests(args, test_list)


if __name__ == "__main__":
    main()
