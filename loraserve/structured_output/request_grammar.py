"""One request's grammar, as the engine keeps it beside the request."""

from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import xgrammar as xgr


class RequestGrammar:
    """One request's grammar: its compile, then its matcher."""

    def __init__(self, compiled: Future) -> None:
        self.compiled = compiled
        self.matcher: xgr.GrammarMatcher | None = None

    @property
    def ready(self) -> bool:
        return self.matcher is not None
