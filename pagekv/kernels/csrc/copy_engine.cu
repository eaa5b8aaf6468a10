// Copy-engine backend: a page-first host <-> layer-first device transfer issued as batched DMA
// copies (cudaMemcpyBatchAsync / cudaMemcpy3DBatchAsync, CUDA 12.8+), so the bytes move on the
// GPU's copy engines and no SM runs for them (the kernels in pagekv_kernels.cu use SMs).
//
// Descriptors, by ``rows_mode`` (the Python side picks it from the cache's layer addresses):
//   0  one 1-D copy per (run of consecutive slots in a page, layer, K/V);
//   1  one 2-D copy per (run, K/V) whose rows are the layers: needs every layer of a group at
//      the same distance (``dev_pitch``) from the previous one (one tensor per K and V);
//   2  one 2-D copy per run whose rows are (layer, K/V) in host order: needs those addresses
//      at one distance ``dev_pitch`` (a one-layer transfer: V - K of that layer).
// A run ends at a page end, a skipped slot or (slot stride != row bytes) every token. Bounds
// are the kernels': a page id outside [0, num_host_pages) skips its page, a slot outside
// [0, num_slots) skips its token, so no index becomes a wild copy.
//
// Ownership: the descriptor arrays live in thread-local scratch vectors and are read by the
// driver during the call; the bytes they point at are read by the DMA engines later, in
// stream order: the caller keeps the host pages and device slots valid until an event
// recorded after the call completes (the same rule as a kernel launch).
//
// Streams: each call may split its copies over several streams ("lanes": the caller's and side
// streams forked from it and joined back by events), so that several copy engines work at once.
// The batched API refuses the legacy default stream (torch's default stream): a call there runs
// wholly on side streams, ordered after the caller's earlier work and before its later work.
//
// Exported with C linkage; every entry point returns a cudaError_t (0 = success).

#include <cuda_runtime.h>
#include <stdint.h>

#include <algorithm>
#include <mutex>
#include <vector>

