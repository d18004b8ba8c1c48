"""loraserve as a Ray Serve application: one OpenAI-compatible ingress over several
engine replicas, with each adapter's requests routed to a replica that holds it.

Needs Ray Serve (`pip install 'loraserve[ray]'`); the rest of loraserve imports
without it. See loraserve/ray/app.py and docs/scale-out.md.
"""

from typing import Any

__all__ = ["RayOptions", "app_builder", "build_application", "run_application"]


def __getattr__(name: str) -> Any:
    # Imported on first use, so that loraserve.entrypoints.ray_options (the `serve-ray` flags,
    # which `loraserve --help` lists) imports without Ray.
    if name in __all__:
        from loraserve.ray import app

        return getattr(app, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
