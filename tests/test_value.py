"""The small values written by hand for the start path (core/value.py) behave as the frozen
dataclasses they replaced: equal by their fields, hashed and shown by them, never changed."""

from __future__ import annotations

import signal

import pytest
from ranktop.core import commands as cmd
from ranktop.core.engine import OutputCursor
from ranktop.core.protocol import Output
from ranktop.core.rendezvous import RoundEnd


def test_a_value_is_equal_hashed_and_shown_by_its_fields():
    cursor = OutputCursor(2, 40, 7)
    assert cursor == OutputCursor(2, 40, 7) and hash(cursor) == hash(OutputCursor(2, 40, 7))
    assert cursor != OutputCursor(2, 41, 7) and OutputCursor() == OutputCursor(-1, 0, -1)
    assert cursor != (2, 40, 7) and Output(0, 1, b"") != RoundEnd("stopped", "")  # another class is never equal
    assert len({cursor, OutputCursor(2, 40, 7), OutputCursor()}) == 2
    assert repr(cursor) == "OutputCursor(generation=2, line=40, version=7)"
    assert RoundEnd("new_round", "wait").serves_store is False
    # A command: its defaults, and the fields a client sends over the socket
    assert cmd.Stop() == cmd.Stop(signal.SIGTERM, None) and cmd.KillGroup() == cmd.KillGroup()
    assert cmd.DumpStacks((1,)).as_dict() == {"local_ranks": (1,), "save": True, "native_frames": False}


def test_a_value_is_not_changed_once_made():
    end = RoundEnd("left_behind", "dropped", serves_store=True)
    with pytest.raises(AttributeError):
        end.kind = "stopped"
    with pytest.raises(AttributeError):
        del end.message
    with pytest.raises(AttributeError):  # no field of that name: no __dict__ to take it
        end.extra = 1
    assert (end.kind, end.message, end.serves_store) == ("left_behind", "dropped", True)
