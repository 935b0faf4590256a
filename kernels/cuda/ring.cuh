// Device helpers of the persistent decode kernel (decode_step.cu): fixed-width types, the
// mbarrier ring, bulk and TMA copies, the grid barrier's acquire/release, mma.sync and
// ldmatrix. No CUDA headers: NVRTC builds it as is (kernels/cuda/cuda_step.py inlines it).
#pragma once
typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

struct __align__(64) TensorMap {  // a CUtensorMap (kernels/cuda/cuda_rt.py encodes it), by value
  u64 opaque[16];
};

// ---- mbarrier ring, bulk and tensor copies, grid barrier ----------------------------------
__device__ __forceinline__ u32 smem_u32(const void* p) {
  return (u32)__cvta_generic_to_shared(p);
}
__device__ __forceinline__ void mbar_init(u64* bar, u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count));
}
__device__ __forceinline__ void mbar_arrive_tx(u64* bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)),
               "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u64* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}
__device__ __forceinline__ void mbar_arrive_n(u64* bar, u32 count) {  // count arrivals at once
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(count)
               : "memory");
}
__device__ __forceinline__ bool mbar_try_wait(u64* bar, u32 parity) {
  u32 ok;
  asm volatile(
      "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      " selp.b32 %0, 1, 0, p;\n}\n"
      : "=r"(ok) : "r"(smem_u32(bar)), "r"(parity) : "memory");
  return ok != 0;
}
__device__ __forceinline__ void mbar_wait(u64* bar, u32 parity) {
  while (!mbar_try_wait(bar, parity)) {
  }
}
// a consumer warp's wait: lanes may leave the spin on different iterations; reconverge before
// the shuffles and mma.sync that follow
__device__ __forceinline__ void warp_wait(u64* bar, u32 parity) {
  mbar_wait(bar, parity);
  __syncwarp();
}
// an L2 cache policy (createpolicy) for data read once, and the bulk copy that takes one
__device__ __forceinline__ u64 l2_evict_first() {
  u64 pol;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
  return pol;
}
__device__ __forceinline__ void bulk_g2s_hint(void* dst, const void* src, u32 bytes, u64* bar,
                                              u64 pol) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
      " [%0], [%1], %2, [%3], %4;"
      ::"r"(smem_u32(dst)), "l"(src), "r"(bytes), "r"(smem_u32(bar)), "l"(pol) : "memory");
}
__device__ __forceinline__ void tma_3d(void* dst, const TensorMap* map, int c0, int c1, int c2,
                                       u64* bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4}], [%5];"
      ::"r"(smem_u32(dst)), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(smem_u32(bar))
      : "memory");
}
__device__ __forceinline__ u64 gtimer() {
  u64 t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ u32 ld_acquire(const unsigned* p) {
  u32 v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void red_release_add(unsigned* p, unsigned v) {
  asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ u32 lop3_or_and(u32 a, u32 mask, u32 magic) {
  u32 r;  // (a & mask) | magic
  asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(r) : "r"(a), "r"(mask), "r"(magic));
  return r;
}
__device__ __forceinline__ void mma16816(float* d, const u32* a, u32 b0, u32 b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void ldsm_x4_trans(u32* r, const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_u32(p)));
}

struct Range {
  i64 a, b;
};
__device__ __forceinline__ Range cta_range(i64 n, int c, int P) {
  return Range{n * c / P, n * (c + 1) / P};
}
// where consumer unit `unit` of `units` (each taking every units-th stream position) starts in a
// phase whose first ring entry is stream position pos0: its first phase-relative index
// (returned), that entry's slot and the parity to wait for
// (stages must be a multiple of units: a unit then waits only on slots whose previous fill in
// the phase it waited for itself. Bulk copies may land out of order, so a parity wait on a slot
// whose previous fill is still in flight would pass at once; kernels/cuda/cuda_step.py ring_units)
__device__ __forceinline__ int ring_start(int pos0, int unit, int units, int stages, int& slot,
                                          u32& parity) {
  const int first = (((unit - pos0) % units) + units) % units;
  slot = (pos0 + first) % stages;
  parity = (u32)(((pos0 + first) / stages) & 1);
  return first;
}

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }
__device__ __forceinline__ float ex(float x) { return __expf(x); }

// The sum of each consumer thread's v over the NWARPS consumer warps (named barrier 1, which
// the producer warp never joins); every consumer thread gets it. ssum: [NWARPS] shared floats.
template <int NWARPS>
__device__ __forceinline__ float consumers_sum(float v, float* ssum, int warp, int lane) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if (lane == 0) ssum[warp] = v;
  asm volatile("bar.sync 1, %0;" ::"r"(NWARPS * 32) : "memory");
  float tot = 0.f;
#pragma unroll
  for (int w = 0; w < NWARPS; ++w) tot += ssum[w];
  return tot;
}

// ---- fp16 as raw 16-bit values (no cuda_fp16.h) ----------------------------------------------
__device__ __forceinline__ float h2f(u16 h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}
__device__ __forceinline__ u16 f2h(float f) {
  u16 h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}
