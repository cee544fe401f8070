"""Real-model check (examples/pd_transformers.py): a transformers model prefilled by one engine and
decoded by another through two real daemons gives the reference's tokens and bit-identical KV, for
every TP pair CI covers, in bf16 and fp32; and a wrong head mapping makes the check fail.

Cost control (2 cores): two daemons serve every case; the example's ``main`` runs in a process
forked from a warm interpreter that imported torch/transformers/triton once (the CLI, minus the
interpreter start-up); each case does both dtypes in one run.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvxfer_protocol.pb.kvxfer.v1 import engine_pb2, engine_pb2_grpc
from kvxfer_protocol.slot_layout import KVLayout, part_bytes
from tests.conftest import ROOT, DaemonProc, spawn_daemon, wait_ready

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="needs transformers (the [test] extra)"
)

KV_HEADS = 2
LAYERS = 4
HEAD_DIM = 16
NEW_TOKENS = 6
ROOMS = 8
# A tiny model: 4 layers, 4 query heads over 2 KV heads (so TP 4 replicates each KV head).
# `--kernel-backend triton` makes a silent fall-back to the torch copies an error.
MODEL = [
    "--layers", str(LAYERS), "--heads", "4", "--kv-heads", str(KV_HEADS),
    "--head-dim", str(HEAD_DIM), "--hidden", "64", "--rooms", str(ROOMS),
    "--new-tokens", str(NEW_TOKENS), "--kernel-backend", "triton", "--timeout", "90",
]
DEFAULT_CHUNKING = ["--prompt-tokens", "40", "--chunk-tokens", "16", "--page-size", "8"]
DTYPES = {"bfloat16": 2, "float32": 4}

# Imports everything heavy once, then forks one child per request: {"argv": [...], "out": path} on
# stdin, the child's exit status on stdout. The child's stdout/stderr go to the `out` file.
_RUNNER = r"""
import json, os, sys, traceback
import torch
import transformers.models.llama.modeling_llama  # noqa: F401
import transformers.models.mistral.modeling_mistral  # noqa: F401
import transformers.models.qwen2.modeling_qwen2  # noqa: F401
import kvxfer_client  # noqa: F401
import kvxfer_client.kernels._triton_kv  # noqa: F401
from examples import pd_transformers
print("ready", flush=True)
for line in sys.stdin:
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:
        fd = os.open(req["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        code = 3
        try:
            code = pd_transformers.main(req["argv"])
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 2
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    print(os.waitstatus_to_exitcode(status), flush=True)
"""


class WarmRunner:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.log = workdir / "runner.log"
        self.n = 0
        # TRITON_INTERPRET must be set before triton is imported: it picks the interpreter at decoration.
        env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONUNBUFFERED": "1"}
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _RUNNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                cwd=ROOT, env=env, text=True,
            )

    def _line(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"warm runner died:\n{self.log.read_text(errors='replace')[-4000:]}")
        return line.strip()

    def wait_ready(self) -> None:
        assert self._line() == "ready"

    def run(self, *argv: str) -> tuple[int, dict[str, Any], str]:
        """Runs the example's main(argv); returns (exit status, the JSON report, what it printed)."""
        self.n += 1
        out = self.workdir / f"case{self.n}.out"
        report = self.workdir / f"case{self.n}.json"
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"argv": [*argv, "--json", str(report)], "out": str(out)}) + "\n")
        self.proc.stdin.flush()
        code = int(self._line())
        printed = out.read_text(errors="replace")
        rep = json.loads(report.read_text()) if report.exists() else {}
        return code, rep, printed

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


@dataclass
class Env:
    runner: WarmRunner
    prefill: DaemonProc
    decode: DaemonProc

    def shared(self) -> list[str]:
        return ["--prefill-socket", self.prefill.socket, "--decode-socket", self.decode.socket,
                "--prefill-address", self.prefill.peer_address]


