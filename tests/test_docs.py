"""docs/configuration.md documents every `loraserve serve` (and `serve-ray`) flag and every
environment variable loraserve reads, with the defaults the code has."""

from __future__ import annotations

import argparse
import importlib.util
import re
from pathlib import Path

from loraserve.cli_args import build_parser

ROOT = Path(__file__).resolve().parent.parent
CONFIG_DOC = ROOT / "docs" / "configuration.md"
# Read by the test suite only, never by a user's server.
_TEST_ONLY_ENV_PREFIX = "LORASERVE_TEST_"


def _serve_parsers() -> list[argparse.ArgumentParser]:
    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return [subparsers.choices["serve"], subparsers.choices["serve-ray"]]


def _documented_actions() -> list[argparse.Action]:
    """`serve`'s flags, then those that only `serve-ray` has."""
    actions: dict[str, argparse.Action] = {}
    for parser in _serve_parsers():
        for action in parser._actions:
            if not isinstance(action, argparse._HelpAction):
                actions.setdefault(action.dest, action)
    return list(actions.values())


def _name(action: argparse.Action) -> str:
    return action.option_strings[0] if action.option_strings else action.metavar or action.dest


def _table_rows(text: str) -> dict[str, str]:
    """First cell (its first `name`) -> the whole row, for every table row."""
    rows = {}
    for line in text.splitlines():
        match = re.match(r"\|\s*`([^`]+)`", line)
        if match:
            rows[match.group(1)] = line
    return rows


def test_every_serve_flag_has_a_row():
    rows = _table_rows(CONFIG_DOC.read_text())
    missing = [_name(a) for a in _documented_actions() if _name(a) not in rows]
    assert not missing, f"docs/configuration.md has no table row for {missing}"


def test_every_option_string_is_named():
    text = CONFIG_DOC.read_text()
    missing = [
        option
        for action in _documented_actions()
        for option in action.option_strings
        if f"`{option}`" not in text
    ]
    assert not missing, f"docs/configuration.md never names {missing}"


def test_documented_defaults_are_the_parsers():
    rows = _table_rows(CONFIG_DOC.read_text())
    wrong = []
    for action in _documented_actions():
        default = action.default
        # None and booleans are described in words ("the model's", "off").
        if default is None or isinstance(default, bool) or default == argparse.SUPPRESS:
            continue
        row = rows.get(_name(action), "")
        cells = [c.strip() for c in row.strip("|").split("|")]
        # The cell starts with the default as the parser has it, maybe explained after.
        shown = re.match(r"`([^`]*)`", cells[1]) if len(cells) > 1 else None
        if shown is None or shown.group(1) != str(default):
            wrong.append(f"{_name(action)} (the parser's default is {default!r})")
    assert not wrong, f"docs/configuration.md gives other defaults for {wrong}"


def test_every_flag_the_docs_name_exists():
    options = {o for a in _documented_actions() for o in a.option_strings}
    section = CONFIG_DOC.read_text().split("## Environment variables")[0]
    named = set(re.findall(r"`(--[a-z0-9-]+)`", section))
    unknown = sorted(named - options)
    assert not unknown, f"docs/configuration.md names flags that `serve` lacks: {unknown}"


def _environment_variables() -> set[str]:
    """The LORASERVE_* names in the package's code, and loraserve.envs' variables."""
    names = set()
    for folder in ("loraserve", "kernels"):
        for path in (ROOT / folder).rglob("*.py"):
            names |= set(re.findall(r"[\"'](LORASERVE_[A-Z0-9_]+)[\"']", path.read_text()))
    if importlib.util.find_spec("loraserve.envs") is not None:
        from loraserve import envs

        names |= {var.name for var in getattr(envs, "VARIABLES", ())}
    return {n for n in names if not n.startswith(_TEST_ONLY_ENV_PREFIX)}


def test_every_environment_variable_has_a_row():
    rows = _table_rows(CONFIG_DOC.read_text().split("## Environment variables", 1)[1])
    variables = _environment_variables()
    assert "LORASERVE_ALLOW_RUNTIME_LORA_UPDATING" in variables  # the scan finds them
    missing = sorted(variables - set(rows))
    assert not missing, f"docs/configuration.md has no row for {missing}"


# The pages whose commands a reader copies.
COMMAND_PAGES = ("README.md", "benchmarks/RESULTS.md", "examples/README.md", "docs/design.md",
                 "docs/lora.md", "docs/configuration.md", "docs/scale-out.md")


def _runnable_module(name: str) -> bool:
    """Whether `python -m name` from the root runs a file of the repository."""
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__main__.py").is_file()


def test_every_script_the_docs_run_exists():
    missing = []
    # The pages, the GPU suite's stages, and the usage in each benchmark's docstring.
    benchmarks = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "benchmarks").rglob("*.py"))
    for page in (*COMMAND_PAGES, "benchmarks/gpu_suite.sh", *benchmarks):
        text = (ROOT / page).read_text()
        for script in set(re.findall(r"\b(?:python3?|bash)\s+((?:[\w.-]+/)*[\w.-]+\.(?:py|sh))",
                                     text)):
            if not (ROOT / script).is_file():
                missing.append(f"{page}: {script}")
        for module in set(re.findall(r"\bpython3?\s+-m\s+([\w.]+)", text)):
            # The repository's own modules (the benchmarks, loraserve.cli), not pip's or pytest's.
            if (ROOT / module.split(".")[0]).is_dir() and not _runnable_module(module):
                missing.append(f"{page}: -m {module}")
    assert not missing, f"commands run scripts that do not exist: {missing}"
