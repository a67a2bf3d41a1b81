"""SLO attainment, goodput and the report of benchmarks/goodput.py (no torch, no network: unit-testable).

A request meets an SLO pair when it completed, its TTFT <= the TTFT target and its TPOT ((end - first token) /
(output tokens - 1); 0 for one output token) <= the TPOT target. Attainment at a rate = requests meeting it / requests
sent (failed and unfinished ones count as misses). Goodput = the highest swept rate at which attainment >= 90 %,
every lower swept rate passing too (a conservative reading of DistServe's definition); `interpolated` also
places the crossing linearly between the last passing and the first failing rate; `highest_passing` is the literal
reading (the highest swept rate that passes, lower failures or not). Where the two readings differ the curve is
not monotonic (noise: short windows, each rate drawing its own prompts) and a bar decided by the difference is
reported NOT ROBUST rather than PASS or FAIL. Per GPU: divided by the GPUs the configuration uses.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

TARGET = 0.9


@dataclass(frozen=True)
class Slo:
    name: str
    ttft_s: float
    tpot_s: float


SLOS = (Slo("tight", 1.0, 0.025), Slo("loose", 2.0, 0.060))


@dataclass(frozen=True)
class Outcome:
    """One request as the client saw it."""

    ok: bool
    ttft_s: float | None
    tpot_s: float | None
    output_tokens: int


def meets(o: Outcome, slo: Slo, ttft: bool = True, tpot: bool = True) -> bool:
    if not o.ok or o.ttft_s is None:
        return False
    return (not ttft or o.ttft_s <= slo.ttft_s) and (not tpot or (o.tpot_s or 0.0) <= slo.tpot_s)


def attainment(outcomes: Sequence[Outcome], slo: Slo, ttft: bool = True, tpot: bool = True) -> float:
    return sum(meets(o, slo, ttft, tpot) for o in outcomes) / len(outcomes) if outcomes else 0.0


def goodput(points: Sequence[tuple[float, float]], target: float = TARGET) -> dict[str, float]:
    """points: (rate, attainment) of one configuration and SLO. {"measured", "interpolated"} in req/s (0: even the
    lowest rate failed), and "lower_bound" 1.0 when no swept rate failed: the sweep never reached the knee (it ended
    or its later rates were skipped), so the true goodput is at least "measured" and may be much higher."""
    measured, interpolated, lower_bound = 0.0, 0.0, 1.0
    prev: tuple[float, float] | None = None
    for rate, att in sorted(points):
        if att < target:
            if prev is not None:
                r0, a0 = prev
                interpolated = r0 + (rate - r0) * (a0 - target) / (a0 - att) if a0 > att else r0
            lower_bound = 0.0
            break
        measured = interpolated = rate
        prev = (rate, att)
    highest = max((rate for rate, att in points if att >= target), default=0.0)
    return {
        "measured": measured,
        "interpolated": interpolated,
        "lower_bound": lower_bound if points else 0.0,
        "highest_passing": highest,
    }


def percentile(values: Sequence[float], p: float) -> float:
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * p
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize_rate(rate: float, outcomes: Sequence[Outcome], duration_s: float) -> dict[str, Any]:
    ok = [o for o in outcomes if o.ok and o.ttft_s is not None]
    ttft = [o.ttft_s for o in ok if o.ttft_s is not None]
    tpot = [o.tpot_s for o in ok if o.tpot_s is not None and o.output_tokens > 1]
    row: dict[str, Any] = {
        "rate": rate,
        "sent": len(outcomes),
        "completed": len(ok),
        "duration_s": duration_s,
        "ttft_ms": {f"p{q}": 1e3 * percentile(ttft, q / 100) for q in (50, 90, 99)},
        "tpot_ms": {f"p{q}": 1e3 * percentile(tpot, q / 100) for q in (50, 90, 99)},
        "output_tok_s": sum(o.output_tokens for o in ok) / duration_s if duration_s else 0.0,
        "attainment": {
            s.name: {
                "both": attainment(outcomes, s),
                "ttft": attainment(outcomes, s, tpot=False),
                "tpot": attainment(outcomes, s, ttft=False),
            }
            for s in SLOS
        },
    }
    return row


def config_goodput(rows: Sequence[dict[str, Any]], num_gpus: int) -> dict[str, dict[str, float]]:
    out = {}
    for s in SLOS:
        g = goodput([(r["rate"], r["attainment"][s.name]["both"]) for r in rows])
        out[s.name] = {
            **g,
            "per_gpu": g["measured"] / num_gpus,
            "per_gpu_interpolated": g["interpolated"] / num_gpus,
            "per_gpu_highest_passing": g["highest_passing"] / num_gpus,
        }
    return out


def table(results: Sequence[dict[str, Any]]) -> str:
    """One row per (workload, arrival, configuration): goodput per SLO (total and per GPU), low-load latencies."""
    head = (
        "workload",
        "arrival",
        "config",
        "gpus",
        "tight req/s (per GPU)",
        "loose req/s (per GPU)",
        "low-load TTFT p50 ms",
        "low-load TPOT p50 ms",
        "D step ms",
        "TPOT/step",
    )
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        g, low = r.get("goodput", {}), r.get("low_load") or {}
        step = low.get("decode_step_ms")
        ratio = low.get("tpot_over_step")
        lines.append(
            "| "
            + " | ".join(
                [
                    r["workload"],
                    r["arrival"],
                    r["config"],
                    str(r["num_gpus"]),
                    _cell(g, "tight"),
                    _cell(g, "loose"),
                    _f(low.get("ttft_p50_ms")),
                    _f(low.get("tpot_p50_ms")),
                    _f(step),
                    _f(ratio, 2),
                ]
            )
            + " |"
        )
    return "\n".join(lines)


def _cell(g: dict[str, Any], slo: str) -> str:
    x = g.get(slo)
    if x is None:
        return "n/a"
    more = ">=" if x.get("lower_bound") else ""  # no swept rate failed: the knee lies beyond the sweep
    return f"{more}{x['measured']:.2f} ({more}{x['per_gpu']:.2f})"


def _f(x: float | None, digits: int = 1) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def write_json(path: str, doc: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=2, default=str)


def plot(results: Sequence[dict[str, Any]], out_dir: str) -> list[str]:
    """Attainment-vs-rate curves per (workload, arrival) and SLO, and TTFT/TPOT CDFs at each configuration's
    highest common rate. Returns the PNG paths; none (with a message) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots (pip install matplotlib); the JSON has every point")
        return []
    paths = []
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in results:
        groups.setdefault((r["workload"], r["arrival"]), []).append(r)
    for (wl, arrival), rs in groups.items():
        fig, axes = plt.subplots(1, len(SLOS) + 2, figsize=(5 * (len(SLOS) + 2), 4))
        for ax, s in zip(axes, SLOS, strict=False):
            for r in rs:
                xs = [p["rate"] / r["num_gpus"] for p in r["rates"]]
                ax.plot(xs, [p["attainment"][s.name]["both"] for p in r["rates"]], marker="o", label=r["config"])
            ax.axhline(TARGET, color="grey", ls="--", lw=0.8)
            ax.set(
                title=f"{wl}/{arrival}: {s.name} (TTFT<={s.ttft_s:g}s, TPOT<={1e3 * s.tpot_s:g}ms)",
                xlabel="rate per GPU (req/s)",
                ylabel="SLO attainment",
                ylim=(0, 1.02),
            )
            ax.legend()
        for ax, key in zip(axes[len(SLOS) :], ("ttft_s", "tpot_s"), strict=True):
            for r in rs:
                if r["rates"]:
                    last = r["rates"][-1]
                    xs = sorted(x for x in last.get("samples", {}).get(key, []) if x is not None)
                    if xs:
                        ax.plot(
                            [1e3 * x for x in xs],
                            [(i + 1) / len(xs) for i in range(len(xs))],
                            label=f"{r['config']} @ {last['rate']:g} req/s",
                        )
            ax.set(title=f"{key[:-2].upper()} CDF (highest rate run)", xlabel="ms", ylabel="fraction")
            ax.legend()
        fig.tight_layout()
        path = os.path.join(out_dir, f"goodput_{wl}_{arrival}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def bars(results: Sequence[dict[str, Any]]) -> list[str]:
    """The acceptance checks per (workload, arrival) with a colocated and a PD row: low-load PD TTFT p50 within
    colocated + 30 ms; D's TPOT within 1.15x its engine's decode step; tight-SLO goodput per GPU of 1P1D >= 2x
    colocated; loose-SLO best of PD configurations >= 1.0x colocated."""
    out = []
    groups: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}
    for r in results:
        groups.setdefault((r["workload"], r["arrival"]), {})[r["config"]] = r
    for (wl, arrival), by in groups.items():
        colo, pd = by.get("colocated"), by.get("1p1d")
        if colo is None or pd is None:
            continue
        tag = f"{wl}/{arrival}"
        lc, lp = colo.get("low_load") or {}, pd.get("low_load") or {}
        if lc.get("ttft_p50_ms") is not None and lp.get("ttft_p50_ms") is not None:
            d = lp["ttft_p50_ms"] - lc["ttft_p50_ms"]
            out.append(f"{tag}: low-load TTFT p50 PD - colocated = {d:+.1f} ms (bar <= +30): {_ok(d <= 30)}")
        for name, low in (("PD decode", lp), ("colocated", lc)):
            if low.get("tpot_over_step") is not None:
                x = low["tpot_over_step"]
                out.append(f"{tag}: {name} TPOT / engine decode step = {x:.2f} (bar <= 1.15): {_ok(x <= 1.15)}")
        gc, gp = colo.get("goodput") or {}, pd.get("goodput") or {}
        if "tight" in gc and "tight" in gp:
            out.append(_ratio(f"{tag}: tight goodput per GPU 1P1D / colocated", gp["tight"], gc["tight"], 2.0))
        if "loose" in gc:
            best = max(
                (r["goodput"]["loose"] for n, r in by.items() if n != "colocated" and r.get("goodput")),
                key=lambda g: g["per_gpu"],
                default=None,
            )
            if best is not None:
                out.append(_ratio(f"{tag}: loose goodput per GPU best PD / colocated", best, gc["loose"], 1.0))
    return out


