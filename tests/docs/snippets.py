"""The fenced code blocks of README.md and docs/**/*.md, and how the docs tests treat each.

A block is run by the tests unless an HTML comment just before it (blank lines and one visible note
line may stand between) marks it:

    <!-- snippet: gpu -->
    *Needs CUDA GPUs: not run by the docs tests.*
    ```bash

Marks that keep a block from running (each needs that visible note, so a reader sees it too):
`gpu`, `cluster` (several hosts or a Ray cluster), `slow` (minutes: another test runs it), `real`
(SmolLM2: the `real` extra), `vllm` (vLLM installed; tests/rl_routes and tests/vllm run these),
`output` (what a command prints, not a command). Marks that say how a block runs:
`sidecar` (a fresh sidecar of the tiny model stands at the block's `tcp://127.0.0.1:5555`),
`http` (the same with its OpenAI front at `http://127.0.0.1:8000`; flags after the marks, as in
`<!-- snippet: sidecar --dtype bfloat16 -->`, go to that sidecar's command line), `continues` (the page's
previous python block runs first, in the same process), `serves` (a bash block of
`python -m rollout.serve ...` lines: each is started, must print READY, and is stopped).
`text` fences (pictures) are not code.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SKIP_MARKS = {
    "gpu": "needs CUDA GPUs",
    "cluster": "needs several hosts or a Ray cluster",
    "slow": "runs for minutes (another test runs it)",
    "real": "needs SmolLM2 (the real extra)",
    "vllm": "needs vLLM (tests/rl_routes and tests/vllm run it)",
    "output": "shows output, not a command",
    "torchrl": "needs TorchRL and its trainer (tests/sglang_routes runs TorchRL's own code)",
}
RUN_MARKS = {"sidecar", "http", "continues", "serves"}
CODE_LANGS = {"python", "bash"}
TEXT_LANGS = {"text"}
SIDECAR_URL = "tcp://127.0.0.1:5555"
HTTP_URL = "http://127.0.0.1:8000"

_FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
_MARK = re.compile(r"^\s*<!--\s*snippet:\s*([\w\-. ]+?)\s*-->\s*$")
_NOTE = re.compile(r"^\s*(\*|_|>)")


@dataclass
class Snippet:
    path: str  # relative to the repository root
    line: int  # the opening fence's line, 1-based
    lang: str
    code: str
    marks: set[str] = field(default_factory=set)
    noted: bool = False  # a visible note line stands between the mark and the fence
    sidecar_args: list[str] = field(default_factory=list)  # flags for the sidecar a `sidecar` block gets
    previous: Snippet | None = None  # the page's python block before this one (for `continues`)

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"

    @property
    def skip_reason(self) -> str | None:
        skips = sorted(self.marks & SKIP_MARKS.keys())
        return ", ".join(f"marked {m}: {SKIP_MARKS[m]}" for m in skips) or None

    def full_code(self) -> str:
        """The block's code, after the page's previous python block when it `continues` it."""
        if "continues" in self.marks and self.previous is not None:
            return self.previous.full_code() + "\n" + self.code
        return self.code


def pages(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted(p for p in (root / "docs").rglob("*.md") if "screenshots" not in p.parts)]


def parse(path: Path, root: Path = ROOT) -> list[Snippet]:
    lines = path.read_text().splitlines()
    out: list[Snippet] = []
    last_python: Snippet | None = None
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, lang = m.group(1), m.group(2)
        end = i + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        body = "\n".join(line[len(indent):] if line.startswith(indent) else line for line in lines[i + 1:end])
        words, noted = _marks_before(lines, i)
        flags = next((k for k, w in enumerate(words) if w.startswith("--")), len(words))
        snippet = Snippet(str(path.relative_to(root)), i + 1, lang, body + "\n", set(words[:flags]), noted,
                          words[flags:], last_python)
        out.append(snippet)
        if lang == "python":
            last_python = snippet
        i = end + 1
    return out


def _marks_before(lines: list[str], fence: int) -> tuple[list[str], bool]:
    """The words of the comment before line `fence`, and whether a note line stands between."""
    j, noted = fence - 1, False
    while j >= 0 and not lines[j].strip():
        j -= 1
    if j >= 0 and _NOTE.match(lines[j]) and not _MARK.match(lines[j]):
        noted = True
        j -= 1
        while j >= 0 and not lines[j].strip():
            j -= 1
    m = _MARK.match(lines[j]) if j >= 0 else None
    return (m.group(1).split() if m else []), noted


def collect(root: Path = ROOT) -> list[Snippet]:
    return [s for p in pages(root) for s in parse(p, root)]


def problems(snippets: list[Snippet]) -> list[str]:
    """What is wrong with the blocks' languages and marks, one line each."""
    out = []
    for s in snippets:
        if s.lang not in CODE_LANGS | TEXT_LANGS:
            out.append(f"{s.id}: fence language {s.lang!r}: use python, bash or text")
        unknown = s.marks - SKIP_MARKS.keys() - RUN_MARKS
        if unknown:
            out.append(f"{s.id}: unknown snippet marks {sorted(unknown)}")
        if s.marks & SKIP_MARKS.keys() and not s.noted:
            out.append(f"{s.id}: marked {sorted(s.marks & SKIP_MARKS.keys())} without a visible note line before the fence")
        if "continues" in s.marks and s.previous is None:
            out.append(f"{s.id}: marked continues, but no python block comes before it on the page")
        if s.sidecar_args and not s.marks & {"sidecar", "http"}:
            out.append(f"{s.id}: sidecar flags {s.sidecar_args} without a sidecar or http mark")
        if s.lang in TEXT_LANGS and s.marks:
            out.append(f"{s.id}: a text block takes no marks")
    return out


def inventory(snippets: list[Snippet]) -> str:
    """One line: how many blocks the tests run, and how many are marked, by mark."""
    code = [s for s in snippets if s.lang in CODE_LANGS]
    run = [s for s in code if s.skip_reason is None]
    by_mark: dict[str, int] = {}
    for s in code:
        for m in sorted(s.marks & SKIP_MARKS.keys())[:1]:  # a block counts once, under its first mark
            by_mark[m] = by_mark.get(m, 0) + 1
    ran = ", ".join(f"{lang} {sum(s.lang == lang for s in run)}" for lang in sorted(CODE_LANGS))
    marked = ", ".join(f"{m} {n}" for m, n in sorted(by_mark.items()))
    texts = sum(s.lang in TEXT_LANGS for s in snippets)
    return (f"docs snippets: {len(run)} run ({ran}); {len(code) - len(run)} marked ({marked}); "
            f"{texts} text blocks (pictures, not code)")


if __name__ == "__main__":
    found = collect()
    print(inventory(found))
    for line in problems(found):
        print("problem:", line)
