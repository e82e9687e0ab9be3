"""CUDA C++ comparison kernels for ``bench/transfer_peer.py`` (built on the GPU machine).

Built with ``torch.utils.cpp_extension.load_inline`` at first use (nvcc, sm_90),
never imported by hicache itself. Three things, all written here from public
descriptions, none copied:

* ``peer_copy``: a page-transfer kernel in SGLang's published style
  (``sgl_kernel`` ``transfer_kv_all_layer``): one warp per page item, each lane
  moving 8 bytes per step with a non-coherent load (``ld.global.nc.b64``) and a
  cache-global store (``st.global.cg.b64``); items split evenly over
  ``block_quota x warps_per_block`` warps; per-layer base-pointer tables for K
  and V; every layer's K and V in one launch.
* ``tma_copy``: bulk copies through shared memory (``cp.async.bulk``, the TMA
  unit, completing on an mbarrier), one issuing thread per block, a 4-stage
  ring of chunk buffers: host memory reads issued by the copy hardware of the
  SM rather than by load instructions.
* ``ce_batch``: one ``cudaMemcpyBatchAsync`` call (copy engines) over a list of
  (dst, src, bytes) triples built on the host.
"""
from __future__ import annotations

import functools
import os

CPP = r"""
#include <torch/extension.h>
void peer_copy(torch::Tensor src_tbl, torch::Tensor dst_tbl, torch::Tensor src_idx, torch::Tensor dst_idx,
               int64_t num_layers, int64_t has_v, int64_t item_bytes, int64_t src_stride, int64_t dst_stride,
               int64_t blocks, int64_t warps_per_block);
void tma_copy(torch::Tensor chunks, torch::Tensor src_idx, torch::Tensor dst_idx, int64_t blocks,
              int64_t chunk_bytes);
void ce_batch(torch::Tensor dsts, torch::Tensor srcs, torch::Tensor sizes);
"""

CUDA = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>
#include <cstdint>

// ------------------------------------------------------------------ peer (SGLang style)
__device__ __forceinline__ void warp_move_8b(const char* src, char* dst, int64_t nbytes, int lane) {
  const uint64_t* s = reinterpret_cast<const uint64_t*>(src);
  uint64_t* d = reinterpret_cast<uint64_t*>(dst);
  const int64_t words = nbytes >> 3;
#pragma unroll 4
  for (int64_t j = lane; j < words; j += 32) {
    uint64_t v;
    asm volatile("ld.global.nc.b64 %0, [%1];" : "=l"(v) : "l"(s + j));
    asm volatile("st.global.cg.b64 [%0], %1;" :: "l"(d + j), "l"(v) : "memory");
  }
}

__global__ void peer_kernel(const int64_t* __restrict__ src_tbl,  // [2*L] K bases then V bases
                            const int64_t* __restrict__ dst_tbl,
                            const int64_t* __restrict__ src_idx, const int64_t* __restrict__ dst_idx,
                            int64_t num_items, int64_t items_per_warp, int64_t num_layers, int64_t has_v,
                            int64_t item_bytes, int64_t src_stride, int64_t dst_stride) {
  const int64_t tid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  const int lane = threadIdx.x & 31;
  const int64_t warp = tid >> 5;
  for (int64_t i = 0; i < items_per_warp; ++i) {
    const int64_t item = warp * items_per_warp + i;
    if (item >= num_items) return;
    const int64_t so = src_idx[item] * src_stride, dof = dst_idx[item] * dst_stride;
    for (int64_t l = 0; l < num_layers; ++l) {
      warp_move_8b(reinterpret_cast<const char*>(src_tbl[l]) + so, reinterpret_cast<char*>(dst_tbl[l]) + dof,
                   item_bytes, lane);
      if (has_v)
        warp_move_8b(reinterpret_cast<const char*>(src_tbl[num_layers + l]) + so,
                     reinterpret_cast<char*>(dst_tbl[num_layers + l]) + dof, item_bytes, lane);
    }
  }
}

