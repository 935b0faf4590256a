// The skeleton of a whole-step persistent INT4 decode kernel: would one launch a token reach
// the 2.5x-fp16 target of issue 5?
//
// benchmarks/gpu_cuda_step.py drives it (BENCHMARKS.md "Runs 104-" has the numbers). It runs a
// decode step's data-dependent phases for the 8B decoder in ONE launch of one CTA per SM,
// with a grid barrier between phases:
//   per layer: q|k|v GEMV -> sparse attention over paged KV -> o GEMV (its x load combines
//   the attention's split partials) -> gate|up GEMV -> down GEMV (x = silu(g) u);
//   then the INT4 lm_head GEMV (4096 -> 128256).
// As in gemv_chain_ring.cu (whose GEMV item math and ring it reuses: mma.sync m16n8k16, 4
// warps an item, 16 consumer warps), a producer warp streams everything that does not depend
// on the token into a shared-memory ring and runs ahead across the barriers: the weights'
// 8512-byte items AND the attention's KV pages (K and V of 16 tokens of one KV head, 4 KB
// each, head-major cache [L][capacity][Hkv][16][128] fp16, pages through a block table).
//
// Attention phase: unit u = (KV head h, split s) on CTA u (8 x S units, S = 16: 128 of the
// 132 CTAs), its 4 query heads (GQA 4), pages [s P, (s + 1) P) of the block table; each
// consumer warp takes every 16th page (lane = key j & 15, half of the dims), online softmax
// in fp32, then the CTA merges its warps and writes the unit's (unnormalised acc[4][128], m,
// l). The last split also attends to the current token's k, v (from the q|k|v output).
// The o GEMV's x load combines the S partials of each head it uses (no separate phase).
//
// The RMSNorm before q|k|v, gate|up and the head is in their x loads (every CTA reads the
// whole 4096-vector for its sum of squares). The attention phase applies RoPE to q and the
// current k and stores the current k, v into the cache; a last phase takes the greedy argmax
// of the logits; with flag 64 (the mma attention) the o phase also adds each key's
// importance mass. Left out (the real kernel needs them; this measures the dependency
// structure and the bytes): the residual adds (the GEMVs' atomics would add into the
// residual stream itself), the globals' own mass slots, the sinks/window edge masks (every
// page here is full), the embedding row of the next token (the next step's first x load).
// x between GEMVs: x0 + f / 2 as in gemv_chain_ring.cu.
// Built with nvcc -O3 -gencode arch=compute_90,code=sm_90. Benchmark code, not the engine.
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "ring_common.cuh"

#define RED_TILES 10  // column tiles one CTA may touch in one GEMV (the host checks)
#define META 10
#define NW 16       // consumer warps
#define SPLIT 4     // warps an item (GEMV)
#define GROUPS (NW / SPLIT)
#define HD 128      // head dim
#define GQA 4       // query heads a KV head
#define PAGE 16     // tokens a page
#define ATT_STRIDE (GQA * (HD + 2))  // floats of one unit's partial: acc[4][128], m[4], l[4]
#define NSTAMP 12  // timeline entries a phase and CTA (step_launch says which)
#define HKV_N 8   // KV heads (the mass buffer's layout; the host checks)
#define HKV_UNITS (HKV_N * 16)  // attention units: KV heads x 16 splits
#define MASS_PAGES 32  // pages a unit may have with the importance mass on (flag 64)

__device__ __forceinline__ void consumers_sync() {
  asm volatile("bar.sync 1, %0;" ::"r"(NW * 32) : "memory");
}

