"""A benchmark's runs as a table, JSON and a PNG plot (against concurrency when there are several)."""

from __future__ import annotations

import json
from pathlib import Path

from rlserve.bench.metrics import PERCENTILES


def table(runs: list[dict]) -> str:
    head = ["concurrency", "requests", "failed", "out tok/s", "req/s"]
    for name in ("TTFT", "ITL", "latency"):
        head += [f"{name} p{p} ms" for p in PERCENTILES]
    rows = [head]
    for r in runs:
        row = [str(r["concurrency"] or "-"), str(r["requests"]), str(r["failed"]),
               f"{r['output_tokens_per_s']:.1f}", f"{r['requests_per_s']:.2f}"]  # fmt: skip
        for key in ("ttft_ms", "itl_ms", "latency_ms"):
            stats = r[key]
            row += [f"{stats[f'p{p}']:.1f}" if stats else "-" for p in PERCENTILES]
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows)


def write_json(path: Path, meta: dict, runs: list[dict]) -> None:
    path.write_text(json.dumps({**meta, "runs": runs}, indent=2) + "\n")


def plot(path: Path, title: str, runs: list[dict]) -> None:
    """Throughput and latency percentiles against concurrency (one point per run)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: never a display
    import matplotlib.pyplot as plt

    x = [r["concurrency"] or 1 for r in runs]
    fig, (tput, lat) = plt.subplots(1, 2, figsize=(11, 4.2))
    tput.plot(x, [r["output_tokens_per_s"] for r in runs], "o-", label="output tokens/s")
    tput.set_xlabel("concurrency")
    tput.set_ylabel("output tokens/s")
    tput.set_title("throughput")
    for color, (key, name) in enumerate((("ttft_ms", "TTFT"), ("itl_ms", "ITL"), ("latency_ms", "latency"))):
        for p, style in zip(PERCENTILES, ("o-", "s--", "^:")):
            if all(r[key] for r in runs):
                lat.plot(x, [r[key][f"p{p}"] for r in runs], style, color=f"C{color}", label=f"{name} p{p}")
    lat.set_yscale("log")
    lat.set_xlabel("concurrency")
    lat.set_ylabel("ms")
    lat.set_title("latency percentiles")
    lat.legend(fontsize=7, ncol=3)
    for ax in (tput, lat):
        ax.set_xscale("log", base=2)
        ax.grid(True, alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