def handoff_lines(results: Sequence[dict[str, Any]]) -> list[str]:
    """Where a PD request's low-load TTFT went: the workers' handoff phase means (P: queue, prefill, lease; D:
    handshake, admit, pull, commit, resume, total), one line per PD configuration and workload."""
    out = []
    colocated = {(r["workload"], r["arrival"]): r for r in results if r["config"] == "colocated"}
    for r in results:
        low = r.get("low_load") or {}
        phases = low.get("handoff_ms") or {}
        if not phases:
            continue
        tag = f"{r['workload']}/{r['arrival']} {r['config']}"
        out.append(f"{tag} low-load handoff ms: " + ", ".join(f"{k} {v:.1f}" for k, v in phases.items()))
        base = ((colocated.get((r["workload"], r["arrival"])) or {}).get("low_load") or {}).get("per_request") or []
        for i, one in enumerate(low.get("per_request") or []):
            other = base[i] if i < len(base) and base[i]["prompt_tokens"] == one["prompt_tokens"] else None
            if one["ttft_ms"] is None:
                continue
            vs = (
                ""
                if other is None or other["ttft_ms"] is None
                else (f" vs colocated {other['ttft_ms']:.1f} ({one['ttft_ms'] - other['ttft_ms']:+.1f})")
            )
            cells = ", ".join(f"{k} {v:.1f}" for k, v in one["handoff_ms"].items())
            out.append(f"  {one['prompt_tokens']} prompt tokens: TTFT {one['ttft_ms']:.1f} ms{vs}; {cells}")
    return out


