"""The table of ./build.sh bench-push: per deployment and case, the medians
of the two rounds' p50s (bench/run_push_bench.sh writes one JSON per
deployment and round). Usage: push_table.py DIR."""

from __future__ import annotations

import collections
import glob
import json
import os
import statistics
import sys


def main() -> None:
    rows: dict[tuple, list[dict]] = collections.defaultdict(list)
    for path in sorted(glob.glob(os.path.join(sys.argv[1], "*.json"))):
        with open(path) as f:
            r = json.load(f)
        for c in r["cases"]:
            rows[(c["prompt_chars"], c["concurrency"], r["label"])].append(c)
    print("| prompt tokens | concurrent | deployment | prefill alone p50 ms | TTFT p50 ms | TTFT p90 ms | hand-off p50 ms | end-to-end p50 ms | rounds |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (n, conc, label), cs in sorted(rows.items()):

        def med(k: str, cs: list[dict] = cs) -> float:
            return statistics.median(c[k] for c in cs)

        print(f"| {int(med('prompt_tokens'))} | {conc} | {label} | {med('prefill_alone_ms_p50'):.0f} | {med('ttft_ms_p50'):.0f} | "
              f"{med('ttft_ms_p90'):.0f} | {med('handoff_ms_p50'):.0f} | {med('e2e_ms_p50'):.0f} | {len(cs)} |")


if __name__ == "__main__":
    main()
