// One whole decode step of a Llama-family INT4 model in ONE persistent launch (sm_90).
//
// Why: the engine's kernel-per-operation decode (~345 launches a token, chained with
// programmatic dependent launch) spends ~1/3 of an INT4 step between kernels: ramps, tails and
// dependency latency that the 3.6x smaller INT4 weights expose (BENCHMARKS.md, runs 84-118).
// Here one CTA per SM runs every phase of the step with a grid barrier between phases, and a
// producer warp per CTA streams everything that does not depend on the token (the INT4 weight
// items and the attention's KV pages) into a shared-memory ring ahead of the barriers, so the
// weights stream through the dependencies. The benchmark skeleton it grew from
// (benchmarks/cuda/step_ring.cu, in git history) measured 2.45-2.55x the fp16 engine at 32K context.
//
// Phases (a table of META int64 rows built by kernels/cuda/cuda_step.py):
//   per layer: q|k|v GEMV (x = RMSNorm(h); layer 0 reads the token's embedding row and writes
//   h) -> ATTENTION (RoPE of q and the current k, K/V store into the paged cache, sparse
//   attention over the step's block list + the layer's global slots + the current token,
//   split-K partials) -> o GEMV (its x load combines the partials; it adds into h, the
//   residual stream, kept in fp32; with the importance mass, each attention unit's keys'
//   probabilities are added to the run's score / global mass after the phase's arrival) ->
//   MLP: gate|up and down in one phase over every CTA with per-tile flags between the two
//   GEMVs (K_MLP2: x = RMSNorm(h); gate|up sums through memory; then x = silu(g) u of the
//   CTA's down groups; adds into h);
//   then either the INT4 lm_head GEMV (x = RMSNorm(h) with the final norm) into the logits, or
//   FINAL_NORM (the normed hidden state in fp16 for an fp16 head run by the host after this).
//
// Semantics are the engine's (kernels/attention/attention_ref.py is the oracle): a query at position q
// sees key position k iff k <= q and (k < sinks or k > q - window), plus every global slot of
// its KV head whose position is >= 0; decode importance mass = each key's attention
// probability summed over the query heads of its KV head, added to score[block, offset, head]
// for the listed keys (at least `min_distance` positions back, SnapKV), to global_mass for the
// globals, and 1 to every global_seen. The current token's K/V are written to its slot; the
// producer may have streamed that slot's stale row with its page, so the page loop masks
// position q and the last split adds the current token from registers.
//
// Layouts:
//   INT4 items (kernels/int4/awq_items.py): a linear's weights as items of one 128-row input group x
//   128 output columns (8512 bytes: mma.sync A fragments, scales, zero points), item index =
//   column tile * G + group, G = in / 128.
//   KV cache [L, capacity, block_size, Hkv, 128] fp16 (the engine's), read page by page (16
//   keys of one KV head) with TMA tensor maps over [L * capacity * block_size, Hkv, 128]: K
//   plain, V with the 128-byte swizzle (16-byte chunk j of key row r at j ^ (r & 7) inside each
//   128-byte half-row), which makes ldmatrix.trans conflict-free; globals [L, Hkv, G, 128]
//   through maps of the same form (Hkv = 1, rows = L * Hkv * G).
//
// No CUDA headers: compiled at run time by NVRTC (kernels/cuda/cuda_rt.py), so fp16 is handled as
// raw 16-bit values with PTX conversions; ring.cuh (the shared helpers) is inlined by
// kernels/cuda/cuda_step.py. Compile-time: GQA (query heads a KV head, <= 8), NORM_PAIRS
// (hidden / 1024), ATT_WARPS (warps an attention page, chosen by the step for its pages a
// unit) and TIMELINE (profiling stamps, for benchmarks). The variants that lost their A/B
// (two-phase and K_MLP MLPs, NW = 12, ITEM_ILP, SILU_VEC = 0, DOWN_V4 = 0, NORM_PF,
// ATT_COMBINE, RING_HINT = 0 / 2) and the XSKIP diagnostics are gone (git history, and
// docs/history/ for their measurements).

#include "ring.cuh"

#ifndef GQA
#define GQA 4
#endif
#define HD 128           // head dim (one item column tile = one head)
#define NW 16            // consumer warps (run 155: 12 gained nothing)
#define SPLIT 4          // warps an item (each two of its 8 row tiles)
#define GROUPS (NW / SPLIT)  // consumer groups of the GEMV items
#ifndef ATT_WARPS
#define ATT_WARPS 4      // warps an attention page (each HD / ATT_WARPS dims of P.V; every one
#endif                   // computes the page's q.K): 4, or 2 (twice the groups, half the pages
                         // one after another in a group: kernels/cuda/cuda_step.py picks it)
#define AGROUPS (NW / ATT_WARPS)  // attention groups; a unit's page e goes to group e % AGROUPS
#define MERGE_GROUPS 8   // attention groups the merge space holds (>= AGROUPS)
static_assert(AGROUPS <= MERGE_GROUPS && SPLIT % ATT_WARPS == 0 && HD % (16 * ATT_WARPS) == 0,
              "ATT_WARPS: 2 or 4");
#define ITEM_BYTES 8512  // 128 x 128 INT4 words (8192 B), scales (256 B), zero points (64 B)
#define SCALES_OFF 8192
#define ZEROS_OFF 8448
#define SLOT 9216        // ring slot stride: 1024-aligned slots (the V pages' 128-byte swizzle
                         // repeats every 1024 bytes) holding an item or a page (K 4 KB, V 4 KB)
#define PAGE 16          // keys a page
#define MAX_K 14336      // longest GEMV input (x in shared memory as fp16)
#define MAX_G (MAX_K / 128)
#define MAX_S 32         // splits a KV head
#define MAX_HQ 64        // query heads (the o GEMV's per-head split weights)
#define MAX_UNIT_PAGES 1024  // pages one attention unit may read (validity masks in smem)
#define MASS_PAGES 32    // pages a unit may read with the importance mass (its scores in smem)
#define ATT_STRIDE (GQA * (HD + 2))  // floats of one unit's partial: acc [GQA][128], m, l
#define META 12
// The ring's loads of weight items go under the L2 policy evict_first (the weights are read
// once a step; run 162: -0.03 to -0.06 ms a step, as the small data every phase re-reads -- h,
// partials, sums, norm weights -- stays in L2). The silu(g) u x load reads 2 pairs a 16-byte
// load (run 132: -0.045 ms); the down sums leave as one 16-byte reduction a 4 rows (run 133).
#ifndef NORM_PAIRS
#define NORM_PAIRS 4     // x pairs a thread in the RMSNorm (held in registers): hidden <= 1024 x
#endif                   // this; compiled per model (kernels/cuda/cuda_step.py: hidden / 1024)

#define K_GEMV 0
#define K_ATTN 1
#define K_FINAL_NORM 2
#define K_MLP2 4      // gate|up + down in one phase over every CTA, tile flags between them
#define X_NORM 0      // x = RMSNorm(h) * w
#define X_ATT 2       // x = the attention output combined from the split partials
#define X_NORM_EMB 3  // x = RMSNorm(embedding row) * w, and h = the row (layer 0)

#define F_MASS 2      // importance mass (the MASS instance)
#define F_TIMELINE 4  // stamps: phase start, past the barrier, x ready, items done, arrived
#ifndef TIMELINE
#define TIMELINE 0    // the stamps are compiled in only with -DTIMELINE=1 (registers)
#endif

struct StepParams {
  const i64* meta;      // [n_phase][META]
  const i64* dev;       // [2 + 2 nb]: position, slot, block ids (nb), block starts (nb)
  const i64* tok;       // [1] the token at this position
  const u16* embed;     // [vocab, hidden] fp16 (device memory or mapped host memory)
  float* h;             // [hidden] residual stream
  float* part;          // [Hkv * S][ATT_STRIDE] attention partials (one layer at a time)
  unsigned* counter;    // grid barrier (zeroed before each launch)
  const float* inv_freq;  // [64] RoPE inverse frequencies
  u16* kcache;          // [L, capacity, bs, Hkv, 128]
  u16* vcache;
  const i64* gpos;      // [L, Hkv, G] (-1: empty slot)
  float* score;         // [L, capacity, bs, Hkv] importance mass
  float* gmass;         // [L, Hkv, G]
  float* gseen;         // [L, Hkv, G]
  u64* stamps;          // F_TIMELINE: [n_phase][CTAs][5] globaltimer (ns)
  i64 capacity;
  int n_phase, stages, red_tiles, flags;
  int nb, bs, hkv, hq, hidden, G, S;
  int sinks, window, min_distance;  // window < 0: none
  float scale, eps, rope_scaling;
};


__device__ __forceinline__ float ldcg(const float* p) { return __ldcg(p); }
__device__ __forceinline__ float2 ldcg2(const float* p) {
  return __ldcg(reinterpret_cast<const float2*>(p));
}
__device__ __forceinline__ void consumers_sync() {
  asm volatile("bar.sync 1, %0;" ::"r"(NW * 32) : "memory");
}


// ---- GEMV item math: mma.sync m16n8k16, the item's 16 output rows x 16 K as A, x as B ------
// Item words [rt 0..7][kt / 4][lane][kt % 4]; lane L = 4 g + t holds A's fragment of (rt, kt)
// in one word: nibble pair p = 0..3 (bits 4p.. = even K, 16 + 4p.. = odd K) is row
// 16 rt + g + 8 (p & 1), K 16 kt + 2 t + 8 (p >> 1) + {0, 1}. Scales fp16 [g][rt][row half],
// zero points one byte per (g, rt) (low nibble row 16 rt + g, high row + 8). The LOP3 magic
// turns nibble q into the fp16 1024 + q (p 0, 2) or 1024 + 16 q (p 1, 3); 1024 sum(x) is taken
// off afterwards with the group's x sum. This warp (part of 4) does row tiles 2 part, +1.
__device__ __forceinline__ void item_mma(const u8* it, const u32* xw, float xsum, int part,
                                         int lane, float* f) {
  const int g = lane >> 2, t = lane & 3;
  u32 b[16];  // B fragments of the 8 K tiles
#pragma unroll
  for (int kt = 0; kt < 8; ++kt) b[2 * kt] = xw[8 * kt + t], b[2 * kt + 1] = xw[8 * kt + 4 + t];
  const uint4* words = reinterpret_cast<const uint4*>(it);
  const u32* s2 = reinterpret_cast<const u32*>(it + SCALES_OFF) + 8 * g;
  const u8* z8 = it + ZEROS_OFF + 8 * g;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int rt = 2 * part + r;
    const uint4 wa = words[(rt * 2) * 32 + lane], wb = words[(rt * 2 + 1) * 32 + lane];
    const u32 w[8] = {wa.x, wa.y, wa.z, wa.w, wb.x, wb.y, wb.z, wb.w};
    float d[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int kt = 0; kt < 8; ++kt) {
      const u32 hi = w[kt] >> 8;
      const u32 a[4] = {lop3_or_and(w[kt], 0x000F000Fu, 0x64006400u),
                        lop3_or_and(w[kt], 0x00F000F0u, 0x64006400u),
                        lop3_or_and(hi, 0x000F000Fu, 0x64006400u),
                        lop3_or_and(hi, 0x00F000F0u, 0x64006400u)};
      mma16816(d, a, b[2 * kt], b[2 * kt + 1]);
    }
    const u32 zbits = z8[rt];
    const float z0 = (float)(zbits & 15), z1 = (float)(zbits >> 4);
    const float2 sf = h22f2(s2[rt]);
    f[2 * r] += sf.x * (d[0] - (1024.0f + z0) * xsum);
    f[2 * r + 1] += sf.y * ((d[2] - 1024.0f * xsum) * (1.0f / 16.0f) - z1 * xsum);
  }
}

