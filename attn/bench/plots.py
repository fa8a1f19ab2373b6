"""PNG plots of a sweep: peak memory vs N (log–log, grey guides of slopes 1 and 2), time and
TFLOP/s vs N; docs/benchmarks.md ('Reading the memory plot') reads them.
"""

from __future__ import annotations

import sys
from pathlib import Path

_COLORS = {"reference": "tab:red", "tiled": "tab:blue", "sdpa": "tab:green",
           "triton": "tab:purple", "sdpa-flash": "tab:olive", "sdpa-efficient": "tab:cyan",
           "sdpa-cudnn": "tab:brown", "flex": "tab:orange"}
_MODES = ("fwd", "fwd+bwd")


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    return plt


def _draw(ax, rows, mode, field, scale=1.0):
    for backend in dict.fromkeys(r["backend"] for r in rows):
        for causal in sorted({r["causal"] for r in rows}):
            pts = sorted((r["N"], r[field]) for r in rows if r["backend"] == backend
                         and r["causal"] == causal and r["mode"] == mode
                         and r["status"] == "ok" and r[field] is not None)
            if pts:
                ax.plot([n for n, _ in pts], [y * scale for _, y in pts], marker="o", ms=4,
                        color=_COLORS.get(backend), ls="--" if causal else "-",
                        label=backend + (" causal" if causal else ""))
    ax.set_xscale("log", base=2)
    ns = sorted({r["N"] for r in rows})
    ax.set_xticks(ns, [str(n) for n in ns])  # the measured N, not powers of two in 2^k form
    ax.minorticks_off()
    ax.set(xlabel="sequence length N", title=mode)
    ax.grid(True, which="both", alpha=0.3)


def _guides(ax, rows, mode, scale):
    """Lines ∝ N and ∝ N² through the smallest measured point, to read slopes against."""
    pts = [(r["N"], r["peak_bytes"]) for r in rows
           if r["mode"] == mode and r["status"] == "ok" and r["peak_bytes"]]
    if not pts:
        return
    ns = sorted({n for n, _ in pts})
    n0 = ns[0]
    at_n0 = sorted(y for n, y in pts if n == n0)
    y0 = at_n0[len(at_n0) // 2] * scale  # the median backend, so guides sit mid-plot
    for power, label, ls in ((1, "∝ N", ":"), (2, "∝ N²", "-.")):
        ax.plot(ns, [y0 * (n / n0) ** power for n in ns], color="grey", ls=ls, lw=1,
                label=label)


def _figure(rows: list[dict], n_rows: int, height: float, **share):
    """A figure of ``n_rows`` panels per mode the rows measured, modes in the usual order (a
    forward-only sweep gets one column, not an empty forward+backward one beside it); returns
    the figure, its axes (n_rows × modes) and the modes."""
    present = {r["mode"] for r in rows}
    modes = [m for m in _MODES if m in present]
    fig, axes = _pyplot().subplots(n_rows, len(modes), figsize=(5.5 * len(modes), height),
                                   squeeze=False, **share)
    return fig, axes, modes


def _legend(ax) -> None:
    """A legend when the panel has labelled lines (a panel whose points all failed or were
    skipped has none, and matplotlib warns about an empty legend)."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)


def _title(rows: list[dict], header: dict | None) -> str:
    r = rows[0]
    dev = (header or {}).get("device_name", r["device"])
    if len({(x["B"], x["H"]) for x in rows}) == 1:
        return f"{dev} — {r['dtype']}, B={r['B']}, H={r['H']}, D={r['D']}"
    return f"{dev} — {r['dtype']}, B and H per N (fixed work per point), D={r['D']}"


def save(fig, path: str | Path, title: str | None = None) -> Path:
    """Write ``fig`` (with ``title`` above its panels) to ``path`` and close it."""
    if title is not None:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return Path(path)


def plot_memory(rows: list[dict], path: str | Path, header: dict | None = None) -> Path:
    """Peak MiB above the inputs vs N, log–log, one panel per mode."""
    fig, axes, modes = _figure(rows, 1, 4.5, sharey=True)
    for ax, mode in zip(axes[0], modes):
        _draw(ax, rows, mode, "peak_bytes", 1 / 2**20)
        _guides(ax, rows, mode, 1 / 2**20)
        ax.set(yscale="log", ylabel="peak MiB above inputs")
        _legend(ax)
    return save(fig, path, "Peak memory — " + _title(rows, header))


def plot_speed(rows: list[dict], path: str | Path, header: dict | None = None) -> Path:
    """Top: median ms vs N (log–log). Bottom: TFLOP/s vs N with the matmul rate as a ceiling."""
    fig, axes, modes = _figure(rows, 2, 8, sharex=True)
    rate = (header or {}).get("matmul_tflops", {}).get(rows[0]["dtype"])
    for col, mode in enumerate(modes):
        _draw(axes[0, col], rows, mode, "ms")
        axes[0, col].set(yscale="log", ylabel="ms (median)")
        _legend(axes[0, col])
        _draw(axes[1, col], rows, mode, "tflops")
        if rate:
            axes[1, col].axhline(rate, color="black", ls=":", lw=1, label="square matmul")
        axes[1, col].set(ylabel="TFLOP/s (4·B·H·N²·D fwd, ×3.5 fwd+bwd)", ylim=(0, None))
        _legend(axes[1, col])
    return save(fig, path, "Speed — " + _title(rows, header))


def write_plots(rows: list[dict], out_dir: str | Path, header: dict | None = None) -> list[Path]:
    """memory-<dtype>-d<D>.png and speed-<dtype>-d<D>.png per (dtype, D) with data to show.
    Returns [] (with the reason on stderr) when matplotlib is not installed."""
    try:
        _pyplot()
    except ImportError:
        print("attn: matplotlib is not installed, no plots (pip install matplotlib)",
              file=sys.stderr)
        return []
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for dtype, D in dict.fromkeys((r["dtype"], r["D"]) for r in rows):
        rs = [r for r in rows if r["dtype"] == dtype and r["D"] == D]
        if any(r["peak_bytes"] for r in rs):
            paths.append(plot_memory(rs, out_dir / f"memory-{dtype}-d{D}.png", header))
        if any(r["ms"] for r in rs):
            paths.append(plot_speed(rs, out_dir / f"speed-{dtype}-d{D}.png", header))
    return paths
