"""Small immutable values written by hand, for the classes a run makes before its first rank starts.

A frozen @dataclass costs about half a millisecond to make (it compiles six methods when its
module is imported), and ranktop imports dozens of classes before it can start a rank. A class
here is as cheap as any other: it names its fields in `__slots__` and sets them in its own
`__init__`; this base gives it what a frozen dataclass would: equality and a hash over those
fields, a repr naming them, fields that cannot be set again, and `as_dict`.
"""

from __future__ import annotations


class Value:
    """A value whose fields are its `__slots__` (a direct subclass's, each set once, in `__init__`)."""

    __slots__ = ()

    def _fields(self) -> tuple:
        return tuple(getattr(self, name) for name in self.__slots__)

    def as_dict(self) -> dict[str, object]:
        """Its fields by name (what a command sends over the socket)."""
        return dict(zip(self.__slots__, self._fields(), strict=True))

    def __setattr__(self, name: str, value: object) -> None:
        if hasattr(self, name):  # (an unset slot raises AttributeError: `__init__` sets it)
            raise AttributeError(f"cannot assign to field {name!r}: a {type(self).__name__} is not changed once made")
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"cannot delete field {name!r}: a {type(self).__name__} is not changed once made")

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return self._fields() == other._fields()

    def __hash__(self) -> int:
        return hash(self._fields())

    def __repr__(self) -> str:
        shown = ", ".join(f"{name}={getattr(self, name)!r}" for name in self.__slots__)
        return f"{type(self).__name__}({shown})"