// ---- attention page math (mma.sync) -------------------------------------------------------
// The GQA query heads are rows 0..GQA-1 of the m16 tiles (the rest zero). q.K: K page [16 keys]
// [128] fp16 in the slot; the dims are visited in a permuted order (the same for q and every
// key): in K tile s lane (g, t) holds words 16 t + 2 s (b0 / a0) and 16 t + 2 s + 1 (b1 / a2)
// of a 64-word row, read as chunks c = (i + (t >> 1)) & 3 (2-way conflicts). The q fragments
// are staged once per unit in qfrag [lane][4 chunks][4 words] (chunk c of lane L at word
// 16 L + 4 ((c + (L >> 1)) & 3)). P.V: the q.K accumulators are P's A fragment as they are;
// V's B fragments come from ldmatrix.x4.trans of the swizzled V page ([2 halves][16 keys][64
// dims], 16-byte chunk j of key r at j ^ (r & 7)). A warp of a group computes q.K for the page
// (all 4 warps the same) and P.V for its 32 dims. valid: bit j = key j is visible.
template <int NJ>  // 16-dim chunks of P.V this warp does (its dims d0 .. d0 + 16 NJ - 1)
__device__ __forceinline__ void attend_page(const u8* pg, const u32* qfrag, int lane, int d0,
                                            u32 valid, float scale, float& m, float& l,
                                            float (*o)[2], float* sc_out) {
  const int g = lane >> 2, t = lane & 3;
  float s0[4], s1[4];  // keys 0-7, 8-15
  page_qk(pg, qfrag, lane, s0, s1);
  const float ninf = neg_inf();
  // lane (g, t) holds keys 2t, 2t + 1 (s0) and 8 + 2t, 9 + 2t (s1) of head g
  const float x00 = (valid >> (2 * t)) & 1 ? s0[0] * scale : ninf;
  const float x01 = (valid >> (2 * t + 1)) & 1 ? s0[1] * scale : ninf;
  const float x10 = (valid >> (8 + 2 * t)) & 1 ? s1[0] * scale : ninf;
  const float x11 = (valid >> (9 + 2 * t)) & 1 ? s1[1] * scale : ninf;
  if (sc_out && g < GQA) {  // the page's scores [head][16 keys] for the mass
    float* so = sc_out + g * PAGE;
    *reinterpret_cast<float2*>(so + 2 * t) = make_float2(x00, x01);
    *reinterpret_cast<float2*>(so + 8 + 2 * t) = make_float2(x10, x11);
  }
  u32 pa[4];
  const float corr = page_softmax(x00, x01, x10, x11, m, l, pa);
  const u8* V = pg + PAGE * HD * 2;
  const int key = (lane & 7) + 8 * ((lane >> 3) & 1), chunk = lane >> 4;
#pragma unroll
  for (int jj = 0; jj < NJ; ++jj) {
    u32 b[4];
    const int jc = (d0 + 16 * jj + 8 * chunk) >> 3;  // 16-byte chunk of the 256-byte row
    const int half = jc >> 3, j8 = jc & 7;
    ldsm_x4_trans(b, V + half * (PAGE * 128) + key * 128 + ((j8 ^ (key & 7)) << 4));
    // rows g + 8 of the product (heads >= 8: none) are not kept: zeros in, discarded out,
    // so only half the accumulators stay live across pages
    float d0v[4] = {o[2 * jj][0] * corr, o[2 * jj][1] * corr, 0.f, 0.f};
    float d1v[4] = {o[2 * jj + 1][0] * corr, o[2 * jj + 1][1] * corr, 0.f, 0.f};
    mma16816(d0v, pa, b[0], b[1]);
    mma16816(d1v, pa, b[2], b[3]);
    o[2 * jj][0] = d0v[0], o[2 * jj][1] = d0v[1];
    o[2 * jj + 1][0] = d1v[0], o[2 * jj + 1][1] = d1v[1];
  }
}

// the 16 keys of unit page e: visible (bit j)? Cache pages come first (page e of the block list,
// pages_per_block of them a block), then the layer's global slots, 16 a page.
__device__ __forceinline__ u32 page_valid(const StepParams& p, int layer, int kvh, int e,
                                          int n_cache_pages, int ppb, i64 q, int lane) {
  bool ok = false;
  if (lane < PAGE) {
    if (e < n_cache_pages) {
      const i64 start = p.dev[2 + p.nb + e / ppb] + (e % ppb) * PAGE + lane;
      ok = start < q && (start < p.sinks || p.window < 0 || start > q - p.window);
    } else {
      const i64 idx = (i64)(e - n_cache_pages) * PAGE + lane;
      ok = p.gpos[((i64)layer * p.hkv + kvh) * p.G + idx] >= 0;
    }
  }
  return __ballot_sync(0xffffffffu, ok) & 0xffffu;
}

// a head's split weight exp(m_s - M) / L on lane s < S (0 on the others): M the splits' max,
// L = sum exp(m_s - M) l_s, from lane s's m_s and l_s (lanes >= S pass -inf and 0)
__device__ __forceinline__ float split_weight(float ms, float ls, int lane, int S) {
  float M = ms;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
  const float e = lane < S && ms != neg_inf() ? ex(ms - M) : 0.f;
  float L = e * ls;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) L += __shfl_xor_sync(0xffffffffu, L, o);
  return lane < S ? e / L : 0.f;
}

// a warp's 32 consecutive x pairs (half of a 128-row group, kp >> 6) into the group's x sum
// (the fp16 values, as the item math reads them)
__device__ __forceinline__ void group_sum(float* xsum, int kp, u32 x2, int lane) {
  const float2 f = h22f2(x2);
  float v = f.x + f.y;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if (lane == 0) atomicAdd(&xsum[kp >> 6], v);
}

__device__ __forceinline__ void red_add_v4(float* p, float4 v) {  // 16-byte aligned p
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(p), "f"(v.x), "f"(v.y),
               "f"(v.z), "f"(v.w)
               : "memory");
}
// a warp's item sums f (item_mma: rows 16 rt + g, + 8, rt = 2 part, + 1) into red tile `tile`
// (shared, fp32), then f = 0
__device__ __forceinline__ void red_add(float* red, int tile, int part, int lane, float* f) {
  if ((lane & 3) == 0) {
    const int g = lane >> 2;
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      const int rt = part * 2 + rr;
      atomicAdd(&red[tile * 128 + 16 * rt + g], f[2 * rr]);
      atomicAdd(&red[tile * 128 + 16 * rt + g + 8], f[2 * rr + 1]);
    }
  }
#pragma unroll
  for (int q = 0; q < 4; ++q) f[q] = 0.f;
}

// one item's sums f (item_mma: this warp's rows 32 part + g + {0, 8, 16, 24}) added into the
// 128 rows at out (16-byte aligned): a 16-byte reduction a 4 rows through the warp's 32 floats
// of scratch
__device__ __forceinline__ void item_out(float* out, float* scratch, int part, int lane,
                                         const float* f) {
  if ((lane & 3) == 0) {
    const int g = lane >> 2;
    scratch[g] = f[0], scratch[g + 8] = f[1], scratch[g + 16] = f[2], scratch[g + 24] = f[3];
  }
  __syncwarp();
  if (lane < 8)
    red_add_v4(out + 32 * part + 4 * lane, *reinterpret_cast<const float4*>(scratch + 4 * lane));
  __syncwarp();
}

