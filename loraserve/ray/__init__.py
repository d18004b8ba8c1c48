"""loraserve as a Ray Serve application: one OpenAI-compatible ingress over several
engine replicas, with each adapter's requests routed to a replica that holds it.

Needs Ray Serve (`pip install 'loraserve[ray]'`); the rest of loraserve imports
without it. See loraserve/ray/app.py and docs/scale-out.md.
"""

from loraserve.ray.app import RayOptions, app_builder, build_application, run_application

__all__ = ["RayOptions", "app_builder", "build_application", "run_application"]
