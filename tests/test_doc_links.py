"""Every relative link in the README, CHANGELOG, docs/ and the bench READMEs resolves: files move
(results to bench/results/archive/, text between READMEs) and a dead link is found here."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _docs() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "deploy" / "README.md"]
    files += sorted((ROOT / "docs").glob("*.md")) + sorted((ROOT / "bench").rglob("*.md"))
    return [f for f in files if f.exists()]


def test_relative_markdown_links_resolve() -> None:
    docs = _docs()
    assert len(docs) >= 8
    dead = []
    for doc in docs:
        text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)  # code blocks are not links
        for target in LINK.findall(text):
            if re.match(r"^[a-z]+:", target) or target.startswith("#"):
                continue  # URLs and in-page anchors
            path = target.split("#", 1)[0]
            if not (doc.parent / path).exists():
                dead.append(f"{doc.relative_to(ROOT)}: {target}")
    assert not dead, "dead links:\n" + "\n".join(dead)