// The GEMV items of one phase on this warp: its consumer group takes ring entries pos + e,
// e = grp, grp + GROUPS, ... < n (whole ring slots); entry e is input group (j0 + e) % G of
// output tile (j0 + e) / G counted from the phase's first tile, and each tile's sums go into
// red tile `tile` (red_add) when the warp moves past it.
__device__ __forceinline__ void gemv_items(const u8* ring, u64* full, u64* empty, int stages,
                                           int pos, int n, int G, int j0, const u32* xs,
                                           const float* xsum, float* red, int warp, int lane) {
  const int part_ = warp % SPLIT, grp = warp / SPLIT;
  int slot;
  u32 phase;
  const int first = ring_start(pos, grp, GROUPS, stages, slot, phase);
  float f[4] = {0.f, 0.f, 0.f, 0.f};
  int cur = -1, rel = (j0 + first) / G, j = (j0 + first) % G;
  for (int e = first; e < n; e += GROUPS, slot += GROUPS, j += GROUPS) {
    if (slot >= stages) slot -= stages, phase ^= 1u;
    while (j >= G) j -= G, ++rel;
    if (rel != cur) {
      if (cur >= 0) red_add(red, cur, part_, lane, f);
      cur = rel;
    }
    warp_wait(&full[slot], phase);
    item_mma(ring + (size_t)slot * SLOT, xs + j * 64, xsum[j], part_, lane, f);
    __syncwarp();
    if (lane == 0) mbar_arrive(&empty[slot]);
  }
  if (cur >= 0) red_add(red, cur, part_, lane, f);
}

// x = RMSNorm(in) * w over all K (= hidden <= 8192: at most NORM_PAIRS pairs a thread, held in
// registers between the two passes; the norm weights are loaded with x, so the second pass
// reads nothing) into xs (fp16 pairs) and the groups' x sums; erow: read the fp16 embedding row
// instead of `in`. Every consumer thread calls it.
__device__ __forceinline__ void norm_x(const u32* erow, const float* in, const u16* nw, int K,
                                       float eps, u32* xs, float* xsum, float* ssum, int warp,
                                       int lane) {
  float2 v[NORM_PAIRS];
  u32 wv[NORM_PAIRS];
  float ss = 0.f;
#pragma unroll
  for (int u = 0; u < NORM_PAIRS; ++u) {
    const int kp = threadIdx.x + u * NW * 32;
    v[u] = make_float2(0.f, 0.f);
    wv[u] = 0u;
    if (kp < K / 2) {
      v[u] = erow ? h22f2(erow[kp]) : ldcg2(in + 2 * kp);
      wv[u] = reinterpret_cast<const u32*>(nw)[kp];
    }
    ss += v[u].x * v[u].x + v[u].y * v[u].y;
  }
  const float rs = rsqrtf(consumers_sum<NW>(ss, ssum, warp, lane) / (float)K + eps);
#pragma unroll
  for (int u = 0; u < NORM_PAIRS; ++u) {
    const int kp = threadIdx.x + u * NW * 32;
    if (kp < K / 2) {  // (K / 2 is a multiple of 64: whole warps in or out)
      const float2 w = h22f2(wv[u]);
      const u32 x2 = f22h2(rh(v[u].x * rs) * w.x, rh(v[u].y * rs) * w.y);
      xs[kp] = x2;
      group_sum(xsum, kp, x2, lane);
    }
  }
}

