// A persistent INT4 GEMV chain whose weight stream never waits for the data dependencies.
//
// What it measures (benchmarks/gpu_cuda_chain.py drives it; BENCHMARKS.md "Runs 93-101" has
// the numbers): the 8B decoder's 128 INT4 GEMVs of one token, each GEMV's input made from the
// previous GEMV's output (a real all-to-all dependency, a grid barrier between GEMVs), in ONE
// launch of one CTA per SM, where a producer warp streams the CTA's share of every GEMV's
// weights into a shared-memory ring with bulk copies (cp.async.bulk completing on mbarriers)
// and runs ahead across the grid barriers: weights depend on nothing, so the copy engine keeps
// DRAM busy while the consumer warps wait for x. Runs 84-85 (Triton, weights 1-3 steps ahead in
// registers) measured 3.5-6 us a dependency; the question was whether a ring of 100-200 KB a
// SM hides that. (Answer: the barrier, yes, ~0.3 us; the serial work around each dependency,
// ~3.2 us, no.)
//
// Weights (this benchmark's own format; a loader would convert AWQ's once): items of 128
// output columns x one group of 128 K rows, 8512 bytes each, the same bytes as AWQ's: 8192
// bytes of 4-bit words, 256 of fp16 scales, 64 of zero-point nibbles, w = (q - z) s, in one of
// two layouts (the item math decides which; item_lanes below and item_mma in
// ring_common.cuh spell them out):
//   MMA 0 ("lanes"): words [kp / 4][lane][kp % 4], K pairs kp 0..63, lane L owns columns
//     4 L + i (nibble i of the low half: K row 2 kp, of the high half: 2 kp + 1); scales
//     [lane][4], zeros [lane] u16.
//   MMA 1, 2 (mma.sync m16n8k16 fragments): see item_mma.
// A GEMV's items are ordered (column tile, group); CTA c takes items [c I / P, (c + 1) I / P)
// of each GEMV, so its share of the chain is a list of contiguous runs, streamed in order. The
// NW consumer warps form NW / SPLIT groups of SPLIT warps; group i takes every (NW / SPLIT)-th
// item of the CTA's stream (the ring's slots are a multiple of the groups, so each slot has one
// owner: see launch()), each warp of a group one part of the item (MMA 0: K pairs, MMA 1, 2:
// row tiles). A warp's sums of a column tile meet in shared memory (atomicAdd); after the GEMV
// one fp32 atomicAdd per column and CTA to the output (outputs are zeroed before the launch;
// the order of atomics is not fixed, so the last bits vary from run to run), then a fence and
// the CTA's arrival on the grid counter.
//
// Between GEMVs (xform in the metadata) x[k] = x0[k mod 4096] + f / 2, f = 0: the previous
// output's element k, 1 (gate|up -> down): silu(g[k]) u[k] (g, u its two halves); x0 keeps
// the values O(1) along 128 random GEMVs (without it they decay to 0 by the 40th). Each CTA
// loads only the x groups its items use.
//
// Built with nvcc -O3 -gencode arch=compute_90,code=sm_90 (cp.async.bulk and mbarrier
// transaction counts need sm_90). CUDA 13.0 here and on the H200. Benchmark code: not used by
// the engine.
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "ring_common.cuh"

#define WORDS_BYTES 8192
#define RED_TILES 8  // column tiles one CTA may touch in one GEMV (the host checks)
#define META 8  // per GEMV: K, N, G, T, item_base, out_off, xform, in_off (-1: x0)

__device__ __forceinline__ void consumers_sync(int nthreads) {
  asm volatile("bar.sync 1, %0;" ::"r"(nthreads) : "memory");
}

