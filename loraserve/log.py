"""One logging set-up for every loraserve process: the command's own, and the
engine core and tensor-parallel ranks, which start (spawned) without the
parent's logging and would otherwise drop their INFO lines (model loading, KV
cache and adapter slot sizes, graph capture)."""

from __future__ import annotations

import logging

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging() -> None:
    """INFO and above to stderr, unless the process set up logging already."""
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
