"""The PNG of `bench serve --plot`: latency percentiles, and over time the output throughput,
the server's running batch size (from its /metrics, when it exports it) and the inter-token
latency (median and p99 of the tokens that arrived in each time bin)."""

from __future__ import annotations

import sys


def plot(res: dict, path: str) -> bool:
    """Write the PNG; False (and a message) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: skipping the plot (pip install matplotlib)",
              file=sys.stderr)
        return False
    fig, axes = plt.subplots(2, 2, figsize=(13, 8))
    (ax_lat, ax_tput), (ax_bs, ax_itl) = axes
    names = [("ttft_ms", "TTFT"), ("itl_ms", "ITL"), ("tpot_ms", "TPOT"), ("e2el_ms", "E2E")]
    width = 0.25
    for j, stat in enumerate(("median", "p90", "p99")):
        vals = [res[k][stat] or 0.0 for k, _ in names]
        ax_lat.bar([i + (j - 1) * width for i in range(len(names))], vals, width, label=stat)
    ax_lat.set_xticks(range(len(names)), [n for _, n in names])
    ax_lat.set_ylabel("ms")
    ax_lat.set_yscale("log")
    ax_lat.set_title("latency percentiles")
    ax_lat.legend()

    tl = res["timeline"]
    xs = [(i + 0.5) * tl["bin_s"] for i in range(len(tl["output_tokens_per_s"]))]
    ax_tput.plot(xs, tl["output_tokens_per_s"], label="output tok/s")
    ideal = (res.get("ideal") or {}).get("output_throughput")
    if ideal:
        ax_tput.axhline(ideal, color="tab:green", linestyle="--", label=f"ideal {ideal:,.0f}")
    ax_tput.set_xlabel("time (s)")
    ax_tput.set_ylabel("output tokens / s")
    ax_tput.set_title("throughput over time")
    ax_tput.legend(loc="upper right")

    srv = res.get("server") or {}
    stl = srv.get("timeline") or {}
    if any(v is not None for v in stl.get("running", [])):
        ax_bs.plot(stl["t_s"], [v or 0 for v in stl["running"]], label="running")
        ax_bs.plot(stl["t_s"], [v or 0 for v in stl["waiting"]], label="waiting", alpha=0.6)
        ax_bs.legend(loc="upper right")
    else:
        ax_bs.text(0.5, 0.5, "the server exports no running-batch gauge", ha="center",
                   va="center", transform=ax_bs.transAxes)
    ax_bs.set_xlabel("time (s)")
    ax_bs.set_ylabel("sequences")
    ax_bs.set_title("running batch size (server /metrics)")

    med, p99 = tl.get("itl_median_ms", []), tl.get("itl_p99_ms", [])
    ax_itl.plot(xs[: len(med)], [v if v is not None else float("nan") for v in med],
                label="median")
    ax_itl.plot(xs[: len(p99)], [v if v is not None else float("nan") for v in p99],
                label="p99", alpha=0.7)
    ax_itl.set_xlabel("time (s)")
    ax_itl.set_ylabel("ms")
    ax_itl.set_title("inter-token latency over time")
    ax_itl.legend(loc="upper right")

    c = res["config"]
    extra = ""
    if srv.get("preemptions") is not None:
        extra += f", {srv['preemptions']} preemptions"
    if srv.get("device_busy_fraction") is not None:
        extra += f", device busy {100 * srv['device_busy_fraction']:.0f} %"
    fig.suptitle(f"{c['model']} ({c['dataset']}): in {c['input_len']} / out {c['output_len']} "
                 f"tokens, rate {c['request_rate']}, concurrency {c['max_concurrency'] or 'inf'}, "
                 f"{res['completed']} requests, {res['output_throughput']:.1f} tok/s{extra}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
