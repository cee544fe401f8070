#!/usr/bin/env python3
"""Real vLLM engines, disaggregated over two kvxferd daemons: greedy tokens identical to one engine.

One command: ``python examples/pd_vllm.py`` (after ``make install-test``, which installs vLLM's CPU
build). It writes a tiny Llama (random weights, a word-level tokenizer: ``examples/tiny_llama.py``),
starts two daemons (temp sockets, peer port 0) and three vLLM engines, each an offline ``LLM`` in
its own process:

* ``reference``: no KV connector; generates ``--new-tokens`` greedily for every prompt;
* ``prefill``: ``KvxferdConnector`` on the prefill daemon; each prompt with ``max_tokens=1`` and
  ``kv_transfer_params={"do_remote_decode": true}``, as a PD proxy sends it; chunked prefill
  (``--max-batched-tokens``) sends each prompt's KV in several chunks;
* ``decode``: ``KvxferdConnector`` on the decode daemon; each prompt with the ``kv_transfer_params``
  the prefill output carries.

Exit status 0 only when every prompt's decode tokens equal the reference's, every decode request
loaded its whole prompt's KV through kvxferd, and the swap check passes (two prompts of one length
decoded with each other's rooms do not give their own tokens: the KV received is what the decode
continues from). ``--fault kill-prefill-daemon`` then also stops the prefill daemon before the
decode engine asks for the KV and kills it while the decode engine waits for it: every request
must end with vLLM's error finish reason (no hang), and the decode engine must still serve a plain
request afterwards. Exit status 1: a check failed; 2: the run itself failed.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import secrets
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from examples.pd_transformers import OwnDaemons  # noqa: E402
from examples.tiny_llama import PROMPTS, build  # noqa: E402

ENGINE_START_S = 240.0


def engine_env() -> None:
    # The engine core in the engine's own process (no extra process on a small machine), a small
    # CPU KV cache, and no hub access ever.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


def engine_main(role: str, model: str, socket: str, block_size: int, max_batched: int, cmds: Any, out: Any,
                extra: dict[str, Any] | None = None, log: str = "") -> None:
    """One vLLM engine; runs ("generate", prompts, params, max_tokens) commands until None."""
    try:
        if log:
            # vLLM logs hundreds of lines per engine start: into the engine's own file, so the
            # report is what the terminal shows.
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.close(fd)
        engine_env()
        from vllm import LLM, SamplingParams
        from vllm.config import KVTransferConfig

        kw: dict[str, Any] = {}
        if role != "reference":
            kw["kv_transfer_config"] = KVTransferConfig(
                kv_connector="KvxferdConnector", kv_connector_module_path="kvxfer_client.vllm", kv_role="kv_both",
                kv_connector_extra_config={"socket": socket, "group": f"pd-{role}", "ring_bytes": 16 << 20,
                                           **(extra or {})},
            )
        t0 = time.monotonic()
        llm = LLM(model=model, dtype="float32", max_model_len=1024, enforce_eager=True, seed=0,
                  block_size=block_size, max_num_batched_tokens=max_batched, enable_prefix_caching=False,
                  **kw)
        out.put(("ready", role, time.monotonic() - t0))
        while True:
            cmd = cmds.get()
            if cmd is None:
                break
            _, prompts, params, max_tokens = cmd
            sps = [SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                  extra_args={"kv_transfer_params": p} if p else None) for p in params]
            t = time.monotonic()
            res = llm.generate(list(prompts), sps, use_tqdm=False)
            out.put(("result", role, {"wall_s": time.monotonic() - t, "outputs": [{
                "prompt_tokens": len(r.prompt_token_ids or ()), "tokens": list(r.outputs[0].token_ids),
                "finish_reason": r.outputs[0].finish_reason, "kv_transfer_params": r.kv_transfer_params,
            } for r in res]}))
    except BaseException:
        out.put(("error", role, traceback.format_exc()))


class Engine:
    def __init__(self, ctx: Any, role: str, model: str, socket: str, args: argparse.Namespace) -> None:
        self.role = role
        self.cmds: Any = ctx.Queue()
        self.out: Any = ctx.Queue()
        logs = getattr(args, "engine_logs", None)
        self.log = str(Path(logs) / f"{role}.log") if logs else ""
        self.proc = ctx.Process(target=engine_main, name=f"vllm-{role}", daemon=True, args=(
            role, model, socket, args.block_size, args.max_batched_tokens, self.cmds, self.out,
            getattr(args, "extra_config", None), self.log))
        self.proc.start()

    def wait(self, kind: str, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            try:
                got = self.out.get(timeout=1.0)
            except queue.Empty:
                if not self.proc.is_alive():
                    raise RuntimeError(f"{self.role} engine exited with {self.proc.exitcode}") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.role} engine: no {kind} in {timeout} s") from None
                continue
            if got[0] == "error":
                where = f" (its log: {self.log})" if self.log else ""
                raise RuntimeError(f"{self.role} engine failed{where}:\n{got[2]}")
            if got[0] == kind:
                return got[2]

    def generate(self, prompts: list[str], params: list[dict[str, Any] | None], max_tokens: int,
                 timeout: float) -> dict[str, Any]:
        self.cmds.put(("generate", prompts, params, max_tokens))
        return self.wait("result", timeout)  # type: ignore[no-any-return]

    def close(self) -> None:
        if self.proc.is_alive():
            self.cmds.put(None)
            self.proc.join(20)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


def run(args: argparse.Namespace) -> dict[str, Any]:
    prompts = list(PROMPTS)
    workdir = Path(tempfile.mkdtemp(prefix="kvx-vllm-"))
    if args.engine_logs is None:
        args.engine_logs = workdir / "logs"
    Path(args.engine_logs).mkdir(parents=True, exist_ok=True)
    print(f"engine logs: {args.engine_logs}/{{reference,prefill,decode}}.log", file=sys.stderr, flush=True)
    model = str(build(workdir / "model"))
    daemons = OwnDaemons()
    ctx = mp.get_context("spawn")  # vLLM and torch threads do not survive a fork
    engines: dict[str, Engine] = {}
    try:
        daemons.wait_ready()
        sockets = {"prefill": str(daemons.dir / "prefill.sock"), "decode": str(daemons.dir / "decode.sock"),
                   "reference": ""}
        for role in ("reference", "prefill", "decode"):
            engines[role] = Engine(ctx, role, model, sockets[role], args)
        starts = {role: e.wait("ready", args.engine_start_s) for role, e in engines.items()}
        n = args.new_tokens
        ref = engines["reference"].generate(prompts, [None] * len(prompts), n, args.timeout)
        engines["reference"].close()
        pre = engines["prefill"].generate(prompts, [{"do_remote_decode": True}] * len(prompts), 1, args.timeout)
        params = [o["kv_transfer_params"] for o in pre["outputs"]]
        if any(not p for p in params):
            raise RuntimeError(f"prefill returned no kv_transfer_params: {params}")
        report: dict[str, Any] = {"engine_start_s": starts, "prefill_wall_s": pre["wall_s"]}
        dec = engines["decode"].generate(prompts, params, n, args.timeout)
        per = []
        for i, (r, d, p) in enumerate(zip(ref["outputs"], dec["outputs"], params, strict=True)):
            dp = d["kv_transfer_params"] or {}
            loaded = dp.get("kvxfer_loaded_tokens")
            per.append({"prompt": i, "prompt_tokens": r["prompt_tokens"], "reference": r["tokens"],
                        "pd": d["tokens"], "match": r["tokens"] == d["tokens"], "finish_reason": d["finish_reason"],
                        "prefill_block_hold_ms": p.get("kvxfer_prefill_block_hold_ms"), "loaded_tokens": loaded,
                        "decode_load_ms": dp.get("kvxfer_load_ms")})
        report.update(per_prompt=per, tokens_match=all(x["match"] for x in per), decode_wall_s=dec["wall_s"],
                      all_loaded=all(x["loaded_tokens"] == x["prompt_tokens"] for x in per),
                      block_size=args.block_size, max_batched_tokens=args.max_batched_tokens)
        report["swap_check"] = swap_check(args, engines, prompts, ref["outputs"])
        report["layerwise"] = layerwise_run(args, engines, prompts, ref["outputs"], params[0])
        report["ok"] = (report["tokens_match"] and report["all_loaded"] and report["swap_check"]["kv_used"]
                        and report["layerwise"]["match"] and report["layerwise"]["all_loaded"])
        if args.fault == "kill-prefill-daemon":
            again = engines["prefill"].generate(prompts, [{"do_remote_decode": True}] * len(prompts), 1, args.timeout)
            fault = fault_run(args, daemons, engines["decode"], prompts, [o["kv_transfer_params"] for o in again["outputs"]], n)
            report["fault"] = fault
            report["ok"] = report["ok"] and fault["all_failed_cleanly"] and bool(fault["served_after"])
        return report
    finally:
        for e in engines.values():
            e.close()
        daemons.close()


def swap_check(args: argparse.Namespace, engines: dict[str, Engine], prompts: list[str],
               ref: list[dict[str, Any]]) -> dict[str, Any]:
    """Two prompts of one length decoded with each other's rooms must NOT give their own tokens:
    the decode engine really continues from the KV it received, it does not recompute the prompt."""
    a, b = 1, len(prompts) - 1
    if ref[a]["prompt_tokens"] != ref[b]["prompt_tokens"]:
        raise RuntimeError("the swap check needs prompts 1 and -1 of one length")
    pre = engines["prefill"].generate([prompts[a], prompts[b]], [{"do_remote_decode": True}] * 2, 1, args.timeout)
    pa, pb = (o["kv_transfer_params"] for o in pre["outputs"])
    dec = engines["decode"].generate([prompts[a], prompts[b]], [pb, pa], args.new_tokens, args.timeout)
    got = [o["tokens"] for o in dec["outputs"]]
    # Loads between daemons that already know each other (the first batch also pays the peer handshake).
    load_ms = [(o["kv_transfer_params"] or {}).get("kvxfer_load_ms") for o in dec["outputs"]]
    return {"prompts": [a, b], "tokens": got, "kv_used": got[0] != ref[a]["tokens"] and got[1] != ref[b]["tokens"],
            "decode_load_ms": load_ms, "prefill_block_hold_ms": [p.get("kvxfer_prefill_block_hold_ms") for p in (pa, pb)]}


def layerwise_run(args: argparse.Namespace, engines: dict[str, Engine], prompts: list[str],
                  ref: list[dict[str, Any]], seen: dict[str, Any]) -> dict[str, Any]:
    """Layer-wise streaming as ``proxy --concurrent`` drives it: room ids drawn here, the decode
    engine asked first (it expects each room while the prefill computes), the prefill sending a
    part per layer (layer_group 1) from the forward's hooks. Tokens must equal the reference's."""
    rooms = [secrets.randbits(62) for _ in prompts]
    where = {"kvxfer_prefill_address": seen["kvxfer_prefill_address"],
             "kvxfer_prefill_group": seen["kvxfer_prefill_group"]}
    dec_params = [{"do_remote_prefill": True, "kvxfer_room": r, **where} for r in rooms]
    pre_params = [{"do_remote_decode": True, "kvxfer_room": r, "kvxfer_layerwise": True, "kvxfer_layer_group": 1}
                  for r in rooms]
    engines["decode"].cmds.put(("generate", prompts, dec_params, args.new_tokens))
    pre = engines["prefill"].generate(prompts, pre_params, 1, args.timeout)
    dec = engines["decode"].wait("result", args.timeout)
    got = [o["tokens"] for o in dec["outputs"]]
    loaded = [(o["kv_transfer_params"] or {}).get("kvxfer_loaded_tokens") for o in dec["outputs"]]
    return {"tokens": got, "match": got == [r["tokens"] for r in ref], "loaded_tokens": loaded,
            "all_loaded": loaded == [r["prompt_tokens"] for r in ref],
            "prefill_failed": [(o["kv_transfer_params"] or {}).get("kvxfer_prefill_failed") for o in pre["outputs"]]}


def fault_run(args: argparse.Namespace, daemons: OwnDaemons, decode: Engine, prompts: list[str],
              params: list[dict[str, Any]], n: int) -> dict[str, Any]:
    """The prefill daemon is stopped, the decode engine asks for the KV, then the daemon is killed."""
    victim = daemons.procs["prefill"]
    victim.send_signal(signal.SIGSTOP)
    t0 = time.monotonic()
    decode.cmds.put(("generate", prompts, params, n))
    time.sleep(args.kill_after_s)
    victim.kill()
    victim.wait(10)
    got = decode.wait("result", args.timeout)
    failed_s = time.monotonic() - t0
    # The engine must still serve: a plain request after the failed ones.
    after = decode.generate(prompts[:1], [None], 2, args.timeout)
    reasons = [o["finish_reason"] for o in got["outputs"]]
    return {"finish_reasons": reasons, "all_failed_cleanly": all(r == "error" for r in reasons),
            "seconds_to_fail": round(failed_s, 2), "served_after": after["outputs"][0]["tokens"]}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    ap.add_argument("--new-tokens", type=int, default=12)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--max-batched-tokens", type=int, default=64, help="vLLM's chunked prefill budget per step")
    ap.add_argument("--timeout", type=float, default=180.0)
    ap.add_argument("--engine-start-s", type=float, default=ENGINE_START_S,
                    help="how long the three engines may take to start (a loaded machine needs more)")
    ap.add_argument("--fault", choices=("none", "kill-prefill-daemon"), default="none")
    ap.add_argument("--kill-after-s", type=float, default=1.0)
    ap.add_argument("--json", type=Path, help="write the report here too")
    ap.add_argument("--engine-logs", type=Path, help="directory for each engine's log (default: a new temp dir, "
                                                     "printed at start)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        rep = run(args)
    except Exception:
        traceback.print_exc()
        return 2
    text = json.dumps(rep, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text)
    ok = bool(rep.get("ok"))
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