// ---- MMA 0: fp16x2 lane sums. Item words [kp / 4][lane][kp % 4]; lane L owns columns
// 4 L + i; the warp's part of an item is K pairs [part 64/SPLIT, (part+1) 64/SPLIT).
template <int SPLIT>
__device__ __forceinline__ void item_lanes(const uint8_t* it, const __half2* xg2, int part,
                                           int lane, float* f) {
  constexpr int KP = 64 / SPLIT;
  const int kp0 = part * KP;
  const __half2 inv128 = __float2half2_rn(1.0f / 128.0f);
  const __half2 inv2048 = __float2half2_rn(1.0f / 2048.0f);
  const uint4* words = reinterpret_cast<const uint4*>(it);  // [16][32 lanes][4]
  const uint2 sc = reinterpret_cast<const uint2*>(it + SCALES_OFF)[lane];
  const uint32_t zw = reinterpret_cast<const uint16_t*>(it + ZEROS_OFF)[lane];
  // nibble positions 0, 2 (bits 0-3 of each half after no shift / >> 8) read as the fp16
  // 1024 + q: times 1/128; positions 1, 3 (bits 4-7) as 1024 + 16 q: times 1/2048. Either
  // way minus (base + z / 128) gives (q - z) / 128 exactly.
  __half2 zz[4];
#pragma unroll
  for (int q = 0; q < 4; ++q)
    zz[q] = __float2half2_rn(
        -((q & 1 ? 0.5f : 8.0f) + (float)((zw >> (4 * q)) & 15) * (1.0f / 128.0f)));
  const uint4* xg = reinterpret_cast<const uint4*>(xg2 + kp0);  // 4 x pairs each
  float sum[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 2
  for (int ch = 0; ch < KP / 8; ++ch) {  // 8 K pairs: 8 products a fp16 lane sum at most
    __half2 acc[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) acc[q] = __float2half2_rn(0.f);
#pragma unroll
    for (int h4 = 0; h4 < 2; ++h4) {
      const int quad = (kp0 >> 2) + ch * 2 + h4;
      const uint4 w4 = words[quad * 32 + lane];
      const uint4 x4 = xg[ch * 2 + h4];
      const uint32_t wv[4] = {w4.x, w4.y, w4.z, w4.w};
      const uint32_t xv[4] = {x4.x, x4.y, x4.z, x4.w};
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const __half2 xp = *reinterpret_cast<const __half2*>(&xv[k]);
        const uint32_t hi = wv[k] >> 8;
        uint32_t h[4] = {lop3_or_and(wv[k], 0x000F000Fu, 0x64006400u),
                         lop3_or_and(wv[k], 0x00F000F0u, 0x64006400u),
                         lop3_or_and(hi, 0x000F000Fu, 0x64006400u),
                         lop3_or_and(hi, 0x00F000F0u, 0x64006400u)};
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          __half2 d = __hfma2(*reinterpret_cast<__half2*>(&h[q]), q & 1 ? inv2048 : inv128, zz[q]);
          acc[q] = __hfma2(d, xp, acc[q]);
        }
      }
    }
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      float2 a2 = __half22float2(acc[q]);
      sum[q] += a2.x + a2.y;
    }
  }
  const __half* s4 = reinterpret_cast<const __half*>(&sc);
#pragma unroll
  for (int q = 0; q < 4; ++q) f[q] += 128.0f * __half2float(s4[q]) * sum[q];
}

// A warp's running sums of one column tile and their flush into the CTA's tile sums (shared
// memory; the warps of all groups add into them).
template <int MMA, int SPLIT>
struct Acc {
  static constexpr int N = MMA == 0 ? 4 : 2 * (8 / SPLIT);
  float f[N] = {};
  __device__ __forceinline__ void flush(float* tile, int lane, int part) {
    if constexpr (MMA == 0) {
#pragma unroll
      for (int q = 0; q < 4; ++q) atomicAdd(&tile[4 * lane + q], f[q]);
    } else {
      if ((lane & 3) == 0) {  // column 0 of the MMA's output: rows 16 rt + g and + 8
        const int g = lane >> 2;
#pragma unroll
        for (int r = 0; r < N / 2; ++r) {
          const int rt = part * (N / 2) + r;
          atomicAdd(&tile[16 * rt + g], f[2 * r]);
          atomicAdd(&tile[16 * rt + g + 8], f[2 * r + 1]);
        }
      }
    }
#pragma unroll
    for (int q = 0; q < N; ++q) f[q] = 0.f;
  }
};

