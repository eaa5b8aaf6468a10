// What the copy-engine diagnostics (scripts/diag_ce_*.cu) share: the error check, the median,
// pagekv's copy-engine form of a gather (1-D cudaMemcpyBatchAsync, one copy per row, over side
// streams forked from the caller's stream and joined back to it) and its timing against one
// contiguous cudaMemcpyAsync of the same bytes.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { printf("ERR %s line %d: %s\n", #x, __LINE__, cudaGetErrorString(e_)); exit(1); } } while (0)
static double med(std::vector<double> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; }

// One batched call of `count` copies on `st`, each stream-ordered after the stream's earlier work.
static cudaError_t batch(void** d, const void** s, size_t* n, size_t count, cudaStream_t st) {
  cudaMemcpyAttributes attr = {};
  attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  attr.flags = 1;
  size_t first = 0;
  return cudaMemcpyBatchAsync(d, s, n, count, &attr, &first, 1, st);
}

// `n` side streams, made on construction and destroyed with the object.
struct Lanes {
  std::vector<cudaStream_t> side;
  std::vector<cudaEvent_t> join;
  cudaEvent_t fork;
  explicit Lanes(int n) : side(n), join(n) {
    for (auto& s : side) CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    for (auto& e : join) CK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    CK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
  }
  ~Lanes() {
    for (auto& s : side) CK(cudaStreamDestroy(s));
    for (auto& e : join) CK(cudaEventDestroy(e));
    CK(cudaEventDestroy(fork));
  }
  // The rows split evenly over the lanes, one batched call each, after `st`'s earlier work;
  // `st`'s later work waits for every lane.
  void gather(cudaStream_t st, std::vector<void*>& dst, std::vector<const void*>& src, std::vector<size_t>& size) {
    const size_t rows = dst.size(), lanes = side.size();
    CK(cudaEventRecord(fork, st));
    for (auto s : side) CK(cudaStreamWaitEvent(s, fork, 0));
    for (size_t i = 0; i < lanes; ++i) {
      size_t b = rows * i / lanes, e = rows * (i + 1) / lanes;
      CK(batch(dst.data() + b, src.data() + b, size.data() + b, e - b, side[i]));
    }
    for (size_t i = 0; i < lanes; ++i) { CK(cudaEventRecord(join[i], side[i])); CK(cudaStreamWaitEvent(st, join[i], 0)); }
  }
};

// Median time of one contiguous host-to-device copy of `bytes` over that of `issue()` on `st`
// (6 rounds of the two alternated, the first dropped); the copy's median ms into *copy_ms.
template <class Issue>
static double copy_over(cudaStream_t st, char* dev, const char* host, size_t bytes, Issue issue, double* copy_ms = nullptr) {
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  std::vector<double> tc, tg;
  for (int round = 0; round < 6; ++round) {
    for (int k = 0; k < 2; ++k) {
      CK(cudaStreamSynchronize(st));
      CK(cudaEventRecord(e0, st));
      if (k == 0) CK(cudaMemcpyAsync(dev, host, bytes, cudaMemcpyHostToDevice, st)); else issue();
      CK(cudaEventRecord(e1, st));
      CK(cudaEventSynchronize(e1));
      float ms;
      CK(cudaEventElapsedTime(&ms, e0, e1));
      if (round) (k ? tg : tc).push_back(ms);
    }
  }
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
  if (copy_ms) *copy_ms = med(tc);
  return med(tc) / med(tg);
}
