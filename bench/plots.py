"""PNG plots of the benchmark JSON files (matplotlib, the ``bench`` extra).

- micro benchmarks (JSON with ``tables``): one panel per table, each row's ``relative`` speed
  (to the table's baseline: its first row, or each pair's alternative in bench_rpc), log scale;
- the race: rows/s per contender at each K (log scale, the floor marked), the time of every
  batch per contender, and the restart cost per state size.
"""
import json
import math
import os

_COLORS = {"floor": "#888888", "stream_floor": "#bbbbbb", "hdfs": "#1f77b4", "rocksdb": "#ff7f0e", "rocksdb_changelog": "#d62728",
           "pandas_state": "#9467bd", "tws_pandas": "#8c564b", "statecore": "#2ca02c",
           "statecore_raw": "#98df8a", "statecore_pre": "#c5b0d5"}


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    return plt


def _caption(payload):
    m = payload.get("machine", {})
    return (f"{m.get('cpu', '?')}, {m.get('cores', '?')} cores; Python {m.get('python', '?')}; "
            f"statecore {m.get('statecore_commit', '?')}")


def plot(name, json_path, out_dir):
    """The PNG files made from one benchmark's JSON (an empty list if it has nothing to plot)."""
    with open(json_path) as f:
        payload = json.load(f)
    if name == "race":
        return plot_race(payload, out_dir)
    if payload.get("tables"):
        return [plot_tables(name, payload, out_dir)]
    return []


def plot_tables(name, payload, out_dir):
    plt = _pyplot()
    tables = payload["tables"]
    fig, axes = plt.subplots(len(tables), 1, figsize=(9, 1.2 + sum(0.35 * len(rows) + 0.6 for rows in tables.values())),
                             squeeze=False)
    for ax, (title, rows) in zip(axes[:, 0], tables.items()):
        names = [_row_name(r) for r in rows][::-1]
        relative = [max(r.get("relative", 0.0), 1e-3) for r in rows][::-1]
        ax.barh(names, relative, color=["#888888" if v == 1.0 else "#2ca02c" for v in relative])
        ax.set_xscale("log")
        ax.axvline(1.0, color="black", linewidth=0.8)
        ax.set_title(title, fontsize=9, loc="left")
        ax.tick_params(labelsize=8)
        for y, v in enumerate(relative):
            ax.text(v, y, f" {v:.1f}x", va="center", fontsize=7)
    axes[-1, 0].set_xlabel("speed relative to the baseline (grey bars, 1.0x), log scale", fontsize=8)
    fig.suptitle(f"bench_{name}: {_caption(payload)}", fontsize=8)
    fig.tight_layout()
    path = os.path.join(out_dir, f"{name}.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _row_name(row):
    """A table row's label: its name, else what identifies it (the RPC tables' system and clients)."""
    if "name" in row:
        return row["name"]
    parts = [str(row[k]) for k in ("system", "mode") if k in row]
    if "procs" in row and "threads" in row:
        parts.append(f"{row['procs']}x{row['threads']}")
    return " ".join(parts) or "?"


def plot_race(payload, out_dir):
    plt = _pyplot()
    paths = []
    race = payload.get("race", {})
    if race:
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), squeeze=False)
        for ax, (keys, table) in zip(axes[0], race.items()):
            names = list(table)
            rates = [table[n]["rows_per_s"] for n in names]
            ax.bar(names, rates, color=[_COLORS.get(n, "#333333") for n in names])
            ax.set_yscale("log")
            ax.set_title(f"K = {int(keys):,} keys: rows/s (median of batches 3..N)", fontsize=9)
            ax.tick_params(axis="x", rotation=30, labelsize=8)
            for x, v in enumerate(rates):
                ax.text(x, v, f"{v / 1e3:,.0f}k", ha="center", va="bottom", fontsize=7)
        fig.suptitle(f"end-to-end race, local[2], 2 state partitions: {_caption(payload)}", fontsize=8)
        fig.tight_layout()
        paths.append(os.path.join(out_dir, "race_rows_per_s.png"))
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)

        fig, axes = plt.subplots(1, len(race), figsize=(6 * len(race), 4.2), squeeze=False)
        for ax, (keys, table) in zip(axes[0], race.items()):
            for n, s in table.items():
                ax.plot(range(1, len(s["batch_seconds"]) + 1), s["batch_seconds"], marker="o", markersize=3,
                        label=f"{n} ({s['rows_per_batch']:,} rows/batch)", color=_COLORS.get(n))
            ax.set_yscale("log")
            ax.set_xlabel("batch", fontsize=8)
            ax.set_ylabel("seconds", fontsize=8)
            ax.set_title(f"K = {int(keys):,}: time of each batch", fontsize=9)
            ax.legend(fontsize=7)
        fig.tight_layout()
        paths.append(os.path.join(out_dir, "race_batches.png"))
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    restart = payload.get("restart", {})
    if restart:
        fig, ax = plt.subplots(figsize=(8, 4))
        sizes = list(restart)
        contenders = sorted({c for t in restart.values() for c in t}, key=list(_COLORS).index)
        width = 0.8 / max(1, len(contenders))
        for i, c in enumerate(contenders):
            values = [max(restart[s].get(c, {}).get("restart_cost_s", math.nan), 0.01) for s in sizes]
            ax.bar([x + i * width for x in range(len(sizes))], values, width, label=c, color=_COLORS.get(c))
        ax.set_xticks([x + width * (len(contenders) - 1) / 2 for x in range(len(sizes))])
        ax.set_xticklabels([f"{int(s):,} keys" for s in sizes])
        ax.set_yscale("log")
        ax.set_ylabel("restart-to-first-batch minus an empty query's (s)", fontsize=8)
        ax.legend(fontsize=8)
        ax.set_title(f"restart from a checkpoint: {_caption(payload)}", fontsize=8)
        fig.tight_layout()
        paths.append(os.path.join(out_dir, "race_restart.png"))
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths
