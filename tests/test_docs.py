"""The repository documents itself: nothing points outside it, and every citation of the
design document (``docs/design.md §N`` or ``§N.M``) names a section that exists.

No jax work here (conftest imports it, nothing else does): seconds, on any machine.
"""

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DESIGN = os.path.join(ROOT, "docs", "design.md")

# Spelled in pieces so that this file does not match itself.
FORBIDDEN = ("../" + "shared", "DESIGN" + " §", "DESIGN" + ".md")

# Build outputs and local state, never part of the repository (see .gitignore).
SKIP_DIRS = {
  ".git",
  ".venv",
  "__pycache__",
  ".pytest_cache",
  "build",
  "dist",
  "workdirs",
  "runs",
  ".whl",
  "wheels",
}

HEADING = re.compile(r"^#{2,4}\s+(\d+(?:\.\d+)*)\.?\s+\S", re.MULTILINE)
SECTION = re.compile(r"§\s?(\d+(?:\.\d+)*)")
# "docs/design.md §2.4", "`docs/design.md` §2.5-§2.7", "docs/design.md §1, §2 and §7.2"
CITATION = re.compile(r"docs/design\.md`?((?:\s*(?:,|-|and|or)?\s*§\s?\d+(?:\.\d+)*)+)")


def _files():
  for top, dirs, names in os.walk(ROOT):
    dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info"))
    for name in sorted(names):
      yield os.path.join(top, name)


def _text(path):
  with open(path, "rb") as f:
    return f.read().decode("utf-8", errors="replace")


def _sections():
  return set(HEADING.findall(_text(DESIGN)))


def test_design_document_has_numbered_sections():
  assert os.path.isfile(DESIGN), "docs/design.md is missing"
  found = HEADING.findall(_text(DESIGN))
  assert len(found) == len(set(found)), "section numbers must be unique"
  assert {"1", "2", "3", "4", "5", "6", "7", "8", "9"} <= set(found)
  # every sub-section's chapter exists
  assert {s.split(".")[0] for s in found} <= set(found)


def test_nothing_points_outside_the_repository():
  bad = []
  for path in _files():
    data = _text(path)
    for needle in FORBIDDEN:
      if needle in data:
        line = data[: data.index(needle)].count("\n") + 1
        bad.append(f"{os.path.relpath(path, ROOT)}:{line}: {needle!r}")
  assert not bad, (
    "references to files outside the repository (cite docs/design.md "
    "sections instead):\n" + "\n".join(bad)
  )


def _citations():
  """(file:line, section) for every docs/design.md citation in the repository, and every
  bare section reference inside docs/design.md itself."""
  out = []
  for path in _files():
    data = _text(path)
    rel = os.path.relpath(path, ROOT)
    if os.path.abspath(path) == DESIGN:
      spans = [(m.start(), m.group(0)) for m in SECTION.finditer(data)]
    else:
      spans = [(m.start(), m.group(1)) for m in CITATION.finditer(data)]
    for pos, text in spans:
      line = data[:pos].count("\n") + 1
      out += [(f"{rel}:{line}", s) for s in SECTION.findall(text)]
  return out


def test_every_cited_section_exists():
  sections = _sections()
  cites = _citations()
  assert any(not where.startswith(os.path.join("docs", "design.md")) for where, _ in cites), (
    "no citation of docs/design.md found: is the citation pattern still right?"
  )
  missing = [f"{where}: §{s}" for where, s in cites if s not in sections]
  assert not missing, (
    "citations of docs/design.md sections that do not exist (headings: "
    f"{', '.join(sorted(sections, key=lambda s: [int(x) for x in s.split('.')]))}):\n"
    + "\n".join(missing)
  )


@pytest.mark.parametrize(
  "text, want",
  [
    ("see docs/design.md §2.4.", ["2.4"]),
    ("(`docs/design.md` §2.5-§2.7)", ["2.5", "2.7"]),
    ("docs/design.md §1, §2 and §7.2", ["1", "2", "7.2"]),
    ("docs/design.md; the tests", []),
  ],
)
def test_citation_pattern(text, want):
  got = [s for m in CITATION.finditer(text) for s in SECTION.findall(m.group(1))]
  assert got == want
