"""The timeline of one overlapped call, like the wave-pattern figure of the paper: below, every
tile at its completion time (x) and worker / CTA (y), colored by group; above, each group's
transfer as a bar from its start to its end (and, if given, the predicted ones)."""
from __future__ import annotations

from pathlib import Path

from ..tile_trace import TileTrace


def plot_timeline(trace: TileTrace, path, title: str = "", predicted=None) -> Path:
    """Write the PNG; ``predicted``: optional (start, end) seconds per group, drawn as a
    second, hatched row of transfer bars."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = plt.get_cmap("tab10")
    fig, (bars, tiles) = plt.subplots(2, 1, sharex=True, figsize=(11, 6),
                                      gridspec_kw={"height_ratios": [1, 5]})
    rows = [("measured", list(zip(trace.transfer_start, trace.transfer_end)), None)]
    if predicted:
        rows.append(("predicted", list(predicted), "//"))
    for y, (_, spans, hatch) in enumerate(rows):
        for g, (start, end) in enumerate(spans):  # staggered: transfers may overlap in time
            if start is not None and end is not None:
                bars.barh(y - 0.3 + 0.2 * (g % 4), (end - start) * 1e3, left=start * 1e3,
                          height=0.18, hatch=hatch, color=colors(g % 10), edgecolor="black",
                          linewidth=0.5, align="edge")
    bars.set_yticks(range(len(rows)), [name for name, _, _ in rows])
    bars.invert_yaxis()
    bars.set_title(title or f"{trace.num_items} tiles in {len(trace.group_sizes)} groups, "
                   f"waves of {trace.wave_size}: transfers (bars) and tiles by completion")

    group_of = [g for g, size in enumerate(trace.group_sizes) for _ in range(size)]
    tiles.scatter([t * 1e3 for t in trace.item_end], trace.item_worker, s=8, marker="s",
                  c=[colors(g % 10) for g in group_of], linewidths=0)
    tiles.yaxis.get_major_locator().set_params(integer=True)
    tiles.set_ylabel("worker / CTA")
    tiles.set_xlabel(f"ms from the call's start ({trace.clock or 'clock not given'}); "
                     "dashed: result complete")
    if trace.call_end is not None:
        for ax in (bars, tiles):
            ax.axvline(trace.call_end * 1e3, color="black", linestyle="--", linewidth=0.8)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
