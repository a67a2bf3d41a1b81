"""`hybridpd serve` hands prefill workers their own flags: --max-decode-share (the mixed role's cap) is parsed by
serve, checked before Ray starts, and put on the command line of each prefill worker only, where `hybridpd worker`
parses it into WorkerOptions. No Ray, no engine: serve's launcher and run_worker are intercepted."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest
from hybridpd.deploy import cli
from hybridpd.deploy.ray_launcher import role_argv
from hybridpd.worker.bootstrap import WorkerOptions


def _serve(monkeypatch: pytest.MonkeyPatch, model: Path, *flags: str) -> tuple[int, list[Any]]:
    """Run `hybridpd serve` up to the launcher; returns its exit code and what the launcher got."""
    got: list[Any] = []

    def launch(*a: Any) -> int:
        got.append(a)
        return 0

    monkeypatch.setattr("hybridpd.deploy.ray_launcher.serve", launch)
    (model / "config.json").write_text("{}")
    return cli.main(["serve", "--model", str(model), "--port", "0", *flags]), got


def _worker_options(monkeypatch: pytest.MonkeyPatch, argv: list[str]) -> WorkerOptions:
    seen: list[WorkerOptions] = []

    def run_worker(cfg: object, opts: WorkerOptions) -> int:
        seen.append(opts)
        return 0

    monkeypatch.setattr("hybridpd.worker.bootstrap.run_worker", run_worker)
    assert cli.main(["worker", *argv]) == 0
    return seen[0]


def test_serve_help_documents_max_decode_share() -> None:
    sub = cli.build_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    options = " ".join(sub.format_help().split("options:", 1)[1].split())
    entry = options[options.index("--max-decode-share SHARE") :][:400]
    assert "whole requests" in entry and "(default: 0.25)" in entry


@pytest.mark.parametrize(
    ("flags", "share"), [((), 0.25), (("--max-decode-share", "0.1"), 0.1), (("--max-decode-share=0",), 0.0)]
)
def test_the_share_reaches_each_prefill_worker_and_only_them(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, flags: tuple[str, ...], share: float
) -> None:
    code, got = _serve(monkeypatch, tmp_path, *flags)
    assert code == 0
    args, engine_argv = got[0][0], got[0][1]
    prefill = role_argv(args, "prefill", engine_argv, 1, ["--register-with", "http://127.0.0.1:1"])
    assert _worker_options(monkeypatch, prefill).max_decode_share == share
    for role in ("decode", "colocated"):  # the flag is a prefill worker's; others keep theirs at the default
        argv = role_argv(args, role, engine_argv, 1, [])
        assert "--max-decode-share" not in argv and argv[:2] == ["--role", role]
        assert _worker_options(monkeypatch, argv).role == role


@pytest.mark.parametrize("bad", ["1.5", "-0.1"])
def test_a_share_outside_0_1_is_refused_before_ray(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str], bad: str
) -> None:
    code, got = _serve(monkeypatch, tmp_path, "--max-decode-share", bad)
    assert (code, got) == (2, [])
    assert f"--max-decode-share must be in [0, 1], got {float(bad)}" in capsys.readouterr().err
    assert cli.main(["worker", "--role", "prefill", "--model", str(tmp_path), "--max-decode-share", bad]) == 2


def test_role_argv_keeps_tp_and_registration() -> None:
    args = argparse.Namespace(max_decode_share=0.5)
    argv = role_argv(args, "prefill", ["--model", "m", "--tensor-parallel-size", "2"], 4, ["--register-with", "u"])
    assert argv == [
        "--role",
        "prefill",
        "--model",
        "m",
        "--tensor-parallel-size",
        "4",
        "--max-decode-share",
        "0.5",
        "--register-with",
        "u",
    ]


def test_enforce_eager_reaches_every_worker_on_its_command_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`serve --enforce-eager`: every worker's command line carries it (an environment variable of the driver does
    not reach the actors of a Ray cluster serve joins with --address)."""
    code, got = _serve(monkeypatch, tmp_path, "--enforce-eager")
    assert code == 0
    args, engine_argv = got[0][0], got[0][1]
    for role in ("prefill", "decode", "colocated"):
        argv = role_argv(args, role, engine_argv, 1, [])
        assert cli.build_parser().parse_args(["worker", *argv]).enforce_eager, argv
    code, got = _serve(monkeypatch, tmp_path)
    assert "--enforce-eager" not in role_argv(got[0][0], "decode", got[0][1], 1, [])
