"""The help format of every `legato` command: each flag's help ends with its default."""

from __future__ import annotations

import argparse


class DefaultsFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" to a flag's help unless the help already says what the default is."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        if "default" in help_text.lower() or action.default is argparse.SUPPRESS or not action.option_strings:
            return help_text
        default = action.default
        if isinstance(action, argparse._StoreTrueAction):
            shown = "off"
        elif default is None:
            shown = "none"
        elif isinstance(default, (list, tuple)):
            shown = ",".join(map(str, default)) or "none"
        else:
            shown = str(default).replace("%", "%%")
        return f"{help_text} (default: {shown})".strip()