// One CTA: NW consumer warps + 1 producer warp. Dynamic shared memory: the ring (S items),
// then x pairs (MAX_K / 2 half2), the reduction buffer (NW x 128 fp32), then 2 S mbarriers.
template <int MMA, int SPLIT, int NW, int ACC>
__global__ void __launch_bounds__((NW + 1) * 32, 1)
    gemv_chain_ring(const uint8_t* __restrict__ items, const long long* __restrict__ meta,
                    const float* __restrict__ x0, float* outs, unsigned* counter, int n_gemv,
                    int stages, int flags, unsigned long long* stamps) {
  extern __shared__ __align__(128) uint8_t smem[];
  uint8_t* ring = smem;
  __half2* xs = reinterpret_cast<__half2*>(smem + (size_t)stages * ITEM_BYTES);
  float* red = reinterpret_cast<float*>(xs + MAX_K / 2);
  float* xsum = red + RED_TILES * 128;  // [MAX_G] sums of each group's fp16 x (MMA 1, 2)
  u64* full = reinterpret_cast<u64*>(xsum + 3 * MAX_G);
  u64* empty = full + stages;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int P = gridDim.x, c = blockIdx.x;
  constexpr int NC = NW * 32;  // consumer threads
  ring_init(full, empty, stages, SPLIT);
  for (int t = threadIdx.x; t < RED_TILES * 128; t += blockDim.x) red[t] = 0.f;
  __syncthreads();

  const bool wait_barrier = flags & 1, no_weights = flags & 2, skip_items = flags & 4;
  // 8: timeline (stamps[(g * P + c) * 8 + i], see STAMP below); 16: arrive with one
  // red.release instead of __threadfence + atomicAdd; 32: each group's x sum made by the
  // warps that convert its x (no separate pass, one CTA sync fewer)
  const bool timeline = flags & 8, release_arrive = flags & 16, fused_xsum = flags & 32;
  if (warp == NW) {  // producer: streams the CTA's items of every GEMV, in order
    if (lane == 0 && !no_weights) {
      int slot = 0, round = 0;  // ring position; round: how often the ring has wrapped
      for (int g = 0; g < n_gemv; ++g) {
        const long long* m = meta + g * META;
        Range r = cta_range(m[2] * m[3], c, P);
        const uint8_t* src = items + ((size_t)m[4] + (size_t)r.a) * ITEM_BYTES;
        for (long long i = r.a; i < r.b; ++i, src += ITEM_BYTES) {
          if (round > 0) mbar_wait(&empty[slot], (uint32_t)((round - 1) & 1));
          mbar_arrive_tx(&full[slot], ITEM_BYTES);
          bulk_g2s(ring + (size_t)slot * ITEM_BYTES, src, ITEM_BYTES, &full[slot]);
          if (++slot == stages) slot = 0, ++round;
        }
      }
    }
    return;
  }

  int pos0 = 0;  // the CTA's position (items streamed so far) at the start of GEMV g
  for (int g = 0; g < n_gemv; ++g) {
    const long long* m = meta + g * META;
    const int K = (int)m[0], G = (int)m[2], xform = (int)m[6];
    const long long in_off = m[7];
    float* out = outs + m[5];
    Range r = cta_range(m[2] * m[3], c, P);
    const int n = (int)(r.b - r.a), tile0 = (int)(r.a / G), j0 = (int)(r.a % G);
    unsigned long long* st = stamps + ((size_t)g * P + c) * 8;
#define STAMP(i) \
  if (timeline && threadIdx.x == 0) st[i] = clock64();
    STAMP(0)
    if (g > 0 && wait_barrier) {  // every CTA finished GEMV g - 1
      if (threadIdx.x == 0) {
        const unsigned target = (unsigned)(g * P);
        while (ld_acquire(counter) < target) {
        }
      }
    }
    consumers_sync(NC);
    STAMP(1)
    if (timeline && threadIdx.x == 0) st[6] = gtimer();
    // x pairs of the groups this CTA's items use, from the previous output (or x0)
    if (n > 0) {
      const int j1 = (int)((r.b - 1) % G);
      const bool all = n >= G;
      const float* src = in_off < 0 ? x0 : outs + in_off;
      const int npairs = all ? K / 2 : ((j1 >= j0 ? j1 - j0 + 1 : G - j0 + j1 + 1) * 64);
      constexpr int U = 4;  // pairs a thread loads before it converts any: one L2 round trip
      const float2* x02 = reinterpret_cast<const float2*>(x0);
      const float2* src2 = reinterpret_cast<const float2*>(src);
      for (int t0 = threadIdx.x; t0 < npairs; t0 += U * NC) {
        float2 gv[U], uv[U], bv[U];
        int kps[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int t = t0 + u * NC;
          kps[u] = t < npairs ? (all ? t : ((j0 * 64 + t) % (K / 2))) : -1;
          if (kps[u] >= 0) {
            bv[u] = x02[kps[u] & 2047];
            if (in_off >= 0) {
              gv[u] = __ldcg(src2 + kps[u]);
              if (xform == 1) uv[u] = __ldcg(src2 + K / 2 + kps[u]);
            }
          }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
          if (kps[u] < 0) continue;
          float v0 = bv[u].x, v1 = bv[u].y;
          if (in_off >= 0) {  // x0 + f / 2: stays O(1) along the chain, still depends on
            float f0 = gv[u].x, f1 = gv[u].y;  // every previous output
            if (xform == 1) {
              f0 = f0 / (1.0f + __expf(-f0)) * uv[u].x;
              f1 = f1 / (1.0f + __expf(-f1)) * uv[u].y;
            }
            v0 += 0.5f * f0, v1 += 0.5f * f1;
          }
          xs[kps[u]] = __floats2half2_rn(v0, v1);
        }
        if (MMA != 0 && fused_xsum) {  // a warp's 32 lanes hold half a group's pairs (npairs
#pragma unroll                          // and the index base are multiples of 32): warp sums
          for (int u = 0; u < U; ++u) {  // (kps is valid for all 32 lanes or none)
            if (t0 + u * NC - (int)(threadIdx.x & 31) >= npairs) break;
            float2 hv = __half22float2(xs[kps[u]]);
            float v = hv.x + hv.y;
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
            if (lane == 0) xsum[MAX_G + kps[u] / 32] = v;  // half sums, after the group sums
          }
        }
      }
      if (MMA != 0 && fused_xsum) {
        // nothing: item_mma adds the two half sums
      } else if constexpr (MMA != 0) {  // each used group's fp16 x sum (64 pairs), a warp each
        consumers_sync(NC);
        const int ng = all ? G : npairs / 64;
        for (int q = warp; q < ng; q += NW) {
          const int jj = all ? q : (j0 + q) % G;
          float2 a = __half22float2(xs[jj * 64 + lane]);
          float2 b = __half22float2(xs[jj * 64 + 32 + lane]);
          float v = (a.x + a.y) + (b.x + b.y);
#pragma unroll
          for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
          if (lane == 0) xsum[jj] = v;
        }
      }
    }
    consumers_sync(NC);
    STAMP(2)
    unsigned long long ring_wait = 0;

    // Items of this GEMV this warp computes: its group's position class, its part of each
    // (MMA 0: K pairs [part 64/SPLIT, ...); MMA 1, 2: row tiles [part 8/SPLIT, ...)).
    constexpr int GROUPS = NW / SPLIT;
    const int part = warp % SPLIT, grp = warp / SPLIT;
    const int first = (((grp - pos0) % GROUPS) + GROUPS) % GROUPS;
    constexpr int step = GROUPS;
    Acc<MMA, SPLIT> acc;
    int cur = -1;  // the tile acc belongs to (relative to tile0)
    // ring slot and parity, column tile (relative to tile0) and group of item `first`; then
    // advanced by `step` positions an item without divisions (step <= stages, step < G)
    int slot = (pos0 + first) % stages, rel = (j0 + first) / G, j = (j0 + first) % G;
    uint32_t phase = (uint32_t)(((pos0 + first) / stages) & 1);
    for (int e = first; e < n && !skip_items;
         e += step, slot += step, j += step) {
      if (slot >= stages) slot -= stages, phase ^= 1u;
      if (j >= G) j -= G, ++rel;
      if (rel != cur) {
        if (cur >= 0) acc.flush(red + cur * 128, lane, part);
        cur = rel;
      }
      if (!no_weights) {
        if (timeline && warp == 0) {
          const unsigned long long w0 = clock64();
          mbar_wait(&full[slot], phase);
          ring_wait += clock64() - w0;
        } else {
          mbar_wait(&full[slot], phase);
        }
      }
      const uint8_t* it = ring + (size_t)slot * ITEM_BYTES;
      if constexpr (MMA == 0) {
        item_lanes<SPLIT>(it, xs + j * 64, part, lane, acc.f);
      } else {
        const float xs_j = fused_xsum ? xsum[MAX_G + 2 * j] + xsum[MAX_G + 2 * j + 1] : xsum[j];
        item_mma<SPLIT, MMA == 2, ACC>(it, xs + j * 64, xs_j, part, lane, acc.f);
      }
      __syncwarp();
      if (lane == 0 && !no_weights) mbar_arrive(&empty[slot]);
    }
    if (cur >= 0) acc.flush(red + cur * 128, lane, part);
    pos0 += n;
    consumers_sync(NC);
    STAMP(3)
    if (timeline && threadIdx.x == 0) st[5] = ring_wait;
    if (n > 0) {  // one atomic per column of the tiles this CTA touched; red back to zero
      const int span = (int)((r.b - 1) / G) - tile0 + 1;
      for (int t = threadIdx.x; t < span * 128; t += NC) {
        atomicAdd(out + (long long)tile0 * 128 + t, red[t]);
        red[t] = 0.f;
      }
    }
    consumers_sync(NC);
    if (threadIdx.x == 0) {
      if (release_arrive) {  // release: the CTA's atomics (ordered by the bar.sync) first
        red_release_add(counter, 1u);
      } else {
        __threadfence();
        atomicAdd(counter, 1u);
      }
    }
    STAMP(4)
    if (timeline && threadIdx.x == 0) st[7] = gtimer();
#undef STAMP
  }
}

