// Shared by gemv_chain_ring.cu and step_ring.cu (benchmark code, sm_90): the item format
// and its mma.sync item math, the ring's initialisation; the mbarrier / bulk-copy /
// grid-barrier / mma.sync helpers are the engine kernel's (ring.cuh, included below).
#pragma once
#include <cuda_fp16.h>
#include <stdint.h>

// mbarrier / bulk-copy / grid-barrier / mma.sync helpers: the engine kernel's own (headerless)
#include "../../hisparse_cli/kernels/cuda/ring.cuh"

#define ITEM_BYTES 8512  // 128 columns x one 128-row group: words, scales, zero points
#define SCALES_OFF 8192
#define ZEROS_OFF 8448
#define MAX_K 14336
#define MAX_G (MAX_K / 128)

// The ring's barriers, by thread 0: full[s] completes when slot s's bytes landed (the
// producer's one arrival + transaction count), empty[s] when its `consumers` arrivals came.
__device__ __forceinline__ void ring_init(u64* full, u64* empty, int stages,
                                          uint32_t consumers) {
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], consumers);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
}

// ---- MMA 1, 2: mma.sync m16n8k16 (fp16 in, fp32 accumulate), the weights as A (16 rows of
// output x 16 K), x as B (column 0 the token; the other 7 columns repeat it and are
// discarded). Item words [rt 0..7][kt / 4][lane][kt % 4] for row tile rt (rows 16 rt..),
// K tile kt (K 16 kt..); lane L = 4 g + t holds A's fragment for (rt, kt) in one word:
// nibble pair p = 0..3 (bits 4p..4p+3 low half, 16+4p.. high half) = rows 16 rt + g + 8 (p & 1),
// K 16 kt + 2 t + 8 (p >> 1) + {0, 1}. Scales [g][rt][row half] fp16, zeros the same as
// nibbles (one 64-bit word a g). The LOP3 magic gives 1024 + q (p 0, 2) or 1024 + 16 q
// (p 1, 3); MMA 1 feeds that to the MMA and removes 1024 sum(x) (fp32, the group's x sum)
// afterwards, MMA 2 subtracts 1024 first (HADD2, exact). mma16816: ring.cuh.
template <int SPLIT, bool SUB, int ACC>
__device__ __forceinline__ void item_mma(const uint8_t* it, const __half2* xg2, float xsum,
                                         int part, int lane, float* f) {
  constexpr int NRT = 8 / SPLIT;
  const int rt0 = part * NRT, g = lane >> 2, t = lane & 3;
  const uint32_t* xw = reinterpret_cast<const uint32_t*>(xg2);
  uint32_t b[16];  // B fragments of the 8 K tiles: pairs 8 kt + t and 8 kt + 4 + t
#pragma unroll
  for (int kt = 0; kt < 8; ++kt) b[2 * kt] = xw[8 * kt + t], b[2 * kt + 1] = xw[8 * kt + 4 + t];
  const uint4* words = reinterpret_cast<const uint4*>(it);
  const __half2* s2 = reinterpret_cast<const __half2*>(it + SCALES_OFF) + 8 * g;  // [rt]
  const uint8_t* z8 = it + ZEROS_OFF + 8 * g;                                     // [rt]
  const uint32_t sub = 0x64006400u;  // fp16x2 1024
#pragma unroll
  for (int r = 0; r < NRT; ++r) {
    const int rt = rt0 + r;
    const uint4 wa = words[(rt * 2) * 32 + lane], wb = words[(rt * 2 + 1) * 32 + lane];
    const uint32_t w[8] = {wa.x, wa.y, wa.z, wa.w, wb.x, wb.y, wb.z, wb.w};
    float dd[ACC][4];  // ACC independent MMA accumulator chains (K tile kt -> kt % ACC)
#pragma unroll
    for (int a = 0; a < ACC; ++a) dd[a][0] = dd[a][1] = dd[a][2] = dd[a][3] = 0.f;
#pragma unroll
    for (int kt = 0; kt < 8; ++kt) {
      const uint32_t hi = w[kt] >> 8;
      uint32_t a[4] = {lop3_or_and(w[kt], 0x000F000Fu, 0x64006400u),
                       lop3_or_and(w[kt], 0x00F000F0u, 0x64006400u),
                       lop3_or_and(hi, 0x000F000Fu, 0x64006400u),
                       lop3_or_and(hi, 0x00F000F0u, 0x64006400u)};
      if constexpr (SUB) {
#pragma unroll
        for (int p = 0; p < 4; ++p) {
          __half2 v = __hsub2(*reinterpret_cast<__half2*>(&a[p]),
                              *reinterpret_cast<const __half2*>(&sub));
          a[p] = *reinterpret_cast<uint32_t*>(&v);
        }
      }
      mma16816(dd[kt % ACC], a, b[2 * kt], b[2 * kt + 1]);
    }
    float d[4] = {dd[0][0], dd[0][1], dd[0][2], dd[0][3]};
#pragma unroll
    for (int a = 1; a < ACC; ++a) d[0] += dd[a][0], d[2] += dd[a][2];
    // d[0]: row 16 rt + g, d[2]: row 16 rt + g + 8 (column 0 where t == 0)
    const uint32_t zbits = z8[rt];
    const float z0 = (float)(zbits & 15), z1 = (float)(zbits >> 4);
    const float2 sf = __half22float2(s2[rt]);
    const float s0 = sf.x, s1 = sf.y;
    if constexpr (SUB) {
      f[2 * r] += s0 * (d[0] - z0 * xsum);
      f[2 * r + 1] += s1 * (d[2] * (1.0f / 16.0f) - z1 * xsum);
    } else {
      f[2 * r] += s0 * (d[0] - (1024.0f + z0) * xsum);
      f[2 * r + 1] += s1 * ((d[2] - 1024.0f * xsum) * (1.0f / 16.0f) - z1 * xsum);
    }
  }
}

