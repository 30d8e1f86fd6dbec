# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Simulated peak memory per rank of Seq1F1B and torch's 1F1B under context parallelism.

Runs the simulator (docs/simulator.md) over a CP x PP grid for Llama 3 8B at 128k
tokens and Llama 3 70B at 256k, both schedules under the same CP degree, and prints
the largest per-rank peak (model states + activations + K/V) as a markdown table.

    python -m benchmarks.cp_memory
    python -m benchmarks.cp_memory --cp 1 4 --pp 4 -k 8
"""

import argparse

from torchtitan_seq1f1b.tools.model_shapes import get_preset
from torchtitan_seq1f1b.tools.simulate import SimConfig, simulate

GIB = 2**30
MODELS = (("llama3-8b", 131072), ("llama3-70b", 262144))


def peak_gib(name: str, seq_len: int, schedule: str, cp: int, pp: int, args) -> float:
    """Largest per-rank peak of one simulated step, in GiB."""
    config = SimConfig(
        model=get_preset(name), model_name=name, seq_len=seq_len, pp=pp,
        microbatches=args.microbatches, segments=args.segments, schedule=schedule, cp=cp,
    )
    return simulate(config).max_peak_memory_bytes / GIB


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("-m", "--microbatches", type=int, default=8)
    parser.add_argument("-k", "--segments", type=int, default=4, help="Seq1F1B's k")
    args = parser.parse_args(argv)
    labels = [
        f"{name.removeprefix('llama3-').upper()} {seq_len // 1024}k" for name, seq_len in MODELS
    ]
    print("| CP | PP | " + " | ".join(
        f"{label} 1F1B | {label} Seq1F1B | ratio" for label in labels
    ) + " |")
    print("|---|---|" + "---|---|---|" * len(MODELS))
    for cp in args.cp:
        for pp in args.pp:
            cells = []
            for name, seq_len in MODELS:
                base, seq = (
                    peak_gib(name, seq_len, schedule, cp, pp, args)
                    for schedule in ("1F1B", "Seq1F1B")
                )
                cells += [f"{base:.0f}", f"{seq:.0f}", f"{seq / base:.2f}"]
            print(f"| {cp} | {pp} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
