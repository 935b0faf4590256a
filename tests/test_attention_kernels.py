"""Triton attention kernels vs the torch reference (kernels/attention/attention_ref.py, the oracle).

On CPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set below before the
kernel modules are imported) with small shapes; `gpu`-marked tests use larger shapes and the
engine end to end (skipped without CUDA). Caches and unused blocks hold random garbage, block
lists are scattered over the pool, and every buffer the launcher allocates is NaN-poisoned, so
an element a kernel forgets to write fails the comparison.
"""

from __future__ import annotations

import itertools
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from hisparse_cli.kernels.attention import attention_ref as ref  # noqa: E402
from hisparse_cli.kernels.attention import attention_triton as tri  # noqa: E402
from hisparse_cli.kernels.attention.importance_triton import strided_mass_reference  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# |triton - reference| <= atol + rtol * |reference|
TOL = {  # out: fp16/bf16 outputs; mass: fp32 probabilities summed over queries and heads
    torch.float16: dict(out=(3e-3, 3e-3), mass=(2e-4, 2e-3)),
    torch.bfloat16: dict(out=(2e-2, 2e-2), mass=(2e-4, 2e-3)),
}
# small key tiles: several tiles per program even for the short CPU sequences
SMALL = tri.AttnConfig(block_m=32, block_n=16, num_warps=4, num_stages=2,
                       score_block_m=32, score_block_n=16)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    """Launcher allocations start as NaN: unwritten output elements cannot pass."""
    def alloc(shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    monkeypatch.setattr(tri, "_alloc", alloc)


def make_step(seed, *, t, q_start, hq, hkv, d, bs, window, sinks, g, dtype, extra_block=False):
    """A scattered paged cache full of garbage, the step's block list, q and globals."""
    gen = torch.Generator().manual_seed(seed)
    last = (q_start + t - 1) // bs
    if window is None:
        logical = list(range(last + 1))
    else:  # sink blocks + window blocks (one more, fully invisible, with extra_block)
        lo = max(0, max(0, q_start - window + 1) // bs - int(extra_block))
        logical = sorted(set(range(cdiv(sinks, bs))) | set(range(lo, last + 1)))
    n_phys = len(logical) + 3
    phys = torch.randperm(n_phys, generator=gen)[: len(logical)]

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(dtype).to(DEV)

    step = dict(
        q=rnd(t, hq, d), k_cache=rnd(n_phys, bs, hkv, d), v_cache=rnd(n_phys, bs, hkv, d),
        block_ids=phys.to(DEV), block_starts=torch.tensor([b * bs for b in logical], device=DEV),
        q_start=q_start, sinks=sinks if window is not None else 0, window=window, scale=d ** -0.5)
    if g:
        oldest = max(1, q_start - (window or 0))
        g_pos = torch.randint(0, oldest, (hkv, g), generator=gen)
        g_pos[0, ::3] = -1  # empty slots
        if hkv > 1:
            g_pos[-1] = -1  # a KV head with no globals at all
        step.update(g_k=rnd(hkv, g, d), g_v=rnd(hkv, g, d), g_pos=g_pos.to(DEV))
    return step


def run_both(step, return_scores=True, **kw):
    expect = ref.sparse_attention(**step, return_scores=return_scores)
    got = tri.sparse_attention(**step, return_scores=return_scores, **kw)
    return expect, got


def assert_close(got, expect, tol, what):
    atol, rtol = tol
    assert got.shape == expect.shape, (what, got.shape, expect.shape)
    assert torch.isfinite(got).all(), f"{what}: non-finite (unwritten?) elements"
    err = (got.float() - expect.float()).abs()
    bad = err > atol + rtol * expect.float().abs()
    assert not bad.any(), f"{what}: max err {err.max().item():.3e} at {bad.nonzero()[0].tolist()}"


def check(step, dtype, return_scores=True, **kw):
    (o_r, km_r, gm_r), (o_t, km_t, gm_t) = run_both(step, return_scores, **kw)
    assert o_t.dtype == step["q"].dtype
    assert_close(o_t, o_r, TOL[dtype]["out"], "out")
    if not return_scores:
        assert km_t is None and gm_t is None
        return
    assert_close(km_t, km_r, TOL[dtype]["mass"], "key_mass")
    if gm_r is None:
        assert gm_t is None
    else:
        assert_close(gm_t, gm_r, TOL[dtype]["mass"], "global_mass")


# dtype x heads x block size x window in full; sinks, globals and lengths cycle through them
HEADS = [(4, 4), (4, 1), (8, 1)]
WINDOWS = [None, 3, 40]  # dense, smaller than a block, larger than several blocks
LENGTHS = [(0, 13), (21, 19), (50, 9)]  # (q_start, T): first chunk, ragged starts and tails
GRID = list(itertools.product([torch.float16, torch.bfloat16], HEADS, [8, 16], WINDOWS))


@pytest.mark.parametrize("i", range(len(GRID)))
def test_prefill_and_decode_match_reference(i):
    dtype, (hq, hkv), bs, window = GRID[i]
    sinks = (0, 2, 5)[i % 3]
    g = (0, 6)[(i // 3) % 2]
    q_start, t = LENGTHS[(i // 2) % 3]
    shape = dict(hq=hq, hkv=hkv, d=16, bs=bs, window=window, sinks=sinks, g=g, dtype=dtype)
    # prefill chunk, exact importance (stride 1), multi-tile loops through small tiles
    step = make_step(i, t=t, q_start=q_start, extra_block=bool(i % 2), **shape)
    check(step, dtype, config=SMALL, score_stride=1)
    # decode step right after it: default tiles, logits-based exact importance, split keys
    step = make_step(100 + i, t=1, q_start=q_start + t, extra_block=bool(i % 2), **shape)
    check(step, dtype, num_splits=2)


@pytest.mark.parametrize("t,splits", [(1, 1), (1, 5), (3, 2), (24, 1), (24, 5)])
def test_split_keys_match_reference(t, splits):
    step = make_step(7, t=t, q_start=37, hq=4, hkv=2, d=32, bs=8, window=20, sinks=3, g=5,
                     dtype=torch.float16)
    check(step, torch.float16, num_splits=splits, config=SMALL, score_stride=1)


@pytest.mark.parametrize("window", [None, 64])
def test_unmasked_full_tiles_match_masked_path(window):
    """Prefill row tiles skip masks on key tiles every row sees in full; same result."""
    step = make_step(9, t=40, q_start=100, hq=2, hkv=2, d=16, bs=8, window=window, sinks=3,
                     g=0, dtype=torch.float16)
    expect = ref.sparse_attention(**step)[0]
    for full in (True, False):
        cfg = tri.AttnConfig(block_m=32, block_n=16, num_warps=4, full_tiles=full)
        got = tri.sparse_attention(**step, config=cfg)[0]
        assert_close(got, expect, TOL[torch.float16]["out"], f"out full_tiles={full}")


def test_default_config_prefill_without_scores():
    step = make_step(3, t=40, q_start=9, hq=8, hkv=2, d=32, bs=16, window=24, sinks=4, g=7,
                     dtype=torch.bfloat16)
    check(step, torch.bfloat16, return_scores=False)


@pytest.mark.parametrize("stride", [2, 5])
def test_strided_importance_matches_its_reference(stride):
    step = make_step(11, t=30, q_start=20, hq=4, hkv=2, d=16, bs=8, window=25, sinks=2, g=4,
                     dtype=torch.float16)
    km_r, gm_r = strided_mass_reference(**step, stride=stride)
    _, km_t, gm_t = tri.sparse_attention(**step, return_scores=True, score_stride=stride,
                                         config=SMALL)
    assert_close(km_t, km_r, TOL[torch.float16]["mass"], "key_mass")
    assert_close(gm_t, gm_r, TOL[torch.float16]["mass"], "global_mass")
    km_exact = ref.sparse_attention(**step, return_scores=True)[1]
    assert not torch.allclose(km_r, km_exact)  # the approximation is really exercised


def test_strided_importance_error_is_small_for_a_long_prefill():
    """Documented approximation (importance_triton.py): scoring a 512-token chunk from every
    8th query (the coarsest default) keeps the heavy hitters; measured here rel. L1 ~0.07,
    top-64 overlap ~56/64. Torch only (oracle vs oracle), so shapes can be real."""
    gen = torch.Generator().manual_seed(5)
    t, q_start, bs, hkv, grp, d, window, g = 512, 1536, 16, 2, 4, 64, 1024, 32
    n_blocks = cdiv(q_start + t, bs)
    k = torch.randn(n_blocks, bs, hkv, d, generator=gen)
    hot = torch.randint(0, q_start + t, (24,), generator=gen)  # heavy-hitter keys
    flat = k.view(-1, hkv, d)
    q = torch.randn(t, hkv * grp, d, generator=gen)
    q += 2.0 * flat[hot].mean(0).repeat_interleave(grp, 0)[None]  # queries drawn to them
    first = (q_start - window + 1) // bs
    ids = torch.tensor([0] + list(range(first, n_blocks)))
    step = dict(q=q, k_cache=k, v_cache=k.clone(), block_ids=ids, block_starts=ids * bs,
                q_start=q_start, sinks=4, window=window, scale=d ** -0.5,
                g_k=torch.randn(hkv, g, d, generator=gen), g_v=torch.randn(hkv, g, d, generator=gen),
                g_pos=torch.randint(4, first * bs, (hkv, g), generator=gen))
    _, exact, g_exact = ref.sparse_attention(**step, return_scores=True)
    approx, g_approx = strided_mass_reference(**step, stride=tri.MAX_SCORE_STRIDE)
    rel_l1 = ((approx - exact).abs().sum() / exact.sum()).item()
    assert rel_l1 < 0.10, rel_l1
    g_rel = ((g_approx - g_exact).abs().sum() / g_exact.sum()).item()
    assert g_rel < 0.10, g_rel
    # the global-selection signal: the top keys (per KV head) mostly agree
    k_top = 64
    for h in range(hkv):
        a = set(exact[h].topk(k_top).indices.tolist())
        b = set(approx[h].topk(k_top).indices.tolist())
        assert len(a & b) >= 0.8 * k_top, len(a & b)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("src", ["same", "fp32"])
def test_store_kv_matches_reference(dtype, src):
    gen = torch.Generator().manual_seed(2)
    nb, bs, hkv, d, t = 6, 8, 3, 32, 11
    k_cache = torch.randn(nb, bs, hkv, d, generator=gen).to(dtype).to(DEV)
    v_cache = torch.randn(nb, bs, hkv, d, generator=gen).to(dtype).to(DEV)
    slots = torch.randperm(nb * bs, generator=gen)[:t].to(DEV)
    # K/V as strided views of a fused projection; fp32 inputs are converted on store
    kv = torch.randn(t, 2 * hkv, d, generator=gen).to(dtype if src == "same" else torch.float32)
    k, v = kv.to(DEV)[:, :hkv], kv.to(DEV)[:, hkv:]
    kc_r, vc_r = k_cache.clone(), v_cache.clone()
    ref.store_kv(kc_r, vc_r, k, v, slots)
    tri.store_kv(k_cache, v_cache, k, v, slots)
    if src == "same" or DEV == "cuda":
        assert torch.equal(k_cache, kc_r) and torch.equal(v_cache, vc_r)
    else:  # the interpreter rounds fp32 -> fp16/bf16 toward zero: one ulp at most
        ulp = 2.0 ** (-7 if dtype == torch.bfloat16 else -10)
        for got, want in ((k_cache, kc_r), (v_cache, vc_r)):
            assert torch.allclose(got.float(), want.float(), rtol=ulp, atol=0)
    before = (k_cache.clone(), v_cache.clone())
    pad = torch.full((t,), -1, device=DEV)  # padding slots are skipped
    tri.store_kv(k_cache, v_cache, k, v, pad)
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])


def test_default_score_stride_is_cost_aware():
    assert tri.default_score_stride(32, 10_000, 32, 128) == 1  # short steps: exact
    assert tri.default_score_stride(256, 1_280, 32, 128) <= 2  # 8B, small window: ~exact
    wide = tri.default_score_stride(2048, 10_752, 32, 128)  # 8B, window 8192
    assert 4 <= wide <= tri.MAX_SCORE_STRIDE
    assert tri.default_score_stride(2048, 10_752, 16, 128) >= wide  # smaller model


def test_launcher_rejects_bad_layouts():
    step = make_step(1, t=4, q_start=8, hq=4, hkv=2, d=16, bs=8, window=None, sinks=0, g=0,
                     dtype=torch.float16)
    bad = dict(step, k_cache=step["k_cache"].transpose(-1, -2).contiguous().transpose(-1, -2))
    with pytest.raises(AssertionError):
        tri.sparse_attention(**bad)
    with pytest.raises(AssertionError):
        tri.sparse_attention(**dict(step, q=step["q"][:, :3]))  # Hq not a multiple of Hkv
    with pytest.raises(AssertionError):
        tri.sparse_attention(**dict(step, block_starts=step["block_starts"][:-1]))


def test_engine_with_triton_kernels_matches_torch_backend(tmp_path):
    """The real runner (paged steps, eviction, recalibration from our key/global mass) through
    the Triton kernels. On CPU: fp32 caches under the interpreter; dispatch only picks triton
    on CUDA, so the backend is set directly."""
    from conftest import save_tiny

    from hisparse_cli.engine import Engine, SparseConfig
    from hisparse_cli.kernels.dispatch import KernelBackend

    path, _ = save_tiny(tmp_path, "llama")
    sparse = SparseConfig(sink_tokens=4, window_size=24, global_tokens=4, block_size=8,
                          prefill_chunk=16, recalibrate_every=16, recalibrate_topk=4)
    ids = torch.randint(3, 256, (40,), generator=torch.Generator().manual_seed(0))
    out = {}
    for name in ("torch", "triton"):
        eng = Engine.from_pretrained(path, device=DEV, sparse=sparse)
        eng.backend = KernelBackend(attention=name, int4_linear="torch")
        out[name] = (eng.logits(ids), eng.generate(ids, max_new_tokens=2, eos_token_ids=()).token_ids)
    assert (out["triton"][0] - out["torch"][0]).abs().max().item() < 1e-4
    assert out["triton"][1] == out["torch"][1]


# -- GPU: larger shapes and the engine end to end ------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("t,q_start,window,bs", [(512, 1000, 256, 16), (300, 77, None, 64),
                                                 (1, 5000, 2048, 16), (7, 9000, None, 32)])
def test_gpu_large_shapes(dtype, t, q_start, window, bs):
    step = make_step(t, t=t, q_start=q_start, hq=8, hkv=2, d=128, bs=bs, window=window,
                     sinks=16, g=64, dtype=dtype)
    check(step, dtype, score_stride=1)
    check(step, dtype, return_scores=False)


@pytest.mark.gpu
def test_gpu_engine_triton_matches_torch(tmp_path):
    from conftest import save_tiny

    from hisparse_cli.engine import Engine, SparseConfig

    path, _ = save_tiny(tmp_path, "llama", num_key_value_heads=2)
    sparse = SparseConfig(sink_tokens=4, window_size=64, global_tokens=8, block_size=16,
                          prefill_chunk=32, recalibrate_every=32, recalibrate_topk=8)
    ids = torch.randint(3, 256, (200,), generator=torch.Generator().manual_seed(0))
    engines = {b: Engine.from_pretrained(path, device="cuda", dtype=torch.float16, sparse=sparse,
                                         backend=b) for b in ("triton", "torch")}
    assert engines["triton"].backend.attention == "triton"
    logits = {b: e.logits(ids) for b, e in engines.items()}
    assert (logits["triton"] - logits["torch"]).abs().max().item() < 5e-2 * logits["torch"].abs().max().item()
    # tokens in fp32: in fp16 the two backends round differently and a random tiny model's
    # near-tied logits (or near-tied importance scores at a recalibration) can flip
    engines = {b: Engine.from_pretrained(path, device="cuda", dtype=torch.float32, sparse=sparse,
                                         backend=b) for b in ("triton", "torch")}
    toks = {b: e.generate(ids, max_new_tokens=24, eos_token_ids=()).token_ids for b, e in engines.items()}
    assert toks["triton"] == toks["torch"]


@pytest.mark.parametrize("t", [1, 9])
def test_q_start_from_device_tensor_equals_int(t):
    """CUDA-graph replay passes the query position as a 1-element device tensor."""
    step = make_step(31, t=t, q_start=45, hq=4, hkv=2, d=16, bs=8, window=20, sinks=2, g=6,
                     dtype=torch.float16)
    o_i, km_i, gm_i = tri.sparse_attention(**step, return_scores=True, config=SMALL)
    step["q_start"] = torch.tensor([45], dtype=torch.int64, device=DEV)
    o_t, km_t, gm_t = tri.sparse_attention(**step, return_scores=True, config=SMALL)
    assert torch.equal(o_i, o_t) and torch.equal(km_i, km_t) and torch.equal(gm_i, gm_t)
    ref_out, _, _ = ref.sparse_attention(**step, return_scores=True)  # reference takes it too
    assert_close(o_t, ref_out, TOL[torch.float16]["out"], "out")


@pytest.mark.parametrize("t,stride,g,pad,splits", [
    (1, 1, 5, False, None), (1, 1, 5, True, None), (1, 1, 0, True, None), (1, 1, 5, True, 3),
    (1, 1, 0, False, 4), (24, 1, 5, False, None), (24, 4, 5, True, None), (9, 2, 0, False, None)])
def test_scores_into_adds_like_the_reference(t, stride, g, pad, splits):
    """scores_into: the mass kernels add into the run's score / global_mass / global_seen
    (decode: from the stored logits; prefill: recomputed, strided) as
    attention_ref.accumulate_scores does with the reference's masses; slots of blocks not in
    the step's list keep their values. pad: the list ends with repeats of its first block at
    an unreachable start (as the CUDA-graph decoder pads it), which must add nothing.
    splits: decode with split keys, where the reduce and the mass share one launch."""
    step = make_step(11 + t, t=t, q_start=45, hq=4, hkv=2, d=32, bs=8, window=20, sinks=3,
                     g=g, dtype=torch.float16)
    if pad:
        n = 3
        step["block_ids"] = torch.cat((step["block_ids"], step["block_ids"][:1].repeat(n)))
        step["block_starts"] = torch.cat((step["block_starts"],
                                          torch.full((n,), 1 << 30, device=DEV)))
    n_phys, bs, hkv, _ = step["k_cache"].shape
    gen = torch.Generator().manual_seed(5)
    start = (torch.rand(n_phys, bs, hkv, generator=gen).to(DEV),
             torch.rand(hkv, g, generator=gen).to(DEV), torch.rand(hkv, g, generator=gen).to(DEV))
    expect = tuple(x.clone() for x in start)
    _, km, gm = strided_or_exact(step, stride)
    ref.accumulate_scores(expect, step["block_ids"], km, gm, t)
    got = tuple(x.clone() for x in start)
    out = tri.sparse_attention(**step, return_scores=True, score_stride=stride, config=SMALL,
                               scores_into=got, num_splits=splits)
    assert out[1] is None and out[2] is None
    assert_close(out[0], ref.sparse_attention(**step)[0], TOL[torch.float16]["out"], "out")
    for name, a, b in zip(("score", "global_mass", "global_seen"), got, expect):
        assert_close(a, b, TOL[torch.float16]["mass"], name)
    listed = torch.zeros(n_phys, dtype=torch.bool, device=DEV)
    listed[step["block_ids"]] = True
    assert torch.equal(got[0][~listed], start[0][~listed])


@pytest.mark.parametrize("accum", [False, True])
def test_fused_reduce_mass_equals_two_launches(monkeypatch, accum):
    """A decode step with split keys and stored logits: `_attn_reduce_mass` (the reduce and
    the mass in one launch, the lse from the forward's last split program) against
    `_attn_reduce` + `_mass_from_logits`: the same output bits (the same row code), the same
    masses up to the order of the lse's adds, and both launch counts as claimed."""
    step = make_step(23, t=1, q_start=61, hq=8, hkv=2, d=32, bs=8, window=24, sinks=3, g=7,
                     dtype=torch.float16)
    launched: list[str] = []
    real = {n: getattr(tri, n) for n in ("_attn_reduce", "_attn_reduce_mass",
                                        "_mass_from_logits")}

    class Spy:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            launched.append(self.name)
            return real[self.name][grid]

    for n in real:
        monkeypatch.setattr(tri, n, Spy(n))
    n_phys, bs, hkv, _ = step["k_cache"].shape
    results = {}
    for fuse in (False, True):
        launched.clear()
        if accum:
            into = (torch.zeros(n_phys, bs, hkv, device=DEV), torch.zeros(hkv, 7, device=DEV),
                    torch.zeros(hkv, 7, device=DEV))
            out = tri.sparse_attention(**step, return_scores=True, num_splits=3,
                                       scores_into=into, fuse_reduce_mass=fuse)
            results[fuse] = (out[0], *into)
        else:
            results[fuse] = tri.sparse_attention(**step, return_scores=True, num_splits=3,
                                                 fuse_reduce_mass=fuse)
        assert launched == (["_attn_reduce_mass"] if fuse
                            else ["_attn_reduce", "_mass_from_logits"]), launched
    # the forward's lse tail left its split counters at zero for the next call / replay
    assert not tri._counter_buffer(step["q"].device).any()
    assert torch.equal(results[True][0], results[False][0])
    for a, b in zip(results[True][1:], results[False][1:]):
        assert_close(a, b, (1e-6, 1e-5), "mass")
    assert results[True][1].abs().sum() > 0


def strided_or_exact(step, stride):
    if stride == 1:
        return ref.sparse_attention(**step, return_scores=True)
    km, gm = strided_mass_reference(**step, stride=stride)
    return None, km, gm
