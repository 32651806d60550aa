"""Every ``§N`` / ``§N.M`` reference in the specification, its README and the code's docstrings
and comments names a section that exists in ``spec/SPEC.md``: a renumbered or removed section
cannot leave a dangling reference behind. References to other documents (``RFC 9110 §5.6.7``,
``ISO/IEC 14496-12 §12.1.3``) are not SPEC's and are skipped."""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SPEC = REPO / "spec" / "SPEC.md"

HEADING = re.compile(r"^#{2,3} (\d+(?:\.\d+)*)\.? ", re.MULTILINE)
# "§6.3", "§ 7.1", and ranges "§3.6–3.7" / "§4.1–§4.4", whose end must exist too.
REFERENCE = re.compile(r"§\s?(\d+(?:\.\d+)*)(?:–§?(\d+(?:\.\d+)*))?")
# A reference right after the name of another document belongs to that document.
OTHER_DOCUMENT = re.compile(r"(RFC ?\d+|ISO/IEC [\d-]+|\d{4,}-\d+)[,:]? $")


def sections(text: str) -> set[str]:
    return set(HEADING.findall(text))


def dangling_references(text: str, known: set[str]) -> list[str]:
    """The ``§`` references of ``text`` that name no section in ``known``, with their line."""
    found = []
    for line_number, line in enumerate(text.splitlines(), 1):
        for match in REFERENCE.finditer(line):
            if OTHER_DOCUMENT.search(line[: match.start()]):
                continue
            if not {match[1], match[2] or match[1]} <= known:
                found.append(f"{line_number}: {match[0]}")
    return found


def sources() -> list[Path]:
    return [
        SPEC,
        REPO / "spec" / "README.md",
        *sorted((REPO / "refstream").rglob("*.py")),
        *sorted((REPO / "spec").rglob("*.py")),
        *sorted(p for p in (REPO / "tests").glob("*.py") if p.name != Path(__file__).name),
    ]


def test_the_spec_has_its_sections():
    known = sections(SPEC.read_text(encoding="utf-8"))
    assert {"1", "1.4", "3.6", "8.7", "10.8", "12"} <= known


@pytest.mark.parametrize("path", sources(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_section_reference_exists(path):
    known = sections(SPEC.read_text(encoding="utf-8"))
    assert dangling_references(path.read_text(encoding="utf-8"), known) == []


# A section number without its sign ("retried (7.3)", "the check of 7.1"), which the check above
# cannot see.
BARE_REFERENCE = re.compile(r"(?:\(|\bsee |\bof |\bper )[1-9]\d?\.\d{1,2}(?!\d|\.\d)")


@pytest.mark.parametrize("path", [SPEC, REPO / "spec" / "README.md"], ids=lambda p: p.name)
def test_the_spec_writes_every_reference_with_its_sign(path):
    assert BARE_REFERENCE.findall(path.read_text(encoding="utf-8")) == []


def test_a_reference_to_a_missing_section_is_found():
    known = {"7", "7.1", "8", "8.2"}
    text = ("retried (§8.3), see §7.1 and § 7.9, §7.1–8.2, §7–§8.4;\n"
            "ISO/IEC 14496-12 §12.1.3, RFC 9110 §5.6.7")
    assert dangling_references(text, known) == ["1: §8.3", "1: § 7.9", "1: §7–§8.4"]
    bare = "retried (7.3), identities per 7.1. A half frame (0.5), a tolerance of 1e-4"
    assert BARE_REFERENCE.findall(bare) == ["(7.3", "per 7.1"]
