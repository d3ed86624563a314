"""The user docs hold together: links resolve, the README stays short, every error class is explained, and the
README's set-up commands are the ones CI runs."""

from __future__ import annotations

import ast
import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
DEMO_COMMAND = ("python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 && .venv/bin/pip install -e . && "
                ".venv/bin/python -m taco_notebook run examples/02-train-with-dashboard.ipynb")

_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
_CODE_SPAN = re.compile(r"`[^`\n]*`")


def _prose(text: str) -> str:
    """The text without fenced blocks and code spans, where brackets are code, not links."""
    return _CODE_SPAN.sub("", _FENCE.sub("", text))


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation and symbols dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    kept = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LMN")
    return kept.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    for line in _FENCE.sub("", path.read_text(encoding="utf-8")).splitlines():
        found = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not found:
            continue
        slug = _slug(found.group(1))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def _relative_links(page: Path) -> list[str]:
    return [t for t in _LINK.findall(_prose(page.read_text(encoding="utf-8")))
            if not re.match(r"[a-z][a-z0-9+.-]*:", t) and not t.startswith("//")]


def test_docs_pages_exist() -> None:
    wanted = {"install", "magics", "gpus", "multinode", "horovod-and-ddp", "dashboard", "elastic",
              "troubleshooting", "architecture", "scaling", "performance", "security"}
    missing = sorted(name for name in wanted if not (DOCS / f"{name}.md").is_file())
    assert not missing, f"docs pages missing: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for target in _relative_links(page):
        file_part, _, anchor = target.partition("#")
        if file_part == "options.md" or file_part.endswith("/options.md"):
            if not (page.parent / file_part).exists():
                continue  # generated from the option table; test_options_reference_is_linked says so
        resolved = (page.parent / file_part).resolve() if file_part else page
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            broken.append(f"{target}: no heading with anchor #{anchor} in {resolved.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_readme_is_short_and_links_every_docs_page() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 220, f"README.md has {len(lines)} lines; move detail into docs/"
    linked = {Path(t.partition("#")[0]).name for t in _relative_links(README) if t.startswith("docs/")}
    unlinked = sorted(p.name for p in DOCS.glob("*.md") if p.name not in linked)
    assert not unlinked, f"README.md does not link {unlinked}"


@pytest.mark.parametrize("page", sorted(DOCS.glob("*.md")), ids=lambda p: p.name)
def test_every_page_starts_by_saying_what_it_is_for(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    if text.startswith("<!--"):  # a generated page says first how it is made
        text = text.partition("-->")[2].lstrip("\n")
    lines = text.splitlines()
    assert lines and lines[0].startswith("# "), f"{page.name} starts with a title"
    purpose = next((line for line in lines[1:] if line.strip()), "")
    assert purpose and not purpose.startswith(("#", "|", "```", "-")), \
        f"{page.name}: the first line after the title says what the page is for, got {purpose!r}"


def test_every_error_class_is_in_troubleshooting() -> None:
    tree = ast.parse((ROOT / "taco_notebook" / "errors.py").read_text(encoding="utf-8"))
    classes = [node.name for node in tree.body if isinstance(node, ast.ClassDef)]
    assert "TacoError" in classes
    page = (DOCS / "troubleshooting.md").read_text(encoding="utf-8")
    missing = [name for name in classes if not re.search(rf"\b{name}\b", page)]
    assert not missing, f"docs/troubleshooting.md does not explain {missing}"


def _bash_blocks(text: str) -> list[str]:
    return [block.strip() for block in re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M)]


def _ci_command() -> str:
    lines = [line for line in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
             if line.strip() and not line.startswith("#") and not line.startswith(("set ", "cd "))]
    assert len(lines) == 1, f".ci/run should run one command after set/cd, found {lines}"
    return lines[0].strip()


def test_the_two_set_up_commands_are_in_the_readme_and_ci_runs_the_second() -> None:
    text = README.read_text(encoding="utf-8")
    section = text.split("## Set up (two commands)", 1)[1].split("\n## ", 1)[0]
    blocks = _bash_blocks(section)
    assert len(blocks) == 2, f"the set-up section holds two commands, found {len(blocks)}"
    demo, tests = blocks
    assert tests == _ci_command(), "README's test command differs from what .ci/run runs"
    assert demo == DEMO_COMMAND, "README's demo command changed; keep it as users and scripts know it"
    assert (ROOT / "examples" / "02-train-with-dashboard.ipynb").is_file()


def test_options_reference_is_linked_from_readme_and_magics() -> None:
    for page in (README, DOCS / "magics.md"):
        targets = [t.partition("#")[0] for t in _relative_links(page)]
        assert any(Path(t).name == "options.md" for t in targets), f"{page.name} links docs/options.md"
    if not (DOCS / "options.md").exists():
        pytest.skip("docs/options.md is generated from the option table by another change; not here yet")
