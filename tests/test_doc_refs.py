"""Every reference to a section of our docs points at a section that exists (issue 29 item 7: seven
dangling ones).  A reference is `docs/x.md` alone (the file), `docs/x.md §n` (a numbered heading
`## n.` or `### n.m`), `docs/x.md#anchor` (GitHub's slug of a heading) or `docs/x.md, "Title"`
(a heading that contains Title), written in the README, docs/, pyproject.toml, the package (comments,
docstrings, `--help`), bench/, tests/ and .ci/.  The finder is tested on planted defects below, so a
pattern it stops recognising fails here instead of passing quietly."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("README.md", "pyproject.toml", "docs", "plamo2_tools", "bench", "tests", ".ci")
SUFFIXES = {".md", ".py", ".toml", ".sh", ".yaml", ""}
# `docs/x.md` not inside a string literal of its own ("docs/api.md", ...), then §n, #anchor or a title.
REF = re.compile(
    r"""(?<!["'/\w])docs/(?P<file>[\w-]+\.md)`?"""
    r"""(?:\s*§\s*(?P<section>\d+(?:\.\d+)*)|#(?P<anchor>[\w-]+)|,?\s+["“'](?P<title>[^"”'\n]{1,80})["”'])?"""
)
HEADING = re.compile(r"^(#{1,6})\s+(?P<text>.+?)\s*#*\s*$", re.MULTILINE)
# A named paragraph (`**Rank numbering.** r = ...`) is a target for a title too.
LEAD = re.compile(r"^\*\*(?P<text>[^*\n]{1,80}?)\.?\*\*", re.MULTILINE)
NUMBER = re.compile(r"^(?P<n>\d+(?:\.\d+)*)\.?\s")


@dataclass(frozen=True)
class Ref:
    where: str
    file: str
    section: str | None = None
    anchor: str | None = None
    title: str | None = None

    def __str__(self) -> str:
        target = f" §{self.section}" if self.section else f"#{self.anchor}" if self.anchor else ""
        target += f' "{self.title}"' if self.title else ""
        return f"{self.where}: docs/{self.file}{target}"


def headings(markdown: str) -> list[str]:
    return [re.sub(r"[`*]", "", m.group("text")) for m in HEADING.finditer(_without_code(markdown))]


def _without_code(markdown: str) -> str:
    return re.sub(r"^```.*?^```", "", markdown, flags=re.MULTILINE | re.DOTALL)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def find_refs(text: str, where: str) -> list[Ref]:
    refs = []
    for line_no, line in enumerate(text.splitlines(), 1):
        for m in REF.finditer(line):
            refs.append(Ref(f"{where}:{line_no}", m["file"], m["section"], m["anchor"], m["title"]))
    return refs


def dangling(ref: Ref, docs: dict[str, str]) -> bool:
    if ref.file not in docs:
        return True
    titles = headings(docs[ref.file])
    leads = [m["text"] for m in LEAD.finditer(_without_code(docs[ref.file]))]
    if ref.section is not None:
        return not any((m := NUMBER.match(t)) and m["n"] == ref.section for t in titles)
    if ref.anchor is not None:
        return ref.anchor not in {slug(t) for t in titles}
    if ref.title is not None:
        return not any(ref.title.lower() in t.lower() for t in titles + leads)
    return False


def source_files() -> list[Path]:
    files = []
    for name in SOURCES:
        path = ROOT / name
        candidates = [path] if path.is_file() else sorted(path.rglob("*"))
        files += [p for p in candidates if p.is_file() and p.suffix in SUFFIXES and "__pycache__" not in p.parts]
    return files


def all_refs() -> list[Ref]:
    refs = []
    for path in source_files():
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        refs += find_refs(text, str(path.relative_to(ROOT)))
    return refs


def our_docs() -> dict[str, str]:
    return {p.name: p.read_text(encoding="utf-8") for p in (ROOT / "docs").glob("*.md")}


def test_every_section_reference_has_its_section() -> None:
    refs = [r for r in all_refs() if not r.where.startswith("tests/test_doc_refs.py")]
    assert len(refs) > 100, "the finder found almost nothing: its pattern broke"
    assert any(r.section for r in refs) and any(r.title for r in refs)
    docs = our_docs()
    missing = [str(r) for r in refs if dangling(r, docs)]
    assert not missing, "dangling doc references:\n" + "\n".join(missing)


DOCS = {
    "a.md": "# A\n\n## 1. One\n\n### 1.2 Sub part\n\n## Batch files, and more\n\n```\n## 9. not a heading\n```\n"
    "\n**Rank numbering.** r = pp_rank * tp + tp_rank\n"
}


@pytest.mark.parametrize(
    ("text", "broken"),
    [
        ("see docs/a.md §1", False),
        ("see docs/a.md §1.2", False),
        ("see docs/a.md §2", True),  # no section 2
        ("see docs/a.md §9", True),  # a heading inside a code block is no section
        ('docs/a.md, "Batch files"', False),
        ('docs/a.md "Batch files"', False),
        ("docs/a.md 'Sub part'", False),
        ('docs/a.md, "Streaming"', True),
        ("docs/a.md#batch-files-and-more", False),
        ("docs/a.md#batch", True),
        ("docs/b.md", True),  # no such file
        ('docs/a.md, "Rank numbering"', False),  # a named paragraph
        ('docs/a.md, "Ranks"', True),
        ('`docs/a.md`, "One"', False),
    ],
)
def test_the_finder_sees_each_kind_of_reference(text: str, broken: bool) -> None:
    (ref,) = find_refs(text, "planted")
    assert dangling(ref, DOCS) is broken, ref


def test_a_quoted_path_in_code_is_not_a_reference() -> None:
    assert find_refs('("docs/api.md", "exec")', "planted") == []
