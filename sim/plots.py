"""Plots of a `looseleaf simulate` run: start-delay CDFs, GPU-hours by load, and
GPU occupancy over time. Run by `looseleaf simulate` with the results file, the
plot data and the output directory."""

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

STYLE = {
    "looseleaf": dict(color="#1b9e77", lw=2.6),
    "notebookos": dict(color="#d95f02", lw=1.8),
    "pinned": dict(color="#444444", lw=1.8),
    "pinned_30": dict(color="#777777", lw=1.2, ls="--"),
    "pinned_60": dict(color="#999999", lw=1.2, ls="-."),
    "pinned_180": dict(color="#bbbbbb", lw=1.2, ls=":"),
    "naive": dict(color="#7570b3", lw=1.6),
    "modal": dict(color="#e7298a", lw=1.6),
    "snapshot": dict(color="#66a61e", lw=1.4, ls="--"),
    "snapshot_criu": dict(color="#a6761d", lw=1.2, ls=":"),
}


def style(policy):
    return STYLE.get(policy, {})


def cdfs(plot_data, out):
    keys = list(plot_data)
    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.8), squeeze=False)
    for ax, key in zip(axes[0], keys, strict=True):
        for policy, pts in plot_data[key]["cdf"].items():
            if pts:
                xs = [max(p[0], 1.0) for p in pts]
                ax.step(xs, [p[1] for p in pts], where="post", label=policy, **style(policy))
        ax.axvline(1000, color="k", lw=0.6, ls=":")
        ax.set_xscale("log")
        ax.set_xlabel("start delay (ms, log)")
        ax.set_title(key)
        ax.set_ylim(0, 1.01)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("share of GPU cells")
    axes[0][-1].legend(fontsize=7, loc="lower right")
    fig.suptitle("GPU cells started within a delay (dotted: 1 s)")
    fig.tight_layout()
    fig.savefig(out / "start-delay-cdf.png", dpi=110)


def gpu_hours(results, out):
    loads = [k for k in results["loads"] if k.startswith("s") and k[1:].isdigit()]
    if not loads:
        loads = list(results["loads"])[:1]
    policies = [p["policy"] for p in results["loads"][loads[0]]["policies"]]
    fig, ax = plt.subplots(figsize=(9, 4.2))
    width = 0.8 / max(len(policies), 1)
    for i, policy in enumerate(policies):
        ys = [results["loads"][k].get(f"{policy}_gpu_hours", 0) for k in loads]
        xs = [j + i * width for j in range(len(loads))]
        color = style(policy).get("color")
        ax.bar(xs, ys, width, label=policy, color=color, edgecolor="white")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(loads))])
    ax.set_xticklabels([f"{results['loads'][k]['sessions']} sessions" for k in loads])
    ax.set_ylabel("GPU-hours provisioned")
    ax.set_title("GPU-hours by load and policy")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "gpu-hours.png", dpi=110)


def occupancy(plot_data, out):
    key = max((k for k in plot_data if k.startswith("s") and k[1:].isdigit()), key=lambda k: int(k[1:]), default=None)
    key = key or next(iter(plot_data))
    fig, ax = plt.subplots(figsize=(9, 4.2))
    for policy, rows in plot_data[key]["occupancy"].items():
        if policy.startswith("pinned_") or policy == "snapshot_criu":
            continue
        ax.plot([r[0] / 3600 for r in rows], [r[1] for r in rows], label=f"{policy} provisioned", **style(policy))
    rows = plot_data[key]["occupancy"].get("looseleaf", [])
    if rows:
        hours = [r[0] / 3600 for r in rows]
        ax.fill_between(hours, [r[2] for r in rows], color="#1b9e77", alpha=0.25, label="looseleaf slots held")
        ax.fill_between(hours, [r[3] for r in rows], color="#1b9e77", alpha=0.6, label="GPU cells running")
    ax.set_xlabel("hours")
    ax.set_ylabel("GPUs")
    ax.set_title(f"GPU occupancy over time ({key})")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "occupancy.png", dpi=110)


def main():
    results = json.loads(Path(sys.argv[1]).read_text())
    plot_data = json.loads(Path(sys.argv[2]).read_text())
    out = Path(sys.argv[3])
    cdfs(plot_data, out)
    gpu_hours(results, out)
    occupancy(plot_data, out)


main()