template <bool MASS>
__global__ void __launch_bounds__((NW + 1) * 32, 1)
    decode_step(const StepParams p, const __grid_constant__ TensorMap kmap,
                const __grid_constant__ TensorMap vmap, const __grid_constant__ TensorMap gkmap,
                const __grid_constant__ TensorMap gvmap) {
  extern __shared__ u8 smem_raw[];
  // 1024-byte aligned by pointer arithmetic on smem_raw (not an integer round trip): the
  // compiler keeps the shared space for every pointer derived from it, so shared accesses are
  // LDS / STS / ATOMS, not generic LD / ST / ATOM (run 143: -0.04 / -0.05 ms a step)
  u8* ring = smem_raw + ((1024 - ((size_t)smem_raw & 1023)) & 1023);
  u32* xs = reinterpret_cast<u32*>(ring + (size_t)p.stages * SLOT);  // [MAX_K / 2] fp16 pairs
  float* red = reinterpret_cast<float*>(xs + MAX_K / 2);              // [red_tiles][128]
  float* xsum = red + p.red_tiles * 128;                              // [MAX_G]
  float* wts = xsum + MAX_G;                                          // [MAX_HQ][MAX_S]
  float* qf = wts + MAX_HQ * MAX_S;                                   // [GQA][128]
  float* merge = qf + GQA * HD;                                 // [MERGE_GROUPS][ATT_STRIDE]
  float* ssum = merge + MERGE_GROUPS * ATT_STRIDE;                    // [NW]
  float* rope = ssum + NW;                                            // [128] cos 64, sin 64
  float* kcur = rope + HD;                                            // [128]
  float* vcur = kcur + HD;                                            // [128]
  float* scur = vcur + HD;                                            // [8] current token
  float* mlh = scur + 8;                                              // [16] mass: M, 1 / L
  float* mls = mlh + 16;                                  // [MAX_S][m 8, l 8] mass: the splits'
  u32* qfrag = reinterpret_cast<u32*>(mls + MAX_S * 16);              // [32][16]
  u32* vmask = qfrag + 512;                                           // [MAX_UNIT_PAGES]
  float* scores = reinterpret_cast<float*>(vmask + MAX_UNIT_PAGES);   // [MASS_PAGES][GQA][16]
  u64* full = reinterpret_cast<u64*>(scores + (MASS ? MASS_PAGES * GQA * PAGE : 0));
  u64* empty = full + p.stages;

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int P = gridDim.x, c = blockIdx.x;
  const int stages = p.stages;
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], SPLIT);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  for (int t = threadIdx.x; t < p.red_tiles * 128; t += blockDim.x) red[t] = 0.f;
  const i64 q_pos = p.dev[0], slot_q = p.dev[1];
  if (threadIdx.x < HD / 2) {  // RoPE at this position (fp16 tables, as the engine's): once
    const float a = (float)q_pos * p.inv_freq[threadIdx.x];
    rope[threadIdx.x] = rh(cosf(a) * p.rope_scaling);
    rope[HD / 2 + threadIdx.x] = rh(sinf(a) * p.rope_scaling);
  }
  __syncthreads();

  const int ppb = p.bs / PAGE;
  const int n_cache_pages = p.nb * ppb, n_pages = n_cache_pages + p.G / PAGE;
  const int S = p.S, units = p.hkv * S;
  const int unit_pages = (n_pages + S - 1) / S;

  if (warp == NW) {  // producer: every phase's weight items and KV pages of this CTA, in order
    if (lane == 0) {
      int slot = 0, round = 0;
      auto next = [&]() -> u8* {
        if (round > 0) mbar_wait(&empty[slot], (u32)((round - 1) & 1));
        return ring + (size_t)slot * SLOT;
      };
      auto advance = [&]() {
        if (++slot == stages) slot = 0, ++round;
      };
      const u64 pol_ring = l2_evict_first();
      auto load_item = [&](u8* dst, const u8* src) {
        bulk_g2s_hint(dst, src, ITEM_BYTES, &full[slot], pol_ring);
      };
      auto load_page = [&](u8* dst, const TensorMap* map, int c0, int c1, int c2) {
        tma_3d(dst, map, c0, c1, c2, &full[slot]);
      };
      for (int ph = 0; ph < p.n_phase; ++ph) {
        const i64* m = p.meta + ph * META;
        if (m[0] == K_GEMV) {
          const Range r = cta_range(m[3] * m[4], c, P);
          const u8* src = reinterpret_cast<const u8*>(m[5]) + (size_t)r.a * ITEM_BYTES;
          for (i64 i = r.a; i < r.b; ++i, src += ITEM_BYTES) {
            u8* dst = next();
            mbar_arrive_tx(&full[slot], ITEM_BYTES);
            load_item(dst, src);
            advance();
          }
        } else if (m[0] == K_MLP2) {  // this CTA's range of the gate|up items (tile-major),
          // then its range of the down items taken group by group (entry i: tile i % T of
          // input group i / T)
          const int G = (int)m[3], NGI = (int)m[4], T = (int)(m[1] / HD);
          const u8* gu = reinterpret_cast<const u8*>(m[5]);
          const u8* dn = reinterpret_cast<const u8*>(m[11]);
          const Range r1 = cta_range((i64)2 * NGI * G, c, P), r2 = cta_range((i64)NGI * T, c, P);
          for (i64 i = r1.a; i < r1.b; ++i) {
            u8* dst = next();
            mbar_arrive_tx(&full[slot], ITEM_BYTES);
            load_item(dst, gu + i * ITEM_BYTES);
            advance();
          }
          int j = (int)(r2.a / T), t = (int)(r2.a % T);
          for (i64 i = r2.a; i < r2.b; ++i) {
            u8* dst = next();
            mbar_arrive_tx(&full[slot], ITEM_BYTES);
            load_item(dst, dn + ((i64)t * NGI + j) * ITEM_BYTES);
            advance();
            if (++t == T) t = 0, ++j;
          }
        } else if (m[0] == K_ATTN && c < units) {
          const int layer = (int)m[1], kvh = c / S, s = c % S;
          const int e0 = s * unit_pages, e1 = min(n_pages, e0 + unit_pages);
          for (int e = e0; e < e1; ++e) {
            u8* dst = next();
            mbar_arrive_tx(&full[slot], 2 * PAGE * HD * 2);
            if (e < n_cache_pages) {
              const i64 blk = p.dev[2 + e / ppb];
              const int row = (int)(((i64)layer * p.capacity + blk) * p.bs + (e % ppb) * PAGE);
              load_page(dst, &kmap, 0, kvh, row);
              load_page(dst + PAGE * HD * 2, &vmap, 0, kvh, row);
              load_page(dst + PAGE * HD * 2 + PAGE * 128, &vmap, 64, kvh, row);
            } else {
              const int row = (int)((((i64)layer * p.hkv + kvh) * p.G) +
                                    (e - n_cache_pages) * PAGE);
              load_page(dst, &gkmap, 0, 0, row);
              load_page(dst + PAGE * HD * 2, &gvmap, 0, 0, row);
              load_page(dst + PAGE * HD * 2 + PAGE * 128, &gvmap, 64, 0, row);
            }
            advance();
          }
        }
      }
    }
    return;
  }

  int pos0 = 0;  // ring entries streamed to this CTA before the current phase
  for (int ph = 0; ph < p.n_phase; ++ph) {
    const i64* m = p.meta + ph * META;
    u64* st = TIMELINE && (p.flags & F_TIMELINE) ? p.stamps + ((size_t)ph * P + c) * 5 : nullptr;
    if (st && threadIdx.x == 0) st[0] = gtimer(), st[2] = st[3] = 0;
    if (m[0] == K_GEMV || m[0] == K_MLP2)  // the x loads add each group's
      for (int t = threadIdx.x; t < (int)m[3]; t += NW * 32) xsum[t] = 0.f;  // x sum here
    if (m[0] == K_ATTN && c < units) {  // before the barrier (they do not depend on the
      // step's results): the visibility masks of this unit's pages
      const int e0 = (c % S) * unit_pages, npg = max(0, min(n_pages, e0 + unit_pages) - e0);
      for (int e = warp; e < npg; e += NW) {
        const u32 v = page_valid(p, (int)m[1], c / S, e0 + e, n_cache_pages, ppb, q_pos, lane);
        if (lane == 0) vmask[e] = v;
      }
    }
    if (ph > 0 && threadIdx.x == 0) {
      const unsigned target = (unsigned)(ph * P);
      while (ld_acquire(p.counter) < target) {
      }
    }
    consumers_sync();
    if (st && threadIdx.x == 0) st[1] = gtimer();
    int n_streamed = 0;
    bool mass_after = false;  // the o phase's mass, done after the arrival
    if (m[0] == K_GEMV) {  // ---------------------------------------------------------- GEMV
      // [1] K [2] N [3] G [4] T [5] items [6] out (fp32, added into) [7] xform [8] in (fp32)
      // [9] norm weight (fp16) [10] layer (X_ATT with the mass)
      const int K = (int)m[1], G = (int)m[3], xform = (int)m[7];
      float* out = reinterpret_cast<float*>(m[6]);
      const float* in = reinterpret_cast<const float*>(m[8]);
      const u16* nw = reinterpret_cast<const u16*>(m[9]);
      const Range r = cta_range(m[3] * m[4], c, P);
      const int n = (int)(r.b - r.a), tile0 = (int)(r.a / G), j0 = (int)(r.a % G);
      n_streamed = n;
      const bool mass_here = MASS && xform == X_ATT && c < units;
      if (mass_here && threadIdx.x < S * GQA) {  // the splits' m, l of this CTA's KV head (for
        // the mass after the items): loaded now, alongside the x load
        const int s2 = threadIdx.x / GQA, q = threadIdx.x % GQA;
        const float* pm = p.part + (size_t)((c / S) * S + s2) * ATT_STRIDE + GQA * HD;
        mls[s2 * 16 + q] = ldcg(pm + q);
        mls[s2 * 16 + 8 + q] = ldcg(pm + GQA + q);
      }
      if (xform == X_NORM_EMB && c == 0) {  // h = the token's embedding row (every CTA
        const u32* erow = reinterpret_cast<const u32*>(p.embed + (size_t)p.tok[0] * K);
        for (int kp = threadIdx.x; kp < K / 2; kp += NW * 32)  // may have no items here)
          reinterpret_cast<float2*>(p.h)[kp] = h22f2(erow[kp]);
      }
      if (n > 0) {
        const int j1 = (int)((r.b - 1) % G);
        const bool all = n >= G;
        const int ngrp = all ? G : (j1 >= j0 ? j1 - j0 + 1 : G - j0 + j1 + 1);
        if (xform == X_ATT) {  // each used head's split weights
          // exp(m_s - M) / L
          for (int q = warp; q < ngrp; q += NW) {
            const int hq = all ? q : (j0 + q) % G;
            const float* pp = p.part + (size_t)((hq / GQA) * S) * ATT_STRIDE + GQA * HD;
            const float ms = lane < S ? ldcg(pp + lane * ATT_STRIDE + hq % GQA) : neg_inf();
            const float ls = lane < S ? ldcg(pp + lane * ATT_STRIDE + GQA + hq % GQA) : 0.f;
            const float w = split_weight(ms, ls, lane, S);
            if (lane < S) wts[hq * MAX_S + lane] = w;
          }
          consumers_sync();
        }
        if (xform == X_NORM || xform == X_NORM_EMB) {
          norm_x(xform == X_NORM_EMB
                     ? reinterpret_cast<const u32*>(p.embed + (size_t)p.tok[0] * K)
                     : nullptr,
                 in, nw, K, p.eps, xs, xsum, ssum, warp, lane);
        } else {  // X_ATT: the used heads' pairs, combined from the split partials with the
          // weights in shared memory
          const int npairs = ngrp * 64;
          for (int t = threadIdx.x; t < npairs; t += NW * 32) {
            const int kp = all ? t : ((j0 * 64 + t) % (K / 2));
            // pair kp: head hq = kp / 64, dims 2 (kp % 64) + {0, 1}
            const int hq = kp / 64, d = 2 * (kp % 64);
            const float* pp = p.part + (size_t)((hq / GQA) * S) * ATT_STRIDE + (hq % GQA) * HD + d;
            float f0 = 0.f, f1 = 0.f;
            // 16 splits' loads in flight at once
            for (int s0 = 0; s0 < S; s0 += 16) {
              float2 a[16];
#pragma unroll
              for (int s = 0; s < 16; ++s)
                a[s] = s0 + s < S ? ldcg2(pp + (s0 + s) * ATT_STRIDE) : make_float2(0.f, 0.f);
#pragma unroll
              for (int s = 0; s < 16; ++s) {
                const float w = s0 + s < S ? wts[hq * MAX_S + s0 + s] : 0.f;
                f0 += w * a[s].x, f1 += w * a[s].y;
              }
            }
            const u32 x2 = f22h2(f0, f1);
            xs[kp] = x2;
            group_sum(xsum, kp, x2, lane);
          }
        }
      }
      consumers_sync();
      if (st && threadIdx.x == 0) st[2] = gtimer();
      // the items (each consumer group every GROUPS-th, whole ring slots), sums into red
      gemv_items(ring, full, empty, stages, pos0, n, G, j0, xs, xsum, red, warp, lane);
      consumers_sync();
      if (st && threadIdx.x == 0) st[3] = gtimer();
      mass_after = mass_here;
      if (n > 0) {
        const int span = (int)((r.b - 1) / G) - tile0 + 1;
        for (int t = threadIdx.x; t < span * 128; t += NW * 32) {
          atomicAdd(out + (i64)tile0 * 128 + t, red[t]);
          red[t] = 0.f;
        }
      }
    } else if (m[0] == K_MLP2) {  // ------------------------- gate|up + down over every CTA
      // [1] hidden [2] intermediate [3] G (hidden / 128) [4] NGI (intermediate / 128) [5]
      // gate|up items [6] out (h, added into) [7] gate|up sums (fp32 [2 intermediate], then
      // the tiles' flags: u32 [2 NGI], both zeroed each step) [8] in (h) [9] norm weight [11]
      // down items. The gate|up items are shared out over every CTA as a GEMV's (x =
      // RMSNorm(h)); each CTA adds its sums into the gate|up buffer and then its item count
      // into each touched tile's flag (release). Then the down items, shared out group by
      // group: a CTA's range is one or two input groups j, whose x_j = silu(g) u it makes
      // once the flags of gate tile j and up tile j say all G items are in (acquire); each
      // down item's sums go into h at once. No grid barrier between the two GEMVs, and no
      // CTA left out.
      const int K = (int)m[1], G = (int)m[3], NGI = (int)m[4], T = K / HD, I = NGI * HD;
      float* out = reinterpret_cast<float*>(m[6]);
      float* gus = reinterpret_cast<float*>(m[7]);
      unsigned* flag = reinterpret_cast<unsigned*>(gus + 2 * I);
      const Range r1 = cta_range((i64)2 * NGI * G, c, P), r2 = cta_range((i64)NGI * T, c, P);
      const int n1 = (int)(r1.b - r1.a), n2 = (int)(r2.b - r2.a);
      n_streamed = n1 + n2;
      if (n1 > 0)
        norm_x(nullptr, reinterpret_cast<const float*>(m[8]),
               reinterpret_cast<const u16*>(m[9]), K, p.eps, xs, xsum, ssum, warp, lane);
      consumers_sync();
      if (st && threadIdx.x == 0) st[2] = gtimer();
      gemv_items(ring, full, empty, stages, pos0, n1, G, (int)(r1.a % G), xs, xsum, red, warp,
                 lane);
      consumers_sync();
      if (n1 > 0) {  // the sums into the gate|up buffer, then each tile's item count
        const int tile0 = (int)(r1.a / G), span = (int)((r1.b - 1) / G) - tile0 + 1;
        for (int t = threadIdx.x; t < span * 128; t += NW * 32) {
          atomicAdd(gus + (i64)tile0 * 128 + t, red[t]);
          red[t] = 0.f;
        }
        consumers_sync();
        if (threadIdx.x < span) {
          const i64 a = max(r1.a, (i64)(tile0 + threadIdx.x) * G);
          const i64 b = min(r1.b, (i64)(tile0 + threadIdx.x + 1) * G);
          red_release_add(flag + tile0 + threadIdx.x, (unsigned)(b - a));
        }
      }
      if (n2 > 0) {
        const int j0 = (int)(r2.a / T), nj = (int)((r2.b - 1) / T) - j0 + 1;
        for (int t = threadIdx.x; t < nj; t += NW * 32) xsum[j0 + t] = 0.f;
        if (threadIdx.x < 2 * nj) {  // gate and up tile of each group: all G items in
          const int j = j0 + threadIdx.x / 2, tile = (threadIdx.x & 1) ? NGI + j : j;
          while (ld_acquire(flag + tile) < (unsigned)G) {
          }
        }
        consumers_sync();
        for (int t = threadIdx.x; t < nj * 64; t += NW * 32) {  // x_j = silu(g) u (fp16, the
          // sums rounded as the engine's output); a warp's 32 pairs are one group's
          const int kp = j0 * 64 + t;
          const float2 gv = ldcg2(gus + 2 * kp);
          const float2 uv = ldcg2(gus + I + 2 * kp);
          const float g0 = rh(gv.x), g1 = rh(gv.y);
          const u32 x2 = f22h2(rh(rh(g0 / (1.0f + ex(-g0))) * rh(uv.x)),
                               rh(rh(g1 / (1.0f + ex(-g1))) * rh(uv.y)));
          xs[kp] = x2;
          group_sum(xsum, kp, x2, lane);
        }
        consumers_sync();
        // entries pos0 + n1 + e: tile (r2.a + e) % T of input group (r2.a + e) / T, each
        // added into out at once
        const int part_ = warp % SPLIT, grp = warp / SPLIT;
        int slot;
        u32 phase;
        const int first = ring_start(pos0 + n1, grp, GROUPS, stages, slot, phase);
        int j = (int)((r2.a + first) / T), t = (int)((r2.a + first) % T);
        for (int e = first; e < n2; e += GROUPS, slot += GROUPS, t += GROUPS) {
          if (slot >= stages) slot -= stages, phase ^= 1u;
          while (t >= T) t -= T, ++j;
          warp_wait(&full[slot], phase);
          float f[4] = {0.f, 0.f, 0.f, 0.f};
          item_mma(ring + (size_t)slot * SLOT, xs + j * 64, xsum[j], part_, lane, f);
          __syncwarp();
          if (lane == 0) mbar_arrive(&empty[slot]);
          item_out(out + (i64)t * HD, merge + warp * 32, part_, lane, f);
        }
      }
      consumers_sync();
      if (st && threadIdx.x == 0) st[3] = gtimer();
    } else if (m[0] == K_ATTN) {  // ------------------------------------------------ ATTENTION
      // [1] layer [2] q|k|v output (fp32 sums [Hq + 2 Hkv][128])
      const int layer = (int)m[1];
      const float* qkv = reinterpret_cast<const float*>(m[2]);
      if (c < units) {
        const int kvh = c / S, s = c % S;
        const int e0 = s * unit_pages, e1 = min(n_pages, e0 + unit_pages);
        const int npg = max(0, e1 - e0);
        n_streamed = npg;
        // rotate-half RoPE: x'[d] = x[d] cos[d] + (d < 64 ? -x[d + 64] : x[d - 64]) sin[d]
        for (int t = threadIdx.x; t < GQA * HD; t += NW * 32) {
          const int d = t % HD, i = d & 63;
          const float* qh = qkv + (size_t)kvh * GQA * HD + (t - d);
          const float a = rh(ldcg(qh + d));
          const float b = rh(ldcg(qh + (d ^ 64)));
          qf[t] = rh(a * rope[i] + (d < 64 ? -b : b) * rope[64 + i]);
        }
        const bool last = s == S - 1;
        if (last && threadIdx.x < HD) {  // the current token's k (rotated) and v, to its slot
          const int d = threadIdx.x, i = d & 63;
          const float* kh = qkv + (size_t)p.hq * HD + (size_t)kvh * HD;
          const float a = rh(ldcg(kh + d));
          const float b = rh(ldcg(kh + (d ^ 64)));
          const u16 kq = f2h(a * rope[i] + (d < 64 ? -b : b) * rope[64 + i]);
          const u16 vq = f2h(ldcg(kh + (size_t)p.hkv * HD + d));
          kcur[d] = h2f(kq), vcur[d] = h2f(vq);
          const size_t at = (((size_t)layer * p.capacity * p.bs + slot_q) * p.hkv + kvh) * HD + d;
          p.kcache[at] = kq;
          p.vcache[at] = vq;
        }
        consumers_sync();
        const int g = lane >> 2, t = lane & 3;
        if (warp == 0) stage_qfrag<GQA>(qf, qfrag, lane);
        consumers_sync();
        if (st && threadIdx.x == 0) st[2] = gtimer();
        constexpr int DW = HD / ATT_WARPS, NT = DW / 8;  // this warp's P.V dims, 8-dim tiles
        const int grp = warp / ATT_WARPS, d0 = DW * (warp % ATT_WARPS);
        float mm = neg_inf(), ll = 0.f, o[NT][2];  // (the rows of heads g; g + 8: none)
#pragma unroll
        for (int jx = 0; jx < NT; ++jx) o[jx][0] = o[jx][1] = 0.f;
        if (last && grp == 0) {  // the current token: group 0's starting state
          float sc = 0.f;  // head g, dims 32 t .. 32 t + 31
          if (g < GQA) {
#pragma unroll 8
            for (int d = 32 * t; d < 32 * t + 32; ++d) sc += qf[g * HD + d] * kcur[d];
          }
          sc += __shfl_xor_sync(0xffffffffu, sc, 1);
          sc += __shfl_xor_sync(0xffffffffu, sc, 2);
          sc *= p.scale;
          if (MASS && warp == 0 && t == 0 && g < GQA) scur[g] = sc;
          mm = sc, ll = 1.f;
#pragma unroll
          for (int jx = 0; jx < NT; ++jx) {
            o[jx][0] = vcur[d0 + 8 * jx + 2 * t];
            o[jx][1] = vcur[d0 + 8 * jx + 2 * t + 1];
          }
        }
        {  // group grp takes the unit's pages grp, grp + AGROUPS, ... (whole ring slots; a
          // slot's empty barrier counts SPLIT arrivals: each warp gives SPLIT / ATT_WARPS)
          int slot;
          u32 phase;
          const int first = ring_start(pos0, grp, AGROUPS, stages, slot, phase);
          for (int e = first; e < npg; e += AGROUPS, slot += AGROUPS) {
            if (slot >= stages) slot -= stages, phase ^= 1u;
            warp_wait(&full[slot], phase);
            attend_page<DW / 16>(ring + (size_t)slot * SLOT, qfrag, lane, d0, vmask[e], p.scale,
                                 mm, ll, o,
                                 MASS && warp % ATT_WARPS == 0 && e < MASS_PAGES
                                     ? scores + e * GQA * PAGE
                                     : nullptr);
            __syncwarp();
            if (lane == 0) mbar_arrive_n(&empty[slot], SPLIT / ATT_WARPS);
          }
        }
        if (g < GQA) {  // this warp's state into merge [group][head][acc 128, m, l]
          float* mw = merge + (grp * GQA + g) * (HD + 2);
#pragma unroll
          for (int jx = 0; jx < NT; ++jx)
            *reinterpret_cast<float2*>(mw + d0 + 8 * jx + 2 * t) = make_float2(o[jx][0], o[jx][1]);
          if (warp % ATT_WARPS == 0 && t == 0) mw[HD] = mm, mw[HD + 1] = ll;
        }
        consumers_sync();
        if (st && threadIdx.x == 0) st[3] = gtimer();
        float* pu = p.part + (size_t)c * ATT_STRIDE;  // the unit's partial: acc, m, l
        for (int t2 = threadIdx.x; t2 < GQA * HD; t2 += NW * 32) {
          const int q = t2 / HD, d = t2 % HD;
          float M = neg_inf();
#pragma unroll
          for (int g2 = 0; g2 < AGROUPS; ++g2) M = fmaxf(M, merge[(g2 * GQA + q) * (HD + 2) + HD]);
          float A = 0.f, L = 0.f;
#pragma unroll
          for (int g2 = 0; g2 < AGROUPS; ++g2) {
            const float* mw2 = merge + (g2 * GQA + q) * (HD + 2);
            const float e = mw2[HD] == neg_inf() ? 0.f : ex(mw2[HD] - M);
            A += e * mw2[d], L += e * mw2[HD + 1];
          }
          pu[t2] = A;
          if (d == 0) pu[GQA * HD + q] = M, pu[GQA * HD + GQA + q] = L;
        }
      }
    } else if (m[0] == K_FINAL_NORM) {  // ---------------------------------------- FINAL NORM
      // [1] hidden [6] out (fp16 [hidden]) [9] norm weight: CTA 0 writes RMSNorm(h) * w
      if (c == 0) {
        const int K = (int)m[1];
        const u16* nw = reinterpret_cast<const u16*>(m[9]);
        u32* out = reinterpret_cast<u32*>(m[6]);
        float ss = 0.f;
        for (int kp = threadIdx.x; kp < K / 2; kp += NW * 32) {
          const float2 v = ldcg2(p.h + 2 * kp);
          ss += v.x * v.x + v.y * v.y;
        }
        const float rs = rsqrtf(consumers_sum<NW>(ss, ssum, warp, lane) / (float)K + p.eps);
        for (int kp = threadIdx.x; kp < K / 2; kp += NW * 32) {
          const float2 v = ldcg2(p.h + 2 * kp);
          const float2 w = h22f2(reinterpret_cast<const u32*>(nw)[kp]);
          out[kp] = f22h2(rh(v.x * rs) * w.x, rh(v.y * rs) * w.y);
        }
      }
    }
    pos0 += n_streamed;
    consumers_sync();
    if (threadIdx.x == 0) red_release_add(p.counter, 1u);
    if (st && threadIdx.x == 0) st[4] = gtimer();
    if (MASS && mass_after) {  // this CTA's attention unit (the o phase just arrived: this
      // fills the barrier's wait; nothing in the step reads the mass): each visible key's
      // probability
      const int layer = (int)m[10], kvh = c / S, s = c % S;
      if (threadIdx.x < GQA) {  // head q: M and 1 / L over the splits
        const int q = threadIdx.x;
        float M = neg_inf(), L = 0.f;
        for (int s2 = 0; s2 < S; ++s2) M = fmaxf(M, mls[s2 * 16 + q]);
        for (int s2 = 0; s2 < S; ++s2) {
          const float ms = mls[s2 * 16 + q];
          if (ms != neg_inf()) L += mls[s2 * 16 + 8 + q] * ex(ms - M);
        }
        mlh[q] = M, mlh[GQA + q] = 1.0f / L;
      }
      consumers_sync();
      const float* Mh = mlh;
      const float* Lh = Mh + GQA;
      const int e0 = s * unit_pages, npg = max(0, min(n_pages, e0 + unit_pages) - e0);
      for (int t = threadIdx.x; t < npg * PAGE; t += NW * 32) {
        const int e = e0 + t / PAGE, row = t % PAGE;
        float v = 0.f;
#pragma unroll
        for (int q = 0; q < GQA; ++q)
          v += ex(scores[((t / PAGE) * GQA + q) * PAGE + row] - Mh[q]) * Lh[q];
        if (v == 0.f) continue;  // invisible (score -inf)
        if (e < n_cache_pages) {
          const i64 pos = p.dev[2 + p.nb + e / ppb] + (e % ppb) * PAGE + row;
          if (q_pos - pos < p.min_distance) continue;
          const i64 blk = p.dev[2 + e / ppb];
          atomicAdd(&p.score[((((i64)layer * p.capacity + blk) * p.bs + (e % ppb) * PAGE + row) *
                              p.hkv) + kvh], v);
        } else {
          const i64 idx = (i64)(e - n_cache_pages) * PAGE + row;
          atomicAdd(&p.gmass[((i64)layer * p.hkv + kvh) * p.G + idx], v);
        }
      }
      if (s == S - 1 && threadIdx.x == 0 && p.min_distance <= 0) {  // the current token
        float v = 0.f;
        for (int q = 0; q < GQA; ++q) v += ex(scur[q] - Mh[q]) * Lh[q];
        atomicAdd(&p.score[((i64)layer * p.capacity * p.bs + slot_q) * p.hkv + kvh], v);
      }
      if (s == 0)
        for (int t = threadIdx.x; t < p.G; t += NW * 32)
          p.gseen[((i64)layer * p.hkv + kvh) * p.G + t] += 1.0f;
    }
  }
}

