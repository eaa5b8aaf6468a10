// Copy-engine transfers with one pitched copy per page (issue 32): where each (layer, K/V) cache
// lies at a fixed stride from the next, an all-layer page is one 2-D copy (a row per layer and
// K/V) instead of one copy per row. Timed against one contiguous cudaMemcpyAsync of the same
// 256 MiB, rows of 4-32 KiB, pages in random order, device rows in shuffled slots:
//   2d       cudaMemcpy2DAsync per page, over 1 / 4 / 16 streams forked from one;
//   3dbatch  cudaMemcpy3DBatchAsync (CUDA >= 12.8), all pages in 1 / 4 / 16 calls.
// Each variant is checked against the source first (the destination poisoned), then timed
// (median of 5 after one) with its host time; ratios are copy time / variant time.
//   nvcc -O3 -std=c++17 -arch=sm_90 -o /tmp/diag_ce_pitched scripts/diag_ce_pitched.cu
//   /tmp/diag_ce_pitched
#include <cuda_runtime.h>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <algorithm>
#include <random>
#include <chrono>
#include <functional>
#include <string>
#include <stdint.h>
#define CK(x) do { cudaError_t ce_ = (x); if (ce_ != cudaSuccess) { printf("ERR %s line %d: %s\n", #x, __LINE__, cudaGetErrorString(ce_)); exit(1);} } while (0)
static float med(std::vector<float> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; }
static double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

