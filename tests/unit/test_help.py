"""Every `kubesgl` command's --help: exits 0, every flag has help text, and every default worth
showing (not unset, not a switch that is off, not an empty list) is shown once. The parsers are
the ones the commands build, caught as they parse `--help`, so a new command or flag is checked
without being listed here."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kubesgl.cli import SUBCOMMANDS, main
from kubesgl.cli_help import shows_default

DEFAULT_SAID = re.compile(r"\(?\bdefault\b[: ]")  # "(default: X)", "(default X)", "default: X"
COMMANDS = [[name] for name in SUBCOMMANDS] + [["bench", "serving"]]


def _help(argv: list[str], monkeypatch, capsys) -> tuple[int, str, list[argparse.ArgumentParser]]:
    """(exit status, stdout, the parsers that parsed) of `kubesgl ARGV --help`."""
    parsers = []
    parse = argparse.ArgumentParser.parse_known_args

    def caught(self, *args, **kwargs):
        parsers.append(self)
        return parse(self, *args, **kwargs)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", caught)
    try:
        status = main([*argv, "--help"])
    except SystemExit as exit_:
        status = exit_.code
    return status, capsys.readouterr().out, parsers


@pytest.mark.parametrize("argv", COMMANDS, ids=" ".join)
def test_help_exits_0_and_every_flag_has_help_and_its_default_once(argv, monkeypatch, capsys):
    status, out, parsers = _help(argv, monkeypatch, capsys)
    assert status == 0, out
    if argv == ["bench"]:  # a list of kinds, no parser
        assert "kubesgl bench serving --help" in out
        return
    (parser,) = parsers
    assert out == parser.format_help()
    assert not parser.allow_abbrev, f"{' '.join(argv)} takes a prefix of a flag for the flag"
    formatter = parser._get_formatter()
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction) or action.help == argparse.SUPPRESS:
            continue
        name = "/".join(action.option_strings) or action.dest
        assert action.help and action.help.strip(), f"{' '.join(argv)} {name} has no help"
        shown = formatter._expand_help(action)
        assert len(DEFAULT_SAID.findall(shown)) <= 1, (
            f"{' '.join(argv)} {name} says its default twice: {shown}"
        )
        if shows_default(action):
            assert "default" in shown, f"{' '.join(argv)} {name} does not show its default: {shown}"


def test_the_top_level_help_exits_0(capsys):
    assert main(["--help"]) == 0 and "kubesgl <command>" in capsys.readouterr().out


def test_no_command_is_a_usage_error(capsys):
    """Nothing to run (a bare `docker run` of the image, say) fails, with the usage on stderr."""
    assert main([]) == 2 and "kubesgl <command>" in capsys.readouterr().err


def test_bench_without_a_kind_is_a_usage_error(capsys):
    assert main(["bench"]) == 2 and "kubesgl bench serving" in capsys.readouterr().err


def test_an_unknown_benchmark_is_named(capsys):
    """`kubesgl bench foo` printed the usage alone, where `kubesgl bogus` names the command."""
    assert main(["bench", "foo"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kubesgl bench: unknown benchmark 'foo'\n\nusage: kubesgl bench ")


@pytest.mark.parametrize("argv", COMMANDS, ids=" ".join)
def test_every_port_flag_refuses_a_port_outside_1_to_65535(argv, monkeypatch, capsys):
    # `kubesgl serve --port 70000` listened on 4464 (70000 mod 65536) while it printed 70000
    *_, parsers = _help(argv, monkeypatch, capsys)
    ports = [a for p in parsers for a in p._actions if "--port" in a.option_strings]
    for port in ports:
        for wrong in ("70000", "65536", "-1", "http"):
            with pytest.raises(argparse.ArgumentTypeError, match="a port from [01] to 65535"):
                port.type(wrong)
        assert port.type("8000") == 8000
        if argv == ["serve"]:  # 0: a free port, which the server logs
            assert port.type("0") == 0
        else:  # the URL `up` prints, the port the router logs, would be 0
            with pytest.raises(argparse.ArgumentTypeError):
                port.type("0")


# A fresh interpreter each, in the repository: this test process may have torch loaded by other
# tests.
REPO = Path(__file__).resolve().parents[2]
PARSE_ONLY = """
import sys
from kubesgl.cli import main

try:
    main(sys.argv[1:])
except SystemExit:
    pass
sys.exit(", ".join(sorted({"torch", "transformers"} & set(sys.modules))) or None)
"""


@pytest.mark.parametrize(
    "argv",
    [["serve", "--help"], ["serve"], ["generate", "--help"], ["generate", "--model", "X"]],
    ids=" ".join,
)
def test_help_and_usage_errors_of_the_engine_commands_import_no_torch(argv):
    """--help and an argparse error are answered at once: torch and transformers, seconds to
    import, only once the arguments are parsed (`generate --model X` took 12 s to say --prompt
    is required)."""
    result = subprocess.run(
        [sys.executable, "-c", PARSE_ONLY, *argv],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert result.returncode == 0, (
        f"`kubesgl {' '.join(argv)}` imported {result.stderr.splitlines()[-1:]}"
    )


def _with_reader_gone(argv: list[str], buffered: bool) -> subprocess.CompletedProcess[str]:
    """`kubesgl ARGV | head` once head has exited: stdout is a pipe whose reader is closed."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    if not buffered:  # each write reaches the pipe at once, and fails there
        env["PYTHONUNBUFFERED"] = "1"
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run(
            [sys.executable, "-m", "kubesgl", *argv],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
            cwd=REPO,
            env=env,
        )
    finally:
        os.close(write)


@pytest.mark.parametrize("buffered", [True, False], ids=["buffered", "unbuffered"])
@pytest.mark.parametrize("argv", [["--help"], ["--version"]], ids=" ".join)
def test_a_reader_that_goes_away_is_no_traceback(argv, buffered):
    # `kubesgl -h | head -3` ended with a BrokenPipeError traceback (unbuffered: at the print;
    # buffered: "Exception ignored" as Python flushed stdout at exit, status 120)
    result = _with_reader_gone(argv, buffered)
    assert (result.returncode, result.stderr) == (141, "")  # as a tool SIGPIPE ended


@pytest.mark.parametrize("argv", COMMANDS, ids=" ".join)
def test_a_reader_that_goes_away_from_a_commands_help_is_no_traceback(argv):
    # Buffered, a short help was written at exit: "Exception ignored ... BrokenPipeError" and
    # status 120. A help longer than the buffer (serve's) reaches the pipe as argparse writes it,
    # and argparse ignores the failed write itself: status 0.
    result = _with_reader_gone([*argv, "--help"], buffered=True)
    assert result.stderr == "" and result.returncode in (0, 141)


def test_bench_serving_says_its_results_are_saved_only_with_output_file(capsys):
    """Its help said the results were "printed, and saved as JSON": nothing is saved without
    --output-file."""
    with pytest.raises(SystemExit):
        main(["bench", "serving", "--help"])
    description = " ".join(capsys.readouterr().out.split("options:")[0].split())
    assert "(printed, and written as JSON to --output-file where given)" in description