def _ok(passed: bool) -> str:
    return "PASS" if passed else "FAIL"


def _ratio(label: str, num: dict[str, float], den: dict[str, float], bar: float) -> str:
    a, b = num["per_gpu"], den["per_gpu"]
    if b == 0:
        return f"{label} = {a:.2f} / 0 (colocated met no swept rate; sweep lower rates)"
    verdict = _ok(a / b >= bar)
    # A goodput whose sweep never failed is only a lower bound: a pass against a lower-bound denominator, or a fail
    # with a lower-bound numerator, says nothing.
    if (verdict == "PASS" and den.get("lower_bound")) or (verdict == "FAIL" and num.get("lower_bound")):
        verdict = "INCONCLUSIVE (a sweep ended before its knee: extend the rates)"
    elif _ok(_literal(num) / _literal(den) >= bar) != verdict:  # literal >= measured: den's is > 0 here
        verdict = (
            f"NOT ROBUST (the literal reading, highest passing rate: {_literal(num):.2f} / {_literal(den):.2f} "
            "per GPU, decides the other way: attainment is not monotonic in the rate; repeat with longer windows)"
        )
    shown = [f">={x:.2f}" if g.get("lower_bound") else f"{x:.2f}" for x, g in ((a, num), (b, den))]
    return f"{label} = {shown[0]} / {shown[1]} = {a / b:.2f}x (bar >= {bar:g}x): {verdict}"


def _literal(g: dict[str, float]) -> float:
    """Goodput per GPU read literally (the highest passing rate); runs from before it was recorded: the measured."""
    return g.get("per_gpu_highest_passing", g["per_gpu"])


def report(doc: dict[str, Any], path: str = "") -> list[str]:
    """A run's report, the table last: its device and versions, the rates not run, the bar checks, the low-load
    handoff phases, the configurations not run and why."""
    env = doc.get("environment", {})
    lines = [
        f"{path + ': ' if path else ''}{env.get('gpus') or 'cpu'}, {env.get('date_utc')}, commit "
        f"{str(env.get('commit'))[:10]}, torch {env.get('torch')}, fla-core {env.get('fla-core')}, elapsed "
        f"{doc.get('elapsed_s', 0):.0f} s"
    ]
    for r in doc["results"]:  # recomputed from the rows: runs written before "lower_bound" existed lack it
        if r.get("rates"):
            r["goodput"] = config_goodput(r["rates"], r["num_gpus"])
        if r.get("skipped_rates"):
            lines.append(f"  {r['config']}/{r['workload']}/{r['arrival']}: rates {r['skipped_rates']} not run")
    lines += ["  " + line for line in bars(doc["results"]) + handoff_lines(doc["results"])]
    lines += [f"  {skip['config']}: {skip['why']}" for skip in doc.get("skipped", [])]
    return [*lines, table(doc["results"])]


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m benchmarks.goodput_report RUN.json...`: the table and the bar checks of one or more runs."""
    import sys

    paths = list(argv if argv is not None else sys.argv[1:])
    for path in paths:
        with open(path) as f:
            doc = json.load(f)
        print("\n" + "\n".join(report(doc, path)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
