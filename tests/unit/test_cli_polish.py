"""CLI polish: --version, defaults in --help, a busy port refused before anything starts, API key from a file."""

from __future__ import annotations

import socket
import time

import pytest
from hybridpd.deploy.cli import build_parser, main


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("hybridpd ")


@pytest.mark.parametrize("command", ["serve", "worker", "proxy", "generate"])
def test_help_shows_every_default(command: str) -> None:
    sub = build_parser()._subparsers._group_actions[0].choices[command]  # type: ignore[union-attr]
    text = sub.format_help()
    assert "(default: 16)" in text or command == "proxy"
    for action in sub._actions:
        if action.option_strings and action.dest != "help":
            assert action.help, f"{command} {action.option_strings} has no help text"


def test_busy_port_is_refused_before_anything_starts(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        t0 = time.monotonic()
        assert main(["serve", "--port", str(port)]) == 2
        assert time.monotonic() - t0 < 2
        assert f"127.0.0.1:{port}" in capsys.readouterr().err
        assert main(["proxy", "--decode", "127.0.0.1:1", "--port", str(port)]) == 2


def test_unreadable_api_key_file_is_a_clean_error(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    assert main(["proxy", "--decode", "127.0.0.1:1", "--port", "0", "--api-key-file",
                 str(tmp_path / "missing")]) == 2
    assert "API key file" in capsys.readouterr().err
