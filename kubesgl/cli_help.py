"""The help of every `kubesgl` command: each flag has help text and shows its default once;
and a parser that raises where a command would exit, for checking command lines.

`DefaultsOnce` adds " (default: X)" to a flag's help unless the help already says what its
default is (mentions "default") or there is nothing to show: no value (None), a switch that is
off (False), an empty list, or a required flag. tests/unit/test_help.py checks every command.
`port_number` (or `port_or_zero`) is the type of every command's --port; `at_least(N)` that of
a whole-number flag with a floor, `fraction` that of a share from 0 to 1, `above_zero(...)` that
of a number above 0 such as a rate or a time bound: argparse then refuses a bad value with a
usage error that names the flag.
`CommandParser` is the parser of every command: it takes no abbreviations, and it answers a
flag that another server names differently with the flag to use.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import NoReturn


def shows_default(action: argparse.Action) -> bool:
    """Whether the default of `action` is a value worth showing in its help."""
    default = action.default
    return not (
        action.required
        or not action.option_strings
        or default is None
        or default is False
        or default == []
        or default is argparse.SUPPRESS
        or isinstance(action, argparse._HelpAction)
    )


class DefaultsOnce(argparse.HelpFormatter):
    def _get_help_string(self, action: argparse.Action) -> str:
        help_ = action.help or ""
        if shows_default(action) and "default" not in help_:
            help_ += " (default: %(default)s)"
        return help_


_UNRECOGNIZED = "unrecognized arguments: "  # how argparse starts the error of unknown flags


class CommandParser(argparse.ArgumentParser):
    """The parser of a `kubesgl` command. It takes flags whole: argparse would take any prefix
    that names one flag alone (`--tp` for `--tp-size`), whose meaning a new flag could change.
    `names_elsewhere` maps another server's flag (vLLM's `--max-model-len`) to this command's
    flag of the same meaning, which the error of an unknown flag then names."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **{"allow_abbrev": False, **kwargs})
        self.names_elsewhere: dict[str, str] = {}

    def error(self, message: str) -> NoReturn:
        super().error(self.with_hints(message))

    def with_hints(self, message: str) -> str:
        """The message, and for each unknown flag that another server names, the flag to use."""
        if not message.startswith(_UNRECOGNIZED):
            return message
        given = [arg.split("=", 1)[0] for arg in message.removeprefix(_UNRECOGNIZED).split()]
        hints = [
            f"{flag} is {self.names_elsewhere[flag]} in {self.prog}"
            for flag in dict.fromkeys(given)
            if flag in self.names_elsewhere
        ]
        return "; ".join([message, *hints])


class RefusingParser(CommandParser):
    """Raises ValueError with what the command would print and exit on: for the operator, which
    checks the command lines it renders with the parsers of the commands that run them."""

    def error(self, message: str) -> NoReturn:
        raise ValueError(self.with_hints(message))

    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:
        raise ValueError(message or "the command would exit at start (--help, say)")

    def print_help(self, file=None) -> None:
        pass


def _whole_number(text: str) -> int | None:
    """Digits, with a minus or not, as a number; None for anything else (int() would also take
    " 7", "+7" and "7_000")."""
    return int(text) if text.lstrip("-").isdigit() else None


def port_number(text: str, lowest: int = 1) -> int:
    """A --port: 1 to 65535. The OS would take 70000 as 70000 mod 65536 (the printed URL then
    names a port nobody listens on), and 0 as a free port, which only a command that logs
    the port it bound may take (`port_or_zero`)."""
    port = _whole_number(text)
    if port is None or not lowest <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port from {lowest} to 65535, not {text!r}")
    return port


def port_or_zero(text: str) -> int:
    """A port from 0 to 65535, where 0 means what its flag says: a free port to a server that
    logs the address it bound, no listener to an optional one."""
    return port_number(text, lowest=0)


def at_least(lowest: int) -> Callable[[str], int]:
    """The type of a whole-number flag whose values start at `lowest`: `type=at_least(1)`."""

    def whole_number(text: str) -> int:
        number = _whole_number(text)
        if number is None or number < lowest:
            raise argparse.ArgumentTypeError(f"a whole number from {lowest} up, not {text!r}")
        return number

    return whole_number


def _number(text: str, allowed: Callable[[float], bool], wanted: str) -> float:
    """A number the check `allowed` takes; NaN never is (it compares false with every bound)."""
    try:
        number = float(text)
    except ValueError:
        number = math.nan
    if not allowed(number):
        raise argparse.ArgumentTypeError(f"{wanted}, not {text!r}")
    return number


def above_zero(what: str, inf: str) -> Callable[[str], float]:
    """The type of a flag that takes a number above 0, inf included, refused as "WHAT above 0
    (inf: INF)": `type=above_zero("milliseconds", "no bound")`."""

    def number_above_zero(text: str) -> float:
        return _number(text, lambda n: n > 0, f"{what} above 0 (inf: {inf})")

    return number_above_zero


def fraction(text: str) -> float:
    """A number from 0 to 1."""
    return _number(text, lambda n: 0 <= n <= 1, "a number from 0 to 1")
