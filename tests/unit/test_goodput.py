"""benchmarks/goodput.py: SLO attainment and goodput arithmetic, the workloads and arrival processes, and one tiny
end-to-end run on CPU (1P1D behind the proxy, real workers)."""

from __future__ import annotations

import json
import random
import statistics

import pytest

from benchmarks.goodput_report import SLOS, Outcome, attainment, config_goodput, goodput, meets, table
from benchmarks.goodput_workloads import WORKLOADS, Shape, arrival_times

TIGHT, LOOSE = SLOS


def test_meets_needs_both_targets_and_completion() -> None:
    assert meets(Outcome(True, 0.9, 0.024, 10), TIGHT)
    assert not meets(Outcome(True, 1.1, 0.010, 10), TIGHT)  # TTFT
    assert not meets(Outcome(True, 0.5, 0.030, 10), TIGHT)  # TPOT
    assert meets(Outcome(True, 0.5, 0.030, 10), TIGHT, tpot=False)
    assert not meets(Outcome(False, None, None, 0), LOOSE)  # a failed request is a miss
    assert meets(Outcome(True, 1.5, 0.050, 10), LOOSE)


def test_attainment_counts_failures_as_misses() -> None:
    got = [Outcome(True, 0.1, 0.01, 5)] * 9 + [Outcome(False, None, None, 0)]
    assert attainment(got, TIGHT) == pytest.approx(0.9)


def test_goodput_is_the_last_rate_of_the_passing_prefix() -> None:
    assert goodput([(1, 1.0), (2, 0.95), (4, 0.5), (6, 0.95)]) == {
        "measured": 2,
        "interpolated": pytest.approx(2 + 2 * (0.95 - 0.9) / (0.95 - 0.5)),
        "lower_bound": 0.0,
        "highest_passing": 6,
    }
    assert goodput([(1, 0.5), (2, 0.99)])["measured"] == 0  # the lowest rate failed: no goodput
    assert goodput([(3, 0.99), (1, 1.0)])["measured"] == 3  # order of the points does not matter
    assert goodput([(3, 0.99), (1, 1.0)])["lower_bound"] == 1.0  # no swept rate failed: only a lower bound


def test_a_ratio_against_a_truncated_sweep_is_inconclusive() -> None:
    from benchmarks.goodput_report import _ratio

    full = {"per_gpu": 2.0, "lower_bound": 0.0}
    truncated = {"per_gpu": 1.0, "lower_bound": 1.0}
    assert _ratio("x", full, truncated, 1.0).endswith("INCONCLUSIVE (a sweep ended before its knee: extend the rates)")
    assert _ratio("x", truncated, full, 1.0).startswith("x = >=1.00 / 2.00") and "INCONCLUSIVE" in _ratio(
        "x", truncated, full, 1.0
    )
    assert _ratio("x", full, {"per_gpu": 1.0, "lower_bound": 0.0}, 1.0).endswith("PASS")
    assert _ratio("x", {"per_gpu": 1.0, "lower_bound": 0.0}, truncated, 2.0).endswith("FAIL")


def test_config_goodput_per_gpu() -> None:
    rows = [{"rate": r, "attainment": {s.name: {"both": a} for s in SLOS}} for r, a in ((2, 1.0), (4, 0.92), (6, 0.3))]
    g = config_goodput(rows, num_gpus=2)
    assert g["tight"]["measured"] == 4 and g["tight"]["per_gpu"] == 2


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_workloads_stay_in_their_documented_ranges(name: str) -> None:
    reqs = WORKLOADS[name](Shape(vocab=1000))(random.Random(0), 200)
    lens = [len(r.prompt) for r in reqs]
    outs = [r.max_tokens for r in reqs]
    assert all(0 <= t < 1000 for r in reqs[:5] for t in r.prompt)
    if name == "long":
        assert 2048 <= min(lens) and max(lens) <= 8192 and 128 <= min(outs) and max(outs) <= 256
    elif name == "chat":
        assert 32 <= min(lens) and max(lens) <= 6000 and 16 <= min(outs) and max(outs) <= 1024
        assert statistics.median(lens) < statistics.mean(lens)  # heavy right tail
    else:  # every request shares the system prompt; later turns extend earlier ones
        assert all(r.prompt[:1024] == reqs[0].prompt[:1024] for r in reqs)
        assert sum(any(o.prompt == r.prompt[: len(o.prompt)] for o in reqs[:i]) for i, r in enumerate(reqs)) > 100


@pytest.mark.parametrize("process", ["poisson", "bursty"])
def test_arrivals_have_the_asked_mean_rate(process: str) -> None:
    times = arrival_times(random.Random(1), rate=20.0, duration_s=200.0, process=process)
    assert len(times) / 200.0 == pytest.approx(20.0, rel=0.1) and times == sorted(times) and times[-1] < 200
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    cv = statistics.pstdev(gaps) / statistics.mean(gaps)
    assert cv == pytest.approx(1.0 if process == "poisson" else 2.0, rel=0.2)