@pytest.fixture(scope="module")
def pd_env() -> Iterator[Env]:
    workdir = Path(tempfile.mkdtemp(prefix="kvx-pdtf-"))  # short: Unix socket paths are capped
    runner = WarmRunner(workdir)
    # All three boot at once; on 2 cores that overlaps their imports with each other.
    pre = spawn_daemon(workdir, "pd-prefill", wait=False, pool="128MiB")
    dec = spawn_daemon(workdir, "pd-decode", wait=False, pool="128MiB")
    try:
        wait_ready(pre)
        wait_ready(dec)
        runner.wait_ready()
        yield Env(runner, pre, dec)
    finally:
        runner.close()
        for d in (pre, dec):
            d.stop()
        if not os.environ.get("KVX_KEEP_LOGS"):
            shutil.rmtree(workdir, ignore_errors=True)


def daemon_status(d: DaemonProc) -> engine_pb2.DaemonStatus:
    with grpc.insecure_channel(f"unix:{d.socket}") as ch:
        return engine_pb2_grpc.EngineStub(ch).GetStatus(engine_pb2.GetStatusRequest(), timeout=5)


def parts_bytes(rep: dict[str, Any], tp: int, page_size: int, kv_heads: int = KV_HEADS) -> int:
    """Bytes of every rank's part of every room of a report, for a TP group of ``tp`` ranks."""
    total = 0
    for r in rep["per_room"]:
        layout = KVLayout(LAYERS, kv_heads, HEAD_DIM, DTYPES[r["dtype"]], page_size)
        total += sum(part_bytes(layout, tp, rank, r["prompt_tokens"]) for rank in range(tp))
    return total


# Every TP pair CI must cover; the model family rotates so each family runs at least twice. Chunk
# and page sizes (prompt tokens, chunk tokens, page size) vary too: engines cut chunks by a token
# budget, so most cases have chunks that start and end mid-page (chunks smaller than a page, larger
# than one, and the 40/32 and 200/16), and one keeps them page-aligned.
CASES = [
    (1, 1, "llama", (40, 12, 8)),
    (2, 1, "qwen2", (40, 16, 8)),
    (1, 2, "mistral", (100, 40, 32)),
    (4, 2, "llama", (30, 5, 8)),
    (2, 4, "qwen2", (420, 200, 16)),
    (1, 4, "mistral", (45, 13, 4)),
]


