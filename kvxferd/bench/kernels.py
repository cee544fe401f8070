"""``kvxferd bench kernels``: gather/scatter against plain copies of the same bytes.

Headline comparisons, each a ratio of bandwidths (1.0 = as fast as the copy):

* gather into pinned host memory vs a D2H ``cudaMemcpyAsync`` (host-pool path, prefill side),
* scatter from pinned host memory vs an H2D copy (host-pool path, decode side),
* gather into a GPU staging ring vs a device-to-device copy (GPU-ring path).

Host ops run as shipped (:class:`~kvxfer_client.kernels.KVPages` with its default
staging buffer); the ``*_direct`` rows show the kernel driving PCIe itself
(``staging_bytes=0``) and ``ring_scatter`` the decode side of the GPU-ring path,
for reference.

Sweep: a 70B-class layout (80 layers, 8 KV heads, head dim 128), page size 16/64,
bf16/fp8, 4k/16k tokens (1.3 / 5.4 GB per bf16 slot), contiguous/shuffled pages. The
worst ratio of each headline kind over the sweep goes to the top-level ``ratios``,
with the case it came from in ``worst``. ``--budget-s`` (default 180) bounds the
run: cases left when it is spent are listed in ``skipped``, never silently dropped.

Timing: one untimed launch primes the stream, then CUDA events bracket ``inner``
launches, so host-side launch cost overlaps GPU work as it does in an engine;
the median over repeats is reported.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvxfer_client.kernels import KVPages, TileConfig, slot_nbytes
from kvxferd.bench._common import write_json

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Shape:
    layers: int
    kv_heads: int
    head_dim: int
    tokens: tuple[int, ...]
    page_sizes: tuple[int, ...]


# 16k tokens rather than 32k: the ratios are flat past a few GB per copy, and at 32k the buffers
# alone (3 x 10.7 GB, one of them pinned) took minutes to allocate and fill on an H100.
SHAPE_70B = Shape(layers=80, kv_heads=8, head_dim=128, tokens=(4096, 16384), page_sizes=(16, 64))
# --tiny: runs anywhere (CPU + TRITON_INTERPRET) so the harness itself is tested in CI.
SHAPE_TINY = Shape(layers=2, kv_heads=2, head_dim=16, tokens=(37,), page_sizes=(16,))
TARGETS = {"gather_over_d2h": 0.98, "scatter_over_h2d": 0.98, "ring_gather_over_d2d": 0.85}
RATIO_OPS = {"gather_over_d2h": "gather_d2h", "scatter_over_h2d": "scatter_h2d", "ring_gather_over_d2d": "ring_gather"}
EXTRA_RATIO_OPS = {
    "direct_gather_over_d2h": "gather_d2h_direct",
    "direct_scatter_over_h2d": "scatter_h2d_direct",
    "ring_scatter_over_d2d": "ring_scatter",
}
# op -> baseline copy it is compared with
OPS = {
    "gather_d2h": "d2h",
    "scatter_h2d": "h2d",
    "ring_gather": "d2d",
    "gather_d2h_direct": "d2h",
    "scatter_h2d_direct": "h2d",
    "ring_scatter": "d2d",
}
DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
TILE_CANDIDATES = [
    TileConfig(target_tile_bytes=8192, lp_per_prog=1, num_warps=4),
    TileConfig(target_tile_bytes=16384, lp_per_prog=1, num_warps=4),
    TileConfig(target_tile_bytes=16384, lp_per_prog=4, num_warps=4),
    TileConfig(target_tile_bytes=32768, lp_per_prog=2, num_warps=8),
    TileConfig(target_tile_bytes=32768, lp_per_prog=4, num_warps=4),
    TileConfig(target_tile_bytes=65536, lp_per_prog=2, num_warps=8),
]


@dataclass(frozen=True)
class Case:
    dtype: str
    page_size: int
    tokens: int
    order: str  # contiguous | shuffled


@dataclass
class Row:
    op: str
    dtype: str
    page_size: int
    tokens: int
    order: str
    bytes: int
    ms: float
    gbps: float
    baseline: str
    baseline_ms: float
    baseline_gbps: float
    ratio: float
    samples_ms: list[float] = field(default_factory=list)


class _Timer:
    """CUDA events on a GPU; a host clock around synchronous CPU work otherwise."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def time(self, fn: Callable[[], object], repeats: int, inner: int) -> list[float]:
        fn()  # warm-up: compiles, allocates staging, uploads tables
        self.sync()
        out: list[float] = []
        for _ in range(repeats):
            if self.cuda:
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                fn()  # keeps the GPU busy while the timed launches are being issued
                start.record()
                for _ in range(inner):
                    fn()
                end.record()
                end.synchronize()
                out.append(start.elapsed_time(end) / inner)
            else:
                t0 = time.perf_counter()
                for _ in range(inner):
                    fn()
                out.append((time.perf_counter() - t0) * 1e3 / inner)
        return out


