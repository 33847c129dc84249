"""The one way a command line refuses bad input: `ranktop: error: <one line>` on stderr, exit 2.

Every parser of `ranktop` and its subcommands is a `UsageParser`; errors found after parsing go
through `usage_error`, so they read the same.
"""

from __future__ import annotations

import argparse
import functools
import re
import shlex
import sys
from typing import TYPE_CHECKING, NoReturn

if TYPE_CHECKING:
    from ranktop.tui.bounded_regex import BoundedPattern

USAGE_EXIT = 2


def run_command(subcommand: str, run_id: str, *options: str) -> str:
    """The `ranktop` subcommand that reaches a run, as a user types it into a shell: the id quoted
    (it may hold a space), and after the options and `--` where it starts with '-' (`--run-id=-x`),
    which argparse would take for an option of its own."""
    run = shlex.quote(run_id)
    if run_id.startswith("-"):
        return " ".join(("ranktop", subcommand, *options, "--", run))
    return " ".join(("ranktop", subcommand, run, *options))


class BadValue(Exception):
    """A flag's value that an argparse type rejects with our own line (naming the flag, the value
    as typed and what is accepted). Not a ValueError: argparse would reword that one (it rewords
    ValueError, TypeError and ArgumentTypeError)."""


class UnusableDefault:
    """A default that is an error only if it is used: a bad value in the environment (PET_*) for
    a flag the line may still give, which then wins and leaves the value unread, as torchrun's
    argparse reads a default only for a flag not given. `message` is the line said otherwise."""

    def __init__(self, message: str) -> None:
        self.message = message


def metric_pattern(text: str) -> BoundedPattern:
    """An argparse type for --metric (the run's and attach's): the regular expression compiled,
    else one line."""
    from ranktop.tui.metric import BadMetric, compile_metric  # only when the flag is given

    try:
        return compile_metric(text)
    except BadMetric as exc:
        raise BadValue(str(exc)) from None


@functools.lru_cache(maxsize=32)
def compiled_regex(text: str, *, ignore_case: bool = False) -> BoundedPattern:
    """A user's pattern (a `re:` search, --metric): `text` as re reads it, matched by the regex
    package with a time limit on each match (tui/bounded_regex.py); ValueError saying why not, in
    words (re's own; or, where re raises OverflowError or RecursionError, as for a{99999999999} or
    thousands of nested groups, that). re compiles it first so that what is a pattern, and the
    line for one that is not, stay re's (regex words them differently and counts positions from 1).
    One object for one text: a pattern given up stays given up (each n / N that searched again
    compiled it afresh and spent the time limit again on the same line)."""
    from ranktop.tui.bounded_regex import BoundedPattern  # only a pattern given loads regex

    try:
        re.compile(text, re.IGNORECASE if ignore_case else 0)
        return BoundedPattern.compile(text, ignore_case=ignore_case)
    except re.error as exc:
        raise ValueError(str(exc)) from None
    except (OverflowError, RecursionError):
        raise ValueError("too large or too deeply nested to compile") from None


def usage_line(message: str) -> str:
    """The line itself. A message quotes what was typed, or what a library said of it: shown with
    nothing a terminal would act on, and kept to one line (an escape or a newline in a value)."""
    from ranktop.core.sanitize import shown  # only bad input pays for it

    return f"ranktop: error: {shown(message)}"


def usage_error(message: str) -> int:
    """Print the one line for bad input; the exit status to return."""
    print(usage_line(message), file=sys.stderr)
    return USAGE_EXIT


class UsageParser(argparse.ArgumentParser):
    # Options of ours that the tool we stand in for lacks: an abbreviation it reads as one of its
    # own (torchrun's `--t` is --tee) must not turn ambiguous because of them (--tui).
    extra_options: frozenset[str] = frozenset()

    def _get_option_tuples(self, option_string: str) -> list:
        found = super()._get_option_tuples(option_string)
        if len(found) > 1:
            theirs = [match for match in found if match[1] not in self.extra_options]
            return theirs or found
        return found

    def error(self, message: str) -> NoReturn:
        # One line, no usage dump: the message already names the bad value.
        self.exit(USAGE_EXIT, usage_line(message) + "\n")

    def parse_known_args(self, args=None, namespace=None):  # noqa: ANN001 (argparse's signature)
        try:
            namespace, extras = super().parse_known_args(args, namespace)
        except BadValue as exc:
            self.error(str(exc))
        for value in vars(namespace).values():
            if isinstance(value, UnusableDefault):  # the line left its flag out: the value is used
                self.error(value.message)
        return namespace, extras
