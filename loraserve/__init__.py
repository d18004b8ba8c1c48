"""loraserve: serve many LoRA adapters of one base model, OpenAI-compatible."""

from loraserve.lora.request import LoRARequest
from loraserve.sampling_params import SamplingParams
from loraserve.version import __version__


def __getattr__(name: str):
    # LLM pulls in torch and transformers; import it lazily so that light users
    # (the CLI's --help, the API server's protocol models) start fast.
    if name == "LLM":
        from loraserve.engine.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "LoRARequest", "SamplingParams", "__version__"]