// One page (16 keys of KV head h) into a warp's online-softmax state for ONE query head (the
// 4 warps of a group take the page's 4 GQA heads). Lane L: key j = L & 15, dims
// [64 (L >> 4), +64) for q.k; then dims 4 L.. for p.V. q: the head's q (fp32, pre-scaled,
// smem [128]); m, l: the head's running max and sum (the same in all lanes); acc: 4 dims.
__device__ __forceinline__ void attend_page(const uint8_t* pg, const float* q, int lane,
                                            float& m, float& l, float* acc) {
  const __half* K = reinterpret_cast<const __half*>(pg);
  const __half* V = reinterpret_cast<const __half*>(pg + PAGE * HD * 2);
  const int j = lane & 15, half = lane >> 4;
  float s0 = 0.f, s1 = 0.f;
#pragma unroll
  for (int c = 0; c < 8; ++c) {  // 8 chunks of 8 dims, rotated by key: no bank conflicts
    const int d0 = half * 64 + ((c + j) & 7) * 8;
    const uint4 kv = *reinterpret_cast<const uint4*>(K + j * HD + d0);
    const __half2* k2 = reinterpret_cast<const __half2*>(&kv);
    const float4 qa = *reinterpret_cast<const float4*>(q + d0);
    const float4 qb = *reinterpret_cast<const float4*>(q + d0 + 4);
    const float2 k01 = __half22float2(k2[0]), k23 = __half22float2(k2[1]);
    const float2 k45 = __half22float2(k2[2]), k67 = __half22float2(k2[3]);
    s0 += qa.x * k01.x + qa.y * k01.y + qa.z * k23.x + qa.w * k23.y;
    s1 += qb.x * k45.x + qb.y * k45.y + qb.z * k67.x + qb.w * k67.y;
  }
  float sc = s0 + s1;
  sc += __shfl_xor_sync(0xffffffffu, sc, 16);  // both halves of the dims
  float mx = sc;
#pragma unroll
  for (int o = 8; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  const float mn = fmaxf(m, mx);
  const float corr = __expf(m - mn);  // m = -inf at the start: 0
  const float p = __expf(sc - mn);
  float ps = p;
#pragma unroll
  for (int o = 8; o > 0; o >>= 1) ps += __shfl_xor_sync(0xffffffffu, ps, o);
  l = l * corr + ps;
  m = mn;
  float a0 = acc[0] * corr, a1 = acc[1] * corr, a2 = acc[2] * corr, a3 = acc[3] * corr;
#pragma unroll
  for (int jj = 0; jj < PAGE; ++jj) {
    const uint2 vv = *reinterpret_cast<const uint2*>(V + jj * HD + 4 * lane);
    const float2 v01 = __half22float2(*reinterpret_cast<const __half2*>(&vv.x));
    const float2 v23 = __half22float2(*reinterpret_cast<const __half2*>(&vv.y));
    const float pj = __shfl_sync(0xffffffffu, p, jj);
    a0 += pj * v01.x, a1 += pj * v01.y, a2 += pj * v23.x, a3 += pj * v23.y;
  }
  acc[0] = a0, acc[1] = a1, acc[2] = a2, acc[3] = a3;
}

// ---- Attention with mma.sync (flag 32). The 4 query heads are rows 0-3 of the m16 tiles
// (rows 4-15 zero). Page slot layout: K [16 keys][128] fp16, then V [16 keys][128] fp16 with
// its 16-byte chunks swizzled IN THE CACHE (chunk j of key row r stored at j ^ (r & 7)): the
// kernel owns the cache layout, and ldmatrix.trans reads 8 keys' rows of one dim chunk, which
// would all hit the same banks at a 256-B stride. (Run 110 padded the rows in shared memory
// instead, with 16 bulk copies of 256 B a page: the page stream slowed by ~3 us a layer.)
// q.K: the dims are visited in a permuted order (the same for q and every key, so the dot
// products are unchanged): in K tile s lane (g, t) holds words w(s, t) = 16 t + 2 s (b0 / a0)
// and 16 t + 2 s + 1 (b1 / a2) of a 64-word row, so its 16 words of a key row are contiguous
// (4 LDS.128, chunk c = K tiles 2c, 2c+1), read in the rotated order c = (i + (t >> 1)) & 3
// (2-way bank conflicts between keys g and g + 1; a rotation by g would break the mma's
// pairing of A and B lanes). The q
// fragments are staged once per unit in qfrag [lane][4 chunks][4 words] (chunk c of lane L at
// word 16 L + 4 ((c + (L >> 1)) & 3): conflict-free LDS.128 too).
// P.V: the q.K accumulators (row g = head, keys 2t, 2t+1 of each n tile) are P's A fragment
// as they are (FA2's register reuse); V's B fragments come from ldmatrix.x4.trans. A warp of
// a group computes q.K for the whole page (all 4 warps the same) and P.V for its 32 dims.
// o[4][4]: this warp's 4 n tiles (dims d0 + 8 j + 2 t, +1 in o[j][0], o[j][1]; rows g + 8 in
// o[j][2..3] are unused); m, l of head g (lanes g < 4; the other lanes carry junk rows).
__device__ __forceinline__ void attend_page_mma(const uint8_t* pg, const uint32_t* qfrag,
                                                int lane, int d0, float& m, float& l,
                                                float (*o)[4], float* sc_out) {
  // q.K in ring.cuh (the chunk order may depend on t only; run 109 rotated by g too: wrong
  // scores)
  const int t = lane & 3;
  float s0[4], s1[4];  // keys 0-7, 8-15
  page_qk(pg, qfrag, lane, s0, s1);
  if (sc_out && (lane >> 2) < GQA) {  // the page's scores [head][16 keys] for the mass
    float* so = sc_out + (lane >> 2) * PAGE;
    *reinterpret_cast<float2*>(so + 2 * t) = make_float2(s0[0], s0[1]);
    *reinterpret_cast<float2*>(so + 8 + 2 * t) = make_float2(s1[0], s1[1]);
  }
  uint32_t pa[4];
  const float corr = page_softmax(s0[0], s0[1], s1[0], s1[1], m, l, pa);  // ring.cuh
  const uint8_t* V = pg + PAGE * HD * 2;
  const int key = (lane & 7) + 8 * ((lane >> 3) & 1), chunk = lane >> 4;
#pragma unroll
  for (int jj = 0; jj < 2; ++jj) {
    uint32_t b[4];
    const int jc = (d0 + 16 * jj + 8 * chunk) >> 3;  // 16-byte chunk of the row, swizzled
    ldsm_x4_trans(b, V + key * (HD * 2) + ((jc ^ (key & 7)) << 4));
#pragma unroll
    for (int q = 0; q < 4; ++q) o[2 * jj][q] *= corr, o[2 * jj + 1][q] *= corr;
    mma16816(o[2 * jj], pa, b[0], b[1]);
    mma16816(o[2 * jj + 1], pa, b[2], b[3]);
  }
}

// A consumer group's pass over the attention unit's pages: group grp takes the unit's pages
// grp, grp + GROUPS, ... (stream positions pos0 + e); page(bytes) runs on each; warp 0 times
// its waits and its math (stamps [5], [9], [10]).
template <class F>
__device__ __forceinline__ void page_loop(uint8_t* ring, u64* full, u64* empty,
                                          int pos0, int grp, int npg, int stages, int warp,
                                          int lane, bool timeline, unsigned long long* st,
                                          F&& page) {
  int slot;
  uint32_t phase;
  const int first = ring_start(pos0, grp, GROUPS, stages, slot, phase);
  unsigned long long page_wait = 0, page_math = 0;
  for (int e = first; e < npg; e += GROUPS, slot += GROUPS) {
    if (slot >= stages) slot -= stages, phase ^= 1u;
    if (timeline && warp == 0) {  // warp 0 times its waits and its math
      const unsigned long long w0 = clock64();
      warp_wait(&full[slot], phase);
      const unsigned long long a0 = clock64();
      page(ring + (size_t)slot * ITEM_BYTES, e);
      __syncwarp();
      page_wait += a0 - w0, page_math += clock64() - a0;
    } else {
      warp_wait(&full[slot], phase);
      page(ring + (size_t)slot * ITEM_BYTES, e);
      __syncwarp();
    }
    if (lane == 0) mbar_arrive(&empty[slot]);
  }
  if (timeline && threadIdx.x == 0) st[5] = page_wait, st[9] = page_math, st[10] = clock64();
}

// One attention unit with mma.sync (flag 32): this warp's share, then its states into merge
// ([group][head][acc 128, m, l], as the FMA path writes them).
__device__ __forceinline__ void attention_unit_mma(
    uint8_t* ring, u64* full, u64* empty, const float* qf, uint32_t* qfrag,
    float* merge, const float* kc, const float* vc, bool last, int npg, int pos0, int stages,
    int warp, int lane, bool timeline, unsigned long long* st, float* scores) {
  const int grp = warp / GQA, qd = warp % GQA, d0 = 32 * qd, g = lane >> 2, t = lane & 3;
  if (warp == 0) stage_qfrag<GQA>(qf, qfrag, lane);  // q fragments (fp16), ring.cuh
  consumers_sync();
  float m = -INFINITY, l = 0.f, o[4][4];
#pragma unroll
  for (int j = 0; j < 4; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  if (last && grp == 0) {  // the current token: group 0's starting state
    float sc = 0.f;  // head g, dims 32 t .. 32 t + 31 (lanes g < 4); kc, vc: fp16 values
    if (g < GQA) {
#pragma unroll 8
      for (int d = 32 * t; d < 32 * t + 32; ++d)
        sc += qf[g * HD + d] * kc[d];
    }
    sc += __shfl_xor_sync(0xffffffffu, sc, 1);
    sc += __shfl_xor_sync(0xffffffffu, sc, 2);
    m = sc, l = 1.f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      o[j][0] = vc[d0 + 8 * j + 2 * t];
      o[j][1] = vc[d0 + 8 * j + 2 * t + 1];
    }
  }
  page_loop(ring, full, empty, pos0, grp, npg, stages, warp, lane, timeline, st,
            [&](const uint8_t* pg, int e) {
              attend_page_mma(pg, qfrag, lane, d0, m, l, o,
                              scores && qd == 0 ? scores + e * GQA * PAGE : nullptr);
            });
  if (g < GQA) {
    float* mw = merge + (grp * GQA + g) * (HD + 2);
#pragma unroll
    for (int j = 0; j < 4; ++j)
      *reinterpret_cast<float2*>(mw + d0 + 8 * j + 2 * t) = make_float2(o[j][0], o[j][1]);
    if (qd == 0 && t == 0) mw[HD] = m, mw[HD + 1] = l;
  }
}

// Phase metadata (META int64 each):
//   GEMV: [0] 0, [1] K, [2] N, [3] G, [4] T, [5] item base, [6] out offset (floats of outs),
//         [7] xform (0: x0 + f / 2 with f = outs[in..]; 1: f = silu(g) u of outs[in..];
//         2: f = the attention output combined from the partials at part + in; 3: RMSNorm
//         of x0 + f / 2 over all 4096, weights x0[4096..8191]), [8] in (-1: x0)
//   ATTN: [0] 1, [1] Hkv, [2] S splits, [3] pages a unit, [4] layer, [5] partial offset
//         (floats of part), [6] q|k|v output offset (floats of outs), [7] Hq, [9] the cache
//         block of the current token (row 5; its rotated k and v are stored there)
//   ARGMAX: [0] 2, [1] vocabulary, [2] logits offset (floats of outs); the token goes to
//         counter[2..3] as (order-preserving value bits << 32 | ~index)
// MASS: the importance mass (flag 64 picks this instance; it spills a few bytes at the
// 96-register cap, the other instance does not)
template <bool MASS>
__global__ void __launch_bounds__((NW + 1) * 32, 1)
    step_ring(const uint8_t* __restrict__ items, const long long* __restrict__ meta,
              __half* __restrict__ kcache, __half* __restrict__ vcache,
              const int* __restrict__ block_table, long long capacity,
              const float* __restrict__ x0, float* outs, float* part, unsigned* counter,
              int n_phase, int stages, int flags, unsigned long long* stamps, float* mass) {
  extern __shared__ __align__(128) uint8_t smem[];
  uint8_t* ring = smem;
  __half2* xs = reinterpret_cast<__half2*>(smem + (size_t)stages * ITEM_BYTES);
  float* red = reinterpret_cast<float*>(xs + MAX_K / 2);  // [RED_TILES][128]
  float* xsum = red + RED_TILES * 128;                    // [MAX_G]
  float* wts = xsum + MAX_G;                               // [32 heads][16 splits]: attention
  float* qf = wts + 32 * 16;                               // [4][128] q of the unit's heads
  float* merge = qf + GQA * HD;                            // [GROUPS][4][130] states
  float* ssum = merge + GROUPS * ATT_STRIDE;                // [NW] the norm's warp sums
  uint32_t* qfrag = reinterpret_cast<uint32_t*>(ssum + NW);  // [32 lanes][16] (flag 32)
  float* kcur_s = reinterpret_cast<float*>(qfrag + 512);     // [128] rotated k, fp16 values
  float* vcur_s = kcur_s + HD;                                // [128] v
  float* scores_s = vcur_s + HD;  // [MASS_PAGES][4][16] the unit's scores (flag 64)
  float* mlbuf = scores_s + MASS_PAGES * GQA * PAGE;  // [16 splits][m 4, l 4], M 4, 1/L 4
  u64* full = reinterpret_cast<u64*>(mlbuf + 17 * 2 * GQA);
  u64* empty = full + stages;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int P = gridDim.x, c = blockIdx.x;
  ring_init(full, empty, stages, SPLIT);
  for (int t = threadIdx.x; t < RED_TILES * 128; t += blockDim.x) red[t] = 0.f;
  __syncthreads();
  const bool wait_barrier = flags & 1, timeline = flags & 8, mma_attention = flags & 32;
  const bool with_mass = MASS && mma_attention;

  if (warp == NW) {  // producer: the CTA's weight items and KV pages of every phase, in order
    if (lane == 0) {
      int slot = 0, round = 0;
      auto next = [&]() -> uint8_t* {
        if (round > 0) mbar_wait(&empty[slot], (uint32_t)((round - 1) & 1));
        uint8_t* dst = ring + (size_t)slot * ITEM_BYTES;
        return dst;
      };
      auto advance = [&]() {
        if (++slot == stages) slot = 0, ++round;
      };
      for (int ph = 0; ph < n_phase; ++ph) {
        const long long* m = meta + ph * META;
        if (m[0] == 0) {
          Range r = cta_range(m[3] * m[4], c, P);
          const uint8_t* src = items + ((size_t)m[5] + (size_t)r.a) * ITEM_BYTES;
          for (long long i = r.a; i < r.b; ++i, src += ITEM_BYTES) {
            uint8_t* dst = next();
            mbar_arrive_tx(&full[slot], ITEM_BYTES);
            bulk_g2s(dst, src, ITEM_BYTES, &full[slot]);
            advance();
          }
        } else if (m[0] == 1) {
          const int hkv = (int)m[1], S = (int)m[2], npg = (int)m[3], layer = (int)m[4];
          if (c < hkv * S) {
            const int h = c / S, s = c % S;
            for (int q = 0; q < npg; ++q) {
              const long long blk = block_table[s * npg + q];
              const size_t off = ((((size_t)layer * capacity + blk) * hkv + h) * PAGE) * HD;
              uint8_t* dst = next();
              mbar_arrive_tx(&full[slot], 2 * PAGE * HD * 2);
              bulk_g2s(dst, kcache + off, PAGE * HD * 2, &full[slot]);
              bulk_g2s(dst + PAGE * HD * 2, vcache + off, PAGE * HD * 2, &full[slot]);
              advance();
            }
          }
        }
      }
    }
    return;
  }

  int pos0 = 0;  // items and pages streamed to this CTA before the current phase
  for (int ph = 0; ph < n_phase; ++ph) {
    const long long* m = meta + ph * META;
    unsigned long long* st = stamps + ((size_t)ph * P + c) * NSTAMP;
    if (timeline && threadIdx.x == 0) st[0] = clock64(), st[5] = 0;
    if (ph > 0 && wait_barrier && threadIdx.x == 0) {
      const unsigned target = (unsigned)(ph * P);
      while (ld_acquire(counter) < target) {
      }
    }
    consumers_sync();
    if (timeline && threadIdx.x == 0) st[1] = clock64(), st[6] = gtimer();
    int n_streamed = 0;
    if (m[0] == 0) {  // ---------------------------------------------------------- GEMV
      const int K = (int)m[1], G = (int)m[3], xform = (int)m[7];
      const long long in_off = m[8];
      float* out = outs + m[6];
      Range r = cta_range(m[3] * m[4], c, P);
      const int n = (int)(r.b - r.a), tile0 = (int)(r.a / G), j0 = (int)(r.a % G);
      n_streamed = n;
      // importance mass of the attention unit this CTA ran (o's phase: every split's m, l is
      // out now): its m, l loads go out here, the mass is made after the items
      const bool mass_here = with_mass && xform == 2 && c < HKV_UNITS;
      if (mass_here && threadIdx.x < 32) {  // [split][m 4, l 4] of this KV head, straight
        // into shared memory with cp.async (no register held across the items)
        const int sp = threadIdx.x >> 1, hf = threadIdx.x & 1;
        const float* src =
            part + in_off + (size_t)((c / 16) * 16 + sp) * ATT_STRIDE + GQA * HD + 4 * hf;
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(
                         smem_u32(mlbuf + sp * 2 * GQA + 4 * hf)), "l"(src) : "memory");
        asm volatile("cp.async.commit_group;" ::: "memory");
      }
      if (n > 0) {
        const int j1 = (int)((r.b - 1) % G);
        const bool all = n >= G;
        const int ngrp = all ? G : (j1 >= j0 ? j1 - j0 + 1 : G - j0 + j1 + 1);
        const int npairs = ngrp * 64;
        const bool one_round = flags & 16;
        if (xform == 2 && !one_round) {  // attention: each used head's weights exp(m_s - M) / L
          const int S = 16;
          for (int q = warp; q < ngrp; q += NW) {
            const int hq = all ? q : (j0 + q) % G;
            const float* pp = part + in_off + (size_t)((hq / GQA) * S) * ATT_STRIDE;
            const float ms = lane < S ? __ldcg(pp + lane * ATT_STRIDE + GQA * HD + hq % GQA)
                                      : -INFINITY;
            const float ls = lane < S ? __ldcg(pp + lane * ATT_STRIDE + GQA * HD + GQA +
                                               hq % GQA) : 0.f;
            float M = ms;
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
            const float e = lane < S ? __expf(ms - M) : 0.f;
            float L = e * ls;
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) L += __shfl_xor_sync(0xffffffffu, L, o);
            if (lane < S) wts[hq * 16 + lane] = e / L;
          }
          consumers_sync();
        }
        const float* src = in_off < 0 ? x0 : outs + in_off;
        const float2* x02 = reinterpret_cast<const float2*>(x0);
        if (xform == 3) {  // RMSNorm: K = 4096 (the host checks), 4 pairs a thread
          float2 v[4];
          float ss = 0.f;
#pragma unroll
          for (int u = 0; u < 4; ++u) {
            const int kp = threadIdx.x + u * NW * 32;
            v[u] = x02[kp];
            if (in_off >= 0) {
              const float2 fv = __ldcg(reinterpret_cast<const float2*>(src) + kp);
              v[u].x += 0.5f * fv.x, v[u].y += 0.5f * fv.y;
            }
            ss += v[u].x * v[u].x + v[u].y * v[u].y;
          }
          const float r = rsqrtf(consumers_sum<NW>(ss, ssum, warp, lane) / 4096.0f + 1e-5f);
#pragma unroll
          for (int u = 0; u < 4; ++u) {
            const int kp = threadIdx.x + u * NW * 32;
            const float2 nw = x02[2048 + kp];
            xs[kp] = __floats2half2_rn(v[u].x * r * nw.x, v[u].y * r * nw.y);
          }
        }
        for (int t = threadIdx.x; t < npairs && xform != 3; t += NW * 32) {
          const int kp = all ? t : ((j0 * 64 + t) % (K / 2));
          const float2 b = x02[kp & 2047];
          float v0 = b.x, v1 = b.y;
          if (in_off >= 0) {
            float f0, f1;
            if (xform == 2) {  // pair kp: head hq = kp / 64, dims 2 (kp % 64) + {0, 1}
              const int hq = kp / 64, d = 2 * (kp % 64);
              const float* pp = part + in_off + (size_t)((hq / GQA) * 16) * ATT_STRIDE +
                                (hq % GQA) * HD + d;
              f0 = f1 = 0.f;
              if (one_round) {  // every load at once: m, l and this pair of all 16 splits
                const float* pml = pp - (hq % GQA) * HD - d + GQA * HD + hq % GQA;
                float2 a[16];
                float ms[16], ls[16];
#pragma unroll
                for (int s = 0; s < 16; ++s) {
                  a[s] = __ldcg(reinterpret_cast<const float2*>(pp + s * ATT_STRIDE));
                  ms[s] = __ldcg(pml + s * ATT_STRIDE);
                  ls[s] = __ldcg(pml + s * ATT_STRIDE + GQA);
                }
                float M = ms[0];
#pragma unroll
                for (int s = 1; s < 16; ++s) M = fmaxf(M, ms[s]);
                float L = 0.f;
#pragma unroll
                for (int s = 0; s < 16; ++s) {
                  const float e = __expf(ms[s] - M);
                  L += e * ls[s], f0 += e * a[s].x, f1 += e * a[s].y;
                }
                f0 /= L, f1 /= L;
              } else {
#pragma unroll
                for (int s = 0; s < 16; ++s) {
                  const float2 a = __ldcg(reinterpret_cast<const float2*>(pp + s * ATT_STRIDE));
                  const float w = wts[hq * 16 + s];
                  f0 += w * a.x, f1 += w * a.y;
                }
              }
            } else {
              const float2 gv = __ldcg(reinterpret_cast<const float2*>(src) + kp);
              f0 = gv.x, f1 = gv.y;
              if (xform == 1) {
                const float2 uv = __ldcg(reinterpret_cast<const float2*>(src) + K / 2 + kp);
                f0 = f0 / (1.0f + __expf(-f0)) * uv.x;
                f1 = f1 / (1.0f + __expf(-f1)) * uv.y;
              }
            }
            v0 += 0.5f * f0, v1 += 0.5f * f1;
          }
          xs[kp] = __floats2half2_rn(v0, v1);
        }
        consumers_sync();
        for (int q = warp; q < ngrp; q += NW) {  // each used group's fp16 x sum
          const int jj = all ? q : (j0 + q) % G;
          const float2 a = __half22float2(xs[jj * 64 + lane]);
          const float2 b = __half22float2(xs[jj * 64 + 32 + lane]);
          float v = (a.x + a.y) + (b.x + b.y);
#pragma unroll
          for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
          if (lane == 0) xsum[jj] = v;
        }
      }
      consumers_sync();
      if (timeline && threadIdx.x == 0) st[2] = clock64();
      const int part_ = warp % SPLIT, grp = warp / SPLIT;
      const int first = (((grp - pos0) % GROUPS) + GROUPS) % GROUPS;
      float f[2 * (8 / SPLIT)] = {};
      unsigned long long ring_wait = 0;
      int cur = -1;
      int slot = (pos0 + first) % stages, rel = (j0 + first) / G, j = (j0 + first) % G;
      uint32_t phase = (uint32_t)(((pos0 + first) / stages) & 1);
      auto flush = [&](int tile) {
        if ((lane & 3) == 0) {
          const int g = lane >> 2;
#pragma unroll
          for (int rr = 0; rr < 8 / SPLIT; ++rr) {
            const int rt = part_ * (8 / SPLIT) + rr;
            atomicAdd(&red[tile * 128 + 16 * rt + g], f[2 * rr]);
            atomicAdd(&red[tile * 128 + 16 * rt + g + 8], f[2 * rr + 1]);
          }
        }
#pragma unroll
        for (int q = 0; q < 2 * (8 / SPLIT); ++q) f[q] = 0.f;
      };
      for (int e = first; e < n; e += GROUPS, slot += GROUPS, j += GROUPS) {
        if (slot >= stages) slot -= stages, phase ^= 1u;
        if (j >= G) j -= G, ++rel;
        if (rel != cur) {
          if (cur >= 0) flush(cur);
          cur = rel;
        }
        if (timeline && warp == 0) {
          const unsigned long long w0 = clock64();
          warp_wait(&full[slot], phase);
          ring_wait += clock64() - w0;
        } else {
          warp_wait(&full[slot], phase);
        }
        item_mma<SPLIT, false, 1>(ring + (size_t)slot * ITEM_BYTES, xs + j * 64, xsum[j], part_,
                                 lane, f);
        __syncwarp();
        if (lane == 0) mbar_arrive(&empty[slot]);
      }
      if (cur >= 0) flush(cur);
      if (timeline && threadIdx.x == 0) st[5] = ring_wait;
      if (mass_here && threadIdx.x < 32) asm volatile("cp.async.wait_all;" ::: "memory");
      consumers_sync();
      if (mass_here) {  // key k of page e: sum over the 4 heads of exp(s - M) / L
        const int layer = (int)(m[9] & 0xffff), npg = (int)(m[9] >> 16), sp = c % 16;
        if (threadIdx.x < GQA) {  // head q's M and 1 / L over the 16 splits, into mlbuf[128..]
          const int q = threadIdx.x;
          float M = -INFINITY, L = 0.f;
          for (int s2 = 0; s2 < 16; ++s2) M = fmaxf(M, mlbuf[s2 * 2 * GQA + q]);
          for (int s2 = 0; s2 < 16; ++s2)
            L += mlbuf[s2 * 2 * GQA + GQA + q] * __expf(mlbuf[s2 * 2 * GQA + q] - M);
          mlbuf[16 * 2 * GQA + q] = M, mlbuf[16 * 2 * GQA + GQA + q] = 1.0f / L;
        }
        consumers_sync();
        const float* Mh = mlbuf + 16 * 2 * GQA;
        const float* Lh = Mh + GQA;
        for (int t = threadIdx.x; t < npg * PAGE; t += NW * 32) {
          const int e = t / PAGE, row = t % PAGE;
          float v = 0.f;
#pragma unroll
          for (int q = 0; q < GQA; ++q)
            v += __expf(scores_s[(e * GQA + q) * PAGE + row] - Mh[q]) * Lh[q];
          const long long blk = block_table[sp * npg + e];
          // a reduction (no return value): no L2 round trip on this CTA's path
          atomicAdd(&mass[(((size_t)layer * capacity + blk) * HKV_N + c / 16) * PAGE + row], v);
        }
      }
      if (timeline && threadIdx.x == 0) st[3] = clock64();
      if (n > 0) {
        const int span = (int)((r.b - 1) / G) - tile0 + 1;
        for (int t = threadIdx.x; t < span * 128; t += NW * 32) {
          atomicAdd(out + (long long)tile0 * 128 + t, red[t]);
          red[t] = 0.f;
        }
      }
    } else if (m[0] == 2) {  // ------------------------------------------------- ARGMAX
      // greedy sampling: the CTA's share of the logits, then one 64-bit atomicMax of
      // (order-preserving bits of the value, ~index: the lowest index wins ties)
      if (timeline && threadIdx.x == 0) st[2] = clock64();
      const long long nv = m[1];
      const float* lg = outs + m[2];
      Range r = cta_range(nv, c, P);
      unsigned long long best = 0ull;
      for (long long i = r.a + threadIdx.x; i < r.b; i += NW * 32) {
        const uint32_t b = __float_as_uint(__ldcg(lg + i));
        const uint32_t key = b & 0x80000000u ? ~b : b | 0x80000000u;
        const unsigned long long k =
            ((unsigned long long)key << 32) | (0xffffffffu - (uint32_t)i);
        best = k > best ? k : best;
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {
        const unsigned long long other = __shfl_xor_sync(0xffffffffu, best, o);
        best = other > best ? other : best;
      }
      if (lane == 0 && best) atomicMax(reinterpret_cast<unsigned long long*>(counter + 2), best);
      if (timeline && threadIdx.x == 0) st[3] = clock64();
    } else {  // ----------------------------------------------------------- ATTENTION
      const int hkv = (int)m[1], S = (int)m[2], npg = (int)m[3];
      const int hq_n = (int)m[7];
      const long long qkv = m[6];
      if (timeline && threadIdx.x == 0) st[2] = clock64();
      if (c < hkv * S) {
        const int h = c / S, s = c % S;
        n_streamed = npg;
        const float scale = rsqrtf((float)HD);
        // RoPE (rotate-half pairs d, d +- 64) at this token's position: cos, sin of the 64
        // frequencies at x0[8192..8319] (the engine keeps such a table too)
        const float* rope = x0 + 8192;
        for (int t = threadIdx.x; t < GQA * HD; t += NW * 32) {
          const int d = t % HD, i = d & 63;
          const float* qh = outs + qkv + (size_t)h * GQA * HD + (t - d);
          const float a = __ldcg(qh + d), b = __ldcg(qh + (d ^ 64));
          qf[t] = (a * rope[i] + (d < 64 ? -b : b) * rope[64 + i]) * scale;
        }
        if (s == S - 1 && threadIdx.x < HD) {  // the current token: k rotated, k and v fp16,
          const int d = threadIdx.x, i = d & 63;  // into the cache slot (block cur_blk, row 5)
          const float* kh = outs + qkv + (size_t)hq_n * HD + (size_t)h * HD;
          const float a = __ldcg(kh + d), b = __ldcg(kh + (d ^ 64));
          const __half kq = __float2half_rn(a * rope[i] + (d < 64 ? -b : b) * rope[64 + i]);
          const __half vq = __float2half_rn(__ldcg(kh + (size_t)hkv * HD + d));
          kcur_s[d] = __half2float(kq), vcur_s[d] = __half2float(vq);
          const size_t base = ((((size_t)m[4] * capacity + m[9]) * hkv + h) * PAGE + 5) * HD;
          kcache[base + d] = kq;
          // the mma attention's V cache is chunk-swizzled by row (row 5: chunk j at j ^ 5)
          vcache[base + (mma_attention ? ((((d >> 3) ^ 5) << 3) | (d & 7)) : d)] = vq;
        }
        consumers_sync();
        if (timeline && threadIdx.x == 0) st[8] = clock64();
        const int hh = warp % GQA, grp = warp / GQA;  // query head 4 h + hh; page group
        if (mma_attention) {
          attention_unit_mma(ring, full, empty, qf, qfrag, merge, kcur_s, vcur_s,
                             s == S - 1, npg, pos0, stages, warp, lane, timeline, st,
                             with_mass ? scores_s : nullptr);
        } else {
        float mm = -INFINITY, ll = 0.f, acc[4] = {0.f, 0.f, 0.f, 0.f};
        if (s == S - 1 && grp == 0) {  // the current token: group 0's starting state
          const float4 k4 = *reinterpret_cast<const float4*>(kcur_s + 4 * lane);
          const float4 v4 = *reinterpret_cast<const float4*>(vcur_s + 4 * lane);
          const float4 q4 = *reinterpret_cast<const float4*>(qf + hh * HD + 4 * lane);
          float sc = q4.x * k4.x + q4.y * k4.y + q4.z * k4.z + q4.w * k4.w;
#pragma unroll
          for (int o = 16; o > 0; o >>= 1) sc += __shfl_xor_sync(0xffffffffu, sc, o);
          mm = sc, ll = 1.f;
          if (timeline && threadIdx.x == 0) st[11] = clock64();
          acc[0] = v4.x, acc[1] = v4.y, acc[2] = v4.z, acc[3] = v4.w;
        }
        page_loop(ring, full, empty, pos0, grp, npg, stages, warp, lane, timeline, st,
                  [&](const uint8_t* pg, int) {
                    attend_page(pg, qf + hh * HD, lane, mm, ll, acc);
                  });
        float* mw = merge + (grp * GQA + hh) * (HD + 2);  // [group][head][acc 128, m, l]
        *reinterpret_cast<float4*>(mw + 4 * lane) = make_float4(acc[0], acc[1], acc[2], acc[3]);
        if (lane == 0) mw[HD] = mm, mw[HD + 1] = ll;
        }
        consumers_sync();
        if (timeline && threadIdx.x == 0) st[3] = clock64();
        float* pu = part + m[5] + (size_t)c * ATT_STRIDE;
        for (int t = threadIdx.x; t < GQA * HD; t += NW * 32) {
          const int q = t / HD, d = t % HD;
          float M = -INFINITY;
          for (int g2 = 0; g2 < GROUPS; ++g2) M = fmaxf(M, merge[(g2 * GQA + q) * (HD + 2) + HD]);
          float A = 0.f, L = 0.f;
          for (int g2 = 0; g2 < GROUPS; ++g2) {
            const float* mw2 = merge + (g2 * GQA + q) * (HD + 2);
            const float e = mw2[HD] == -INFINITY ? 0.f : __expf(mw2[HD] - M);
            A += e * mw2[d], L += e * mw2[HD + 1];
          }
          pu[t] = A;
          if (d == 0) pu[GQA * HD + q] = M, pu[GQA * HD + GQA + q] = L;
        }
      } else if (timeline && threadIdx.x == 0) {
        st[3] = clock64();
      }
    }
    pos0 += n_streamed;
    consumers_sync();
    if (threadIdx.x == 0) red_release_add(counter, 1u);
    if (timeline && threadIdx.x == 0) st[4] = clock64(), st[7] = gtimer();
  }
}

