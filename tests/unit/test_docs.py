"""The README and docs/: the README stays a front page (at most 200 lines, the two set-up commands, the three
kinds of user, a link to every page), and every relative link and anchor in them resolves."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = (
    "architecture",
    "data",
    "training",
    "planning",
    "operations",
    "reliability",
    "benchmarks",
    "security",
    "serving",
)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _prose(path: Path) -> str:
    """The file without its fenced code blocks (a `](` inside code is not a link)."""
    return re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    heads = re.findall(r"^#+ (.+)$", _prose(path), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in heads}


def test_the_readme_is_a_front_page():
    text = README.read_text()
    assert len(text.splitlines()) <= 200, "README.md is at most 200 lines; move detail into docs/"
    commands = [line.split("#")[0].strip() for line in text.splitlines()]
    assert "make demo" in commands and "make test" in commands, "the two set-up commands, as commands"
    for user in ("A schedule", "A person", "CI"):
        assert f"**{user}" in text, f"the README addresses {user!r}"
    for page in PAGES:
        assert f"(docs/{page}.md" in text, f"the README links docs/{page}.md"


def test_make_test_is_what_ci_runs():
    assert "make test" in (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^test:", (ROOT / "Makefile").read_text(), flags=re.M)


@pytest.mark.parametrize("path", [README, *(ROOT / "docs" / f"{p}.md" for p in PAGES)], ids=lambda p: p.name)
def test_every_relative_link_and_anchor_resolves(path):
    assert path.is_file(), f"{path.relative_to(ROOT)} is missing"
    for target in LINK.findall(_prose(path)):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not checked offline
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        assert dest.exists(), f"{path.relative_to(ROOT)} links {target}, which does not exist"
        if anchor:
            assert anchor in _anchors(dest), f"{path.relative_to(ROOT)} links {target}: no such heading"


def test_the_data_page_states_the_readers_rules_as_the_code_has_them():
    """docs/data.md names every reason a JSON line is refused for, with the bounds the reader really uses."""
    from grpo_pipeline.tasks.data import sources as data_io
    from grpo_pipeline.tasks.data.stage import REASONS

    text = " ".join((ROOT / "docs" / "data.md").read_text().split())
    for reason in ("line_too_long", "invalid_utf8", "bad_json", "too_deep", "nul_character"):
        assert reason in REASONS and f"`{reason}`" in text, reason
    assert f"`MAX_LINE_BYTES` ({data_io.MAX_LINE_BYTES >> 20} MiB)" in text
    assert f"`MAX_DEPTH` ({data_io.MAX_DEPTH})" in text
    assert f"at most {data_io.PREVIEW_CHARS:,} characters" in text
    for rule in ("byte order mark", "key given twice", "raw NUL byte"):
        assert rule in text, rule


def test_the_reliability_page_states_the_checkpoint_fallback_as_the_code_has_it():
    from grpo_pipeline.trainer.checkpoints import CORRUPT, REASON_FILE, ResumePoint

    text = " ".join((ROOT / "docs" / "reliability.md").read_text().split())
    assert f"`<root>/{CORRUPT}/checkpoint-<step>-<UTC time>/` with a `{REASON_FILE}`" in text
    assert "`resume_fallback`" in text and "`choose_resume`" in text
    fresh = ResumePoint(skipped=[{"step": 4, "reason": "r", "moved_to": None}]).reason
    assert f"`{fresh.split(';')[0]}" in text  # the words the job says when nothing verifies