namespace {

constexpr int kMaxDevices = 64;

cudaError_t use_device(int device) {
  int current = -1;
  cudaError_t err = cudaGetDevice(&current);
  if (err != cudaSuccess || current == device) return err;
  return cudaSetDevice(device);
}

#if CUDART_VERSION >= 12080
constexpr bool kCompiled = true;

// Descriptors of one call: 1-D (dst, src, size) or 2-D (ops), in the order they were added.
struct Scratch {
  std::vector<void*> dst;
  std::vector<const void*> src;
  std::vector<size_t> size;
  std::vector<cudaMemcpy3DBatchOp> ops;
};
thread_local Scratch scratch;

// ``order``: when the driver may read the sources (cudaMemcpySrcAccessOrder: 1 in stream
// order, the default: sources may be written by earlier work on the stream; 2 during the
// call; 3 any time, in or out of order; the caller guarantees what 2 and 3 need).
cudaError_t batch_1d(size_t first, size_t n, unsigned flags, int order, cudaStream_t stream) {
  cudaMemcpyAttributes attr = {};
  attr.srcAccessOrder = static_cast<cudaMemcpySrcAccessOrder>(order);
  attr.flags = flags;
  size_t attr_first = 0;
#if CUDART_VERSION >= 13000
  return cudaMemcpyBatchAsync(scratch.dst.data() + first, scratch.src.data() + first,
                              scratch.size.data() + first, n, &attr, &attr_first, 1, stream);
#else
  size_t fail = 0;
  return cudaMemcpyBatchAsync(scratch.dst.data() + first,
                              const_cast<void**>(scratch.src.data() + first),
                              scratch.size.data() + first, n, &attr, &attr_first, 1, &fail, stream);
#endif
}

cudaError_t batch_2d(size_t first, size_t n, cudaStream_t stream) {
#if CUDART_VERSION >= 13000
  return cudaMemcpy3DBatchAsync(n, scratch.ops.data() + first, 0, stream);
#else
  size_t fail = 0;
  return cudaMemcpy3DBatchAsync(n, scratch.ops.data() + first, &fail, 0, stream);
#endif
}

// Sends descriptors [first, first + n) to the driver. A call refused as invalid is split in
// halves and sent again, down to kMinSplit descriptors (a refusal caused by the batch's size;
// nothing of a refused call runs, and a copy sent twice writes the same bytes).
constexpr size_t kMinSplit = 64;
cudaError_t send(bool two_d, size_t first, size_t n, unsigned flags, int order,
                 cudaStream_t stream, int64_t* splits) {
  if (n == 0) return cudaSuccess;
  cudaError_t err = two_d ? batch_2d(first, n, stream) : batch_1d(first, n, flags, order, stream);
  if (err != cudaErrorInvalidValue || n <= kMinSplit) return err;
  cudaGetLastError();
  ++*splits;
  err = send(two_d, first, n / 2, flags, order, stream, splits);
  if (err != cudaSuccess) return err;
  return send(two_d, first + n / 2, n - n / 2, flags, order, stream, splits);
}

cudaMemcpy3DOperand pointer_operand(const char* p, int64_t pitch) {
  cudaMemcpy3DOperand o = {};
  o.type = cudaMemcpyOperandTypePointer;
  o.op.ptr.ptr = const_cast<char*>(p);
  o.op.ptr.rowLength = static_cast<size_t>(pitch);  // elements of 1 byte for pointer copies
  o.op.ptr.layerHeight = 0;                         // one layer: tightly packed
  return o;
}

void add_1d(char* dst, const char* src, size_t n) {
  scratch.dst.push_back(dst);
  scratch.src.push_back(src);
  scratch.size.push_back(n);
}

void add_2d(char* dst, int64_t dst_pitch, const char* src, int64_t src_pitch, size_t width,
            size_t height, unsigned flags, int order) {
  cudaMemcpy3DBatchOp op = {};
  op.src = pointer_operand(src, src_pitch);
  op.dst = pointer_operand(dst, dst_pitch);
  op.extent = make_cudaExtent(width, height, 1);
  op.srcAccessOrder = static_cast<cudaMemcpySrcAccessOrder>(order);
  op.flags = flags;
  scratch.ops.push_back(op);
}
#else
constexpr bool kCompiled = false;
#endif

// Per device: side streams (lanes, and the stand-in for the legacy default stream) and the
// events that fork work onto them and join it back, created on first use.
constexpr int kMaxLanes = 16;
struct Lanes {
  cudaStream_t side[kMaxLanes] = {};
  cudaEvent_t fork = nullptr;
  cudaEvent_t join[kMaxLanes] = {};
};
std::mutex lanes_mutex;
Lanes lanes_of[kMaxDevices];

bool is_legacy(cudaStream_t s) { return s == nullptr || s == cudaStreamLegacy; }

cudaError_t lanes_for(int device, int count, Lanes*& out) {
  if (device < 0 || device >= kMaxDevices) return cudaErrorInvalidDevice;
  Lanes& l = lanes_of[device];
  cudaError_t err = cudaSuccess;
  if (!l.fork) err = cudaEventCreateWithFlags(&l.fork, cudaEventDisableTiming);
  for (int i = 0; i < count && err == cudaSuccess; ++i) {
    if (!l.side[i]) err = cudaStreamCreateWithFlags(&l.side[i], cudaStreamNonBlocking);
    if (err == cudaSuccess && !l.join[i])
      err = cudaEventCreateWithFlags(&l.join[i], cudaEventDisableTiming);
  }
  out = &l;
  return err;
}

}  // namespace

extern "C" {

// The CUDA driver version (e.g. 13000) when batched copies can run on ``device``: the library
// was built with CUDA >= 12.8 and the driver is at least 12.8. 0 when they cannot.
int pagekv_copy_engine_support(int device) {
  if (!kCompiled) return 0;
  int driver = 0;
  if (cudaDriverGetVersion(&driver) != cudaSuccess || driver < 12080) return 0;
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || device < 0 || device >= count) return 0;
  int engines = 0;
  if (cudaDeviceGetAttribute(&engines, cudaDevAttrAsyncEngineCount, device) != cudaSuccess ||
      engines < 1)
    return 0;
  return driver;
}

