// Why the kernel tops out near 0.92 of the pinned copy (issue 32): SM-issued transfers between
// pinned host memory and device memory, against one contiguous cudaMemcpyAsync of the same
// 256 MiB, for runs of 4-64 KiB gathered as an all-layer page transfer does (64 runs per
// host page, pages in random order, device runs in shuffled slots):
//   lsu  16-byte loads, 4 in flight per thread, as pagekv's kernel (G blocks x 1024 threads);
//   tma  Hopper bulk copies (cp.async.bulk) host -> shared memory -> device, one issuing thread
//        per warp with K stages of B bytes (G blocks x W warps).
// Each variant is checked against the source first (the destination poisoned), then timed
// (median of 5 after one); ratios are copy time / variant time, load and save.
//   nvcc -O3 -std=c++17 -arch=sm_90 -o /tmp/diag_sm_host_copies scripts/diag_sm_host_copies.cu
//   /tmp/diag_sm_host_copies
// With -DDIAG_SM_LIB -shared -Xcompiler -fPIC: the two variants' launches as a library, no main
// (scripts/diag_sm_beside_decode.py: what each costs a decode beside it).
#include <cuda_runtime.h>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <algorithm>
#include <random>
#include <stdint.h>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("ERR %s line %d: %s\n", #x, __LINE__, cudaGetErrorString(e)); exit(1);} } while (0)

__device__ __forceinline__ uint32_t sa(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

constexpr int MAXK = 8;
__global__ void tma_runs(const char* src, char* dst, const int64_t* soff, const int64_t* doff,
                         int64_t nruns, int R, int B, int K) {
  extern __shared__ __align__(128) char smem[];
  __shared__ __align__(8) uint64_t bars[32][MAXK];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, W = blockDim.x / 32;
  if (lane != 0) return;
  char* stage0 = smem + (size_t)warp * K * B;
  uint64_t* bar = bars[warp];
  for (int s = 0; s < K; ++s) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(sa(&bar[s])));
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  const int64_t gw = (int64_t)blockIdx.x * W + warp, nw = (int64_t)gridDim.x * W;
  const int ppr = (R + B - 1) / B;
  const int64_t P = nruns * ppr;
  const int64_t begin = P * gw / nw, end = P * (gw + 1) / nw;
  uint32_t parity = 0;
  auto piece = [&](int64_t q, int64_t& so, int64_t& d, int& n) {
    int64_t run = q / ppr; int part = (int)(q % ppr); int off = part * B;
    n = min(B, R - off); so = soff[run] + off; d = doff[run] + off;
  };
  auto issue_load = [&](int64_t q) {
    int s = (int)((q - begin) % K); int64_t so, d; int n; piece(q, so, d, n);
    uint32_t b = sa(&bar[s]);
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(b), "r"(n) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(sa(stage0 + (size_t)s * B)), "l"(src + so), "r"(n), "r"(b) : "memory");
  };
  for (int64_t q = begin; q < min(begin + K, end); ++q) issue_load(q);
  for (int64_t q = begin; q < end; ++q) {
    int s = (int)((q - begin) % K);
    uint32_t b = sa(&bar[s]); uint32_t ph = (parity >> s) & 1u; uint32_t done = 0;
    while (!done) {
      asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                   : "=r"(done) : "r"(b), "r"(ph) : "memory");
    }
    parity ^= (1u << s);
    int64_t so, d; int n; piece(q, so, d, n);
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" :: "l"(dst + d), "r"(sa(stage0 + (size_t)s * B)), "r"(n) : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    if (q > begin && q - 1 + K < end) {
      asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
      issue_load(q - 1 + K);
    }
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

