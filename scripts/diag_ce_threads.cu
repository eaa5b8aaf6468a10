// Is the copy engine's rate on 32-36 KiB runs bound by the host's enqueue (issue 32)? One
// all-layer gather as pagekv's copy-engine backend issues it (1-D cudaMemcpyBatchAsync, one copy
// per row, 16 streams forked from one and joined back), 256 MiB of rows of R bytes, random page
// order, shuffled device rows, enqueued by T host threads at once (each sending its own streams'
// batches; T = 1 is pagekv's form). Timed against one contiguous cudaMemcpyAsync of the same bytes
// (median of 5 after one; alternated), with the host time of the enqueue; each variant checked
// against the source first, the destination poisoned.
//   nvcc -O3 -std=c++17 -arch=sm_90 -o /tmp/diag_ce_threads scripts/diag_ce_threads.cu -lpthread
//   /tmp/diag_ce_threads
#include <stdint.h>

#include <chrono>
#include <cstring>
#include <random>
#include <thread>

#include "diag_ce.h"

static double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

constexpr int LANES = 16;
constexpr size_t MAX_OPS = 16384;

int main() {
  const size_t TOTAL = 256ull << 20;
  char *host, *dev, *check;
  CK(cudaHostAlloc(&host, TOTAL, 0));
  CK(cudaHostAlloc(&check, TOTAL, 0));
  CK(cudaMalloc(&dev, TOTAL));
  std::mt19937_64 rng(7);
  for (size_t i = 0; i < TOTAL / 8; ++i) ((uint64_t*)host)[i] = rng();
  cudaStream_t st, side[LANES];
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  cudaEvent_t fork, join[LANES], e0, e1;
  for (auto& s : side) CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  for (auto& e : join) CK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  CK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  for (size_t R : {18432ul, 32768ul, 36864ul, 65536ul, 131072ul}) {
    const size_t rows = TOTAL / R;
    std::vector<size_t> hperm(rows), dperm(rows);
    for (size_t i = 0; i < rows; ++i) hperm[i] = dperm[i] = i;
    std::shuffle(hperm.begin(), hperm.end(), rng);
    std::shuffle(dperm.begin(), dperm.end(), rng);
    std::vector<void*> dst(rows);
    std::vector<const void*> src(rows);
    std::vector<size_t> size(rows, R);
    for (size_t i = 0; i < rows; ++i) {
      src[i] = host + hperm[i] * R;
      dst[i] = dev + dperm[i] * R;
    }
    auto issue = [&](int threads) {
      CK(cudaEventRecord(fork, st));
      for (int i = 0; i < LANES; ++i) CK(cudaStreamWaitEvent(side[i], fork, 0));
      auto lanes = [&](int t) {
        for (int i = t; i < LANES; i += threads) {
          size_t b = rows * i / LANES, e = rows * (i + 1) / LANES;
          for (size_t x = b; x < e; x += MAX_OPS)
            CK(batch(dst.data() + x, src.data() + x, size.data() + x, std::min(MAX_OPS, e - x), side[i]));
        }
      };
      if (threads == 1) {
        lanes(0);
      } else {
        std::vector<std::thread> pool;
        for (int t = 0; t < threads; ++t) pool.emplace_back(lanes, t);
        for (auto& th : pool) th.join();
      }
      for (int i = 0; i < LANES; ++i) {
        CK(cudaEventRecord(join[i], side[i]));
        CK(cudaStreamWaitEvent(st, join[i], 0));
      }
    };
    auto copy = [&](int) { CK(cudaMemcpyAsync(dev, host, TOTAL, cudaMemcpyHostToDevice, st)); };
    for (int threads : {1, 2, 3, 4, 8}) {  // check first
      CK(cudaMemsetAsync(dev, 0xff, TOTAL, st));
      issue(threads);
      CK(cudaStreamSynchronize(st));
      CK(cudaMemcpy(check, dev, TOTAL, cudaMemcpyDeviceToHost));
      for (size_t i = 0; i < rows; ++i)
        if (memcmp(check + dperm[i] * R, host + hperm[i] * R, R)) { printf("MISMATCH R=%zu T=%d row %zu\n", R, threads, i); return 1; }
    }
    std::vector<double> tc, tv[5], hv[5];
    const int T[5] = {1, 2, 3, 4, 8};
    for (int round = 0; round < 6; ++round) {
      for (int k = -1; k < 5; ++k) {
        CK(cudaStreamSynchronize(st));
        CK(cudaEventRecord(e0, st));
        double h = now();
        if (k < 0) copy(0); else issue(T[k]);
        h = now() - h;
        CK(cudaEventRecord(e1, st));
        CK(cudaEventSynchronize(e1));
        float ms;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        if (!round) continue;
        if (k < 0) tc.push_back(ms); else { tv[k].push_back(ms); hv[k].push_back(h * 1e3); }
      }
    }
    printf("R=%zu KiB rows=%zu copy %.2f GB/s |", R / 1024, rows, TOTAL / 1e6 / med(tc));
    for (int k = 0; k < 5; ++k) printf(" T=%d %.3f of copy (host %.2f ms) |", T[k], med(tc) / med(tv[k]), med(hv[k]));
    printf("\n");
    fflush(stdout);
  }
  return 0;
}
