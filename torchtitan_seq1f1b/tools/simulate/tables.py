# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""The tables ``python -m torchtitan_seq1f1b.simulate`` prints."""

from torchtitan_seq1f1b.tools.simulate.memory import GIB
from torchtitan_seq1f1b.tools.simulate.paper import PAPER_CHUNKS
from torchtitan_seq1f1b.tools.simulate.step import SimResult

__all__ = ["print_paper", "print_plan_comparison", "print_results"]

TABLE_LEGEND = """\
columns:
  v, k        stages per rank, segments per microbatch
  makespan    one step's simulated time, in forwards of one microbatch on one rank
  bubble      idle fraction of all ranks over the makespan, with FLOP-priced units
  equal-cost  the same order's bubble when every unit costs the same (F = 1/(k v),
              B = 2F): the schedule's own bubble, without the segment cost imbalance
  analytic    the closed form of equal-cost where one is exact, e.g. (p-1)/(v m k + p-1)
              for the 1F1B family; '-' where none is
  peak GiB    model states + activations + K/V store held at once, per rank (bf16;
              the memory model options below and docs/simulator.md say what counts)
  (...)       rank 0's peak activations in whole microbatches: p for 1F1B,
              (p + k - 1) / k for uniform Seq1F1B"""


def print_results(results: list[SimResult]) -> None:
    """One row per schedule, the shared configuration above, the column legend below."""
    cfg = results[0].config
    print(
        f"model={cfg.model_name} seq_len={cfg.seq_len} pp={cfg.pp} tp={cfg.tp} dp={cfg.dp} "
        + (f"cp={cfg.cp} " if cfg.cp > 1 else "")
        + f"m={cfg.microbatches} partition={cfg.partition} p2p_latency={cfg.p2p_latency} "
        f"backward_split={cfg.backward_split}"
        + (f" documents={cfg.documents_name}" if cfg.documents is not None else "")
        + (f" cp_bandwidth={cfg.cp_bytes_per_second:.3g} cp_latency={cfg.cp_latency:g} "
           f"device_flops={cfg.device_flops:.3g}" if cfg.cp > 1 else "")
    )
    width = max(len("schedule"), *(len(r.schedule) for r in results))
    print(f"{'schedule':<{width}} {'v':>2} {'k':>2} {'makespan':>9} {'bubble':>7} "
          f"{'equal-cost':>10} {'analytic':>8}  peak GiB per rank "
          "(rank 0 activations in microbatches)")
    for r in results:
        peaks = " ".join(f"{b / GIB:6.2f}" for b in r.peak_memory_bytes)
        analytic = r.analytic_bubble_fraction
        analytic = "-" if analytic is None else f"{analytic:.4f}"
        print(
            f"{r.schedule:<{width}} {r.config.v:>2} {r.config.num_segments:>2} "
            f"{r.makespan:>9.3f} {r.bubble_fraction:>7.4f} "
            f"{r.equal_cost_bubble_fraction:>10.4f} {analytic:>8}  {peaks}  "
            f"({r.ranks[0].peak_activation_microbatches:.3f})"
        )
        if r.config.num_segments > 1:
            print(f"{'':<{width}} segment lengths {list(r.segment_lengths)}")
    print(TABLE_LEGEND)


PLANS_LEGEND = """\
  FLOPs max/mean  the costliest segment's forward FLOPs over the mean, with
                  document-masked attention: it paces the pipeline
  causal-balanced equal FLOPs under dense causal attention (a plan that ignores documents);
                  balanced: equal FLOPs under the document mask"""


def print_plan_comparison(results: list[SimResult]) -> None:
    """Segment plans under packed documents: one row per (schedule, partition)."""
    cfg = results[0].config
    print(f"\nsegment plans under packed documents {cfg.documents_name} "
          f"(mean {cfg.documents.mean:.0f} tokens), document-masked attention")
    width = max(len("schedule"), *(len(r.schedule) for r in results))
    print(f"{'schedule':<{width}} {'k':>2} {'partition':<15} {'FLOPs max/mean':>14} "
          f"{'makespan':>9} {'bubble':>7}  segment lengths")
    for r in results:
        print(
            f"{r.schedule:<{width}} {r.config.num_segments:>2} {r.config.partition:<15} "
            f"{r.segment_flops_imbalance:>14.4f} {r.makespan:>9.3f} {r.bubble_fraction:>7.4f}  "
            f"{list(r.segment_lengths)}"
        )
    print(PLANS_LEGEND)


def print_paper(records: list[dict]) -> None:
    """The records of :func:`~torchtitan_seq1f1b.tools.simulate.paper.run_paper` as two tables."""
    print(f"{'config':<16} {'1F1B pred/pub GB':>17} {'Seq1F1B pred/pub GB':>20} "
          f"{'ratio pred/pub':>15} {'diff':>6}")
    by_config: dict[str, dict[str, dict]] = {}
    for rec in records:
        by_config.setdefault(rec["config"], {})[rec["schedule"]] = rec
    for label, recs in by_config.items():
        a, b = recs["1F1B"], recs["Seq1F1B"]
        diff = b["predicted_ratio"] - b["published_ratio"]
        print(
            f"{label:<16} {a['predicted_gb']:>8.1f}/{a['published_gb']:<8.1f} "
            f"{b['predicted_gb']:>10.1f}/{b['published_gb']:<9.1f} "
            f"{b['predicted_ratio']:>7.3f}/{b['published_ratio']:<7.3f} {diff:>+6.3f}"
        )
    print(f"\ninterleaved, v={PAPER_CHUNKS} (reported, not fitted); ratios are to 1F1B")
    print(f"{'config':<16} {'1F1B-I pred/pub GB':>19} {'ratio pred/pub':>15} "
          f"{'Seq1F1B-I pred/pub GB':>22} {'ratio pred/pub':>15}")
    for label, recs in by_config.items():
        cells = []
        for rec in (recs["Interleaved1F1B"], recs["InterleavedSeq1F1B"]):
            published = rec["published_gb"]
            published_ratio = rec["published_ratio"]
            cells.append(
                f"{rec['predicted_gb']:.1f}/{'OOM' if published is None else f'{published:.1f}'}"
            )
            cells.append(
                f"{rec['predicted_ratio']:.3f}/"
                f"{'-' if published_ratio is None else f'{published_ratio:.3f}'}"
            )
        print(f"{label:<16} {cells[0]:>19} {cells[1]:>15} {cells[2]:>22} {cells[3]:>15}")
