"""docs/img/levers.png: the levers table of docs/plan.md as a picture (peak memory and step time of every decoder
layer at a lever's level against none at the same micro-batch). The figures are the table's: CPU from
benchmarks/bench_checkpoint_levels.py, H100 from bench_gpu's levers section (benchmarks/RESULTS.md, run 4).

    python scripts/docs/docs_levers_figure.py docs/img/levers.png
"""

import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# lever: (peak CPU %, step time CPU %, peak H100 %, step time H100 %); None: not measured (offload is CUDA only)
LEVERS = {
    "full checkpointing": (-60, 0, -68, 21),
    "selective checkpointing": (-30, 10, -38, 9),
    "activation offload (CUDA)": (None, None, -71, 340),
}
COLUMNS = ("peak, CPU", "step time, CPU", "peak, H100", "step time, H100")


def main(out: str) -> None:
    names = list(LEVERS)
    fig = plt.figure(figsize=(10, 6))
    grid = fig.add_gridspec(2, 2, height_ratios=[1, 1.3], hspace=0.45, wspace=0.08)
    table_ax = fig.add_subplot(grid[0, :])
    table_ax.axis("off")
    cells = [[n, *("—" if v is None else f"{v:+d}%" for v in LEVERS[n])] for n in names]
    table = table_ax.table(cellText=cells, colLabels=("lever", *COLUMNS), loc="center", cellLoc="center",
                           colWidths=[0.32, 0.17, 0.17, 0.17, 0.17])
    table.auto_set_font_size(False)
    table.set_fontsize(10)
    table.scale(1, 1.7)
    table_ax.set_title("every decoder layer at the lever's level against none, at the same micro-batch", fontsize=11)
    y = list(range(len(names)))
    peak_ax, time_ax = fig.add_subplot(grid[1, 0]), fig.add_subplot(grid[1, 1])
    for ax, (cpu, gpu), title in ((peak_ax, (0, 2), "peak memory"), (time_ax, (1, 3), "step time")):
        ax.barh([i + 0.2 for i in y], [LEVERS[n][gpu] for n in names], height=0.4, label="H100", color="tab:green")
        measured = [i for i, n in enumerate(names) if LEVERS[n][cpu] is not None]
        ax.barh([i - 0.2 for i in measured], [LEVERS[names[i]][cpu] for i in measured], height=0.4, label="CPU",
                color="tab:blue")
        ax.axvline(0, color="black", linewidth=0.8)
        ax.set_yticks(y, [n.replace(" (", "\n(") for n in names] if ax is peak_ax else [""] * len(names), fontsize=9)
        ax.invert_yaxis()
        ax.set_xlabel("% against no lever")
        ax.set_title(title, fontsize=11)
    time_ax.legend(fontsize=9, loc="center right")
    fig.subplots_adjust(left=0.2, right=0.97, top=0.93, bottom=0.1)
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "docs/img/levers.png")
