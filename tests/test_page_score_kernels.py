"""Page scoring + top-k (kernels/attention/page_score_*.py) against brute force, over dtype x
pages x budget: the reference equals an explicit loop over queries, heads and pages; the
Triton kernel equals the reference (`gpu`; also on the CPU with TRITON_INTERPRET=1); the
ranged form (whole tables, a device range) equals the reference over the range's slice; the
INT8 summaries dequantize to within half a step of the exact ones, and a minmax summary still
bounds every key of its page; both Triton kernels compile for sm_90 on the CPU (Triton's
compiler rejects what its interpreter runs)."""

from __future__ import annotations

import os

import pytest
import torch

from hisparse_cli.kernels.attention.page_score_ref import (Summary, page_scores,
                                                           page_scores_in_range, page_summary,
                                                           pool_queries, quantize_summary,
                                                           score_top_pages)

TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}


def brute(q, lo, hi, scale):
    """The scores from first principles: each summary channel is its INT8 value times its
    page's scale, each bound a sum over channels of max(q * lo, q * hi), each row's softmax
    over the pages, a page's score the largest of its rows' probabilities; in float64."""
    t, hq, d = q.shape
    hkv, n, _ = lo.values.shape
    grp = hq // hkv
    out = torch.zeros(hkv, n, dtype=torch.float64)
    for h in range(hkv):
        for ti in range(t):
            for g in range(grp):
                qq = q[ti, h * grp + g].double()
                b = []
                for j in range(n):
                    lo_j = lo.values[h, j].double() * float(lo.scale[h, j])
                    hi_j = hi.values[h, j].double() * float(hi.scale[h, j])
                    b.append(torch.maximum(qq * lo_j, qq * hi_j).sum())
                out[h] = torch.maximum(out[h], torch.softmax(torch.stack(b) * scale, 0))
    return out


def _inputs(t, n, dtype, kind, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, 4, 16, generator=g).to(dtype).to(device)
    pages = torch.randn(2, n, 8, 16, generator=g).to(dtype).to(device)
    lo, hi = page_summary(pages, kind)
    return q, lo, hi, pages


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("t,n", [(1, 5), (3, 17), (9, 40)])
@pytest.mark.parametrize("kind", ["minmax", "mean"])
def test_reference_equals_brute_force(dtype, t, n, kind):
    q, lo, hi, pages = _inputs(t, n, dtype, kind)
    got = page_scores(q, lo, hi, 0.25).double()
    assert torch.allclose(got, brute(q, lo, hi, 0.25), atol=TOL[dtype] * t * 2)
    if kind == "minmax":  # the bound is an upper bound of every key's q.k in the page
        lo_f, hi_f = lo.dequantize(), hi.dequantize()
        for h in range(2):
            qq = q[:, h * 2:(h + 1) * 2].float().reshape(-1, 16)
            bound = qq.clamp(min=0) @ hi_f[h].T + qq.clamp(max=0) @ lo_f[h].T
            dots = torch.einsum("rd,nbd->rnb", qq, pages[h].float()).amax(-1)
            assert (bound >= dots - 1e-4).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rounding", ["nearest", "down", "up"])
def test_quantized_summary_layout_and_error(dtype, rounding):
    """INT8 values in [-127, 127], one fp32 scale a page = the page's absmax / 127 (1 for an
    all-zero page), dequantized within half a step (nearest) or one step on the rounding's
    side (down: never above, up: never below)."""
    x = (torch.randn(3, 7, 32, generator=torch.Generator().manual_seed(1)) * 4).to(dtype)
    x[1, 2] = 0
    s = quantize_summary(x, rounding)
    assert s.values.dtype == torch.int8 and s.scale.dtype == torch.float32
    assert s.values.shape == x.shape and s.scale.shape == x.shape[:-1]
    assert s.values.abs().max() <= 127
    xf = x.float()
    amax = xf.abs().amax(-1)
    assert torch.equal(s.scale[amax > 0], (amax / 127)[amax > 0])
    assert s.scale[1, 2] == 1 and (s.values[1, 2] == 0).all()
    step = s.scale.unsqueeze(-1)
    err = s.dequantize() - xf
    tol = 1e-6 * xf.abs().amax()
    if rounding == "nearest":  # and the absmax channel is exact (floor, ceil may miss by one)
        assert (err.abs() <= step / 2 + tol).all()
        assert (s.values.abs().amax(-1)[amax > 0] == 127).all()
    elif rounding == "down":
        assert (err <= tol).all() and (err >= -step - tol).all()
    else:
        assert (err >= -tol).all() and (err <= step + tol).all()