static size_t smem_bytes(int stages) {
  return (size_t)stages * ITEM_BYTES + (MAX_K / 2) * sizeof(__half2) +
         (RED_TILES * 128 + 3 * MAX_G) * sizeof(float) + 2 * stages * sizeof(u64);
}

template <int MMA, int SPLIT, int NW, int ACC>
static int launch(const uint8_t* items, const long long* meta, const float* x0, float* outs,
                  unsigned* counter, int n_gemv, int ctas, int stages, int flags,
                  unsigned long long* stamps, cudaStream_t stream) {
  size_t smem = smem_bytes(stages);
  // Group i consumes positions i, i + NW/SPLIT, ...; with stages a multiple of NW/SPLIT a slot
  // is only ever used by one group, which has itself waited for the slot's previous phase
  // before it waits for the next. Otherwise a group could wait on a slot whose previous load
  // (another group's) has not landed yet: the parity wait then passes at once (the barrier is
  // a phase behind), the group reads stale bytes and arrives early, and the ring's phases
  // come apart (H200 runs 96-97: hangs).
  if (stages % (NW / SPLIT) != 0) return -2;
  cudaError_t e = cudaFuncSetAttribute(gemv_chain_ring<MMA, SPLIT, NW, ACC>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
  if (e != cudaSuccess) return 1000 + (int)e;
  gemv_chain_ring<MMA, SPLIT, NW, ACC><<<ctas, (NW + 1) * 32, smem, stream>>>(
      items, meta, x0, outs, counter, n_gemv, stages, flags, stamps);
  e = cudaGetLastError();
  return e == cudaSuccess ? 0 : 2000 + (int)e;
}

extern "C" {
// 0: launched; -1: no such (mma, split, nw, acc) (mma 0: fp16x2 lane sums, 1: mma.sync with the
// 1024 offset removed through x sums, 2: mma.sync on (v - 1024); split warps an item; nw
// consumer warps); -2: stages not a multiple of the groups nw / split; 1000 + e: setting the
// shared-memory limit failed with cudaError_t e; 2000 + e: the launch failed with e.
// flags: 1 wait at the grid barriers (0: skip the waits, x read early: a timing floor only);
// 2 no weight stream (consumers compute on whatever the ring holds); 4 (with 2) no item
// math either: the x loads, sums and barriers alone; 8 timeline into `stamps` (8 u64 per GEMV
// and CTA: clock64 at the GEMV's start, after the barrier, x ready, items done, arrived; warp
// 0's cycles waiting for ring slots; globaltimer after the barrier and after the arrival;
// -3 if stamps is null); 16 arrive with red.release (no __threadfence); 32 group x sums made
// while x is converted. acc: independent accumulator chains in the MMA item math (1, 2, 4).
int chain_launch(const void* items, const void* meta, const void* x0, void* outs, void* counter,
                 int n_gemv, int ctas, int mma, int split, int nw, int acc, int stages,
                 int flags, void* stamps, void* stream) {
  auto i = static_cast<const uint8_t*>(items);
  auto m = static_cast<const long long*>(meta);
  auto x = static_cast<const float*>(x0);
  auto o = static_cast<float*>(outs);
  auto cnt = static_cast<unsigned*>(counter);
  auto sp = static_cast<unsigned long long*>(stamps);
  auto st = static_cast<cudaStream_t>(stream);
  if ((flags & 8) && !sp) return -3;
#define CASE(M, S, N, A)                                 \
  if (mma == M && split == S && nw == N && acc == A)     \
    return launch<M, S, N, A>(i, m, x, o, cnt, n_gemv, ctas, stages, flags, sp, st);
  CASE(0, 1, 8, 1) CASE(0, 2, 16, 1) CASE(1, 1, 8, 1)
  CASE(1, 4, 16, 1) CASE(1, 4, 16, 2) CASE(1, 8, 16, 1) CASE(1, 8, 16, 2) CASE(1, 8, 16, 4)
  CASE(1, 4, 12, 1) CASE(1, 4, 12, 2) CASE(1, 4, 12, 4) CASE(1, 8, 8, 2) CASE(1, 8, 8, 4)
#undef CASE
  return -1;
}
// Dynamic shared memory a launch with `stages` ring slots needs.
long long chain_smem_bytes(int stages) { return (long long)smem_bytes(stages); }
const char* chain_error_string(int e) { return cudaGetErrorString((cudaError_t)(e % 1000)); }
}
