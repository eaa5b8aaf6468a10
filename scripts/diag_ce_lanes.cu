// Does the copy engine's rate on 32-36 KiB runs depend on which streams carry the copies
// (issue 32)? pagekv's copy-engine form (1-D cudaMemcpyBatchAsync, one copy per row, streams
// forked from one and joined back, one host thread) over 256 MiB of rows of R bytes in random
// order into shuffled device rows, with 8 / 16 / 32 / 64 streams, each set created fresh for
// each of 4 trials and destroyed after it. Ratio: one contiguous cudaMemcpyAsync of the same
// bytes / the gather (medians of 5 after one, alternated).
//   nvcc -O3 -std=c++17 -arch=sm_90 -o /tmp/diag_ce_lanes scripts/diag_ce_lanes.cu
#include <cuda_runtime.h>
#include <stdint.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { printf("ERR %s line %d: %s\n", #x, __LINE__, cudaGetErrorString(e_)); exit(1); } } while (0)
static double med(std::vector<double> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; }

int main() {
  const size_t TOTAL = 256ull << 20;
  char *host, *dev;
  CK(cudaHostAlloc(&host, TOTAL, 0));
  CK(cudaMalloc(&dev, TOTAL));
  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  cudaEvent_t fork, e0, e1;
  CK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  std::mt19937_64 rng(11);
  for (size_t R : {32768ul, 36864ul}) {
    const size_t rows = TOTAL / R;
    std::vector<size_t> hp(rows), dp(rows);
    for (size_t i = 0; i < rows; ++i) hp[i] = dp[i] = i;
    std::shuffle(hp.begin(), hp.end(), rng);
    std::shuffle(dp.begin(), dp.end(), rng);
    std::vector<void*> dst(rows);
    std::vector<const void*> src(rows);
    std::vector<size_t> size(rows, R);
    for (size_t i = 0; i < rows; ++i) { src[i] = host + hp[i] * R; dst[i] = dev + dp[i] * R; }
    for (int trial = 0; trial < 4; ++trial) {
      printf("R=%zu KiB trial %d:", R / 1024, trial);
      for (int lanes : {8, 16, 32, 64}) {
        std::vector<cudaStream_t> side(lanes);
        std::vector<cudaEvent_t> join(lanes);
        for (auto& s : side) CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
        for (auto& e : join) CK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
        auto issue = [&]() {
          CK(cudaEventRecord(fork, st));
          for (int i = 0; i < lanes; ++i) CK(cudaStreamWaitEvent(side[i], fork, 0));
          cudaMemcpyAttributes attr = {};
          attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
          attr.flags = 1;
          size_t first = 0;
          for (int i = 0; i < lanes; ++i) {
            size_t b = rows * i / lanes, e = rows * (i + 1) / lanes;
            CK(cudaMemcpyBatchAsync(dst.data() + b, src.data() + b, size.data() + b, e - b, &attr, &first, 1, side[i]));
          }
          for (int i = 0; i < lanes; ++i) { CK(cudaEventRecord(join[i], side[i])); CK(cudaStreamWaitEvent(st, join[i], 0)); }
        };
        std::vector<double> tc, tg;
        for (int round = 0; round < 6; ++round) {
          for (int k = 0; k < 2; ++k) {
            CK(cudaStreamSynchronize(st));
            CK(cudaEventRecord(e0, st));
            if (k == 0) CK(cudaMemcpyAsync(dev, host, TOTAL, cudaMemcpyHostToDevice, st)); else issue();
            CK(cudaEventRecord(e1, st));
            CK(cudaEventSynchronize(e1));
            float ms;
            CK(cudaEventElapsedTime(&ms, e0, e1));
            if (round) (k ? tg : tc).push_back(ms);
          }
        }
        printf(" %d streams %.3f |", lanes, med(tc) / med(tg));
        for (auto& s : side) CK(cudaStreamDestroy(s));
        for (auto& e : join) CK(cudaEventDestroy(e));
      }
      printf("\n");
      fflush(stdout);
    }
  }
  return 0;
}
