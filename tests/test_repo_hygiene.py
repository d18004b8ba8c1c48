"""The repository speaks of loraserve and its users, not of how it was made: no
text file refers to work sessions, to runs on a lent machine, or to issue numbers.
History belongs in git, and a comment says why the code is as it is."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
THIS_FILE = Path(__file__).resolve()

_ORDINALS = (
    "first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|"
    "thirteenth|fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth|"
    r"\d+(?:st|nd|rd|th)"
)
# Each names one kind of work-diary wording. A pytest "session" scope, an HTTP client
# session or start_new_session do not match: only a session counted or placed in time.
DIARY_PATTERNS = {
    "a numbered session": rf"\b(?:{_ORDINALS})\s+session\b",
    "a session placed in time": r"\b(?:this|last|next|previous|earlier|later)\s+session\b",
    "a run on a lent machine": r"\bdevice\s+(?:calls?|time)\b",
    "an issue number": r"\bissues?\s*#?\d+",
}
_DIARY_RE = re.compile("|".join(f"(?:{p})" for p in DIARY_PATTERNS.values()), re.IGNORECASE)


def _repo_files() -> list[Path]:
    """Tracked files, and new ones git does not ignore, that exist in the work tree."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
            cwd=ROOT, capture_output=True, check=True,
        ).stdout.decode()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    paths = {ROOT / name for name in listed.split("\0") if name}
    return sorted(p for p in paths if p.is_file() and p.resolve() != THIS_FILE)


def _text(path: Path) -> str | None:
    data = path.read_bytes()
    if b"\0" in data:
        return None  # binary (adapter weights)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def diary_hits(text: str) -> list[tuple[int, str]]:
    """(line number, matched words) of every work-diary phrase in text."""
    return [
        (number, match.group(0))
        for number, line in enumerate(text.splitlines(), 1)
        for match in _DIARY_RE.finditer(line)
    ]


@pytest.mark.parametrize(
    "line",
    [
        "measured in the thirteenth session",
        "as the 5th session found",
        "Fifth Session (2026-11-29): aligned loads",
        "not run again this session",
        "one device call starts a fresh machine",
        "no device time left",
        "Engine on the GPU (issue 5)",
        "see issue #12",
    ],
)
def test_diary_wording_is_found(line: str):
    assert diary_hits(line)


@pytest.mark.parametrize(
    "line",
    [
        '@pytest.fixture(scope="session")',
        "async with aiohttp.ClientSession() as session:",
        "subprocess.Popen(cmd, start_new_session=True)",
        "built once per test session",
        "the device's own timestamps",
        "GPU time by kernel kind",
        "one issue: the tokenizer",
    ],
)
def test_ordinary_wording_passes(line: str):
    assert not diary_hits(line)


def test_no_file_speaks_of_how_it_was_made():
    hits = []
    for path in _repo_files():
        text = _text(path)
        if text is None:
            continue
        rel = path.relative_to(ROOT)
        hits += [f"{rel}:{number}: {words!r}" for number, words in diary_hits(text)]
    assert not hits, "work-diary wording in the repository:\n" + "\n".join(hits)