void peer_copy(torch::Tensor src_tbl, torch::Tensor dst_tbl, torch::Tensor src_idx, torch::Tensor dst_idx,
               int64_t num_layers, int64_t has_v, int64_t item_bytes, int64_t src_stride, int64_t dst_stride,
               int64_t blocks, int64_t warps_per_block) {
  TORCH_CHECK(item_bytes % 8 == 0, "item_bytes must be a multiple of 8");
  const int64_t n = src_idx.numel();
  const int64_t warps = blocks * warps_per_block;
  const int64_t ipw = (n + warps - 1) / warps;
  auto stream = c10::cuda::getCurrentCUDAStream();
  peer_kernel<<<blocks, warps_per_block * 32, 0, stream>>>(
      src_tbl.data_ptr<int64_t>(), dst_tbl.data_ptr<int64_t>(), src_idx.data_ptr<int64_t>(),
      dst_idx.data_ptr<int64_t>(), n, ipw, num_layers, has_v, item_bytes, src_stride, dst_stride);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// ------------------------------------------------------------------ TMA bulk copies
constexpr int STAGES = 4;

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void bar_wait(uint32_t bar, uint32_t parity) {
  // labels are local to the braces, so the block may be inlined many times
  asm volatile("{\n .reg .pred P1;\n LAB_WAIT:\n"
               " mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n"
               " @P1 bra.uni DONE;\n bra.uni LAB_WAIT;\n DONE:\n }" :: "r"(bar), "r"(parity) : "memory");
}

// chunks: int64 [t, 5] = src_base, src_stride, dst_base, dst_stride, nbytes (absolute addresses)
__device__ __forceinline__ void unit_addr(const int64_t* __restrict__ chunks, const int64_t* __restrict__ src_idx,
                                          const int64_t* __restrict__ dst_idx, int64_t t, int64_t u,
                                          int64_t& s, int64_t& d, uint32_t& nb) {
  const int64_t i = u / t;
  const int64_t* e = chunks + (u % t) * 5;
  s = e[0] + src_idx[i] * e[1];
  d = e[2] + dst_idx[i] * e[3];
  nb = static_cast<uint32_t>(e[4]);
}

__global__ void tma_kernel(const int64_t* __restrict__ chunks, const int64_t* __restrict__ src_idx,
                           const int64_t* __restrict__ dst_idx, int64_t n, int64_t t, int64_t chunk_bytes) {
  extern __shared__ __align__(128) char ring[];
  __shared__ __align__(8) uint64_t bars[STAGES];
  if (threadIdx.x != 0) return;  // one issuing thread per block
  for (int s = 0; s < STAGES; ++s)
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(smem_addr(&bars[s])));
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  const int64_t total = n * t, first = blockIdx.x, step = gridDim.x;
  if (first >= total) return;
  const int64_t count = (total - first + step - 1) / step;
  auto load = [&](int64_t j) {
    int64_t s, d; uint32_t nb;
    unit_addr(chunks, src_idx, dst_idx, t, first + j * step, s, d, nb);
    const int st = j % STAGES;
    const uint32_t bar = smem_addr(&bars[st]);
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(nb) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(smem_addr(ring + st * chunk_bytes)), "l"(s), "r"(nb), "r"(bar) : "memory");
  };
  for (int64_t j = 0; j < STAGES && j < count; ++j) load(j);
  for (int64_t j = 0; j < count; ++j) {
    const int st = j % STAGES;
    bar_wait(smem_addr(&bars[st]), (j / STAGES) & 1);
    int64_t s, d; uint32_t nb;
    unit_addr(chunks, src_idx, dst_idx, t, first + j * step, s, d, nb);
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                 :: "l"(d), "r"(smem_addr(ring + st * chunk_bytes)), "r"(nb) : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    // refill the previous stage once its store has read shared memory (one store of slack)
    if (j >= 1 && j - 1 + STAGES < count) {
      asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
      load(j - 1 + STAGES);
    }
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

void tma_copy(torch::Tensor chunks, torch::Tensor src_idx, torch::Tensor dst_idx, int64_t blocks,
              int64_t chunk_bytes) {
  const int64_t n = src_idx.numel(), t = chunks.size(0);
  const int smem = STAGES * chunk_bytes;
  static int configured = 0;
  if (configured < smem) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(tma_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    configured = smem;
  }
  auto stream = c10::cuda::getCurrentCUDAStream();
  tma_kernel<<<blocks, 32, smem, stream>>>(chunks.data_ptr<int64_t>(), src_idx.data_ptr<int64_t>(),
                                           dst_idx.data_ptr<int64_t>(), n, t, chunk_bytes);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// ------------------------------------------------------------------ copy engines
void ce_batch(torch::Tensor dsts, torch::Tensor srcs, torch::Tensor sizes) {
  TORCH_CHECK(dsts.device().is_cpu() && srcs.device().is_cpu() && sizes.device().is_cpu(), "host arrays");
  const size_t count = dsts.numel();
  cudaMemcpyAttributes attr = {};
  attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
  size_t idx = 0;
  auto stream = c10::cuda::getCurrentCUDAStream();
  const size_t limit = 1 << 20;  // stay well inside any per-call descriptor limit
  for (size_t at = 0; at < count; at += limit) {
    const size_t m = count - at < limit ? count - at : limit;
#if CUDART_VERSION >= 13000
    C10_CUDA_CHECK(cudaMemcpyBatchAsync(reinterpret_cast<void* const*>(dsts.data_ptr<int64_t>() + at),
                                        reinterpret_cast<const void* const*>(srcs.data_ptr<int64_t>() + at),
                                        reinterpret_cast<const size_t*>(sizes.data_ptr<int64_t>() + at), m,
                                        &attr, &idx, 1, stream));
#else
    size_t fail = 0;
    C10_CUDA_CHECK(cudaMemcpyBatchAsync(reinterpret_cast<void**>(dsts.data_ptr<int64_t>() + at),
                                        reinterpret_cast<void**>(srcs.data_ptr<int64_t>() + at),
                                        reinterpret_cast<size_t*>(sizes.data_ptr<int64_t>() + at), m,
                                        &attr, &idx, 1, &fail, stream));
#endif
  }
}
"""


@functools.cache
def load():
    """Compile (first call, ~1 min) and import the extension."""
    from torch.utils.cpp_extension import load_inline

    return load_inline(
        name="hicache_bench_peer", cpp_sources=CPP, cuda_sources=CUDA,
        functions=["peer_copy", "tma_copy", "ce_batch"],
        extra_cuda_cflags=["-O3", "-gencode=arch=compute_90,code=sm_90", "-lineinfo"],
        verbose=bool(os.environ.get("HICACHE_BENCH_VERBOSE")))
