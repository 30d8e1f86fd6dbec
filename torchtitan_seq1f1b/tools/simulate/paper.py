# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""The Seq1F1B paper's peak-memory figure: published numbers, inferred layouts, predictions.

The layouts and assumptions are inferred from the authors' launch scripts and
chosen to fit the published 1F1B peaks; docs/simulator.md, "The paper's
figure", gives the reasoning and the layouts that were rejected.
"""

from collections.abc import Sequence
from dataclasses import dataclass

from torchtitan_seq1f1b.tools.model_shapes import get_preset
from torchtitan_seq1f1b.tools.simulate.config import MemoryModel, SimConfig
from torchtitan_seq1f1b.tools.simulate.memory import GIB
from torchtitan_seq1f1b.tools.simulate.schedules import SCHEDULE_SPECS
from torchtitan_seq1f1b.tools.simulate.step import simulate

__all__ = ["PAPER_CHUNKS", "PAPER_CONFIGS", "PaperConfig", "run_paper"]

# Model chunks per rank assumed for the interleaved bars (the scripts sweep 2 and 4).
PAPER_CHUNKS = 2


@dataclass(frozen=True)
class PaperConfig:
    """One bar group of the paper's peak-memory figure and the layout inferred for it.

    ``published_gb`` maps a schedule name to the published GB, None for OOM.
    """

    label: str
    model: str
    gpus: int
    seq_len: int
    pp: int
    tp: int
    microbatches: int
    published_gb: dict[str, float | None]

    def sim_config(self, schedule: str) -> SimConfig:
        return SimConfig(
            model=get_preset(self.model),
            model_name=self.model,
            seq_len=self.seq_len,
            pp=self.pp,
            tp=self.tp,
            dp=self.gpus // (self.pp * self.tp),
            microbatches=self.microbatches,
            segments=4,
            schedule=schedule,
            v=PAPER_CHUNKS if SCHEDULE_SPECS[schedule].multi_stage else 1,
            partition="balanced",
            memory=MemoryModel(
                sequence_parallel=True,
                attention="flash",
                dropout=False,
                kv_store="prefix",
                distributed_optimizer=True,
            ),
        )


def _published(one_f_one_b, seq1f1b, interleaved, interleaved_seq1f1b):
    return {
        "1F1B": one_f_one_b,
        "Seq1F1B": seq1f1b,
        "Interleaved1F1B": interleaved,
        "InterleavedSeq1F1B": interleaved_seq1f1b,
    }


# Published peak memory per GPU (GB), 1F1B / Seq1F1B / 1F1B-I / Seq1F1B-I, design
# notes section 5; None = OOM.
PAPER_CONFIGS: tuple[PaperConfig, ...] = (
    PaperConfig("2.7B 8xGPU 16k", "paper-2.7b", 8, 16384, 8, 1, 16,
                _published(51.4, 29.8, 71.0, 29.7)),
    PaperConfig("7B 32xGPU 32k", "paper-7b", 32, 32768, 4, 8, 8,
                _published(28.0, 18.9, 34.2, 16.4)),
    PaperConfig("7B 32xGPU 64k", "paper-7b", 32, 65536, 4, 8, 8,
                _published(51.4, 34.3, 62.9, 28.4)),
    PaperConfig("13B 32xGPU 32k", "paper-13b", 32, 32768, 4, 8, 8,
                _published(44.2, 29.7, 53.2, 25.8)),
    PaperConfig("30B 64xGPU 32k", "paper-30b", 64, 32768, 8, 8, 16,
                _published(71.4, 37.6, None, 38.6)),
)


def run_paper(configs: Sequence[PaperConfig] = PAPER_CONFIGS) -> list[dict]:
    """Predicted vs published peak memory (GiB), with each schedule's ratio to 1F1B.

    Seq1F1B rows carry the Seq1F1B / 1F1B ratios, as do the 1F1B rows. The
    interleaved rows (v = ``PAPER_CHUNKS``) follow, with their own ratio to
    1F1B; a published None (OOM) has no ratio.
    """
    records = []
    for paper in configs:
        predicted = {
            name: simulate(paper.sim_config(name)).max_peak_memory_bytes / GIB
            for name in paper.published_gb
        }

        def ratios(name: str) -> tuple[float, float | None]:
            published = paper.published_gb[name]
            return (
                predicted[name] / predicted["1F1B"],
                None if published is None else published / paper.published_gb["1F1B"],
            )

        for name in paper.published_gb:
            predicted_ratio, published_ratio = ratios("Seq1F1B" if name == "1F1B" else name)
            records.append({
                "config": paper.label,
                "schedule": name,
                "predicted_gb": round(predicted[name], 2),
                "published_gb": paper.published_gb[name],
                "predicted_ratio": round(predicted_ratio, 3),
                "published_ratio": None if published_ratio is None else round(published_ratio, 3),
                "layout": {"gpus": paper.gpus, "pp": paper.pp, "tp": paper.tp,
                           "dp": paper.gpus // (paper.pp * paper.tp),
                           "microbatches": paper.microbatches, "segments": 4,
                           "chunks": paper.sim_config(name).v},
            })
    return records
