"""bench/results/: every JSON says its commit, machine and command; INDEX.md is what
bench/index_results.py writes; superseded files are in archive/; bench writers record provenance."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from kvxferd.bench._common import write_json

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
sys.path.insert(0, str(ROOT / "bench"))
import index_results  # noqa: E402


def test_every_result_json_has_provenance() -> None:
    files = index_results.tracked(RESULTS, "*.json") + index_results.tracked(RESULTS / "archive", "*.json")
    assert len(files) > 50
    for f in files:
        data = json.loads(f.read_text())
        assert isinstance(data, dict), f
        missing = [k for k in ("commit", "machine", "command") if not data.get(k)]
        assert not missing, f"{f.relative_to(ROOT)} lacks {missing}"


def test_index_is_current_and_nothing_superseded_is_left_out_of_the_archive(tmp_path: Path) -> None:
    script = ROOT / "bench" / "index_results.py"
    check = subprocess.run([sys.executable, str(script), "--check"], capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, f"superseded files not in bench/results/archive/:\n{check.stdout}{check.stderr}"
    out = tmp_path / "INDEX.md"
    res = subprocess.run([sys.executable, str(script), "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert out.read_text() == (RESULTS / "INDEX.md").read_text(), (
        "bench/results/INDEX.md is stale: run python bench/index_results.py")


def test_bench_writer_records_commit_machine_and_command(tmp_path: Path) -> None:
    target = tmp_path / "r.json"
    write_json(target, {"bench": "x", "value": 1.0})
    data = json.loads(target.read_text())
    # a commit of this repository (not compared with HEAD: a shared checkout may commit meanwhile)
    commit = data["commit"].removesuffix("-dirty")
    assert len(commit) == 40
    known = subprocess.run(["git", "cat-file", "-e", f"{commit}^{{commit}}"], cwd=ROOT, capture_output=True)
    assert known.returncode == 0, data["commit"]
    assert data["machine"]["cores"] >= 1 and data["command"]
    assert data["value"] == 1.0
    # a writer's own provenance wins
    write_json(target, {"commit": "abc", "machine": "m", "command": "c"})
    assert json.loads(target.read_text()) == {"commit": "abc", "machine": "m", "command": "c"}
