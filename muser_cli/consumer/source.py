"""Where a request's rows came from (:class:`RowsFrom`): the one name every part of the
consumer (the lane, the route, the answers, the cost model's learning) uses for it. Imports
nothing of muser's: a command may read it without loading the lane."""

from __future__ import annotations

from enum import StrEnum


class RowsFrom(StrEnum):
    """Where the rows a request decoded from came from: its answer's ``source`` (a string in
    JSON, equal to its value). The route's names for the same paths: :attr:`path`."""

    HANDOFF = "handoff"  # a producer's whole pack
    DELTA = "delta"  # a producer's pack of the rows after a prefix this machine's store holds
    PARTIAL_LOCAL = "partial+local"  # a producer's pack cut short, the rest prefilled here
    STORE = "store"  # every row held in the store: nothing computed
    STORE_LOCAL = "store+local"  # a stored prefix, the rest prefilled here
    HELD = "held"  # a served conversation's turn memory, the rest prefilled here
    LOCAL = "local"  # prefilled here

    @property
    def shipped(self) -> bool:
        """Rows of a producer's pack are among them."""
        return self in (RowsFrom.HANDOFF, RowsFrom.DELTA, RowsFrom.PARTIAL_LOCAL)

    @property
    def computed_here(self) -> bool:
        """Every row is this machine's own (held, or prefilled here): none was shipped."""
        return not self.shipped

    @property
    def path(self) -> str:
        """The route's name of the path these rows took (:mod:`muser_cli.consumer.route`)."""
        return _PATHS[self]


_PATHS = {RowsFrom.HANDOFF: "remote_whole", RowsFrom.DELTA: "remote_delta", RowsFrom.PARTIAL_LOCAL: "remote_whole",
          RowsFrom.STORE: "store", RowsFrom.STORE_LOCAL: "local", RowsFrom.HELD: "held", RowsFrom.LOCAL: "local"}


__all__ = ["RowsFrom"]
