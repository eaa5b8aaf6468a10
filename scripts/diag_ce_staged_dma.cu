// A staged transfer with no SM in it (issue 32): whole host pages copied by the copy engines
// into a device staging ring, then scattered into the layer-first caches by device-to-device
// pitched copies (one cudaMemcpy2DAsync per page, a row per layer and K/V) instead of a kernel;
// saves the reverse. Timed against one contiguous cudaMemcpyAsync of the same bytes, rows of
// 4-32 KiB (64 rows a page: 32 layers x K/V), pages in random order on both sides.
//   d2d       the device-to-device pitched scatter alone (staging pages already on the device)
//   pipe CxS  the pipeline: chunks of C MiB over 4 buffers, S stream pairs (copy, scatter)
// Each variant is checked first (destination poisoned), then timed (median of 5 after one).
//   nvcc -O3 -std=c++17 -arch=sm_90 -o /tmp/diag_ce_staged_dma scripts/diag_ce_staged_dma.cu
//   /tmp/diag_ce_staged_dma [total MiB]
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>
#include <stdint.h>

#include "diag_ce.h"

static double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

int main(int argc, char** argv) {
  const size_t TOTAL = (argc > 1 ? atoll(argv[1]) : 256ull) << 20;
  const int LINES = 64;
  const int NBUF = 4;
  char *host, *host2, *cache, *pages_dev, *check;
  CK(cudaHostAlloc(&host, TOTAL, 0)); CK(cudaHostAlloc(&host2, TOTAL, 0)); CK(cudaHostAlloc(&check, TOTAL, 0));
  CK(cudaMalloc(&cache, TOTAL)); CK(cudaMalloc(&pages_dev, TOTAL));
  char* ring; CK(cudaMalloc(&ring, (size_t)NBUF * (64ull << 20)));
  std::mt19937_64 rng(1);
  for (size_t i = 0; i < TOTAL / 8; ++i) ((uint64_t*)host)[i] = rng();
  cudaStream_t st; CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  std::vector<cudaStream_t> cs(8), ss(8);
  for (auto& s : cs) CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  for (auto& s : ss) CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  std::vector<cudaEvent_t> ready(NBUF), freed(NBUF), joins(16);
  for (auto& e : ready) CK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  for (auto& e : freed) CK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  for (auto& e : joins) CK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  cudaEvent_t forkev; CK(cudaEventCreateWithFlags(&forkev, cudaEventDisableTiming));
  cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
  double host_s = 0;
  auto timeit = [&](const std::function<void()>& fn) {
    std::vector<double> t; host_s = 1e9;
    for (int i = 0; i < 6; ++i) {
      CK(cudaEventRecord(e0, st)); double h = now(); fn(); h = now() - h; CK(cudaEventRecord(e1, st));
      CK(cudaEventSynchronize(e1)); float ms; CK(cudaEventElapsedTime(&ms, e0, e1));
      if (i) { t.push_back(ms); host_s = std::min(host_s, h); }
    }
    return med(t);
  };
  auto fork = [&](std::vector<cudaStream_t>& v, int n) { CK(cudaEventRecord(forkev, st)); for (int i = 0; i < n; ++i) CK(cudaStreamWaitEvent(v[i], forkev)); };
  auto join = [&](std::vector<cudaStream_t>& v, int n, int base) { for (int i = 0; i < n; ++i) { CK(cudaEventRecord(joins[base + i], v[i])); CK(cudaStreamWaitEvent(st, joins[base + i])); } };
  for (int R : {4096, 8192, 16384, 18432, 32768}) {
    const size_t page = (size_t)LINES * R;
    const int64_t pages = TOTAL / page;
    const size_t dpitch = (size_t)pages * R;  // (layer, kv) regions one after another
    std::vector<int64_t> hperm(pages), dperm(pages);
    for (int64_t i = 0; i < pages; ++i) hperm[i] = dperm[i] = i;
    std::shuffle(hperm.begin(), hperm.end(), rng); std::shuffle(dperm.begin(), dperm.end(), rng);
    auto hp = [&](int64_t i) { return (size_t)hperm[i] * page; };
    auto dp = [&](int64_t i) { return (size_t)dperm[i] * R; };
    auto verify_load = [&]() { CK(cudaMemcpy(check, cache, TOTAL, cudaMemcpyDeviceToHost)); for (int64_t i = 0; i < pages; ++i) for (int l = 0; l < LINES; ++l) if (memcmp(check + l * dpitch + dp(i), host + hp(i) + (size_t)l * R, R)) return false; return true; };
    auto verify_save = [&]() { for (int64_t i = 0; i < pages; ++i) if (memcmp(host2 + hp(i), host + hp(i), page)) return false; return true; };
    // staging pages on the device in transfer order (for d2d alone)
    for (int64_t i = 0; i < pages; ++i) CK(cudaMemcpy(pages_dev + i * page, host + hp(i), page, cudaMemcpyHostToDevice));
    auto d2d = [&](int k) { return [&, k]() { fork(ss, k); for (int64_t i = 0; i < pages; ++i) CK(cudaMemcpy2DAsync(cache + dp(i), dpitch, pages_dev + i * page, R, R, LINES, cudaMemcpyDeviceToDevice, ss[i % k])); join(ss, k, 0); }; };
    auto pipeline = [&](bool load, size_t chunk_mib, int S) { return [&, load, chunk_mib, S]() {
      const int64_t per = std::max<int64_t>(1, (int64_t)((chunk_mib << 20) / page));
      fork(cs, S); fork(ss, S);
      int chunk = 0;
      for (int64_t b0 = 0; b0 < pages; b0 += per, ++chunk) {
        const int64_t b1 = std::min(pages, b0 + per);
        const int buf = chunk % NBUF; cudaStream_t c = cs[chunk % S], s = ss[chunk % S];
        char* stage = ring + (size_t)buf * (64ull << 20);
        if (load) {
          if (chunk >= NBUF) CK(cudaStreamWaitEvent(c, freed[buf]));
          for (int64_t i = b0; i < b1; ++i) CK(cudaMemcpyAsync(stage + (i - b0) * page, host + hp(i), page, cudaMemcpyHostToDevice, c));
          CK(cudaEventRecord(ready[buf], c)); CK(cudaStreamWaitEvent(s, ready[buf]));
          for (int64_t i = b0; i < b1; ++i) CK(cudaMemcpy2DAsync(cache + dp(i), dpitch, stage + (i - b0) * page, R, R, LINES, cudaMemcpyDeviceToDevice, s));
          CK(cudaEventRecord(freed[buf], s));
        } else {
          if (chunk >= NBUF) CK(cudaStreamWaitEvent(s, freed[buf]));
          for (int64_t i = b0; i < b1; ++i) CK(cudaMemcpy2DAsync(stage + (i - b0) * page, R, cache + dp(i), dpitch, R, LINES, cudaMemcpyDeviceToDevice, s));
          CK(cudaEventRecord(ready[buf], s)); CK(cudaStreamWaitEvent(c, ready[buf]));
          for (int64_t i = b0; i < b1; ++i) CK(cudaMemcpyAsync(host2 + hp(i), stage + (i - b0) * page, page, cudaMemcpyDeviceToHost, c));
          CK(cudaEventRecord(freed[buf], c));
        }
      }
      join(cs, S, 0); join(ss, S, 8);
    }; };
    auto copy_h2d = [&]() { CK(cudaMemcpyAsync(cache, host, TOTAL, cudaMemcpyHostToDevice, st)); };
    auto copy_d2h = [&]() { CK(cudaMemcpyAsync(host2, cache, TOTAL, cudaMemcpyDeviceToHost, st)); };
    float ch = timeit(copy_h2d), cd = timeit(copy_d2h), GB = TOTAL / 1e9;
    printf("R=%d pages=%ld page=%zu KiB copy H2D %.1f D2H %.1f GB/s\n", R, (long)pages, page >> 10, GB / ch * 1e3, GB / cd * 1e3);
    for (int k : {1, 4}) {
      CK(cudaMemsetAsync(cache, 0xff, TOTAL, st)); d2d(k)(); CK(cudaStreamSynchronize(st));
      bool ok = verify_load();
      float t = timeit(d2d(k));
      printf("  d2d x%d       %.1f GB/s = %.2f of the H2D copy (host %.2f ms) %s\n", k, GB / t * 1e3, ch / t, host_s * 1e3, ok ? "" : "BAD");
    }
    for (size_t cm : {4, 16}) for (int S : {1, 2, 4}) {
      std::function<void()> ld = pipeline(true, cm, S);
      std::function<void()> sv = pipeline(false, cm, S);
      CK(cudaMemsetAsync(cache, 0xff, TOTAL, st)); ld(); CK(cudaStreamSynchronize(st)); bool okl = verify_load();
      memset(host2, 0xee, TOTAL); sv(); CK(cudaStreamSynchronize(st)); bool oks = verify_save();
      float tl = timeit(ld); double hl = host_s; float ts = timeit(sv); double hs = host_s;
      printf("  pipe %2zux%d    load %.3f (host %.2f ms) save %.3f (host %.2f ms) %s%s\n", cm, S, ch / tl, hl * 1e3, cd / ts, hs * 1e3, okl ? "" : "LOADBAD ", oks ? "" : "SAVEBAD");
    }
    float ch2 = timeit(copy_h2d), cd2 = timeit(copy_d2h);
    printf("  copy again H2D %.1f D2H %.1f\n", GB / ch2 * 1e3, GB / cd2 * 1e3);
  }
  return 0;
}