def test_table_has_one_row_per_result() -> None:
    res = [
        {
            "workload": "long",
            "arrival": "poisson",
            "config": c,
            "num_gpus": 2,
            "goodput": {"tight": {"measured": 1.0, "per_gpu": 0.5}, "loose": {"measured": 2.0, "per_gpu": 1.0}},
            "low_load": {"ttft_p50_ms": 10.0, "tpot_p50_ms": 5.0, "decode_step_ms": 4.0, "tpot_over_step": 1.25},
        }
        for c in ("colocated", "1p1d")
    ]
    lines = table(res).splitlines()
    assert len(lines) == 4 and "1.00 (0.50)" in lines[2] and "1.25" in lines[3]


@pytest.mark.slow
def test_goodput_runs_end_to_end_on_cpu(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    from benchmarks import goodput

    out = tmp_path / "gp"
    rc = goodput.main(
        [
            "--device",
            "cpu",
            "--len-scale",
            "0.01",
            "--rates",
            "3",
            "--duration",
            "1.5",
            "--drain",
            "30",
            "--warmup-requests",
            "0",
            "--low-load",
            "2",
            "--low-load-max-tokens",
            "4",
            "--gpus",
            "0",
            "--configs",
            "1p1d",  # one cluster: cache-aware routing has its own integration tests (CI time)
            "--workloads",
            "long",
            "--out-dir",
            str(out),
        ]
    )
    assert rc == 0
    doc = json.loads((out / "goodput.json").read_text())
    by = {r["config"]: r for r in doc["results"]}
    assert "1p1d" in by  # (colocated runs the same code with one role; adaptive when the proxy offers it)
    for r in by.values():
        assert r["rates"][0]["sent"] >= 1 and r["rates"][0]["completed"] == r["rates"][0]["sent"]
        assert r["low_load"]["completed"] == 2 and r["low_load"]["decode_step_ms"] > 0
        assert r["workers"][0]["device"] == "cpu" and r["workers"][0]["dtype"] == "float32"
    assert by["1p1d"]["routing"] == "least_loaded"
    assert by["1p1d"]["num_gpus"] == 2 and [w["role"] for w in by["1p1d"]["workers"]] == ["prefill", "decode"]
    phases = by["1p1d"]["low_load"]["handoff_ms"]  # where PD's low-load TTFT went
    assert phases["decode/total"] > 0 and phases["prefill/prefill"] > 0 and phases["decode/commit_rpc"] > 0
    every = [f"{role}/{ph}" for role, names in goodput.HANDOFF_PHASES.items() for ph in names]
    assert [k for k in every if not phases.get(k, 0) > 0] == []  # every handoff phase was measured
    assert phases["proxy/ttft"] >= phases["proxy/prefill_rpc"] > 0
    one = by["1p1d"]["low_load"]["per_request"]
    assert len(one) == 2 and all(r["prompt_tokens"] > 0 and r["handoff_ms"]["decode/total"] > 0 for r in one)
    assert doc["environment"]["torch"]
    printed = capsys.readouterr().out.strip().splitlines()
    assert printed[-1].startswith("| long | poisson |")  # the table is printed last
    assert any(line.startswith("  long/poisson 1p1d low-load handoff ms: ") for line in printed)  # phases before it
    import importlib.util

    has_matplotlib = importlib.util.find_spec("matplotlib") is not None  # the `bench` extra
    assert [p.rsplit("/", 1)[-1] for p in doc["plots"]] == (["goodput_long_poisson.png"] if has_matplotlib else [])
    assert all((out / p.rsplit("/", 1)[-1]).stat().st_size > 1000 for p in doc["plots"])


def test_handoff_lines_compare_each_prompt_with_colocated() -> None:
    from benchmarks.goodput_report import handoff_lines

    def low(ttfts, phases):  # type: ignore[no-untyped-def]
        return {
            "handoff_ms": phases,
            "per_request": [{"prompt_tokens": n, "ttft_ms": t, "handoff_ms": phases} for n, t in ttfts],
        }

    results = [
        {"workload": "long", "arrival": "poisson", "config": "colocated", "low_load": low([(2000, 100.0)], {})},
        {
            "workload": "long",
            "arrival": "poisson",
            "config": "1p1d",
            "low_load": low([(2000, 130.5)], {"decode/pull": 4.0}),
        },
    ]
    lines = handoff_lines(results)
    assert lines[0] == "long/poisson 1p1d low-load handoff ms: decode/pull 4.0"
    assert lines[1] == "  2000 prompt tokens: TTFT 130.5 ms vs colocated 100.0 (+30.5); decode/pull 4.0"


def test_adaptive_uses_the_routing_the_proxy_offers() -> None:
    from benchmarks.goodput import CONFIGS, resolve_routing

    alternatives = CONFIGS["adaptive"].routing
    assert resolve_routing(alternatives, ("round_robin", "least_loaded", "cache_aware")) == "cache_aware"
    assert resolve_routing(alternatives, ("least_loaded", "adaptive")) == "adaptive"
    assert resolve_routing(alternatives, ("round_robin", "least_loaded")) is None
    assert resolve_routing("least_loaded", ("least_loaded",)) == "least_loaded"


def test_refuses_to_measure_a_cuda_worker_on_the_reference_path() -> None:
    from types import SimpleNamespace

    from benchmarks import goodput

    stopped = []

    def running(fast: bool) -> goodput.Cluster:
        w = SimpleNamespace(
            info={"role": "decode", "device": "cuda:0", "dtype": "bfloat16", "fast_path": fast, "cuda_graphs": fast}
        )
        run = goodput.Cluster("m", [], [w], None, "", "m")  # type: ignore[arg-type]
        run.stop = lambda: stopped.append(1)  # type: ignore[method-assign]
        return run

    with pytest.raises(SystemExit, match="reference path"):
        goodput.check_path(running(False), SimpleNamespace(allow_reference_path=False))  # type: ignore[arg-type]
    assert stopped == [1]  # the cluster is stopped before refusing
    told = goodput.check_path(running(False), SimpleNamespace(allow_reference_path=True))  # type: ignore[arg-type]
    assert told[0]["fast_path"] is False
    assert goodput.check_path(running(True), SimpleNamespace(allow_reference_path=False))[0]["device"] == "cuda:0"  # type: ignore[arg-type]


def test_sweep_deadline_reserves_the_later_configurations_setup() -> None:
    import time

    from benchmarks.goodput import sweep_deadline

    now = time.time()
    end = sweep_deadline(now + 100.0, reserved_s=40.0, sweeps_left=3)
    assert 19.0 < end - now < 21.0  # (100 - 40) / 3
    assert sweep_deadline(now + 10.0, reserved_s=40.0, sweeps_left=2) - now < 1.0  # nothing left: ends at once


def test_a_ratio_decided_by_a_non_monotonic_curve_is_not_robust() -> None:
    """Colocated fails 8 req/s but passes 12 (noise): 1P1D's 3x by the conservative goodput is 1x read literally."""
    from benchmarks.goodput_report import _ratio

    pts = {"colocated": [(4, 1.0), (8, 0.47), (12, 1.0)], "1p1d": [(4, 1.0), (8, 1.0), (12, 1.0), (16, 0.43)]}
    rows = {k: [{"rate": r, "attainment": {s.name: {"both": a} for s in SLOS}} for r, a in v] for k, v in pts.items()}
    pd, co = config_goodput(rows["1p1d"], 2)["tight"], config_goodput(rows["colocated"], 2)["tight"]
    assert (pd["per_gpu"], co["per_gpu"], co["per_gpu_highest_passing"]) == (6, 2, 6)
    assert "NOT ROBUST" in _ratio("x", pd, co, 2.0)
    monotonic = config_goodput(
        [{"rate": r, "attainment": {s.name: {"both": a} for s in SLOS}} for r, a in ((4, 1.0), (8, 0.5), (12, 0.4))], 2
    )["tight"]
    assert _ratio("x", pd, monotonic, 2.0).endswith("PASS")


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--rates", "1,x"], "--rates: expected comma-separated numbers"),
        (["--rates", "0,2"], "--rates: every rate must be a positive number"),
        (["--arrivals", "poisson,uniform"], "--arrivals: unknown 'uniform' (known: poisson, bursty, or all)"),
        (["--configs", "2p2d"], "--configs: unknown '2p2d'"),
        (["--workloads", ","], "--workloads: none given"),
        (["--duration", "0"], "--duration 0.0: out of range"),
        (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization 1.5: out of range"),
        (["--dtype", "fp8"], "argument --dtype: invalid choice: 'fp8'"),
        (["--device", "tpu"], "--device 'tpu': expected auto, cpu or cuda"),
        (["--model", "/nonexistent"], "--model '/nonexistent': not a checkpoint directory"),
        (["--device", "cuda", "--gpus", "0", "--configs", "1p1d"], "the configurations need 2 GPUs, it names 1"),
    ],
)
def test_bad_flags_are_refused_with_the_flag_named(capsys, argv: list[str], says: str) -> None:  # type: ignore[no-untyped-def]
    from benchmarks.goodput import parse_args

    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2 and says in capsys.readouterr().err


def test_all_names_every_configuration_workload_and_arrival() -> None:
    from benchmarks.goodput import ARRIVALS, CONFIGS, parse_args

    args = parse_args(["--device", "cpu", "--configs", "all", "--workloads", "all", "--arrivals", "all", "--rates", ""])
    assert (args.configs, args.workloads, args.arrivals) == (list(CONFIGS), list(WORKLOADS), list(ARRIVALS))
    assert args.rates == [] and args.dtype == "auto"  # auto is the workers' to resolve (they report what they ran)
    assert "balanced" in args.configs and "adaptive" in args.configs


def test_sizes_and_dtypes_in_vllms_spellings_as_the_workers_take_them() -> None:
    """--kv-cache-memory-bytes 4G and --dtype half, as `hybridpd worker` (and vLLM) read them."""
    from benchmarks.goodput import parse_args

    args = parse_args(["--device", "cpu", "--kv-cache-memory-bytes", "4G", "--dtype", "half"])
    assert (args.kv_cache_memory_bytes, args.dtype) == (4 * 2**30, "half")