class _Buffers:
    """Big buffers allocated once: (pinned) host slot, device ring, device scratch."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        t0 = time.perf_counter()
        pin = device.type == "cuda"
        self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        self.ring = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.scratch = torch.empty(nbytes, dtype=torch.uint8, device=device)
        # Random bytes: never time or verify on zeros.
        self.ring.random_()
        self.scratch.random_()
        self.host.copy_(self.ring)
        logger.info("allocated 3 x %.2f GB in %.1f s", nbytes / 1e9, time.perf_counter() - t0)


class _KV:
    def __init__(self, case: Case, shape: Shape, device: torch.device) -> None:
        dtype = DTYPES[case.dtype]
        self.case = case
        self.num_pages = -(-case.tokens // case.page_size)
        slots = self.num_pages * case.page_size
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        for _ in range(shape.layers):
            for dst in (self.k, self.v):
                raw = torch.empty(
                    (slots, shape.kv_heads, shape.head_dim * dtype.itemsize), dtype=torch.uint8, device=device
                )
                raw.random_()
                dst.append(raw.view(dtype))
        if case.order == "contiguous":
            self.page_ids = torch.arange(self.num_pages, dtype=torch.int32, device=device)
        else:
            gen = torch.Generator().manual_seed(case.tokens + case.page_size)
            self.page_ids = torch.randperm(self.num_pages, generator=gen).to(torch.int32).to(device)
        self.nbytes = slot_nbytes(shape.kv_heads, shape.layers, 2, case.tokens, shape.head_dim, dtype)
        self.device = device
        self.staged = KVPages(self.k, self.v)
        self.direct = KVPages(self.k, self.v, staging_bytes=0)

    def gather(self, out: torch.Tensor, tile: TileConfig | None, direct: bool = False) -> None:
        c = self.case
        (self.direct if direct else self.staged).gather(
            self.page_ids, c.tokens, c.page_size, out[: self.nbytes], tile=tile
        )

    def scatter(self, src: torch.Tensor, tile: TileConfig | None, direct: bool = False) -> None:
        c = self.case
        (self.direct if direct else self.staged).scatter(
            self.page_ids, c.tokens, c.page_size, src[: self.nbytes], tile=tile
        )


def _verify_gather(kv: _KV, shape: Shape, slot: torch.Tensor) -> None:
    """Check first and last layer of a gathered slot against plain indexing."""
    case = kv.case
    dtype = DTYPES[case.dtype]
    view = slot[: kv.nbytes].view(dtype).view(shape.kv_heads, shape.layers, 2, case.tokens, shape.head_dim)
    tok = torch.arange(case.tokens, device=kv.device)
    slots = kv.page_ids.long()[tok // case.page_size] * case.page_size + tok % case.page_size
    for layer in sorted({0, shape.layers - 1}):
        for plane, src in enumerate((kv.k, kv.v)):
            want = src[layer].view(torch.uint8)[slots].transpose(0, 1)
            got = view[:, layer, plane].to(kv.device).contiguous().view(torch.uint8)
            if not torch.equal(got, want):
                raise AssertionError(f"gather mismatch at layer {layer} plane {plane} for {case}")


def _poison(t: torch.Tensor) -> None:
    t.random_()


def _check_path(kv: _KV, shape: Shape, target: torch.Tensor, run: Callable[[], None]) -> None:
    _poison(target[: kv.nbytes])  # so a path that writes nothing cannot pass on stale bytes
    run()
    if kv.device.type == "cuda":
        torch.cuda.synchronize()
    _verify_gather(kv, shape, target)


def _tune_tiles(
    bufs: _Buffers, kv: _KV, timer: _Timer, repeats: int, inner: int
) -> tuple[dict[str, TileConfig], list[dict[str, Any]]]:
    """Pick the fastest launch shape per direction for device slots (ring and staged paths)."""
    ops: dict[str, Callable[[TileConfig], None]] = {
        "ring_gather": lambda t: kv.gather(bufs.ring, t),
        "ring_scatter": lambda t: kv.scatter(bufs.ring, t),
    }
    best: dict[str, TileConfig] = {}
    log: list[dict[str, Any]] = []
    for op, fn in ops.items():
        timings: list[tuple[float, TileConfig]] = []
        for tile in TILE_CANDIDATES:
            ms = statistics.median(timer.time(functools.partial(fn, tile), repeats, inner))
            timings.append((ms, tile))
            log.append({"op": op, "tile": asdict(tile), "ms": ms})
        best[op] = min(timings, key=lambda x: x[0])[1]
    return best, log


def _cases(shape: Shape, quick: bool) -> list[Case]:
    tokens = shape.tokens[:1] if quick else shape.tokens
    return [
        Case(dtype=d, page_size=p, tokens=t, order=o)
        for d in DTYPES
        for t in tokens
        for p in shape.page_sizes
        for o in ("contiguous", "shuffled")
    ]


def run(
    shape: Shape,
    quick: bool,
    repeats: int,
    inner: int,
    tune: bool,
    device: torch.device,
    budget_s: float = float("inf"),
) -> dict[str, Any]:
    started = time.monotonic()
    timer = _Timer(device)
    cases = _cases(shape, quick)
    max_bytes = max(
        slot_nbytes(shape.kv_heads, shape.layers, 2, c.tokens, shape.head_dim, DTYPES[c.dtype]) for c in cases
    )
    bufs = _Buffers(max_bytes, device)
    tiles: dict[str, TileConfig] = {}
    tile_log: list[dict[str, Any]] = []
    if tune:
        # The largest case this run has buffers for (--quick sizes them for its short cases only).
        probe = Case(dtype="bf16", page_size=shape.page_sizes[0], tokens=max(c.tokens for c in cases), order="shuffled")
        kv = _KV(probe, shape, device)
        tiles, tile_log = _tune_tiles(bufs, kv, timer, repeats=max(1, repeats // 2), inner=inner)
        del kv
    baselines: dict[tuple[str, int], list[float]] = {}

    def baseline(kind: str, nbytes: int) -> list[float]:
        if (kind, nbytes) not in baselines:
            host, ring, scratch = bufs.host[:nbytes], bufs.ring[:nbytes], bufs.scratch[:nbytes]
            copies: dict[str, Callable[[], object]] = {
                "d2h": lambda: host.copy_(ring, non_blocking=True),
                "h2d": lambda: ring.copy_(host, non_blocking=True),
                "d2d": lambda: scratch.copy_(ring),
            }
            baselines[(kind, nbytes)] = timer.time(copies[kind], repeats, inner)
        return baselines[(kind, nbytes)]

    rows: list[Row] = []
    skipped: list[dict[str, Any]] = []
    tg, ts = tiles.get("ring_gather"), tiles.get("ring_scatter")
    for case in cases:
        if rows and time.monotonic() - started > budget_s:
            skipped.append(asdict(case))
            continue
        kv = _KV(case, shape, device)
        fns: dict[str, Callable[[], None]] = {
            "gather_d2h": functools.partial(kv.gather, bufs.host, tg),
            "scatter_h2d": functools.partial(kv.scatter, bufs.host, ts),
            "ring_gather": functools.partial(kv.gather, bufs.ring, tg),
            "gather_d2h_direct": functools.partial(kv.gather, bufs.host, None, True),
            "scatter_h2d_direct": functools.partial(kv.scatter, bufs.host, None, True),
            "ring_scatter": functools.partial(kv.scatter, bufs.ring, ts),
        }
        for op in ("gather_d2h", "gather_d2h_direct", "ring_gather"):
            target = bufs.ring if op == "ring_gather" else bufs.host
            _check_path(kv, shape, target, fns[op])
        for op, base_kind in OPS.items():
            samples = timer.time(fns[op], repeats, inner)
            base = baseline(base_kind, kv.nbytes)
            ms, base_ms = statistics.median(samples), statistics.median(base)
            rows.append(
                Row(
                    op=op,
                    dtype=case.dtype,
                    page_size=case.page_size,
                    tokens=case.tokens,
                    order=case.order,
                    bytes=kv.nbytes,
                    ms=ms,
                    gbps=kv.nbytes / ms / 1e6,
                    baseline=base_kind,
                    baseline_ms=base_ms,
                    baseline_gbps=kv.nbytes / base_ms / 1e6,
                    ratio=base_ms / ms,
                    samples_ms=samples,
                )
            )
            logger.info("%s %s: %.3f ms, ratio %.3f", op, case, ms, base_ms / ms)
        del kv, fns
        if device.type == "cuda":
            torch.cuda.empty_cache()

    def worst_row(op: str) -> Row:
        return min((r for r in rows if r.op == op), key=lambda r: r.ratio)

    def worst(op: str) -> float:
        return worst_row(op).ratio

    if skipped:
        logger.warning("budget of %.0f s spent: %d of %d cases skipped", budget_s, len(skipped), len(cases))
    ratios = {name: worst(op) for name, op in RATIO_OPS.items()}
    worst_cases = {
        name: {k: v for k, v in asdict(worst_row(op)).items() if k != "samples_ms"}
        for name, op in {**RATIO_OPS, **EXTRA_RATIO_OPS}.items()
    }
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "triton": _triton_version(),
        "python": platform.python_version(),
        "layout": {"layers": shape.layers, "kv_heads": shape.kv_heads, "head_dim": shape.head_dim},
        "quick": quick,
        "repeats": repeats,
        "inner": inner,
        "ratios": ratios,
        "extra_ratios": {name: worst(op) for name, op in EXTRA_RATIO_OPS.items()},
        "targets": TARGETS,
        "meets_targets": {k: ratios[k] >= TARGETS[k] for k in TARGETS},
        "worst": worst_cases,
        "skipped": skipped,
        "wall_s": round(time.monotonic() - started, 1),
        "tiles": {k: asdict(v) for k, v in tiles.items()},
        "tile_sweep": tile_log,
        "rows": [asdict(r) for r in rows],
    }


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return str(triton.__version__)


def _print(result: dict[str, Any]) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # rich is a dependency, but a bare box must still print something
        print(json.dumps(result["ratios"], indent=2))
        return
    table = Table(title=f"kernels on {result['device']}")
    for col in ("op", "dtype", "page", "tokens", "order", "GB", "ms", "GB/s", "base GB/s", "ratio"):
        table.add_column(col, justify="left" if col in ("op", "dtype", "order") else "right")
    for r in result["rows"]:
        table.add_row(
            r["op"],
            r["dtype"],
            str(r["page_size"]),
            str(r["tokens"]),
            r["order"],
            f"{r['bytes'] / 1e9:.2f}",
            f"{r['ms']:.3f}",
            f"{r['gbps']:.1f}",
            f"{r['baseline_gbps']:.1f}",
            f"{r['ratio']:.3f}",
        )
    console = Console(width=140)
    console.print(table)
    summary = Table(title="worst case over the sweep")
    for col in ("ratio", "value", "target", "ok"):
        summary.add_column(col)
    summary.add_column("case")

    def where(name: str) -> str:
        w = result["worst"][name]
        return f"{w['dtype']} page {w['page_size']} {w['tokens']} tok {w['order']}"

    for k, v in result["ratios"].items():
        ok = "yes" if result["meets_targets"][k] else "NO"
        summary.add_row(k, f"{v:.3f}", f"{result['targets'][k]:.2f}", ok, where(k))
    for k, v in result["extra_ratios"].items():
        summary.add_row(k, f"{v:.3f}", "-", "-", where(k))
    console.print(summary)
    if result["skipped"]:
        console.print(f"{len(result['skipped'])} cases skipped: the --budget-s was spent")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvxferd bench kernels", description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--json", type=Path, required=True, help="write results here")
    parser.add_argument("--quick", action="store_true", help="shortest token count only, fewer repeats")
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats per op (median reported)")
    parser.add_argument("--inner", type=int, default=1, help="launches per timed repeat")
    parser.add_argument("--no-tune", action="store_true", help="use the built-in tile defaults")
    parser.add_argument("--tiny", action="store_true", help="toy layout that runs on CPU (harness self-test)")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=180.0,
        help="stop starting new cases after this many seconds (skipped cases are listed)",
    )
    args = parser.parse_args(list(argv) if argv is not None else None)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if torch.cuda.is_available():
        device = torch.device("cuda")
    elif args.tiny:
        device = torch.device("cpu")
    else:
        print("kvxferd bench kernels needs a CUDA GPU (or --tiny for a CPU self-test)", file=sys.stderr)
        return 2
    repeats = args.repeats or (3 if args.quick else 5)
    shape = SHAPE_TINY if args.tiny else SHAPE_70B
    result = run(
        shape,
        quick=args.quick,
        repeats=repeats,
        inner=args.inner,
        tune=not args.no_tune,
        device=device,
        budget_s=args.budget_s,
    )
    write_json(args.json, result)  # with commit, machine and command
    _print(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
