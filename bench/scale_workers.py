"""Benchmark: rank 0's saturation rate with 1 and with K proxy worker processes, in alternating rounds.

Usage::

    python bench/scale_workers.py [--workers 1,2] [--rounds 4] [--round-s 10] [--executions 1152]
                                  [--engines 8] [--json [OUT.json]]

``bench/scale.py`` measures one proxy configuration per run, so two runs compare the machine at
two moments as much as the two configurations (its speed moves by tens of percent from one run to
the next on a shared virtual machine). This script starts one proxy of each size in ``--workers``
over the same stand-in engines, each with its own ``--executions`` executions and load-generator
processes (``bench/scale_load.py``, the same load as ``bench/scale.py``), makes every execution's
first call on each, and then measures their saturation rate (``--saturation-concurrency``
callers back to back, no think time) in rounds of ``--round-s`` seconds, the sizes taking turns
in mirrored order (1, 2, 2, 1, 1, 2, ...), one size idle while the other is measured. A slow spell
of the machine then weighs on every size alike.

Per size it reports ``calls_per_s_max`` (its calls over its rounds' time), the proxy's CPU ms per
call and share of the cores, the load generators' and engines' shares, and ``records_lost``; and
the ratio of each size's rate to the first size's, over all rounds (``ratio``) and per round pair
(``round_ratios``, a size's round against the first size's round next to it).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from scale import (PAPER_EXECUTIONS, Load, ProcStat, _emit, add_load_arguments, count_records,  # noqa: E402
                   engine_round_trip_ms, phase, prepare_load, start_engines, start_proxy)


def round_order(sizes: list[int], rounds: int) -> list[int]:
    """The sizes in turn, every other round mirrored: [1, 2] and 3 rounds -> 1, 2, 2, 1, 1, 2."""
    return [k for r in range(rounds) for k in (sizes if r % 2 == 0 else sizes[::-1])]


def rate_ratios(rounds: list[tuple[int, int, float]], base: int) -> dict[int, list[float]]:
    """Per size, each of its rounds' rate over the ``base`` size's rate in the same round of turns
    (``rounds``: ``(round index, size, calls/s)``)."""
    by_round: dict[int, dict[int, float]] = {}
    for r, k, rate in rounds:
        by_round.setdefault(r, {})[k] = rate
    out: dict[int, list[float]] = {}
    for rates in by_round.values():
        for k, rate in rates.items():
            if k != base and rates.get(base):
                out.setdefault(k, []).append(rate / rates[base])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", default="1,2", help="proxy sizes compared (processes); the first is the base")
    ap.add_argument("--rounds", type=int, default=4, help="rounds of turns (each size measured once per round)")
    ap.add_argument("--round-s", type=float, default=10.0)
    ap.add_argument("--executions", type=int, default=PAPER_EXECUTIONS, help="live executions per proxy")
    add_load_arguments(ap)
    args = ap.parse_args(argv)
    try:
        sizes = [int(x) for x in args.workers.split(",") if x]
    except ValueError:
        ap.error(f"--workers takes sizes like 1,2, not {args.workers!r}")
    if len(sizes) < 2 or len(set(sizes)) != len(sizes) or min(sizes) < 1 or args.rounds < 1 or args.round_s <= 0:
        ap.error("--workers needs two or more different sizes >= 1; --rounds and --round-s must be positive")
    init_range = prepare_load(args)
    procs, loads = [], []
    sets: dict[int, dict[str, Any]] = {}
    try:
        procs, engine_urls = start_engines(args.engines, args.engine_processes, args.helpers_nice)
        engines = [ProcStat(p.pid) for p in procs]
        for k in sizes:
            store = tempfile.mkdtemp(prefix=f"gyre-scale-workers-{k}-")
            proxy = start_proxy(k, engine_urls, store, args.heap_trim_s)
            load = Load(proxy.register(args.executions, f"k{k}"), args.load_processes, args, init_range, seed=1)
            loads.append(load)
            sets[k] = {"proxy": proxy, "load": load, "store": store, "calls": 0, "rounds": []}
        engine_ms = engine_round_trip_ms(engine_urls[0], sum(init_range) // 2 + 4 * args.turn_tokens)
        print(f"proxies of {sizes} processes, {args.executions} executions each, {args.engines} engines "
              f"(helpers at nice {args.helpers_nice}); engine round trip {engine_ms:.2f} ms", flush=True)
        for k in sizes:
            s = sets[k]
            s["calls"] += phase(f"warm K={k}", s["load"], {"op": "warm", "concurrency": 16}, None, s["proxy"],
                                engine_ms, engines)["calls"]
        timeline = []
        for i, k in enumerate(round_order(sizes, args.rounds)):
            s = sets[k]
            ph = phase(f"K={k} round {i // len(sizes) + 1}", s["load"],
                       {"op": "closed", "concurrency": args.saturation_concurrency, "duration": args.round_s},
                       "concurrency", s["proxy"], engine_ms, engines)
            s["calls"] += ph["calls"]
            s["rounds"].append(ph)
            timeline.append((i // len(sizes), k, ph["calls_per_s"]))
        for ld in loads:
            ld.close()
        loads = []
        result: dict[str, Any] = {"workers": sizes, "rounds": args.rounds, "round_s": args.round_s,
                                  "executions": args.executions, "engines": args.engines,
                                  "engine_processes": args.engine_processes,
                                  "helpers_nice": args.helpers_nice, "by_workers": {}}
        for k in sizes:
            rs = sets[k]["rounds"]
            calls, wall = sum(r["calls"] for r in rs), sum(r["wall_s"] for r in rs)
            cpu_ms = sum(r["cpu_ms_per_call"] * r["calls"] for r in rs if r["calls"])
            shares = {f: float(np.average([r[f] for r in rs], weights=[r["wall_s"] for r in rs]))
                      for f in ("proxy_cpu_share", "load_cpu_share", "engines_cpu_share", "machine_busy_cores")}
            result["by_workers"][str(k)] = {
                "calls_per_s_max": calls / wall,
                "cpu_ms_per_call": cpu_ms / calls, **shares,
                "round_calls_per_s": [r["calls_per_s"] for r in rs],
                "records_lost": sets[k]["calls"] - count_records(sets[k]["store"]),
                "proxy_rss_bytes": sets[k]["proxy"].rss_bytes()}
        base = sizes[0]
        per_round = rate_ratios(timeline, base)
        result["ratio"] = {str(k): result["by_workers"][str(k)]["calls_per_s_max"]
                           / result["by_workers"][str(base)]["calls_per_s_max"] for k in sizes[1:]}
        result["round_ratios"] = {str(k): v for k, v in per_round.items()}
    finally:
        for ld in loads:
            ld.close()
        for s in sets.values():
            s["proxy"].stop()
        for p in procs:
            p.kill()
            p.wait()
    for k in sizes:
        b = result["by_workers"][str(k)]
        print(f"K={k}: calls_per_s_max {b['calls_per_s_max']:.1f}  proxy CPU {b['cpu_ms_per_call']:.2f} ms/call "
              f"({b['proxy_cpu_share']:.0%} of a core)  rounds {[round(x, 1) for x in b['round_calls_per_s']]}  "
              f"records_lost {b['records_lost']}")
    for k in sizes[1:]:
        rr = result["round_ratios"].get(str(k), [])
        print(f"K={k} / K={base}: {result['ratio'][str(k)]:.2f}x  (per round {[round(x, 2) for x in rr]})", flush=True)
    _emit(result, args.json)
    return 0 if all(result["by_workers"][str(k)]["records_lost"] == 0 for k in sizes) else 1


if __name__ == "__main__":
    sys.exit(main())
