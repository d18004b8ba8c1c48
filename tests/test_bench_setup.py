"""`python -m benchmarks.make_bench_setup` on a tiny model: N adapters that PEFT
loads, the copies hard links to K weight files, and registration files that
loraserve's --lora-modules parser and --config file reader take."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from benchmarks import make_bench_setup
from loraserve.entrypoints.server_args import parse_lora_module

ATTENTION = {"q_proj", "k_proj", "v_proj", "o_proj"}


def setup(out: Path, model: str, *flags: str) -> dict:
    return make_bench_setup.main(["--out", str(out), "--base-model", model, "--rank", "4",
                                  "--dtype", "float32", *flags])


def inode(folder: str | Path) -> int:
    return os.stat(Path(folder) / "adapter_model.safetensors").st_ino


def test_hard_linked_adapters_load_with_peft(llama_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    summary = setup(tmp_path, llama_dir, "--num-adapters", "5", "--distinct", "2",
                    "--target-modules", "attention")
    assert summary["num_adapters"] == 5 and summary["distinct"] == 2
    root = Path(summary["adapters"])
    names = [f"lora{i}" for i in range(5)]
    assert sorted(p.name for p in root.iterdir()) == names
    # Adapter i shares adapter i mod 2's files; the two drawn ones differ.
    assert [inode(root / n) for n in names] == [inode(root / names[i % 2]) for i in range(5)]
    assert inode(root / "lora0") != inode(root / "lora1")
    assert os.stat(root / "lora4" / "adapter_config.json").st_nlink == 3
    first, second = (load_file(root / n / "adapter_model.safetensors") for n in names[:2])
    assert first.keys() == second.keys()
    assert not all(torch.equal(first[k], second[k]) for k in first)
    assert {k.split(".")[-3] for k in first} == ATTENTION
    config = json.loads((root / "lora3" / "adapter_config.json").read_text())
    assert config["r"] == 4 and set(config["target_modules"]) == ATTENTION

    base = AutoModelForCausalLM.from_pretrained(llama_dir, torch_dtype=torch.float32)
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    for i, name in enumerate(names):
        model = PeftModel.from_pretrained(base, str(root / name), adapter_name=name)
        state = {k: v for k, v in model.state_dict().items() if f".{name}." in k}
        assert len(state) == len(first)  # every matrix the file holds
        loaded = state[key.replace("lora_B.weight", f"lora_B.{name}.weight")]
        assert torch.equal(loaded, (first, second)[i % 2][key])
        base = model.unload()


def test_registration_files(llama_dir, tmp_path):
    """lora_modules.txt holds the words of --lora-modules; lora_modules.json is
    a `loraserve serve --config` file that registers every adapter."""
    from loraserve.cli_args import build_parser, command_parsers
    from loraserve.cli_compat import expand_config_file

    summary = setup(tmp_path, llama_dir, "--num-adapters", "3", "--distinct", "1",
                    "--prefix", "tenant-")
    root = Path(summary["adapters"]).absolute()
    expected = [(f"tenant-{i}", str(root / f"tenant-{i}")) for i in range(3)]
    words = Path(summary["lora_modules"]).read_text().splitlines()
    assert [(m.name, m.path) for m in map(parse_lora_module, words)] == expected

    parser = build_parser()
    argv = expand_config_file(["serve", llama_dir, "--enable-lora", "--config",
                               summary["config"]], command_parsers(parser)["serve"])
    args, unknown = parser.parse_known_args(argv)
    assert not unknown
    assert [(m.name, m.path) for m in args.lora_modules] == expected


def test_distinct_weights_and_rerun_over_links(llama_dir, tmp_path):
    """--distinct all draws every adapter (no shared inodes, all seven projections
    by default); run over a folder of hard links, it leaves the drawn weights as
    a fresh run draws them (writing through a link would change its source)."""
    setup(tmp_path, llama_dir, "--num-adapters", "3", "--distinct", "1")
    root = tmp_path / "adapters"
    assert len({inode(root / f"lora{i}") for i in range(3)}) == 1
    summary = setup(tmp_path, llama_dir, "--num-adapters", "3")
    assert summary["distinct"] == 3
    assert len({inode(root / f"lora{i}") for i in range(3)}) == 3
    fresh = setup(tmp_path / "fresh", llama_dir, "--num-adapters", "3")
    for i in range(3):
        rerun = load_file(root / f"lora{i}" / "adapter_model.safetensors")
        drawn = load_file(Path(fresh["adapters"]) / f"lora{i}" / "adapter_model.safetensors")
        assert rerun.keys() == drawn.keys()
        assert all(torch.equal(rerun[k], drawn[k]) for k in rerun)
    modules = {k.split(".")[-3] for k in rerun}
    assert modules == ATTENTION | {"gate_proj", "up_proj", "down_proj"}


def test_bad_flags_are_refused(tmp_path):
    with pytest.raises(SystemExit):
        make_bench_setup.main(["--out", str(tmp_path), "--distinct", "0"])
    with pytest.raises(SystemExit):
        make_bench_setup.main(["--out", str(tmp_path), "--base-model", str(tmp_path)])


def test_byte_level_tokenizer_spells_json(tmp_path):
    """--tokenizer bytes: the Llama-3-8B shape's vocabulary, bos and eos at the
    config's ids, text that decodes back as it was, and a JSON answer whose token
    ids xgrammar's matcher for its schema accepts to the end (the made-up words
    of the default tokenizer have no token for "{")."""
    xgr = pytest.importorskip("xgrammar")
    from transformers import AutoTokenizer

    summary = make_bench_setup.main(["--out", str(tmp_path), "--num-adapters", "0",
                                     "--num-layers", "1", "--tokenizer", "bytes"])
    config = json.loads((Path(summary["model"]) / "config.json").read_text())
    tok = AutoTokenizer.from_pretrained(summary["model"])
    assert len(tok) == config["vocab_size"] == 128256
    assert (tok.bos_token_id, tok.eos_token_id) == (config["bos_token_id"],
                                                    config["eos_token_id"])
    assert tok.decode([tok.eos_token_id]) == "<|end_of_text|>"
    text = '{"name": "Zoë w7", "tags": ["a\\nb", "42"]}'
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert tok.decode(list(range(1000, 1016)))  # made-up ids decode too

    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=config["vocab_size"])
    assert info.vocab_type == xgr.VocabType.BYTE_LEVEL
    schema = {"type": "object", "properties": {"name": {"type": "string"},
                                               "tags": {"type": "array",
                                                        "items": {"type": "string"}}},
              "required": ["name", "tags"]}
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_json_schema(
        json.dumps(schema), any_whitespace=False))
    assert all(matcher.accept_token(t) for t in ids)
    assert matcher.accept_token(tok.eos_token_id) and matcher.is_terminated()

    words = make_bench_setup.main(["--out", str(tmp_path / "words"), "--num-adapters", "0",
                                   "--num-layers", "1"])
    assert AutoTokenizer.from_pretrained(words["model"]).convert_ids_to_tokens(5) == "w5"