int main() {
  const size_t TOTAL = 256ull << 20;
  char *host, *host2, *dev, *check;
  CK(cudaHostAlloc(&host, TOTAL, 0)); CK(cudaHostAlloc(&host2, TOTAL, 0)); CK(cudaHostAlloc(&check, TOTAL, 0));
  CK(cudaMalloc(&dev, TOTAL));
  std::mt19937_64 rng(1);
  for (size_t i = 0; i < TOTAL / 8; ++i) ((uint64_t*)host)[i] = rng();
  cudaStream_t st; CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  std::vector<cudaStream_t> side(16); std::vector<cudaEvent_t> ev(17);
  for (auto& s : side) CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  for (auto& e : ev) CK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
  double host_s = 0;
  auto timeit = [&](auto fn) { std::vector<float> t; host_s = 1e9; for (int i = 0; i < 6; ++i) { CK(cudaEventRecord(e0, st)); double h = now(); fn(); h = now() - h; CK(cudaEventRecord(e1, st)); CK(cudaEventSynchronize(e1)); float ms; CK(cudaEventElapsedTime(&ms, e0, e1)); if (i) { t.push_back(ms); host_s = std::min(host_s, h); } } return med(t); };
  auto fork = [&](int n) { CK(cudaEventRecord(ev[16], st)); for (int i = 0; i < n; ++i) CK(cudaStreamWaitEvent(side[i], ev[16])); };
  auto join = [&](int n) { for (int i = 0; i < n; ++i) { CK(cudaEventRecord(ev[i], side[i])); CK(cudaStreamWaitEvent(st, ev[i])); } };
  const int LINES = 64;  // 32 layers x K/V
  for (int R : {4096, 8192, 16384, 18432, 32768}) {
    const int64_t pages = TOTAL / ((int64_t)LINES * R);
    const size_t dpitch = (size_t)pages * R;  // (layer, kv) regions one after another
    std::vector<int64_t> perm(pages), perm2(pages);
    for (int64_t i = 0; i < pages; ++i) perm[i] = perm2[i] = i;
    std::shuffle(perm.begin(), perm.end(), rng); std::shuffle(perm2.begin(), perm2.end(), rng);
    auto hp = [&](int64_t i) { return (size_t)perm[i] * LINES * R; };
    auto dp = [&](int64_t i) { return (size_t)perm2[i] * R; };
    auto verify_load = [&]() { CK(cudaMemcpy(check, dev, TOTAL, cudaMemcpyDeviceToHost)); for (int64_t i = 0; i < pages; ++i) for (int l = 0; l < LINES; ++l) if (memcmp(check + l * dpitch + dp(i), host + hp(i) + (size_t)l * R, R)) return false; return true; };
    auto verify_save = [&]() { for (int64_t i = 0; i < pages; ++i) if (memcmp(host2 + hp(i), host + hp(i), (size_t)LINES * R)) return false; return true; };
    // 2D per page on k streams
    auto ld2d = [&](int k) { return [&, k]() { fork(k); for (int64_t i = 0; i < pages; ++i) CK(cudaMemcpy2DAsync(dev + dp(i), dpitch, host + hp(i), R, R, LINES, cudaMemcpyHostToDevice, side[i % k])); join(k); }; };
    auto sv2d = [&](int k) { return [&, k]() { fork(k); for (int64_t i = 0; i < pages; ++i) CK(cudaMemcpy2DAsync(host2 + hp(i), R, dev + dp(i), dpitch, R, LINES, cudaMemcpyDeviceToHost, side[i % k])); join(k); }; };
    std::vector<cudaMemcpy3DBatchOp> ops(pages);
    auto batch = [&](bool load, int k) { return [&, load, k]() {
      for (int64_t i = 0; i < pages; ++i) {
        cudaMemcpy3DBatchOp& o = ops[i]; memset(&o, 0, sizeof o);
        cudaMemcpy3DOperand h{}, d{};
        h.type = cudaMemcpyOperandTypePointer; h.op.ptr.ptr = (load ? host : host2) + hp(i); h.op.ptr.rowLength = R; h.op.ptr.layerHeight = LINES;
        d.type = cudaMemcpyOperandTypePointer; d.op.ptr.ptr = dev + dp(i); d.op.ptr.rowLength = dpitch; d.op.ptr.layerHeight = LINES;
        o.src = load ? h : d; o.dst = load ? d : h; o.extent = make_cudaExtent(R, LINES, 1);
        o.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
      }
      fork(k);
      for (int s = 0; s < k; ++s) { int64_t b = pages * s / k, e = pages * (s + 1) / k; if (e > b) CK(cudaMemcpy3DBatchAsync(e - b, ops.data() + b, 0, side[s])); }
      join(k);
    }; };
    auto copy_h2d = [&]() { CK(cudaMemcpyAsync(dev, host, TOTAL, cudaMemcpyHostToDevice, st)); };
    auto copy_d2h = [&]() { CK(cudaMemcpyAsync(host2, dev, TOTAL, cudaMemcpyDeviceToHost, st)); };
    float ch = timeit(copy_h2d), cd = timeit(copy_d2h), GB = TOTAL / 1e9;
    printf("R=%d pages=%ld copy H2D %.1f D2H %.1f GB/s\n", R, (long)pages, GB / ch * 1e3, GB / cd * 1e3);
    std::vector<std::pair<std::string, std::pair<std::function<void()>, std::function<void()>>>> vs = {
      {"2d x1", {ld2d(1), sv2d(1)}}, {"2d x4", {ld2d(4), sv2d(4)}}, {"2d x16", {ld2d(16), sv2d(16)}},
      {"3dbatch x1", {batch(true, 1), batch(false, 1)}}, {"3dbatch x4", {batch(true, 4), batch(false, 4)}}, {"3dbatch x16", {batch(true, 16), batch(false, 16)}}};
    for (auto& v : vs) {
      CK(cudaMemsetAsync(dev, 0xff, TOTAL, st)); v.second.first(); CK(cudaStreamSynchronize(st)); bool okl = verify_load();
      memset(host2, 0xee, TOTAL); v.second.second(); CK(cudaStreamSynchronize(st)); bool oks = verify_save();
      float tl = timeit(v.second.first); double hl = host_s; float ts = timeit(v.second.second); double hs = host_s;
      printf("  %-12s load %.3f (host %.2f ms) save %.3f (host %.2f ms) %s%s\n", v.first.c_str(), ch / tl, hl * 1e3, cd / ts, hs * 1e3, okl ? "" : "LOADBAD ", oks ? "" : "SAVEBAD");
    }
    float ch2 = timeit(copy_h2d), cd2 = timeit(copy_d2h);
    printf("  copy again H2D %.1f D2H %.1f\n", GB / ch2 * 1e3, GB / cd2 * 1e3);
  }
  return 0;
}
