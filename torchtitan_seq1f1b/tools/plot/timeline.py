# Copyright (c) the torchtitan-seq1f1b authors.
# Licensed under the BSD 3-Clause license found in the LICENSE file.

"""Timeline chart: ranks x time, one box per compute action, simulated or measured.

Colour = microbatch, lighter = earlier segment, and the kind by hatching and
label (``F0.1`` forward of microbatch 0 segment 1; B full backward, I
input-gradient, W weight-gradient; a stage prefix such as ``2F0.1`` when a
rank holds several stages).
"""

from __future__ import annotations

import colorsys
from dataclasses import dataclass, fields

import matplotlib.pyplot as plt
from matplotlib.colors import to_rgb
from matplotlib.patches import Patch, Rectangle

from torchtitan_seq1f1b.orders import replay
from torchtitan_seq1f1b.tools.simulate import action_duration, schedule_order, SimConfig

__all__ = ["Action", "TimelineData", "measured_actions", "plot_timeline", "simulated_actions"]

_HATCHES = {"F": "", "B": "///", "I": "\\\\\\", "W": "..."}
_KIND_NAMES = {"F": "forward", "B": "backward", "I": "input grad", "W": "weight grad"}


@dataclass(frozen=True)
class Action:
    """One compute box of a timeline; times in the source's unit."""

    rank: int
    stage: int
    kind: str
    microbatch: int
    segment: int
    start: float
    end: float


@dataclass(frozen=True)
class TimelineData:
    """Everything :func:`plot_timeline` draws, and its caption."""

    actions: list[Action]
    title: str
    time_unit: str
    num_segments: int


def simulated_actions(config: SimConfig) -> TimelineData:
    """The simulator's timeline of ``config``: its real order, timed by FLOPs."""
    plan = config.plan()
    # simulate() replays the same timeline but keeps only the totals, not the spans.
    order = schedule_order(config)
    timeline = replay(order, action_duration(config, plan), config.p2p_latency)
    actions = [
        Action(rank, a.stage, a.kind, a.microbatch, a.segment, *timeline.spans[a])
        for rank, rank_actions in order.items()
        for a in rank_actions
    ]
    k = plan.num_segments
    title = (
        f"simulated {config.schedule}: p={config.pp} v={config.v} m={config.microbatches} "
        f"k={k}{f' {config.partition}' if k > 1 else ''}, model {config.model_name} "
        f"S={config.seq_len}; bubble {timeline.bubble_fraction:.3f}"
    )
    return TimelineData(actions, title, "time (forwards of one microbatch on one rank)", k)


def measured_actions(record: dict) -> TimelineData:
    """The median step of a bench record (``bench --json``), in seconds."""
    actions = [Action(**{f.name: a[f.name] for f in fields(Action)}) for a in record["actions"]]
    if not actions:
        raise ValueError(f"bench record {record['label']!r} has no recorded actions")
    title = (
        f"measured {record['label']}: p={record['pp']} m={record['microbatches']}; "
        f"step {record['step_time_s']:.3f}s, bubble {record['bubble_fraction']:.3f} "
        f"(median step, {record['model']['dim']}-dim {record['model']['n_layers']}-layer model, "
        f"S={record['model']['seq_len']})"
    )
    return TimelineData(actions, title, "time (s) from the step's start", record["segments"])


def _shade(color, segment: int, num_segments: int) -> tuple[float, float, float]:
    """Earlier segments lighter, the last at the base colour."""
    if num_segments == 1:
        return to_rgb(color)
    hue, lightness, saturation = colorsys.rgb_to_hls(*to_rgb(color))
    lighten = 0.55 * (num_segments - 1 - segment) / (num_segments - 1)
    return colorsys.hls_to_rgb(hue, lightness + (1 - lightness) * lighten, saturation)


def _label(action: Action, num_segments: int, multi_stage: bool) -> str:
    unit = f"{action.microbatch}.{action.segment}" if num_segments > 1 else f"{action.microbatch}"
    return f"{action.stage if multi_stage else ''}{action.kind}{unit}"


def plot_timeline(data: TimelineData, path: str) -> None:
    """Draw ``data`` as ranks x time boxes into the PNG ``path``."""
    actions = data.actions
    ranks = sorted({a.rank for a in actions})
    multi_stage = len({a.stage for a in actions}) > len(ranks)
    microbatches = sorted({a.microbatch for a in actions})
    start = min(a.start for a in actions)
    makespan = max(a.end for a in actions) - start
    palette = plt.get_cmap("tab10").colors
    busiest = max(sum(a.rank == r for a in actions) for r in ranks)
    width = min(max(12.0, 0.6 * busiest), 30.0)
    # Long schedules get taller rows too, so the image keeps a viewable shape.
    fig, ax = plt.subplots(figsize=(width, max(3.0, 1.2 + 0.9 * len(ranks), width / 5)))
    for a in actions:
        color = _shade(palette[a.microbatch % len(palette)], a.segment, data.num_segments)
        ax.add_patch(Rectangle(
            (a.start - start, a.rank - 0.4), a.end - a.start, 0.8,
            facecolor=color, edgecolor="black", linewidth=0.6, hatch=_HATCHES[a.kind],
        ))
        # Labels only where they fit: the axis spans ~80% of the figure, and a
        # 7-point character is ~0.06 inch wide.
        label = _label(a, data.num_segments, multi_stage)
        if (a.end - a.start) / makespan * width * 0.8 > (len(label) + 0.5) * 0.06:
            ax.text(
                (a.start + a.end) / 2 - start, a.rank, label, ha="center", va="center",
                fontsize=7, bbox={"boxstyle": "square,pad=0.1", "fc": "white", "ec": "none",
                                  "alpha": 0.7},
            )
    ax.set_xlim(0, makespan * 1.01)
    ax.set_ylim(len(ranks) - 0.5, -0.5)
    ax.set_yticks(ranks, [f"rank {r}" for r in ranks])
    ax.set_xlabel(data.time_unit)
    ax.set_title(data.title, fontsize=9)
    kinds = [k for k in "FBIW" if any(a.kind == k for a in actions)]
    handles = [
        Patch(facecolor="white", edgecolor="black", hatch=_HATCHES[k], label=_KIND_NAMES[k])
        for k in kinds
    ] + [
        Patch(facecolor=palette[i % len(palette)], edgecolor="black", label=f"microbatch {i}")
        for i in microbatches[:10]
    ]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7,
              title="lighter = earlier segment" if data.num_segments > 1 else None,
              title_fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
