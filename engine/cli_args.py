"""Engine options on the command line, shared by `kubesgl serve` and `kubesgl generate`: one
flag per EngineConfig field (`tp_size` -> `--tp-size`), derived from its declaration."""

from __future__ import annotations

import argparse

from kubesgl.cli_help import CommandParser
from kubesgl.engine.config import ENGINE_OPTIONS, EngineConfig, EngineOption

CLI_OPTIONS = [opt for opt in ENGINE_OPTIONS.values() if opt.cli]
_METAVARS = {int: "N", float: "X"}  # shorter than argparse's upper-cased option names


def help_text(opt: EngineOption) -> str:
    """The option's help with its default, which is shown once, here: unset (None) options say in
    their help what the engine does instead, and switches are off unless given."""
    if opt.required or opt.is_switch or opt.default is None:
        return opt.help
    return f"{opt.help} (default: {opt.default})"


class _Refused(argparse.Action):
    """An engine option the command cannot honour: its default is accepted, any other value is
    refused with the reason (never ignored). Not shown in --help."""

    def __init__(self, option_strings, dest, reason: str, **kwargs):
        super().__init__(option_strings, dest, help=argparse.SUPPRESS, **kwargs)
        self.reason = reason

    def __call__(self, parser, namespace, values, option_string=None):
        if values != self.default:
            raise argparse.ArgumentError(self, f"{values} cannot be honoured here: {self.reason}")
        setattr(namespace, self.dest, values)


def add_engine_args(parser: CommandParser, refused: dict[str, str] | None = None) -> None:
    """One flag per engine option. `refused`: options (by name) that this command cannot
    honour, each with the reason a value other than the default is refused."""
    refused = refused or {}
    parser.names_elsewhere |= {
        name: opt.flag for opt in CLI_OPTIONS for name in opt.named_elsewhere
    }
    group = parser.add_argument_group("engine options")
    for opt in CLI_OPTIONS:
        if opt.name in refused:
            group.add_argument(
                *opt.flags,
                type=opt.type,
                default=opt.default,
                metavar=_METAVARS.get(opt.type),
                action=_Refused,
                reason=refused[opt.name],
            )
        elif opt.is_switch:
            group.add_argument(*opt.flags, action="store_true", help=opt.help)
        elif opt.required:
            group.add_argument(*opt.flags, type=opt.type, required=True, help=help_text(opt))
        else:
            group.add_argument(
                *opt.flags,
                type=opt.type,
                choices=opt.choices or None,
                default=opt.default,
                metavar=_METAVARS.get(opt.type),
                help=help_text(opt),
            )


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{opt.name: getattr(args, opt.name) for opt in CLI_OPTIONS})