@pytest.mark.parametrize("t,n", [(1, 4), (8, 4), (9, 4), (3, 4), (7, 2), (5, 1)])
def test_pool_queries_are_the_means_of_consecutive_positions(t, n):
    q = torch.randn(t, 4, 16, generator=torch.Generator().manual_seed(t))
    got = pool_queries(q, n)
    groups = [list(range(i, min(i + n, t))) for i in range(0, t, n)]
    want = torch.stack([q[g].mean(dim=0) for g in groups])
    assert got.shape == (len(groups), 4, 16) and torch.allclose(got, want, atol=1e-6)


@pytest.mark.parametrize("k", [1, 4, 17])
def test_top_pages_are_the_best_k(k):
    q, lo, hi, _ = _inputs(5, 17, torch.float32, "minmax", seed=3)
    top = score_top_pages(q, lo, hi, k, 0.25)
    want = brute(q, lo, hi, 0.25)
    for h in range(2):
        assert top[h].tolist() == sorted(top[h].tolist())
        assert set(top[h].tolist()) == set(want[h].topk(k).indices.tolist())


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["minmax", "mean"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("t,n,k", [(1, 37, 4), (16, 300, 16), (128, 1000, 32)])
def test_triton_scores_equal_the_reference(dtype, t, n, k, kind):
    _check_triton(dtype, t, n, k, "cuda", kind)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the Triton interpreter on the CPU: TRITON_INTERPRET=1")
@pytest.mark.parametrize("kind", ["minmax", "mean"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("t,n,k", [(1, 37, 4), (5, 130, 16), (130, 300, 8)])  # 260 rows: the
# prefill tiles (128 x 128 in fp16)
def test_triton_scores_interpreted(dtype, t, n, k, kind):
    _check_triton(dtype, t, n, k, "cpu", kind)


def _check_triton(dtype, t, n, k, dev, kind):
    """The kernel against the reference; a mean summary is passed as the engine passes it,
    one Summary as lo and hi (the kernel's one-dot form)."""
    pytest.importorskip("triton")
    from hisparse_cli.kernels.attention.page_score_triton import page_scores as tri

    q, lo, hi, _ = _inputs(t, n, dtype, kind, device=dev, seed=t)
    assert (hi is lo) == (kind == "mean")
    # a strided summary view, as the engine passes it ([L, Hkv, pages, D] sliced)
    big_lo = Summary(torch.zeros(2, n + 9, 16, dtype=torch.int8, device=dev),
                     torch.zeros(2, n + 9, device=dev))
    big_lo.values[:, 4:4 + n] = lo.values
    big_lo.scale[:, 4:4 + n] = lo.scale
    view = big_lo.pages(4, 4 + n)
    got = tri(q, view, view if hi is lo else hi, 0.25)
    want = page_scores(q, lo, hi, 0.25)
    assert torch.allclose(got, want, rtol=1e-3, atol=1e-3 * t), (got - want).abs().max()
    top = score_top_pages(q, lo, hi, k, 0.25)
    from hisparse_cli.kernels.attention.page_score_triton import score_top_pages as tri_top

    # the same pages up to ties within the tolerance
    got_top = tri_top(q, lo, hi, k, 0.25)
    assert (want.gather(1, got_top) >= want.gather(1, top).min(1, keepdim=True).values
            - 1e-3 * t).all()


@pytest.mark.parametrize("t,total,first,n", [(1, 40, 3, 20), (2, 17, 0, 17), (1, 30, 5, 0),
                                             (1, 9, 8, 1)])
def test_ranged_reference_equals_the_slice(t, total, first, n):
    """Whole tables and a device range: the pages in range score as page_scores over the
    slice (the softmax over them alone), every other page -1 (no page in range: all -1)."""
    q, lo, hi, _ = _inputs(t, total, torch.float32, "minmax", seed=total)
    got = page_scores_in_range(q, lo, hi, torch.tensor([first, n]), 0.25)
    want = torch.full((2, total), -1.0)
    if n:
        want[:, first:first + n] = page_scores(q, lo.pages(first, first + n),
                                               hi.pages(first, first + n), 0.25)
    assert torch.allclose(got, want, atol=1e-6), (got - want).abs().max()


@pytest.mark.parametrize("k", [1, 4, 12])
def test_top_valid_pages_pads_with_minus_one(k):
    from hisparse_cli.kernels.attention.page_score_ref import top_valid_pages

    scores = torch.tensor([[-1.0, 0.5, 0.1, -1.0, 0.9, 0.0, -1.0, 0.3],
                           [-1.0] * 8])
    got = top_valid_pages(scores, k)
    best = [i for i in sorted(range(8), key=lambda i: -scores[0, i]) if scores[0, i] >= 0][:k]
    picked = [p for p in got[0].tolist() if p >= 0]  # (in no particular order)
    assert sorted(picked) == sorted(best) and got[0].tolist().count(-1) == k - len(best)
    assert got[1].tolist() == [-1] * k


def _check_ranged(dtype, t, total, first, n, dev, kind="minmax"):
    pytest.importorskip("triton")
    from hisparse_cli.kernels.attention.page_score_triton import page_scores_in_range as tri

    q, lo, hi, _ = _inputs(t, total, dtype, kind, device=dev, seed=total + t)
    rng = torch.tensor([first, n], device=dev)
    got = tri(q, lo, hi, rng, 0.25)
    want = page_scores_in_range(q, lo, hi, rng, 0.25)
    assert torch.allclose(got, want, rtol=1e-3, atol=1e-4 * t), (got - want).abs().max()
    assert (got[:, :first] == -1).all() and (got[:, first + n:] == -1).all()


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the Triton interpreter on the CPU: TRITON_INTERPRET=1")
@pytest.mark.parametrize("kind", ["minmax", "mean"])
@pytest.mark.parametrize("t,total,first,n", [(1, 150, 7, 100), (3, 70, 0, 70), (1, 40, 2, 0)])
def test_triton_ranged_scores_interpreted(t, total, first, n, kind):
    _check_ranged(torch.float16, t, total, first, n, "cpu", kind)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["minmax", "mean"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("t,total,first,n", [(1, 2100, 1, 2000), (4, 600, 3, 597),
                                             (1, 8200, 1, 8199), (1, 64, 1, 0)])
def test_triton_ranged_scores_equal_the_reference(dtype, t, total, first, n, kind):
    _check_ranged(dtype, t, total, first, n, "cuda", kind)


_KERNEL_ARGS = ("q_ptr", "lo_ptr", "hi_ptr", "ls_ptr", "hs_ptr", "out_ptr", "n_rows", "n_pages",
                "scale", "s_qt", "s_qh", "s_lh", "s_ln", "s_hh", "s_hn", "s_lsh", "s_hsh", "s_oh")


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                    reason="the interpreter replaces the kernels: nothing to compile")
@pytest.mark.parametrize("one", [True, False])
@pytest.mark.parametrize("qtype", ["*fp16", "*fp32"])  # 16-bit (tensor-core) dots, fp32
@pytest.mark.parametrize("name", ["_page_mass", "_ranged_mass"])
def test_triton_kernels_compile_for_hopper(name, qtype, one, tmp_path, monkeypatch):
    """Both kernels, both dot types, both summary forms, compiled for sm_90 on the CPU
    (Triton's own compiler, not its interpreter: the interpreter runs Python control flow that
    the compiler rejects, such as an early return in a constexpr branch)."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from hisparse_cli.kernels.attention import page_score_triton as kernels

    if not hasattr(getattr(kernels, name), "cache_key"):  # (test_specializations.py, collected
        # alone with this module, sets TRITON_INTERPRET before the kernels' first import)
        pytest.skip("the kernels were imported under the Triton interpreter in this process")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    types = {"q_ptr": qtype, "lo_ptr": "*i8", "hi_ptr": "*i8", "ls_ptr": "*fp32",
             "hs_ptr": "*fp32", "out_ptr": "*fp32", "scale": "fp32"}
    args = list(_KERNEL_ARGS)
    if name == "_ranged_mass":
        args.insert(5, "rng_ptr")
        types["rng_ptr"] = "*i64"
    # the tiles page_scores and page_scores_in_range take at their largest
    big = 128 if qtype != "*fp32" else 64
    consts = {"GRP": 4, "D": 128, "BLOCK_M": big if name == "_page_mass" else 16,
              "BLOCK_N": big if name == "_page_mass" else 64, "LOW": qtype != "*fp32",
              "ONE": one}
    signature = {a: types.get(a, "i32") for a in args} | {c: "constexpr" for c in consts}
    source = ASTSource(fn=getattr(kernels, name), signature=signature, constexprs=consts)
    try:
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32))
    except RuntimeError as exc:  # no CUDA toolchain beside this Triton (ptxas)
        if "ptxas" in str(exc).lower():
            pytest.skip(f"Triton cannot finish a CUDA build here: {exc}")
        raise
    assert "ttgir" in compiled.asm