__device__ __forceinline__ float rh(float f) { return h2f(f2h(f)); }  // fp16 rounding
__device__ __forceinline__ float2 h22f2(u32 v) {
  return make_float2(h2f((u16)(v & 0xffffu)), h2f((u16)(v >> 16)));
}
__device__ __forceinline__ u32 f22h2(float lo, float hi) {
  u32 r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// The q fragments of an attention unit's NH (<= 8) query heads as mma.sync A operands (rows
// 0..NH-1 of the m16 tiles, fp16), staged once per unit by one warp: qf [NH][128] (fp32 holding
// fp16 values) -> qfrag [32 lanes][4 chunks][4 words], chunk c of lane L at word
// 16 L + 4 ((c + (L >> 1)) & 3) (conflict-free 16-byte loads); the dims are visited in the
// permuted order the page math reads K in (words 16 t + 2 s, +1 of a 64-word row in K tile s).
template <int NH>
__device__ __forceinline__ void stage_qfrag(const float* qf, u32* qfrag, int lane) {
  const int g = lane >> 2, t = lane & 3;
  for (int c = 0; c < 4; ++c) {
    u32 w[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {  // e: a0(2c), a2(2c), a0(2c+1), a2(2c+1)
      const int ks = 2 * c + (e >> 1), d = 32 * t + 4 * ks + 2 * (e & 1);
      w[e] = g < NH ? f22h2(qf[g * 128 + d], qf[g * 128 + d + 1]) : 0u;
    }
    *reinterpret_cast<uint4*>(qfrag + 16 * lane + 4 * ((c + (lane >> 1)) & 3)) =
        make_uint4(w[0], w[1], w[2], w[3]);
  }
}

// ---- one 16-key page of attention with mma.sync (the unit's heads are rows 0.. of the tiles)
// q.K: the page's K [16 keys][128] fp16 at pg, the q fragments from stage_qfrag; lane (g, t)
// gets head g's scores of keys 2t, 2t + 1 (s0[0..1]) and 8 + 2t, 9 + 2t (s1[0..1]). The dims
// are visited in a permuted order (the same for q and every key, so the dot products are
// unchanged): in K tile s lane (g, t) holds words 16 t + 2 s and 16 t + 2 s + 1 of a 64-word
// row, so its 16 words of a key row are contiguous (4 LDS.128, chunk c = K tiles 2c, 2c + 1),
// read in the rotated order c = (i + (t >> 1)) & 3 (2-way bank conflicts between keys g and
// g + 1). The order may depend on t only: an mma pairs lane (g, t)'s A with lane (g', t)'s B,
// so both must hold the same dims.
__device__ __forceinline__ void page_qk(const u8* pg, const u32* qfrag, int lane, float* s0,
                                        float* s1) {
  const u32* K = reinterpret_cast<const u32*>(pg);
  const int g = lane >> 2, t = lane & 3, f = t >> 1;
#pragma unroll
  for (int j = 0; j < 4; ++j) s0[j] = s1[j] = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int c = (i + f) & 3;
    const uint4 qa =
        *reinterpret_cast<const uint4*>(qfrag + 16 * lane + 4 * ((c + (lane >> 1)) & 3));
    const uint4 k0 = *reinterpret_cast<const uint4*>(K + g * 64 + 16 * t + 4 * c);
    const uint4 k1 = *reinterpret_cast<const uint4*>(K + (g + 8) * 64 + 16 * t + 4 * c);
    const u32 a01[4] = {qa.x, 0u, qa.y, 0u}, a23[4] = {qa.z, 0u, qa.w, 0u};
    mma16816(s0, a01, k0.x, k0.y);
    mma16816(s0, a23, k0.z, k0.w);
    mma16816(s1, a01, k1.x, k1.y);
    mma16816(s1, a23, k1.z, k1.w);
  }
}
// The online softmax over the page's scores this lane holds (x00, x01: keys 2t, 2t + 1; x10,
// x11: 8 + 2t, 9 + 2t; -inf = invisible): m, l (head g's running max and sum) updated; P as
// the P.V mma's A fragment (fp16) in pa; returns the factor the old accumulators take. While
// nothing is visible (m = -inf) exp() is kept finite (0 for every invisible key).
__device__ __forceinline__ float page_softmax(float x00, float x01, float x10, float x11,
                                              float& m, float& l, u32* pa) {
  float mx = fmaxf(fmaxf(x00, x01), fmaxf(x10, x11));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
  const float mn = fmaxf(m, mx);
  const float base = mn == neg_inf() ? 0.f : mn;
  const float corr = ex(m - base);
  const float p00 = ex(x00 - base), p01 = ex(x01 - base);
  const float p10 = ex(x10 - base), p11 = ex(x11 - base);
  float ps = (p00 + p01) + (p10 + p11);
  ps += __shfl_xor_sync(0xffffffffu, ps, 1);
  ps += __shfl_xor_sync(0xffffffffu, ps, 2);
  l = l * corr + ps;
  m = mn;
  pa[0] = f22h2(p00, p01), pa[1] = 0u, pa[2] = f22h2(p10, p11), pa[3] = 0u;
  return corr;
}
