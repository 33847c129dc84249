"""One list of keys for the help screen and the command palette, read from the BINDINGS that the
app, the main screen and the log widget declare, so the three can never disagree."""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from typing import TYPE_CHECKING

from textual.actions import parse
from textual.app import SystemCommand
from textual.binding import Binding
from textual.dom import DOMNode

if TYPE_CHECKING:
    from textual.app import App


def declared_bindings(node: DOMNode) -> list[Binding]:
    """The node's bindings through its class hierarchy (a subclass's bindings of a key replace its
    bases'), one per action, in declaration order. A class may bind one key twice, to one action
    with two arguments (t: the other threads, or the main ones): both are kept."""
    by_key: dict[str, list[Binding]] = {}
    for cls in reversed(type(node).__mro__):
        own: dict[str, list[Binding]] = {}
        for binding in Binding.make_bindings(cls.__dict__.get("BINDINGS", ())):
            own.setdefault(binding.key, []).append(binding)
        by_key.update(own)
    by_action: dict[str, list[Binding]] = {}
    for bindings in by_key.values():
        for binding in bindings:
            by_action.setdefault(binding.action, []).append(binding)
    return [group[0] for group in by_action.values()]


def keys_for(app: App, node: DOMNode, action: str) -> str:
    """Every key bound to `action` on `node`, as the footer would show them, e.g. 'z / enter'."""
    keys: list[str] = []
    for cls in type(node).__mro__:
        for binding in Binding.make_bindings(cls.__dict__.get("BINDINGS", ())):
            shown = app.get_key_display(binding)
            if binding.action == action and shown not in keys:
                keys.append(shown)
    return " / ".join(keys)


def action_name(action: str) -> str:
    """A binding's action without its namespace and arguments: 'app.quit' and 'stacks(False)' as
    'quit' and 'stacks'."""
    return action.split("(")[0].split(".")[-1]


def described(app: App, node: DOMNode, *, hidden: tuple[str, ...] = ()) -> list[tuple[str, str, Binding]]:
    """(keys, description, binding) for each described binding of `node` whose action is not
    in `hidden` (an action name, without arguments)."""
    rows = []
    bindings = declared_bindings(node)
    twice = {b.key for b in bindings if sum(other.key == b.key for other in bindings) > 1}
    for binding in bindings:
        if binding.description and action_name(binding.action) not in hidden:
            if binding.key in twice and not _offered(node, binding):
                continue  # of a key's two meanings, the one it does not have now (t: what is shown already)
            rows.append((keys_for(app, node, binding.action), binding.description, binding))
    return rows


def _offered(node: DOMNode, binding: Binding) -> bool:
    """Whether the node's check_action lets `binding` run now, as the footer asks it."""
    _, name, parameters = parse(binding.action)
    check = getattr(node, "check_action", None)
    return check is None or check(name, parameters) is not False


def _join_keys(keys: list[str]) -> str:
    """'0 / 1 / … / 9' reads better as '0-9'."""
    if len(keys) > 2 and all(k.isdigit() and len(k) == 1 for k in keys):
        return f"{keys[0]}-{keys[-1]}"
    return " / ".join(keys)


def help_groups(app: App, sections: list[tuple[str, DOMNode, tuple[str, ...]]]) -> list[tuple[str, list]]:
    """[(section title, [(keys, description)])] for the help screen; bindings that share a
    description (the four arrows, the ten digits) make one row."""
    groups = []
    for title, node, hidden in sections:
        rows: dict[str, list[str]] = {}
        for keys, desc, _ in described(app, node, hidden=hidden):
            rows.setdefault(desc, []).append(keys)
        groups.append((title, [(_join_keys(keys), desc) for desc, keys in rows.items()]))
    return groups


def palette_commands(app: App, sections: list[tuple[str, DOMNode, tuple[str, ...]]]) -> Iterator[SystemCommand]:
    """A palette command per described binding; each runs the binding's action on its owner."""
    for title, node, hidden in sections:
        for keys, desc, binding in described(app, node, hidden=hidden):
            yield SystemCommand(desc, f"{title} · key {keys}", partial(app.run_action, binding.action, node))
