"""Where a retrieval decode step's page choice goes: its kernels alone at the 8B shapes.

    python benchmarks/gpu_retrieval_kernels.py [--pages 2048] [--slots 64] [--miss 0.81]
        [--summary mean,minmax] [--out DIR]        # repo root, a CUDA machine

The retrieval tier (engine/retrieval.py) at Llama-3-8B's shapes (32 layers x 8 KV heads,
32 query heads, head size 128, 16-token pages), `--pages` offloaded pages (2,048 = 32K tokens)
and `--slots` page-cache slots per (layer, KV head) (64 = 1,024 retrieval tokens):
1. the copy of the missing pages (a `--miss` share of the slots) from the offload store in
   mapped host memory into the slots (`_fill_page_slots`, num_warps 1, 2, 4, 8: the product
   uses 2), against a DMA copy of the same bytes from pinned memory (the host link's peer);
2. a decode step's choice over every layer at once: the ranged scoring (`_ranged_mass`),
   top-k, the placement (`_place_pages`);
3. a prefill chunk's scoring for one layer (`score_top_pages`) at 1,024 / 512 / 256 / 128
   queries against 1,024 and 2,048 pages.
The scorings are timed for each `--summary` kind (mean, the default, and minmax); then
4. the prefill scoring's tile shapes and warps (the first kind, 1,024 queries, 2,048 pages).
Prints one line a measurement and writes DIR/gpu_retrieval_kernels.json (DIR: --out, else $OUT,
else ./out). Random data: these kernels' times do not depend on the values.
BENCHMARKS.md, "the retrieval tier vs eviction-only", quotes it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

L, HQ, H, D, BS = 32, 32, 8, 128, 16  # Llama-3-8B's attention shapes, the profiles' page size


def bench(fn, reps: int = 20) -> float:
    """Mean ms of fn() over reps calls (after one warm-up), timed by CUDA events."""
    import torch

    fn()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(reps):
        fn()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pages", type=int, default=2048, help="offloaded pages (2,048 = 32K tokens)")
    ap.add_argument("--slots", type=int, default=64,
                    help="page-cache slots per layer and KV head (= pages retrieved)")
    ap.add_argument("--miss", type=float, default=0.81,
                    help="share of the slots copied (0.81: the random-weight decode's misses)")
    ap.add_argument("--summary", default="mean,minmax",
                    help="page summaries whose scoring is timed (comma list; mean: the default)")
    ap.add_argument("--out", default=None, help="folder for the JSON (else $OUT, else ./out)")
    a = ap.parse_args()
    kinds = a.summary.split(",")
    import torch

    if not torch.cuda.is_available():
        sys.exit("gpu_retrieval_kernels.py needs a CUDA GPU")
    from hisparse_cli.engine.retrieval import _host_store
    from hisparse_cli.kernels.attention import page_cache_triton as pc
    from hisparse_cli.kernels.attention import page_score_triton as ps
    from hisparse_cli.kernels.attention.page_score_ref import page_summary, top_valid_pages

    dev = torch.device("cuda")
    P, S = a.pages, a.slots
    heads = L * H
    res: dict = {"command": " ".join([Path(sys.executable).name] + sys.argv),
                 "device": torch.cuda.get_device_name(dev), "torch": torch.__version__,
                 "pages": P, "slots": S, "miss": a.miss}
    print(f"{res['device']}: {L} layers x {H} KV heads, {P} pages, {S} slots, "
          f"{a.miss:.0%} misses", flush=True)

    # 1. the copy of the missing pages from the mapped host store, and a DMA copy beside it
    t0 = time.time()
    store_k = _host_store((P, L, H, BS, D), torch.float16, True)
    store_v = _host_store((P, L, H, BS, D), torch.float16, True)
    print(f"store alloc {time.time() - t0:.1f}s", flush=True)
    sk = torch.zeros((L, H, S * BS, D), dtype=torch.float16, device=dev)
    sv = torch.zeros_like(sk)
    spos = torch.full((L, H, S * BS), -1, dtype=torch.int64, device=dev)
    dst_k, dst_v = (t.view(heads, S, BS, D) for t in (sk, sv))
    src_k, src_v = (t.permute(1, 2, 0, 3, 4).view(heads, P, BS, D) for t in (store_k, store_v))
    g = torch.Generator().manual_seed(0)
    pages = torch.stack([torch.randperm(P, generator=g)[:S] for _ in range(heads)]).to(dev)
    miss = torch.rand((heads, S), generator=g).to(dev) < a.miss
    fill = torch.where(miss, pages, -1)
    slot_page, step = pages.clone(), torch.ones(1, dtype=torch.int64, device=dev)
    slot_used = torch.ones((heads, S), dtype=torch.int64, device=dev)
    nbytes = int(miss.sum()) * 2 * BS * D * 2
    res["fill_bytes"], res["fill_ms"] = nbytes, {}
    for nw in (1, 2, 4, 8):
        def copy(nw=nw):
            pc._fill_page_slots[(heads, S)](
                dst_k, dst_v, src_k, src_v, fill, slot_page, slot_used, step, spos,
                spos.view(heads, -1), S, 0, dst_k.stride(0), dst_k.stride(1), dst_k.stride(2),
                src_k.stride(0), src_k.stride(1), src_k.stride(2), src_v.stride(0),
                src_v.stride(1), src_v.stride(2), 0, S * BS, BS=BS, D=D, G_P=1, HAS_G=False,
                num_warps=nw)
        ms = bench(copy, 10)
        res["fill_ms"][nw] = ms
        print(f"fill num_warps={nw}: {ms:.3f} ms, {nbytes / 1e6:.1f} MB, "
              f"{nbytes / ms / 1e6:.1f} GB/s", flush=True)
    pin = torch.empty(nbytes // 2, dtype=torch.float16, pin_memory=True)
    dbuf = torch.empty(nbytes // 2, dtype=torch.float16, device=dev)
    ms = bench(lambda: dbuf.copy_(pin, non_blocking=True), 10)
    res["dma_ms"] = ms
    print(f"DMA pinned->device {nbytes / 1e6:.1f} MB: {ms:.3f} ms, {nbytes / ms / 1e6:.1f} GB/s",
          flush=True)
    del store_k, store_v, pin

    # 2. a decode step's choice over every layer: scoring, top-k, placement
    keys = torch.randn((heads, P, 2, D), dtype=torch.float16, device=dev)
    q = torch.randn((1, L * HQ, D), dtype=torch.float16, device=dev)
    rng = torch.tensor([4, P - 40], dtype=torch.int64, device=dev)
    for kind in kinds:
        lo, hi = page_summary(keys, kind)
        ms = bench(lambda: ps.page_scores_in_range(q, lo, hi, rng, D ** -0.5))
        res[f"ranged_scoring_{kind}_ms"] = ms
        print(f"ranged scoring ({kind}): {ms:.3f}", flush=True)
    scores = ps.page_scores_in_range(q, lo, hi, rng, D ** -0.5)
    res["top_valid_pages_ms"] = bench(lambda: top_valid_pages(scores, S))
    row_of_page = torch.arange(P, dtype=torch.int64, device=dev)
    counts = torch.zeros(3, dtype=torch.int64, device=dev)
    picks = top_valid_pages(scores, S)
    res["place_pages_ms"] = bench(lambda: pc.place_pages(picks, slot_page, slot_used, step,
                                                         row_of_page, counts))
    for key in ("top_valid_pages_ms", "place_pages_ms"):
        print(f"{key}: {res[key]:.3f}", flush=True)

    # 3. a prefill chunk's scoring, one layer
    res["prefill_scoring_ms"] = {}
    for kind in kinds:
        for n in (1024, 2048):
            lo1, hi1 = page_summary(torch.randn((H, n, 2, D), dtype=torch.float16, device=dev),
                                    kind)
            for t in (1024, 512, 256, 128):
                qq = torch.randn((t, HQ, D), dtype=torch.float16, device=dev)
                ms = bench(lambda: ps.score_top_pages(qq, lo1, hi1, S, D ** -0.5))
                res["prefill_scoring_ms"][f"{kind}_{t}_queries_{n}_pages"] = ms
                print(f"prefill scoring ({kind}) T={t} n={n}: {ms:.3f} ms", flush=True)

    # 4. the prefill scoring's tiles (rows x pages) and warps, 1,024 queries x 2,048 pages
    res["prefill_scoring_tiles_ms"] = {}
    lo1, hi1 = page_summary(torch.randn((H, 2048, 2, D), dtype=torch.float16, device=dev),
                            kinds[0])
    qq = torch.randn((1024, HQ, D), dtype=torch.float16, device=dev)
    for bm in (32, 64, 128):
        for bn in (32, 64, 128):
            for nw in (4, 8):
                try:
                    ms = bench(lambda: ps.page_scores(qq, lo1, hi1, D ** -0.5, block_m=bm,
                                                      block_n=bn, num_warps=nw))
                except Exception as exc:  # noqa: BLE001  (a tile too big for shared memory)
                    print(f"tiles {bm}x{bn} warps {nw}: {type(exc).__name__}", flush=True)
                    continue
                res["prefill_scoring_tiles_ms"][f"{kinds[0]}_m{bm}_n{bn}_w{nw}"] = ms
                print(f"prefill scoring ({kinds[0]}) tiles {bm}x{bn} warps {nw}: {ms:.3f} ms",
                      flush=True)

    out = Path(a.out or os.environ.get("OUT") or "out")
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_retrieval_kernels.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
