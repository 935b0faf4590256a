// Thread-block clusters for the persistent decode step: can clusters of CL CTAs with the decode
// step's shared memory all be resident at once (its grid barrier needs every CTA resident), and
// what do a grid barrier, a cluster barrier and a DSMEM exchange cost a round? Run by
// benchmarks/gpu_cluster_probe.py (NVRTC, ring.cuh inlined), one build per CL.
//
// mode 0: grid barrier each round (the decode step's: release-add on a counter, acquire-spin
//         until it reaches round * CTAs); a CTA that spins past spin_limit polls sets *failed
//         = 1 and every CTA leaves (not co-resident: no hang)
// mode 1: cluster barrier each round (barrier.cluster arrive.release / wait.acquire)
// mode 2: DSMEM exchange each round: thread 0 stores the round into the next rank's shared
//         word (mapa + st.shared::cluster), cluster barrier, checks its own word (*failed = 2
//         on a wrong value), cluster barrier again (the next round's store must not overtake
//         this round's read)
// out[2 c], out[2 c + 1]: globaltimer at the first and after the last round of CTA c.

#include "ring.cuh"

#ifndef CL
#define CL 8
#endif

__device__ __forceinline__ u32 cluster_rank() {
  u32 r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
__device__ __forceinline__ void cluster_sync_all() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n"
               "barrier.cluster.wait.acquire.aligned;" ::: "memory");
}
__device__ __forceinline__ u32 map_rank(u32 addr, u32 rank) {
  u32 r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(addr), "r"(rank));
  return r;
}
__device__ __forceinline__ void st_cluster(u32 addr, u32 v) {
  asm volatile("st.shared::cluster.u32 [%0], %1;" ::"r"(addr), "r"(v) : "memory");
}

extern "C" __global__ void __cluster_dims__(CL, 1, 1) __launch_bounds__(544, 1)
    cluster_probe(unsigned* counter, unsigned* failed, u64* out, int rounds, int mode,
                  unsigned spin_limit) {
  extern __shared__ u8 smem[];
  u32* box = reinterpret_cast<u32*>(smem);
  const int P = gridDim.x;
  if (threadIdx.x == 0) box[0] = 0;
  cluster_sync_all();  // every CTA of the cluster runs (its shared memory may be written)
  const u64 t0 = gtimer();
  for (int r = 1; r <= rounds; ++r) {
    if (mode == 0) {
      __syncthreads();
      if (threadIdx.x == 0) {
        red_release_add(counter, 1u);
        const unsigned target = (unsigned)(r * P);
        unsigned n = 0;
        while (ld_acquire(counter) < target) {
          if (++n > spin_limit || *(volatile unsigned*)failed) {
            atomicExch(failed, 1u);
            break;
          }
        }
      }
      __syncthreads();
      if (*(volatile unsigned*)failed) break;
    } else {
      if (mode == 2 && threadIdx.x == 0)
        st_cluster(map_rank(smem_u32(box), (cluster_rank() + 1) % CL), (u32)r);
      cluster_sync_all();
      if (mode == 2) {
        if (threadIdx.x == 0 && *(volatile u32*)box != (u32)r) atomicExch(failed, 2u);
        cluster_sync_all();
      }
    }
  }
  const u64 t1 = gtimer();
  if (threadIdx.x == 0) out[2 * blockIdx.x] = t0, out[2 * blockIdx.x + 1] = t1;
}