// SM-load reference: 16-byte chunks, 4 in flight per thread (as pagekv's kernel)
__global__ void lsu_runs(const char* src, char* dst, const int64_t* soff, const int64_t* doff, int64_t nruns, int R) {
  const int64_t cpr = R / 16, total = nruns * cpr, stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t base = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; base < total; base += stride * 4) {
    uint4 buf[4]; char* dp[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      int64_t k = base + u * stride; dp[u] = nullptr;
      if (k < total) { int64_t r = k / cpr, c = k % cpr; buf[u] = *(const uint4*)(src + soff[r] + c * 16); dp[u] = dst + doff[r] + c * 16; }
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) if (dp[u]) *(uint4*)dp[u] = buf[u];
  }
}

#ifdef DIAG_SM_LIB
// Built as a library (-DDIAG_SM_LIB -shared) for scripts/diag_sm_beside_decode.py: one launch of
// either variant over runs [0, nruns) of the offset tables, on ``s``; returns cudaGetLastError.
extern "C" int diag_lsu(const char* src, char* dst, const int64_t* soff, const int64_t* doff,
                        int64_t nruns, int R, int G, int T, cudaStream_t s) {
  lsu_runs<<<G, T, 0, s>>>(src, dst, soff, doff, nruns, R);
  return (int)cudaGetLastError();
}
extern "C" int diag_tma(const char* src, char* dst, const int64_t* soff, const int64_t* doff,
                        int64_t nruns, int R, int B, int K, int G, int W, cudaStream_t s) {
  static bool sized = false;
  if (!sized) {
    cudaError_t e = cudaFuncSetAttribute(tma_runs, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         200 * 1024);
    if (e != cudaSuccess) return (int)e;
    sized = true;
  }
  tma_runs<<<G, 32 * W, (size_t)W * K * B, s>>>(src, dst, soff, doff, nruns, R, B, K);
  return (int)cudaGetLastError();
}
#else
static float med(std::vector<float> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; }