static size_t smem_bytes(int stages) {
  return (size_t)stages * ITEM_BYTES + (MAX_K / 2) * sizeof(__half2) +
         (RED_TILES * 128 + MAX_G + 32 * 16 + GQA * HD + GROUPS * ATT_STRIDE + NW + 512 + 2 * HD +
              MASS_PAGES * GQA * PAGE + 17 * 2 * GQA) *
             sizeof(float) +
         2 * stages * sizeof(u64);
}

extern "C" {
// 0: launched; -2: stages not a multiple of the 4 consumer groups (a slot must keep one owner,
// see gemv_chain_ring.cu's launch()); 1000 + e: setting the
// shared-memory limit failed (cudaError_t e); 2000 + e: the launch failed. flags: 1 wait at
// the grid barriers; 8 timeline into stamps (NSTAMP u64 per phase and CTA: [0-4] clock64 at
// the start, after the barrier, inputs ready, work done, arrived; [5] warp 0's cycles waiting
// for ring slots or pages; [6], [7] globaltimer after the barrier and after the arrival;
// attention only: [8] clock64 after the q load, [9] warp 0's cycles in attend_page, [10]
// clock64 after warp 0's page loop, [11] after the current token's score (last split));
// 16 the o GEMV's x load combines the attention partials in one round of loads; 32 the
// attention math with mma.sync (attend_page_mma) instead of fp32 FMAs; 64 (with 32) the
// importance mass: each key's attention probability summed over its 4 query heads, added
// into mass [L][capacity][Hkv][16] (the unit's scores kept in shared memory, the mass made
// in the o phase once every split's m, l is out; no extra dependency).
int step_launch(const void* items, const void* meta, void* kcache, void* vcache,
                const void* block_table, long long capacity, const void* x0, void* outs,
                void* part, void* counter, int n_phase, int ctas, int stages, int flags,
                void* stamps, void* mass, void* stream) {
  if (stages % GROUPS != 0) return -2;
  size_t smem = smem_bytes(stages);
  auto kernel = (flags & 64) ? step_ring<true> : step_ring<false>;
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       (int)smem);
  if (e != cudaSuccess) return 1000 + (int)e;
  kernel<<<ctas, (NW + 1) * 32, smem, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const uint8_t*>(items), static_cast<const long long*>(meta),
      static_cast<__half*>(kcache), static_cast<__half*>(vcache),
      static_cast<const int*>(block_table), capacity, static_cast<const float*>(x0),
      static_cast<float*>(outs), static_cast<float*>(part), static_cast<unsigned*>(counter),
      n_phase, stages, flags, static_cast<unsigned long long*>(stamps),
      static_cast<float*>(mass));
  e = cudaGetLastError();
  return e == cudaSuccess ? 0 : 2000 + (int)e;
}
long long step_smem_bytes(int stages) { return (long long)smem_bytes(stages); }
const char* step_error_string(int e) { return cudaGetErrorString((cudaError_t)(e % 1000)); }
}