@pytest.mark.parametrize(
    ("prefill_tp", "decode_tp", "arch", "chunking"), CASES,
    ids=[f"{p}to{d}-{a}-chunk{c[1]}-page{c[2]}" for p, d, a, c in CASES],
)
def test_tokens_identical_and_kv_bit_exact(
    pd_env: Env, prefill_tp: int, decode_tp: int, arch: str, chunking: tuple[int, int, int]
) -> None:
    prompt, chunk, page = chunking
    # 1->1 starts its own daemons (the example's default path); the others share the module's two.
    own = (prefill_tp, decode_tp) == (1, 1)
    code, rep, printed = pd_env.runner.run(
        *MODEL, "--prompt-tokens", str(prompt), "--chunk-tokens", str(chunk), "--page-size", str(page),
        "--arch", arch, "--prefill-tp", str(prefill_tp), "--decode-tp", str(decode_tp),
        "--dtype", "bfloat16,float32", *([] if own else pd_env.shared()),
    )
    assert code == 0, printed
    assert rep["errors"] == [], printed
    assert rep["ok"] is True
    assert rep["tokens_match"] is True and rep["first_mismatch"] is None
    assert rep["max_abs_kv_diff"] == 0 and rep["kv_bit_identical"] is True
    rooms = rep["per_room"]
    assert rep["rooms"] == len(rooms) == ROOMS * len(DTYPES)
    assert {r["dtype"] for r in rooms} == set(DTYPES)
    for r in rooms:
        assert len(r["tokens"]) == NEW_TOKENS and r["tokens"] == r["reference_tokens"], r
        assert r["chunks"] == -(-r["prompt_tokens"] // chunk)
    # The rooms really are several prompts of different lengths, some prefilled in several chunks.
    assert len({r["prompt_tokens"] for r in rooms}) >= ROOMS // 2
    assert max(r["chunks"] for r in rooms) >= 3
    if chunk % page:
        # Some chunk boundary of some room falls inside a page (the case under test).
        assert any(c * chunk % page for r in rooms for c in range(1, r["chunks"]))
    # Each decode rank got each of its heads once; each prefill rank (replicas too) gathered its own.
    assert rep["bytes_moved"] == parts_bytes(rep, decode_tp, page)
    assert rep["bytes_gathered"] == parts_bytes(rep, prefill_tp, page)
    assert "PASS" in printed and "tokens_match=True" in printed
    if not own:
        for d in (pd_env.prefill, pd_env.decode):
            st = daemon_status(d)
            assert st.slots_held == 0, f"{d.name} still holds {st.slots_held} slots"
            assert st.rooms_by_state.get("FAILED", 0) == 0


def test_layerwise_parts_from_forward_hooks(pd_env: Env) -> None:
    """--layerwise (issue #37): forward hooks send each layer group of a chunk as its own part while
    later layers compute; decode ranks scatter each landed group; tokens and every byte as the
    reference's. 4 KV heads at 4->2 so a decode rank's slot holds 2 heads: its group-major layout
    differs from the whole-chunk one (with one head they agree), and groups of 3 of the 4 layers
    leave a short last group."""
    kv_heads, group, page = 4, 3, 8
    code, rep, printed = pd_env.runner.run(
        *MODEL, "--kv-heads", str(kv_heads), "--rooms", "3", "--prompt-tokens", "30", "--chunk-tokens", "12",
        "--page-size", str(page), "--prefill-tp", "4", "--decode-tp", "2", "--dtype", "bfloat16",
        "--layerwise", "--layer-group", str(group), *pd_env.shared(),
    )
    assert code == 0, printed
    assert rep["errors"] == [], printed
    assert rep["ok"] is True and rep["tokens_match"] is True
    assert rep["max_abs_kv_diff"] == 0 and rep["kv_bit_identical"] is True
    rooms = rep["per_room"]
    assert len(rooms) == rep["rooms"] == 3
    for r in rooms:
        assert r["mode"] == "layerwise"
        assert len(r["tokens"]) == NEW_TOKENS and r["tokens"] == r["reference_tokens"], r
    groups = -(-LAYERS // group)
    chunks = sum(r["chunks"] for r in rooms)
    assert chunks > len(rooms)  # some room went in several chunks
    # Every prefill rank (replicas too) sent every group of every chunk from its own hook (on CPU a
    # group is sent as its layer ends: no two ready together), and each decode rank copied each once.
    assert rep["layer_groups_sent"] == rep["layer_parts_sent"] == 4 * chunks * groups
    assert rep["groups_scattered"] == 2 * chunks * groups
    assert rep["bytes_moved"] == parts_bytes(rep, 2, page, kv_heads)
    assert rep["bytes_gathered"] == parts_bytes(rep, 4, page, kv_heads)
    for d in (pd_env.prefill, pd_env.decode):
        st = daemon_status(d)
        assert st.slots_held == 0, f"{d.name} still holds {st.slots_held} slots"
        assert st.rooms_by_state.get("FAILED", 0) == 0


def test_wrong_head_mapping_fails_the_check(pd_env: Env) -> None:
    """The check can fail: a decode rank scattering its two heads swapped is caught."""
    code, rep, printed = pd_env.runner.run(
        *MODEL, *DEFAULT_CHUNKING, "--prefill-tp", "1", "--decode-tp", "1", "--dtype", "float32",
        "--fault", "swap-heads",
        *pd_env.shared(),
    )
    assert code == 1, printed
    assert rep["errors"] == [], printed  # the transfer itself went fine; the KV is wrong
    assert rep["ok"] is False
    assert rep["kv_bit_identical"] is False and rep["max_abs_kv_diff"] > 0
    assert not any(r["kv_bit_identical"] for r in rep["per_room"])
    # The first token comes from the prefill engine; every later one attends with the swapped KV.
    assert rep["tokens_match"] is False
    assert rep["first_mismatch"]["position"] >= 1
    assert "FAIL" in printed


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--chunk-tokens", "0"], "must be at least 1"),
        (["--decode-tp", "4", "--fault", "swap-heads"], "at least two KV heads"),
        (["--kv-heads", "4", "--prefill-tp", "3"], "cannot be split evenly"),
        (["--prefill-socket", "/nowhere.sock"], "go together"),
    ],
)
def test_bad_flags_are_refused(pd_env: Env, argv: list[str], message: str) -> None:
    code, _, printed = pd_env.runner.run(*MODEL, *DEFAULT_CHUNKING, *argv)
    assert code == 2
    assert message in printed
