// Does the copy engine's rate on small runs depend on how the pinned host memory is backed
// (issue 32)? The copy-engine form of pagekv (1-D cudaMemcpyBatchAsync, one copy per row, 16
// streams forked from one and joined back) gathers 256 MiB of R-byte rows, drawn at random from
// a 2 GiB host pool, into shuffled device rows. The pool is (a) cudaHostAlloc, (b) 4 KiB pages
// (madvise NOHUGEPAGE) registered with cudaHostRegister, (c) transparent huge pages (madvise
// HUGEPAGE) registered the same way. Ratio: one contiguous 256 MiB cudaMemcpyAsync out of the
// same pool / the gather (medians of 5 after one, alternated); pools interleaved per trial.
// With the argument "spread": cudaHostAlloc pools of 256 MiB, 2 GiB and 8 GiB instead (does
// the rate depend on how far apart the rows lie?); "quick": one 256 MiB pool, 32 and 36 KiB
// rows (one process of a series, e.g. under each CUDA_DEVICE_MAX_CONNECTIONS).
//   nvcc -O3 -std=c++17 -arch=sm_90 -o /tmp/diag_ce_hostmem scripts/diag_ce_hostmem.cu
//   /tmp/diag_ce_hostmem; /tmp/diag_ce_hostmem spread
#include <stdint.h>
#include <sys/mman.h>

#include <cstring>
#include <random>

#include "diag_ce.h"

static char* pool(int kind, size_t bytes) {
  if (kind == 0) { char* p; CK(cudaHostAlloc(&p, bytes, 0)); return p; }
  void* p = mmap(nullptr, bytes + (2u << 20), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) { perror("mmap"); exit(1); }
  char* a = (char*)(((uintptr_t)p + (2u << 20) - 1) & ~(uintptr_t)((2u << 20) - 1));
  if (madvise(a, bytes, kind == 2 ? MADV_HUGEPAGE : MADV_NOHUGEPAGE)) perror("madvise");
  memset(a, 1, bytes);
  CK(cudaHostRegister(a, bytes, cudaHostRegisterDefault));
  return a;
}

static long anon_huge_kib() {
  FILE* f = fopen("/proc/self/smaps_rollup", "r");
  if (!f) return -1;
  char line[256]; long kib = -1;
  while (fgets(line, sizeof line, f)) if (sscanf(line, "AnonHugePages: %ld kB", &kib) == 1) break;
  fclose(f);
  return kib;
}

int main(int argc, char** argv) {
  const size_t TOTAL = 256ull << 20;
  const bool quick = argc > 1 && !strcmp(argv[1], "quick");
  const bool spread = quick || (argc > 1 && !strcmp(argv[1], "spread"));
  std::vector<const char*> names;
  std::vector<char*> pools;
  std::vector<size_t> sizes;
  if (spread) {
    names = {"256MiB", "2GiB", "8GiB"};
    sizes = {TOTAL, 2ull << 30, 8ull << 30};
    if (quick) names.resize(1), sizes.resize(1);
    for (size_t b : sizes) pools.push_back(pool(0, b));
  } else {
    names = {"cudaHostAlloc", "4k+register", "thp+register"};
    for (int k = 0; k < 3; ++k) {
      sizes.push_back(2ull << 30);
      pools.push_back(pool(k, sizes[k]));
      printf("%s: AnonHugePages %ld kB\n", names[k], anon_huge_kib());
    }
  }
  char* dev;
  CK(cudaMalloc(&dev, TOTAL));
  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  Lanes lanes(16);
  std::mt19937_64 rng(7);
  std::vector<size_t> runs = {8192ul, 16384ul, 32768ul, 36864ul, 65536ul};
  if (spread) runs = {32768ul, 36864ul, 65536ul};
  if (quick) runs = {32768ul, 36864ul};
  for (size_t R : runs) {
    const size_t rows = TOTAL / R;
    std::vector<std::vector<size_t>> hp(pools.size());
    std::vector<size_t> dp(rows);
    for (size_t k = 0; k < pools.size(); ++k) {
      hp[k].resize(sizes[k] / R);
      for (size_t i = 0; i < hp[k].size(); ++i) hp[k][i] = i;
      std::shuffle(hp[k].begin(), hp[k].end(), rng);
    }
    for (size_t i = 0; i < rows; ++i) dp[i] = i;
    std::shuffle(dp.begin(), dp.end(), rng);
    std::vector<void*> dst(rows);
    std::vector<const void*> src(rows);
    std::vector<size_t> size(rows, R);
    for (int trial = 0; trial < 3; ++trial) {
      printf("R=%zu KiB trial %d:", R / 1024, trial);
      for (size_t k = 0; k < pools.size(); ++k) {
        for (size_t i = 0; i < rows; ++i) { src[i] = pools[k] + hp[k][i] * R; dst[i] = dev + dp[i] * R; }
        double copy_ms;
        double ratio = copy_over(st, dev, pools[k], TOTAL, [&]() { lanes.gather(st, dst, src, size); }, &copy_ms);
        printf(" %s %.3f (copy %.1f GB/s) |", names[k], ratio, TOTAL / copy_ms / 1e6);
      }
      printf("\n");
      fflush(stdout);
    }
  }
  return 0;
}
