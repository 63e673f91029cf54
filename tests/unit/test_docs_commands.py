"""The commands the docs quote run as written: every flag in a `kubesgl COMMAND ...` line of
README.md, docs/ and benchmarks/README.md (shell blocks and inline code) is one of that
command's flags, and the flags docs/server.md and docs/router.md quote on their own are those of
`kubesgl serve` and `kubesgl router`. (The README's own two commands: test_packaging.py.)"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
from pathlib import Path

import pytest

from kubesgl.cli import SUBCOMMANDS, main

ROOT = Path(__file__).resolve().parents[2]
PAGES = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    ROOT / "benchmarks" / "README.md",
]
COMMANDS = [name for name in SUBCOMMANDS if name != "bench"] + ["bench serving"]
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def _flags(command: str) -> set[str]:
    """The option strings of the parser `kubesgl COMMAND --help` builds."""
    parsers = []
    parse = argparse.ArgumentParser.parse_known_args

    def caught(self, *args, **kwargs):
        parsers.append(self)
        return parse(self, *args, **kwargs)

    argparse.ArgumentParser.parse_known_args = caught
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
            main([*command.split(), "--help"])
    finally:
        argparse.ArgumentParser.parse_known_args = parse
    return {flag for action in parsers[0]._actions for flag in action.option_strings}


@pytest.fixture(scope="module")
def flags() -> dict[str, set[str]]:
    return {command: _flags(command) for command in COMMANDS}


def quoted_code(text: str) -> list[str]:
    """Shell blocks (bash, console, sh; continued lines joined) and inline code spans."""
    blocks = re.findall(r"```(?:bash|console|sh)\n(.*?)```", text, flags=re.S)
    text_outside = re.sub(r"```.*?```", "", text, flags=re.S)
    return [block.replace("\\\n", " ") for block in blocks] + re.findall(
        r"`([^`\n]+)`", text_outside
    )


def command_lines(code: str) -> list[tuple[str, str]]:
    """(command, its arguments) of each `kubesgl COMMAND ...` in `code`, up to the end of the
    line, a shell operator or the next kubesgl."""
    found = []
    for line in code.splitlines():
        for part in re.split(r"\bkubesgl\b", line)[1:]:
            part = re.split(r"&&|\|\||[|;]", part)[0].strip()
            command = next(
                (
                    c
                    for c in sorted(COMMANDS, key=len, reverse=True)
                    if part == c or part.startswith(c + " ")
                ),
                None,
            )
            if command is not None:
                found.append((command, part[len(command) :]))
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_flag_of_a_quoted_command_is_the_commands(page, flags):
    quoted = [
        (command, args)
        for code in quoted_code(page.read_text())
        for command, args in command_lines(code)
    ]
    unknown = [
        f"kubesgl {command}{args}: {flag}"
        for command, args in quoted
        for flag in FLAG.findall(args)
        if flag not in flags[command]
    ]
    assert not unknown, f"{page.name} quotes flags its commands do not have:\n" + "\n".join(unknown)


@pytest.mark.parametrize(
    ("page", "command"), [("docs/server.md", "serve"), ("docs/router.md", "router")]
)
def test_the_flags_a_commands_page_quotes_are_the_commands(page, command, flags):
    spans = re.findall(
        r"`([^`\n]+)`", re.sub(r"```.*?```", "", (ROOT / page).read_text(), flags=re.S)
    )
    unknown = sorted(
        {
            flag
            for span in spans
            if "kubesgl" not in span and "sglang" not in span
            for flag in FLAG.findall(span)
        }
        - flags[command]
    )
    assert not unknown, f"{page} quotes flags `kubesgl {command}` does not have: {unknown}"


def test_the_check_finds_a_flag_a_command_lacks(flags):
    ((command, args),) = command_lines(
        "kubesgl serve --model m --no-such-flag 1 && kubesgl router --port 1"
    )[:1]
    assert command == "serve" and "--no-such-flag" in FLAG.findall(args)
    assert "--no-such-flag" not in flags["serve"]
    assert command_lines("kubesgl bench serving --base-url u") == [
        ("bench serving", " --base-url u")
    ]


CURL_DATA = re.compile(r"curl [^\n]*?/v1/chat/completions .*?-d '(\{.*?\})'", re.S)


@pytest.mark.parametrize("page", ["README.md", "docs/up.md"])
def test_the_quickstart_curl_gives_the_answer_shown(page):
    """The quickstart's model has random weights: sampled at the default temperature it drew
    its end-of-sequence token first now and then, and the curl printed an empty answer that
    stopped, not the 16 tokens and "length" shown. Every chat curl of the page ignores it."""
    text = (ROOT / page).read_text()
    bodies = [
        json.loads(body)
        for code in re.findall(r"```(?:bash|console)\n(.*?)```", text, flags=re.S)
        for body in CURL_DATA.findall(code.replace("\\\n", " "))
    ]
    assert bodies
    assert [body.get("ignore_eos") for body in bodies] == [True] * len(bodies)
    for shown in re.findall(r'^\{"id":"chatcmpl-.*$', text, flags=re.M):
        assert '"finish_reason":"length"' in shown
        tokens = int(re.search(r'"completion_tokens":(\d+)', shown).group(1))
        assert tokens == bodies[0]["max_tokens"]
