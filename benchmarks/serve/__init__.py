"""The serving benchmark: an OpenAI-style streaming load generator against a
running ``loraserve serve`` (``python -m benchmarks.serve --help``)."""
