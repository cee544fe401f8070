"""docs/config.md must be what scripts/gen_config_doc.py writes from kvxferd/config.py, and every
config key must say what it does there."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import fields
from pathlib import Path

from kvxferd.cli import main as cli
from kvxferd.config import Config

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import gen_config_doc  # noqa: E402


def test_config_doc_is_current(tmp_path: Path) -> None:
    out = tmp_path / "config.md"
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_config_doc.py"), "--out", str(out)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert out.read_text() == (ROOT / "docs" / "config.md").read_text(), (
        "docs/config.md is stale: run python scripts/gen_config_doc.py")


def test_every_key_is_documented_and_in_the_doc() -> None:
    comments = gen_config_doc.field_comments((ROOT / "kvxferd" / "config.py").read_text())
    doc = (ROOT / "docs" / "config.md").read_text()
    for f in fields(Config):
        assert comments.get(f.name) or f.name in gen_config_doc.NOTES, (
            f"config key {f.name} has no comment above it in kvxferd/config.py and no NOTES entry")
        assert f"\n## {f.name}\n" in doc, f.name


def test_the_flags_the_doc_names_exist(capsys: object) -> None:
    try:
        cli(["serve", "--help"])
    except SystemExit:
        pass
    out = capsys.readouterr().out  # type: ignore[attr-defined]
    for flag in gen_config_doc.FLAGS.values():
        assert flag in out, flag
