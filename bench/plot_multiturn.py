#!/usr/bin/env python3
"""Plots and tabulates bench/run_multiturn_bench.sh's reports.

usage: plot_multiturn.py DATA_DIR OUT.png

DATA_DIR holds gonixl-bench multiturn JSON reports named
{on,off}-seed<N>.json. For each deployment and turn, the runs (seeds) are
combined: token counts summed, latencies averaged over the runs' per-turn
medians. Writes the PNG (prefill-computed tokens, the prefill leg and the
end-to-end latency by turn, on vs off) and prints a markdown table."""

from __future__ import annotations

import json
import pathlib
import statistics
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def load(data: pathlib.Path) -> dict[str, list[dict]]:
    runs: dict[str, list[dict]] = {"on": [], "off": []}
    for f in sorted(data.glob("*-seed*.json")):
        mode = f.name.split("-seed")[0]
        if mode in runs:
            runs[mode].append(json.loads(f.read_text()))
    for mode, reps in runs.items():
        if not reps:
            raise SystemExit(f"no {mode}-seed*.json report in {data}")
        for r in reps:
            if r["failed"]:
                raise SystemExit(
                    f"a {mode} run had {r['failed']} failed requests: {r.get('first_errors')}"
                )
    return runs


def per_turn(reps: list[dict]) -> list[dict]:
    turns = min(len(r["per_turn"]) for r in reps)
    out = []
    for k in range(turns):
        rows = [r["per_turn"][k] for r in reps]
        out.append(
            {
                "turn": k + 1,
                "requests": sum(x["requests"] for x in rows),
                "prompt": sum(x["prompt_tokens"] for x in rows),
                "computed": sum(x.get("prefill_computed_tokens") or 0 for x in rows),
                "pulled": sum(x.get("prefill_pulled_tokens") or 0 for x in rows),
                "cached": sum(x.get("prefill_cached_tokens") or 0 for x in rows),
                "prefill_ms": statistics.mean(
                    x["prefill_ms"]["p50"] for x in rows if x.get("prefill_ms")
                ),
                "e2e_ms": statistics.mean(x["e2e_ms"]["p50"] for x in rows),
                "e2e_mean_ms": statistics.mean(x["e2e_ms"]["mean"] for x in rows),
            }
        )
    return out


def main() -> None:
    data, png = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
    runs = load(data)
    table = {mode: per_turn(reps) for mode, reps in runs.items()}
    turns = [t["turn"] for t in table["on"]]

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    width = 0.38
    for i, (mode, color) in enumerate((("off", "tab:gray"), ("on", "tab:blue"))):
        xs = [t + (i - 0.5) * width for t in turns]
        axes[0].bar(
            xs,
            [t["computed"] for t in table[mode]],
            width,
            color=color,
            label=f"bidirectional {mode}",
        )
        axes[1].plot(
            turns,
            [t["prefill_ms"] for t in table[mode]],
            "o-",
            color=color,
            label=f"bidirectional {mode}",
        )
        axes[2].plot(
            turns,
            [t["e2e_ms"] for t in table[mode]],
            "o-",
            color=color,
            label=f"bidirectional {mode}",
        )
    axes[0].set_title("prompt tokens the prefills computed")
    axes[1].set_title("prefill leg p50 (the prefill's TTFT), ms")
    axes[2].set_title("end-to-end latency p50 (non-streamed turn), ms")
    for ax in axes:
        ax.set_xlabel("turn")
        ax.set_xticks(turns)
        ax.legend()
        ax.grid(alpha=0.3)
    axes[1].set_ylim(bottom=0)
    axes[2].set_ylim(bottom=0)
    runs_n = len(runs["on"])
    fig.suptitle(
        f"Multi-turn, bidirectional KV transfer on vs off (gonixl-proxy --multiturn, 2 prefills + 1 decode each; "
        f"{runs_n} runs per deployment, per-turn medians averaged)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(png, dpi=110)

    print(
        "| turn | requests | prompt tokens | computed off | computed on | pulled on | cached off | cached on "
        "| prefill p50 off (ms) | prefill p50 on (ms) | on/off | e2e p50 off (ms) | e2e p50 on (ms) | on/off |"
    )
    print("|---:" * 14 + "|")
    for off, on in zip(table["off"], table["on"]):
        print(
            f"| {on['turn']} | {on['requests']} | {on['prompt']} | {off['computed']:.0f} | {on['computed']:.0f} "
            f"| {on['pulled']:.0f} | {off['cached']:.0f} | {on['cached']:.0f} | {off['prefill_ms']:.1f} "
            f"| {on['prefill_ms']:.1f} | {on['prefill_ms'] / off['prefill_ms']:.2f} | {off['e2e_ms']:.1f} "
            f"| {on['e2e_ms']:.1f} | {on['e2e_ms'] / off['e2e_ms']:.2f} |"
        )
    tot = {m: sum(t["computed"] for t in table[m][1:]) for m in table}
    print(
        f"\nturns 2+: the prefills computed {tot['on']:.0f} tokens with bidirectional on, {tot['off']:.0f} off"
    )


if __name__ == "__main__":
    main()