int main(int argc, char** argv) {
  const size_t TOTAL = 256ull << 20;
  char *host, *host2, *dev, *check;
  CK(cudaHostAlloc(&host, TOTAL, cudaHostAllocMapped));
  CK(cudaHostAlloc(&host2, TOTAL, cudaHostAllocMapped));
  CK(cudaHostAlloc(&check, TOTAL, 0));
  CK(cudaMalloc(&dev, TOTAL));
  std::mt19937_64 rng(1);
  for (size_t i = 0; i < TOTAL / 8; ++i) ((uint64_t*)host)[i] = rng();
  cudaStream_t st; CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
  CK(cudaFuncSetAttribute(tma_runs, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
  auto timeit = [&](auto fn) { std::vector<float> t; for (int i = 0; i < 6; ++i) { CK(cudaEventRecord(e0, st)); fn(); CK(cudaEventRecord(e1, st)); CK(cudaEventSynchronize(e1)); float ms; CK(cudaEventElapsedTime(&ms, e0, e1)); if (i) t.push_back(ms); } return med(t); };
  auto copy_h2d = [&]() { CK(cudaMemcpyAsync(dev, host, TOTAL, cudaMemcpyHostToDevice, st)); };
  auto copy_d2h = [&]() { CK(cudaMemcpyAsync(host2, dev, TOTAL, cudaMemcpyDeviceToHost, st)); };
  int runs_list[] = {4096, 8192, 16384, 18432, 32768, 65536};
  struct Cfg { int G, W, K, B; };
  std::vector<Cfg> cfgs = {{4,1,8,16384},{8,1,8,16384},{16,1,8,16384},{32,1,8,16384},{16,2,6,16384},{8,4,4,8192},{16,4,4,8192},{32,4,4,8192},{66,1,6,16384},{132,1,4,16384},{16,1,4,32768},{32,1,4,32768}};
  for (int R : runs_list) {
    const int per_page = 64;
    const int64_t pages = TOTAL / ((int64_t)per_page * R), nruns = pages * per_page;
    std::vector<int64_t> perm(pages), perm2(pages);
    for (int64_t i = 0; i < pages; ++i) perm[i] = perm2[i] = i;
    std::shuffle(perm.begin(), perm.end(), rng); std::shuffle(perm2.begin(), perm2.end(), rng);
    std::vector<int64_t> hoff(nruns), doff(nruns);
    for (int64_t i = 0; i < pages; ++i) for (int u = 0; u < per_page; ++u) {
      hoff[i * per_page + u] = perm[i] * per_page * (int64_t)R + (int64_t)u * R;
      doff[i * per_page + u] = (int64_t)u * pages * R + perm2[i] * (int64_t)R;
    }
    int64_t *dh, *dd; CK(cudaMalloc(&dh, nruns * 8)); CK(cudaMalloc(&dd, nruns * 8));
    CK(cudaMemcpy(dh, hoff.data(), nruns * 8, cudaMemcpyHostToDevice)); CK(cudaMemcpy(dd, doff.data(), nruns * 8, cudaMemcpyHostToDevice));
    auto verify_load = [&]() { CK(cudaMemcpy(check, dev, TOTAL, cudaMemcpyDeviceToHost)); for (int64_t r = 0; r < nruns; ++r) if (memcmp(check + doff[r], host + hoff[r], R)) return false; return true; };
    auto verify_save = [&]() { for (int64_t r = 0; r < nruns; ++r) if (memcmp(host2 + hoff[r], host + hoff[r], R)) return false; return true; };
    float ch = timeit(copy_h2d), cd = timeit(copy_d2h);
    float GB = TOTAL / 1e9;
    printf("R=%d copy H2D %.1f GB/s D2H %.1f GB/s\n", R, GB / ch * 1e3, GB / cd * 1e3);
    for (int G : {4, 8, 16}) {
      auto ld = [&]() { lsu_runs<<<G, 1024, 0, st>>>(host, dev, dh, dd, nruns, R); };
      auto sv = [&]() { lsu_runs<<<G, 1024, 0, st>>>(dev, host2, dd, dh, nruns, R); };
      CK(cudaMemsetAsync(dev, 0xff, TOTAL, st)); ld(); CK(cudaStreamSynchronize(st)); bool okl = verify_load();
      memset(host2, 0xee, TOTAL); sv(); CK(cudaStreamSynchronize(st)); bool oks = verify_save();
      float tl = timeit(ld), ts = timeit(sv);
      printf("  lsu G=%-3d load %.3f save %.3f %s%s\n", G, ch / tl, cd / ts, okl ? "" : "LOADBAD ", oks ? "" : "SAVEBAD");
    }
    for (auto c : cfgs) {
      size_t sm = (size_t)c.W * c.K * c.B;
      auto ld = [&]() { tma_runs<<<c.G, 32 * c.W, sm, st>>>(host, dev, dh, dd, nruns, R, c.B, c.K); };
      auto sv = [&]() { tma_runs<<<c.G, 32 * c.W, sm, st>>>(dev, host2, dd, dh, nruns, R, c.B, c.K); };
      CK(cudaMemsetAsync(dev, 0xff, TOTAL, st)); ld(); CK(cudaStreamSynchronize(st)); CK(cudaGetLastError()); bool okl = verify_load();
      memset(host2, 0xee, TOTAL); sv(); CK(cudaStreamSynchronize(st)); bool oks = verify_save();
      float tl = timeit(ld), ts = timeit(sv);
      printf("  tma G=%-3d W=%d K=%d B=%-5d load %.3f save %.3f %s%s\n", c.G, c.W, c.K, c.B, ch / tl, cd / ts, okl ? "" : "LOADBAD ", oks ? "" : "SAVEBAD");
    }
    float ch2 = timeit(copy_h2d), cd2 = timeit(copy_d2h);
    printf("  copy again H2D %.1f D2H %.1f\n", GB / ch2 * 1e3, GB / cd2 * 1e3);
    CK(cudaFree(dh)); CK(cudaFree(dd));
  }
  return 0;
}
#endif  // DIAG_SM_LIB
