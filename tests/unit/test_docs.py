"""The README and docs/ stay true: Python examples parse, every Loader parameter and public name
is in the reference, relative links and their anchors resolve, the Quickstart is the CI's.

No processes, no DALI: Markdown is read as text.
"""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

import loader

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
REFERENCE = DOCS / "reference.md"
CI_SCRIPT = ROOT / ".ci" / "run"

MARKDOWN = [README, *sorted(DOCS.glob("*.md"))]

_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})(.*)$")
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_INLINE_CODE = re.compile(r"(`+).*?\1")
_HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    info: str  # the info string's first word ("" when there is none)
    code: str


def _split(path: Path) -> tuple[list[Block], list[str]]:
    """The fenced code blocks of a Markdown file, and its prose lines (fenced lines blanked)."""
    blocks: list[Block] = []
    prose: list[str] = []
    fence: str | None = None
    start, info, body = 0, "", []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        found = _FENCE.match(line)
        if fence is None:
            if found:
                fence, start, body = found.group(1), number, []
                words = found.group(2).split()
                info = words[0] if words else ""
                prose.append("")
            else:
                prose.append(line)
            continue
        prose.append("")
        marker = found.group(1) if found and not found.group(2).strip() else ""
        if marker and marker[0] == fence[0] and len(marker) >= len(fence):
            blocks.append(Block(path, start, info, "\n".join(body)))
            fence = None
            continue
        body.append(line)
    assert fence is None, f"{path.name}:{start}: a code fence is never closed"
    return blocks, prose


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _python_blocks() -> list[Block]:
    return [b for path in MARKDOWN for b in _split(path)[0] if b.info.lower() in ("python", "py")]


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = _INLINE_CODE.sub(lambda m: m.group(0).strip("`"), heading)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link's text only
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    for line in _split(path)[1]:
        heading = _HEADING.match(line)
        if heading is None:
            continue
        slug = _slug(heading.group(2))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def _links(path: Path) -> list[tuple[int, str]]:
    """(line, target) of every Markdown link and image outside code."""
    links = []
    for number, line in enumerate(_split(path)[1], start=1):
        for match in _LINK.finditer(_INLINE_CODE.sub("", line)):
            links.append((number, match.group(1)))
    return links


def test_the_docs_exist() -> None:
    assert README.is_file()
    assert REFERENCE.is_file()
    assert len(MARKDOWN) > 2


def test_every_python_block_is_found() -> None:
    # the README's example and the reference's signature at least
    assert any(b.path == README for b in _python_blocks())
    assert any(b.path == REFERENCE for b in _python_blocks())


@pytest.mark.parametrize("block", _python_blocks(), ids=lambda b: f"{_name(b.path)}:{b.line}")
def test_python_blocks_parse(block: Block) -> None:
    try:
        ast.parse(textwrap.dedent(block.code), filename=f"{_name(block.path)}:{block.line}")
    except SyntaxError as error:
        line = block.line + (error.lineno or 0)
        pytest.fail(f"{_name(block.path)}:{line}: {error.msg} (mark a partial snippet as text)")


def test_every_loader_parameter_is_in_the_reference() -> None:
    text = REFERENCE.read_text(encoding="utf-8")
    parameters = [p for p in inspect.signature(loader.Loader.__init__).parameters if p != "self"]
    assert "batch_size" in parameters
    missing = [name for name in parameters if f"`{name}`" not in text]
    assert not missing, f"Loader parameters missing from docs/reference.md: {missing}"


def test_every_public_name_is_in_the_reference() -> None:
    text = REFERENCE.read_text(encoding="utf-8")
    # `name` or a signature `name(...)`
    missing = [name for name in loader.__all__ if not re.search(f"`{re.escape(name)}[`(]", text)]
    assert not missing, f"public names of loader missing from docs/reference.md: {missing}"


@pytest.mark.parametrize("path", MARKDOWN, ids=_name)
def test_relative_links_resolve(path: Path) -> None:
    broken = []
    for number, target in _links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):  # http:, mailto:, ...
            continue
        file_part, _, anchor = target.partition("#")
        destination = (path.parent / file_part).resolve() if file_part else path
        if not destination.exists():
            broken.append(f"line {number}: {target} (no such file)")
        elif anchor and destination.suffix == ".md" and anchor not in _anchors(destination):
            broken.append(f"line {number}: {target} (no such heading)")
    assert not broken, f"{_name(path)}: " + "; ".join(broken)


def test_the_readme_links_every_docs_page() -> None:
    targets = {(README.parent / t.partition("#")[0]).resolve() for _, t in _links(README)}
    missing = [_name(page) for page in sorted(DOCS.glob("*.md")) if page.resolve() not in targets]
    assert not missing, f"README.md does not link to {missing}"


def test_no_reference_to_a_missing_design_file() -> None:
    for path in MARKDOWN:
        assert "DESIGN.md" not in path.read_text(encoding="utf-8"), _name(path)


def _ci_commands() -> list[str]:
    """The commands of ``.ci/run``, in order."""
    lines = [line.strip() for line in CI_SCRIPT.read_text(encoding="utf-8").splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def test_the_quickstart_is_two_commands_and_the_second_is_the_ci_s() -> None:
    text = README.read_text(encoding="utf-8")
    section = re.search(r"^## Quickstart\s*$(.*?)(?=^## |\Z)", text, re.MULTILINE | re.DOTALL)
    assert section is not None, "README.md has no '## Quickstart' section"
    start = text[: section.start()].count("\n") + 1
    blocks, _ = _split(README)
    ends = start + section.group(0).count("\n")
    inside = [b for b in blocks if start <= b.line <= ends]
    assert inside, "the Quickstart section has no code block"
    commands = [line.strip() for line in inside[0].code.splitlines() if line.strip()]
    assert len(commands) == 2, commands
    ci = _ci_commands()
    assert commands[0] in ci and commands[1] in ci, "CI runs the Quickstart's commands as written"
    assert ci.index(commands[0]) + 1 == ci.index(commands[1])
    assert "python -m loader" in commands[0]
    assert any("wheel_smoke.sh" in line for line in ci[ci.index(commands[1]) :]), (
        "CI also installs the built wheel and runs it outside the checkout"
    )


def test_the_design_pages_lifecycle_is_the_worker_state_docstring() -> None:
    from loader.engine._session import WorkerState

    docstring = WorkerState.__doc__ or ""
    table = textwrap.dedent(docstring.split("::", 1)[1]).strip()
    text = (DOCS / "design.md").read_text(encoding="utf-8")
    section = text[text.index("## A worker's lifecycle") :]
    block = section[section.index("```text") + len("```text") : section.index("```\n\nIn short")]
    assert block.strip() == table, "docs/design.md's lifecycle differs from WorkerState's"
