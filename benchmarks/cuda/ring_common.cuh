// Shared by gemv_chain_ring.cu and step_ring.cu (benchmark code, sm_90): the item format
// and its mma.sync item math, mbarrier / bulk-copy / grid-barrier helpers.
#pragma once
#include <cuda_fp16.h>
#include <stdint.h>

#define ITEM_BYTES 8512  // 128 columns x one 128-row group: words, scales, zero points
#define SCALES_OFF 8192
#define ZEROS_OFF 8448
#define MAX_K 14336
#define MAX_G (MAX_K / 128)

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count));
}
__device__ __forceinline__ void mbar_arrive_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)),
               "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}
__device__ __forceinline__ bool mbar_try_wait(uint64_t* bar, uint32_t parity) {
  uint32_t ok;
  asm volatile(
      "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      " selp.b32 %0, 1, 0, p;\n}\n"
      : "=r"(ok) : "r"(smem_u32(bar)), "r"(parity) : "memory");
  return ok != 0;
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  while (!mbar_try_wait(bar, parity)) {
  }
}
__device__ __forceinline__ void bulk_g2s(void* dst, const void* src, uint32_t bytes,
                                         uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
      ::"r"(smem_u32(dst)), "l"(src), "r"(bytes), "r"(smem_u32(bar)) : "memory");
}
__device__ __forceinline__ uint32_t ld_acquire(const unsigned* p) {
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ uint32_t lop3_or_and(uint32_t a, uint32_t mask, uint32_t magic) {
  uint32_t r;  // (a & mask) | magic
  asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(r) : "r"(a), "r"(mask), "r"(magic));
  return r;
}

// The ring's barriers, by thread 0: full[s] completes when slot s's bytes landed (the
// producer's one arrival + transaction count), empty[s] when its `consumers` arrivals came.
__device__ __forceinline__ void ring_init(uint64_t* full, uint64_t* empty, int stages,
                                          uint32_t consumers) {
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], consumers);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
}
// Where consumer unit `unit` of `units` (each taking every units-th stream position) starts
// in a phase whose first item is at stream position pos0: the phase-relative index of its
// first item (returned), that item's ring slot and the mbarrier parity to wait for.
__device__ __forceinline__ int ring_start(int pos0, int unit, int units, int stages, int& slot,
                                          uint32_t& parity) {
  const int first = (((unit - pos0) % units) + units) % units;
  slot = (pos0 + first) % stages;
  parity = (uint32_t)(((pos0 + first) / stages) & 1);
  return first;
}

struct Range {
  long long a, b;
};
__device__ __forceinline__ Range cta_range(long long items, int c, int P) {
  return Range{items * c / P, items * (c + 1) / P};
}

// A consumer warp's wait for a ring slot: the spin can end on different iterations in
// different lanes, so the warp reconverges before its shuffles (without this, every shuffle
// of the attention math compiled to a WARPSYNC.COLLECTIVE loop: run 107, 1.7 us a page).
__device__ __forceinline__ void warp_wait(uint64_t* bar, uint32_t parity) {
  mbar_wait(bar, parity);
  __syncwarp();
}
__device__ __forceinline__ unsigned long long gtimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ void red_release_add(unsigned* p, unsigned v) {
  asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// ---- MMA 1, 2: mma.sync m16n8k16 (fp16 in, fp32 accumulate), the weights as A (16 rows of
// output x 16 K), x as B (column 0 the token; the other 7 columns repeat it and are
// discarded). Item words [rt 0..7][kt / 4][lane][kt % 4] for row tile rt (rows 16 rt..),
// K tile kt (K 16 kt..); lane L = 4 g + t holds A's fragment for (rt, kt) in one word:
// nibble pair p = 0..3 (bits 4p..4p+3 low half, 16+4p.. high half) = rows 16 rt + g + 8 (p & 1),
// K 16 kt + 2 t + 8 (p >> 1) + {0, 1}. Scales [g][rt][row half] fp16, zeros the same as
// nibbles (one 64-bit word a g). The LOP3 magic gives 1024 + q (p 0, 2) or 1024 + 16 q
// (p 1, 3); MMA 1 feeds that to the MMA and removes 1024 sum(x) (fp32, the group's x sum)
// afterwards, MMA 2 subtracts 1024 first (HADD2, exact).
__device__ __forceinline__ void mma16816(float* d, const uint32_t* a, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

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

