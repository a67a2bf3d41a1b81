"""An ArgumentParser that answers a mistyped flag or subcommand with "did you mean ...?"."""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

_UNRECOGNIZED = re.compile(r"unrecognized arguments: (.+)$")
_INVALID_CHOICE = re.compile(r"invalid choice: '([^']*)'")


class SuggestingParser(argparse.ArgumentParser):
    """Subparsers are of the same class (argparse's default), so every subcommand suggests too."""

    def parse_known_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:  # type: ignore[override]
        self._argv = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> NoReturn:
        hint = self._suggest(message)
        super().error(message + (f" (did you mean {hint}?)" if hint else ""))

    def _suggest(self, message: str) -> str | None:
        m = _UNRECOGNIZED.search(message)
        if m:
            options = self._options()
            for word in m.group(1).split():
                if word.startswith("-"):
                    close = difflib.get_close_matches(word.split("=", 1)[0], options, n=1, cutoff=0.6)
                    if close:
                        return close[0]
            return None
        m = _INVALID_CHOICE.search(message)
        if m:
            choices = [c for a in self._actions for c in (a.choices or ()) if isinstance(c, str)]
            close = difflib.get_close_matches(m.group(1), choices, n=1, cutoff=0.6)
            return f"'{close[0]}'" if close else None
        return None

    def _options(self) -> list[str]:
        """Option strings of this parser and of the subcommand named on the command line."""
        options = [o for a in self._actions for o in a.option_strings]
        argv = getattr(self, "_argv", [])
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    if name in argv:
                        options += [o for a in sub._actions for o in a.option_strings]
        return options


__all__ = ["SuggestingParser"]
