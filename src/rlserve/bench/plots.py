"""PNGs of a launched benchmark: the curves (six panels, one line per server and dtype) and the
comparison (tokens/s per workload and server). matplotlib is optional: pip install 'rlserve[bench]'."""

from __future__ import annotations

from pathlib import Path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: never a display
    import matplotlib.pyplot as plt

    return plt


def _lines(points: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for p in points:
        label = f"{p['server']} {p['dtype']}" + (" (emulated)" if p.get("emulated") else "")
        out.setdefault(label, []).append(p)
    return out


def _series(ax, points: list[dict], x_key: str, y_of, colors: dict[str, str], style: str = "o-", suffix: str = "",
            **kw) -> None:  # fmt: skip
    for label, ps in _lines(points).items():
        xs = [p[x_key] for p in ps if y_of(p) is not None]
        ys = [y_of(p) for p in ps if y_of(p) is not None]
        if xs:
            ax.plot(xs, ys, style, color=colors[label], label=label + suffix, **kw)


def _plain_log_ticks(ax) -> None:
    """A log axis labelled at the measured points (1, 4, 16, ...), not at powers of ten."""
    from matplotlib.ticker import NullFormatter, NullLocator

    if ax.get_xscale() != "log":
        return
    xs = sorted({float(x) for line in ax.get_lines() for x in line.get_xdata()})
    if xs:
        ax.set_xticks(xs, [f"{x:g}" for x in xs])
        ax.xaxis.set_minor_locator(NullLocator())
        ax.xaxis.set_minor_formatter(NullFormatter())


def plot_curves(path: Path, result: dict) -> None:
    plt = _pyplot()
    c = result["curves"]
    fig, axes = plt.subplots(2, 3, figsize=(16, 8.5))
    (tput, lat, prefill), (ttft, n, prefix) = axes
    # one colour per server and dtype across every panel (a panel may lack a server's points)
    every = _lines([p for points in c.values() for p in points])
    colors = {label: f"C{i}" for i, label in enumerate(every)}
    _series(tput, c["concurrency"], "concurrency", lambda p: p["output_tokens_per_s"], colors)
    tput.set(xlabel="concurrency", ylabel="output tokens/s", title="throughput vs concurrency", xscale="log")
    _series(
        lat, c["concurrency"], "concurrency", lambda p: p["ttft_ms"] and p["ttft_ms"]["p50"], colors, "o-", " TTFT p50"
    )
    _series(
        lat, c["concurrency"], "concurrency", lambda p: p["itl_ms"] and p["itl_ms"]["p50"], colors, "s--", " ITL p50"
    )
    _series(
        lat, c["concurrency"], "concurrency", lambda p: p["itl_ms"] and p["itl_ms"]["p99"], colors, "^:", " ITL p99"
    )
    lat.set(xlabel="concurrency", ylabel="ms", title="latency vs concurrency", xscale="log", yscale="log")
    _series(prefill, c["prompt_len"], "prompt_len", lambda p: p["prefill_tokens_per_s"], colors)
    prefill.set(xlabel="prompt tokens", ylabel="prompt tokens/s", title="prefill vs prompt length", xscale="log")
    _series(ttft, c["prompt_len"], "prompt_len", lambda p: p["ttft_ms"] and p["ttft_ms"]["p50"], colors)
    ttft.set(xlabel="prompt tokens", ylabel="ms", title="time to first token vs prompt length", xscale="log",
             yscale="log")  # fmt: skip
    _series(n, c["n"], "n", lambda p: p["output_tokens_per_s"], colors)
    n.set(xlabel="n (samples per prompt)", ylabel="output tokens/s", title="GRPO shape: throughput vs n", xscale="log")
    measured = [p for p in c["prefix_cache"] if p["hit_rate"] is not None]
    designed = [p for p in c["prefix_cache"] if p["hit_rate"] is None]
    _series(prefix, measured, "hit_rate", lambda p: p["output_tokens_per_s"], colors)
    _series(prefix, designed, "reusable_share", lambda p: p["output_tokens_per_s"], colors, "o--", " (reusable share)",
            markerfacecolor="none")  # fmt: skip
    prefix.set(xlabel="prefix-cache hit rate (prompt tokens)", ylabel="output tokens/s",
               title="multi-turn sessions: throughput vs hit rate")  # fmt: skip
    for ax in axes.flat:
        _plain_log_ticks(ax)
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    cpu = result["cpu"]
    fig.suptitle(f"rlserve bench serve --curves: {Path(result['model']).name}; {cpu['model']}, {cpu['cores']} cores, "
                 f"{' '.join(cpu['flags'])}")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_compare(path: Path, result: dict) -> None:
    plt = _pyplot()
    cells = [(r["dtype"], r["workload"]) for r in result["results"]]
    groups = list(dict.fromkeys(cells))
    servers = list(dict.fromkeys(r["server"] for r in result["results"]))
    fig, ax = plt.subplots(figsize=(max(6, 2.2 * len(groups)), 4.5))
    width = 0.8 / len(servers)
    for k, server in enumerate(servers):
        got = {
            (r["dtype"], r["workload"]): r["output_tokens_per_s"] for r in result["results"] if r["server"] == server
        }
        xs = [i + k * width for i, g in enumerate(groups) if g in got]
        ax.bar(xs, [got[g] for g in groups if g in got], width, label=server, color=f"C{k}")
    ax.set_xticks([i + width * (len(servers) - 1) / 2 for i in range(len(groups))])
    ax.set_xticklabels([f"{w}\n{d}" for d, w in groups], fontsize=8)
    ax.set_ylabel("output tokens/s (median of rounds)")
    ax.legend()
    ax.grid(True, axis="y", alpha=0.3)
    cpu = result["cpu"]
    ax.set_title(f"{Path(result['model']).name}; {cpu['model']}, {cpu['cores']} cores, {' '.join(cpu['flags'])}",
                 fontsize=9)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