// Runs of consecutive valid slots (>= 0) within each page of a host int64 slot table
// [n_pages, page_size]: out[0] = valid slots, out[1] = runs. What the Python side's
// layout.mean_run_bytes computes with torch, without its per-call overhead (a one-layer load
// calls it for every layer). Needs no GPU.
int pagekv_slot_runs(const int64_t* slots, int64_t n_pages, int page_size, int64_t* out) {
  if ((!slots && n_pages > 0) || !out || n_pages < 0 || page_size <= 0)
    return static_cast<int>(cudaErrorInvalidValue);
  int64_t tokens = 0, runs = 0;
  for (int64_t i = 0; i < n_pages; ++i) {
    const int64_t* sl = slots + i * page_size;
    for (int j = 0; j < page_size; ++j) {
      if (sl[j] < 0) continue;
      ++tokens;
      if (j == 0 || sl[j - 1] < 0 || sl[j] != sl[j - 1] + 1) ++runs;
    }
  }
  out[0] = tokens;
  out[1] = runs;
  return 0;
}

// page_ids [n_pages] and slots [n_pages * page_size] are host int64 arrays, read during the
// call. ``src_order``: see batch_1d. The copies are split over ``lanes`` streams (the caller's and lanes - 1 side streams,
// forked from and joined back to the caller's by events), so several copy engines work at once.
// ``max_ops`` bounds the descriptors per driver call. ``stats`` (may be null) receives
// [descriptors sent, calls split after a refusal].
int pagekv_ce_page_transfer(int device, int load, char* host, const int64_t* layer_ptrs,
                            const int64_t* page_ids, const int64_t* slots, int64_t n_pages,
                            int64_t num_host_pages, int64_t num_slots, int64_t page_bytes,
                            int64_t slot_stride, int item_bytes, int page_size, int num_kv,
                            int num_layers, int layer_begin, int layer_count, int rows_mode,
                            int64_t dev_pitch, int flags, int src_order, int lanes,
                            int64_t max_ops,
                            cudaStream_t stream, int64_t* stats) {
  if (stats) stats[0] = stats[1] = 0;
  if (layer_count <= 0 || layer_begin < 0 || layer_begin + layer_count > num_layers ||
      item_bytes <= 0 || page_size <= 0 || (num_kv != 1 && num_kv != 2) || rows_mode < 0 ||
      rows_mode > 2 || lanes < 1 || lanes > kMaxLanes || max_ops < 1 || src_order < 1 ||
      src_order > 3 ||
      (rows_mode != 0 && dev_pitch < static_cast<int64_t>(page_size) * item_bytes))
    return static_cast<int>(cudaErrorInvalidValue);
#if CUDART_VERSION < 12080
  (void)load; (void)host; (void)layer_ptrs; (void)page_ids; (void)slots; (void)n_pages;
  (void)num_host_pages; (void)num_slots; (void)page_bytes; (void)slot_stride; (void)flags;
  (void)stream; (void)device; (void)src_order;
  return static_cast<int>(cudaErrorNotSupported);
#else
  if (n_pages == 0) return 0;
  cudaError_t err = use_device(device);
  if (err != cudaSuccess) return static_cast<int>(err);
  // 1. descriptors
  scratch.dst.clear();
  scratch.src.clear();
  scratch.size.clear();
  scratch.ops.clear();
  const unsigned fl = static_cast<unsigned>(flags);
  const bool contiguous = slot_stride == item_bytes;
  const int64_t row = static_cast<int64_t>(page_size) * item_bytes;  // host bytes per (layer, kv)
  for (int64_t i = 0; i < n_pages; ++i) {
    const int64_t page = page_ids[i];
    if (page < 0 || page >= num_host_pages) continue;
    const int64_t* sl = slots + i * page_size;
    int j = 0;
    while (j < page_size) {
      const int64_t first = sl[j];
      if (first < 0 || first >= num_slots) { ++j; continue; }
      int run = 1;
      while (contiguous && j + run < page_size && sl[j + run] == first + run && first + run < num_slots)
        ++run;
      const size_t width = static_cast<size_t>(run) * item_bytes;
      char* h0 = host + page * page_bytes + static_cast<int64_t>(j) * item_bytes;
      const int64_t d0 = first * slot_stride;
      if (rows_mode == 0) {
        for (int l = layer_begin; l < layer_begin + layer_count; ++l) {
          for (int c = 0; c < num_kv; ++c) {
            char* hp = h0 + (static_cast<int64_t>(l) * num_kv + c) * row;
            char* dp = reinterpret_cast<char*>(layer_ptrs[c * num_layers + l]) + d0;
            load ? add_1d(dp, hp, width) : add_1d(hp, dp, width);
          }
        }
      } else {
        const int groups = rows_mode == 1 ? num_kv : 1;
        const size_t height = rows_mode == 1 ? layer_count : static_cast<size_t>(layer_count) * num_kv;
        const int64_t host_pitch = rows_mode == 1 ? num_kv * row : row;
        for (int c = 0; c < groups; ++c) {
          char* hp = h0 + (static_cast<int64_t>(layer_begin) * num_kv + c) * row;
          char* dp = reinterpret_cast<char*>(layer_ptrs[c * num_layers + layer_begin]) + d0;
          load ? add_2d(dp, dev_pitch, hp, host_pitch, width, height, fl, src_order)
               : add_2d(hp, host_pitch, dp, dev_pitch, width, height, fl, src_order);
        }
      }
      j += run;
    }
  }
  const bool two_d = rows_mode != 0;
  const size_t total = two_d ? scratch.ops.size() : scratch.dst.size();
  if (total == 0) return 0;
  // 2. streams: the caller's, or side streams forked from it (the batched API refuses the
  // legacy default stream, so a call there runs wholly on side streams)
  const bool legacy = is_legacy(stream);
  int used = static_cast<int>(std::min<size_t>(static_cast<size_t>(lanes), total));
  std::unique_lock<std::mutex> lock(lanes_mutex, std::defer_lock);
  Lanes* l = nullptr;
  cudaStream_t targets[kMaxLanes];
  for (int i = 0; i < used; ++i) targets[i] = stream;
  if (legacy || used > 1) {
    lock.lock();
    err = lanes_for(device, used, l);
    if (err == cudaSuccess) err = cudaEventRecord(l->fork, stream);
    for (int i = 0; i < used && err == cudaSuccess; ++i) {
      if (i == 0 && !legacy) continue;
      targets[i] = l->side[i];
      err = cudaStreamWaitEvent(targets[i], l->fork, 0);
    }
    if (err != cudaSuccess) return static_cast<int>(err);
  }
  // 3. each lane a contiguous share, max_ops descriptors per driver call
  int64_t splits = 0;
  size_t sent = 0;
  for (int i = 0; i < used && err == cudaSuccess; ++i) {
    const size_t begin = total * i / used, end = total * (i + 1) / used;
    for (size_t b = begin; b < end && err == cudaSuccess; b += static_cast<size_t>(max_ops)) {
      const size_t n = std::min<size_t>(static_cast<size_t>(max_ops), end - b);
      err = send(two_d, b, n, fl, src_order, targets[i], &splits);
      if (err == cudaSuccess) sent += n;
    }
  }
  if (err != cudaSuccess) cudaGetLastError();  // the next kernel launch must not see it
  // 4. join: whatever was enqueued stays ordered before the caller's later work
  for (int i = 0; i < used && l; ++i) {
    if (targets[i] == stream) continue;
    cudaError_t e2 = cudaEventRecord(l->join[i], targets[i]);
    if (e2 == cudaSuccess) e2 = cudaStreamWaitEvent(stream, l->join[i], 0);
    if (err == cudaSuccess) err = e2;
  }
  if (stats) {
    stats[0] = static_cast<int64_t>(sent);
    stats[1] = splits;
  }
  return static_cast<int>(err);
#endif
}

}  // extern "C"
