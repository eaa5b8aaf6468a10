// Does the copy engine's rate on 32-36 KiB runs depend on which streams carry the copies
// (issue 32)? pagekv's copy-engine form (1-D cudaMemcpyBatchAsync, one copy per row, streams
// forked from one and joined back, one host thread) over 256 MiB of rows of R bytes in random
// order into shuffled device rows, with 8 / 16 / 32 / 64 streams, each set created fresh for
// each of 4 trials and destroyed after it. Ratio: one contiguous cudaMemcpyAsync of the same
// bytes / the gather (medians of 5 after one, alternated).
//   nvcc -O3 -std=c++17 -arch=sm_90 -o /tmp/diag_ce_lanes scripts/diag_ce_lanes.cu
#include <stdint.h>

#include <random>

#include "diag_ce.h"

int main() {
  const size_t TOTAL = 256ull << 20;
  char *host, *dev;
  CK(cudaHostAlloc(&host, TOTAL, 0));
  CK(cudaMalloc(&dev, TOTAL));
  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
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
        Lanes set(lanes);  // made fresh for each trial, destroyed after it
        printf(" %d streams %.3f |", lanes, copy_over(st, dev, host, TOTAL, [&]() { set.gather(st, dst, src, size); }));
      }
      printf("\n");
      fflush(stdout);
    }
  }
  return 0;
}
