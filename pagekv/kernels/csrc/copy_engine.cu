// Copy-engine backend: a page-first host <-> layer-first device transfer issued as batched DMA
// copies (cudaMemcpyBatchAsync, CUDA 12.8+), so the bytes move on the GPU's copy engines and no
// SM runs for them (the kernels in pagekv_kernels.cu use SMs).
//
// Descriptors: one 1-D copy per (run of consecutive slots in a page, layer, K/V). A run ends at
// a page end, a skipped slot or (slot stride != row bytes) every token. Bounds are the kernels':
// a page id outside [0, num_host_pages) skips its page, a slot outside [0, num_slots) skips its
// token, so no index becomes a wild copy. Where each K/V's layers lie at one distance, the
// pitched entry (pagekv_pitched_page_transfer) issues one 2-D copy per run instead, a row per
// layer: the engines' cost is per row there (~45 ns), not per descriptor (~1.4 us).
//
// Ownership: the descriptor arrays live in thread-local scratch vectors and are read by the
// driver during the call; the bytes they point at are read by the DMA engines later, in
// stream order: the caller keeps the host pages and device slots valid until an event
// recorded after the call completes (the same rule as a kernel launch).
//
// Streams: each call splits its copies over several streams ("lanes": the caller's and side
// streams), so that several copy engines work at once. Every side stream first waits on an
// event recorded on the caller's stream (so the copies follow the caller's earlier work), and
// the caller's stream then waits on an event recorded on each side stream (so completion is
// visible there, and the caller's later work and events come after all the copies). The batched
// API refuses the legacy default stream (torch's default stream): a call there runs wholly on
// side streams, joined back the same way. A call of many copies is sent by more than one host
// thread, each its own lanes, all joined before the call returns (see send_all).
//
// Exported with C linkage; every entry point returns a cudaError_t (0 = success).

#include <cuda_runtime.h>
#include <linux/futex.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <climits>

#include <algorithm>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace {

constexpr int kMaxDevices = 64;
constexpr int kMaxThreads = 4;  // host threads sending one call's copies

cudaError_t use_device(int device) {
  int current = -1;
  cudaError_t err = cudaGetDevice(&current);
  if (err != cudaSuccess || current == device) return err;
  return cudaSetDevice(device);
}

// The runs of a transfer, in order: for each page id in [0, num_host_pages), each run of
// consecutive slots in [0, num_slots) within the page (one slot a run where ``contiguous`` is
// false: the slot stride is not the row), as fn(page, j, first, run): the host page, the run's
// first token in it, its first slot, its length. The kernels' bounds rule: a page id out of
// range skips its page, a slot out of range its token. Stops where fn returns false.
template <typename Fn>
void for_each_run(const int64_t* page_ids, const int64_t* slots, int64_t n_pages, int page_size,
                  int64_t num_host_pages, int64_t num_slots, bool contiguous, Fn&& fn) {
  for (int64_t i = 0; i < n_pages; ++i) {
    const int64_t page = page_ids[i];
    if (page < 0 || page >= num_host_pages) continue;
    const int64_t* sl = slots + i * page_size;
    int j = 0;
    while (j < page_size) {
      const int64_t first = sl[j];
      if (first < 0 || first >= num_slots) { ++j; continue; }
      int run = 1;
      while (contiguous && j + run < page_size && sl[j + run] == first + run &&
             first + run < num_slots)
        ++run;
      if (!fn(page, j, first, run)) return;
      j += run;
    }
  }
}

#if CUDART_VERSION >= 12080
constexpr bool kCompiled = true;

// Descriptors of one call (dst, src, size), in the order they were added: the calling thread's,
// read by the threads that send them until the call returns.
struct Scratch {
  std::vector<void*> dst;
  std::vector<const void*> src;
  std::vector<size_t> size;
};
thread_local Scratch scratch;

// Sources are read in stream order (cudaMemcpySrcAccessOrderStream): a load may follow, on
// the stream, the save that fills its host pages.
cudaError_t batch_1d(const Scratch& s, size_t first, size_t n, unsigned flags,
                     cudaStream_t stream) {
  cudaMemcpyAttributes attr = {};
  attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  attr.flags = flags;
  size_t attr_first = 0;
#if CUDART_VERSION >= 13000
  return cudaMemcpyBatchAsync(s.dst.data() + first, s.src.data() + first,
                              s.size.data() + first, n, &attr, &attr_first, 1, stream);
#else
  size_t fail = 0;
  return cudaMemcpyBatchAsync(s.dst.data() + first,
                              const_cast<void**>(s.src.data() + first),
                              s.size.data() + first, n, &attr, &attr_first, 1, &fail, stream);
#endif
}

// Sends descriptors [first, first + n) to the driver. A call refused as invalid is split in
// halves and sent again, down to kMinSplit descriptors (a refusal caused by the batch's size;
// nothing of a refused call runs, and a copy sent twice writes the same bytes).
constexpr size_t kMinSplit = 64;
cudaError_t send(const Scratch& s, size_t first, size_t n, unsigned flags, cudaStream_t stream,
                 int64_t* splits) {
  if (n == 0) return cudaSuccess;
  cudaError_t err = batch_1d(s, first, n, flags, stream);
  if (err != cudaErrorInvalidValue || n <= kMinSplit) return err;
  cudaGetLastError();
  ++*splits;
  err = send(s, first, n / 2, flags, stream, splits);
  if (err != cudaSuccess) return err;
  return send(s, first + n / 2, n - n / 2, flags, stream, splits);
}

// The descriptors of lanes w, w + workers, ... of ``used`` (lane i: the contiguous share
// [total * i / used, total * (i + 1) / used) on targets[i]), at most max_ops a driver call.
struct LaneSends {
  cudaError_t err = cudaSuccess;
  int64_t splits = 0;
  size_t sent = 0;
};
void send_lanes(const Scratch& s, int w, int workers, int used, const cudaStream_t* targets,
                size_t max_ops, unsigned flags, LaneSends& out) {
  const size_t total = s.dst.size();
  for (int i = w; i < used && out.err == cudaSuccess; i += workers) {
    const size_t begin = total * i / used, end = total * (i + 1) / used;
    for (size_t b = begin; b < end && out.err == cudaSuccess; b += max_ops) {
      const size_t n = std::min(max_ops, end - b);
      out.err = send(s, b, n, flags, targets[i], &out.splits);
      if (out.err == cudaSuccess) out.sent += n;
    }
  }
}

// Host threads enqueueing one call's copies: the driver takes ~0.5-1 us of the enqueuing
// thread per copy (about a 32 KiB copy's bus time), so one thread sets the rate of runs under
// ~64 KiB; two threads, each on streams of its own, lift it. The caller says how many threads
// and how many copies make a helper worth its start (the figures: copy_engine.ENQUEUE_THREADS).
//
// send_all runs send_lanes for every worker, worker 0 on the calling thread, the others on
// threads of their own that set ``device`` first, all joined before it returns. A helper that
// cannot be started leaves its lanes to the calling thread. Returns the first error of any
// worker.
cudaError_t send_all(const Scratch& s, int device, int workers, int used,
                     const cudaStream_t* targets, size_t max_ops, unsigned flags,
                     int64_t* splits, size_t* sent, int* threads_used) {
  LaneSends parts[kMaxThreads];
  std::thread helpers[kMaxThreads];
  bool started[kMaxThreads] = {};
  for (int w = 1; w < workers; ++w) {
    try {
      helpers[w] = std::thread([&, w] {
        parts[w].err = use_device(device);
        if (parts[w].err == cudaSuccess)
          send_lanes(s, w, workers, used, targets, max_ops, flags, parts[w]);
      });
      started[w] = true;
    } catch (...) {  // no thread to be had (std::system_error): the caller sends its lanes
    }
  }
  send_lanes(s, 0, workers, used, targets, max_ops, flags, parts[0]);
  *threads_used = 1;
  for (int w = 1; w < workers; ++w) {
    if (started[w]) {
      helpers[w].join();
      ++*threads_used;
    } else if (parts[0].err == cudaSuccess) {
      send_lanes(s, w, workers, used, targets, max_ops, flags, parts[w]);
    }
  }
  cudaError_t err = cudaSuccess;
  for (int w = 0; w < workers; ++w) {
    *splits += parts[w].splits;
    *sent += parts[w].sent;
    if (err == cudaSuccess) err = parts[w].err;
  }
  return err;
}

void add_1d(char* dst, const char* src, size_t n) {
  scratch.dst.push_back(dst);
  scratch.src.push_back(src);
  scratch.size.push_back(n);
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
// The streams of a layer-by-layer call's entry workers (pagekv_ce_page_transfer_layers), apart
// from the lanes: a worker's entries call pagekv_ce_page_transfer, which may take the lanes.
std::mutex entry_mutex;
Lanes entry_lanes_of[kMaxDevices];

bool is_legacy(cudaStream_t s) { return s == nullptr || s == cudaStreamLegacy; }

cudaError_t lanes_for(Lanes* table, int device, int count, Lanes*& out) {
  if (device < 0 || device >= kMaxDevices) return cudaErrorInvalidDevice;
  Lanes& l = table[device];
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
// call. The copies of an all-layer transfer (``layer_count == num_layers``) are split over
// ``lanes`` streams (see "Streams" above), those of a transfer of fewer layers over
// ``layer_lanes``: the engines take each stream's driver call in turn at a few us a call, a
// fixed cost that 16 calls a layer make the bound of a layer-by-layer transfer. The lanes are
// sent from up to ``threads`` host threads (the caller's and helpers joined before the call
// returns), one more for every ``thread_copies`` copies of the call; a transfer of fewer
// layers then takes at least a lane a thread. ``max_ops`` bounds the descriptors per driver
// call. ``stats`` (may be null) receives [descriptors sent, calls split after a refusal,
// streams used, threads used].
int pagekv_ce_page_transfer(int device, int load, char* host, const int64_t* layer_ptrs,
                            const int64_t* page_ids, const int64_t* slots, int64_t n_pages,
                            int64_t num_host_pages, int64_t num_slots, int64_t page_bytes,
                            int64_t slot_stride, int item_bytes, int page_size, int num_kv,
                            int num_layers, int layer_begin, int layer_count, int flags,
                            int lanes, int layer_lanes, int threads, int64_t thread_copies,
                            int64_t max_ops, cudaStream_t stream, int64_t* stats) {
  if (stats) stats[0] = stats[1] = stats[2] = stats[3] = 0;
  if (layer_count <= 0 || layer_begin < 0 || layer_begin + layer_count > num_layers ||
      item_bytes <= 0 || page_size <= 0 || (num_kv != 1 && num_kv != 2) || lanes < 1 ||
      lanes > kMaxLanes || layer_lanes < 1 || layer_lanes > kMaxLanes || threads < 1 ||
      threads > kMaxThreads || thread_copies < 1 || max_ops < 1)
    return static_cast<int>(cudaErrorInvalidValue);
#if CUDART_VERSION < 12080
  (void)load; (void)host; (void)layer_ptrs; (void)page_ids; (void)slots; (void)n_pages;
  (void)num_host_pages; (void)num_slots; (void)page_bytes; (void)slot_stride; (void)flags;
  (void)stream; (void)device; (void)thread_copies;
  return static_cast<int>(cudaErrorNotSupported);
#else
  if (n_pages == 0) return 0;
  cudaError_t err = use_device(device);
  if (err != cudaSuccess) return static_cast<int>(err);
  // 1. descriptors
  scratch.dst.clear();
  scratch.src.clear();
  scratch.size.clear();
  const bool contiguous = slot_stride == item_bytes;
  const int64_t row = static_cast<int64_t>(page_size) * item_bytes;  // host bytes per (layer, kv)
  for_each_run(page_ids, slots, n_pages, page_size, num_host_pages, num_slots, contiguous,
               [&](int64_t page, int j, int64_t first, int run) {
    const size_t width = static_cast<size_t>(run) * item_bytes;
    char* h0 = host + page * page_bytes + static_cast<int64_t>(j) * item_bytes;
    const int64_t d0 = first * slot_stride;
    for (int l = layer_begin; l < layer_begin + layer_count; ++l) {
      for (int c = 0; c < num_kv; ++c) {
        char* hp = h0 + (static_cast<int64_t>(l) * num_kv + c) * row;
        char* dp = reinterpret_cast<char*>(layer_ptrs[c * num_layers + l]) + d0;
        load ? add_1d(dp, hp, width) : add_1d(hp, dp, width);
      }
    }
    return true;
  });
  const size_t total = scratch.dst.size();
  if (total == 0) return 0;
  // 2. streams: the caller's, or side streams forked from it (the batched API refuses the
  // legacy default stream, so a call there runs wholly on side streams)
  const bool legacy = is_legacy(stream);
  const unsigned fl = static_cast<unsigned>(flags);
  const size_t by_copies = total / static_cast<size_t>(thread_copies);
  const int workers = static_cast<int>(std::clamp<size_t>(by_copies, 1, threads));
  const int wanted = layer_count == num_layers ? lanes : std::max(layer_lanes, workers);
  int used = static_cast<int>(std::min<size_t>(static_cast<size_t>(wanted), total));
  std::unique_lock<std::mutex> lock(lanes_mutex, std::defer_lock);
  Lanes* l = nullptr;
  cudaStream_t targets[kMaxLanes];
  for (int i = 0; i < used; ++i) targets[i] = stream;
  if (legacy || used > 1) {
    lock.lock();  // the side streams and events are shared by the device's callers
    err = lanes_for(lanes_of, device, used, l);
    if (err == cudaSuccess) err = cudaEventRecord(l->fork, stream);
    for (int i = 0; i < used && err == cudaSuccess; ++i) {
      if (i == 0 && !legacy) continue;
      targets[i] = l->side[i];
      err = cudaStreamWaitEvent(targets[i], l->fork, 0);
    }
    if (err != cudaSuccess) return static_cast<int>(err);
  }
  // 3. each lane a contiguous share, max_ops descriptors per driver call, the lanes shared
  // out over the threads
  int64_t splits = 0;
  size_t sent = 0;
  int threads_used = 1;
  err = send_all(scratch, device, std::min(workers, used), used, targets,
                 static_cast<size_t>(max_ops), fl, &splits, &sent, &threads_used);
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
    stats[2] = used;
    stats[3] = threads_used;
  }
  return static_cast<int>(err);
#endif
}

// The transfer of pagekv_ce_page_transfer for all layers, as one 2-D copy per (run of
// consecutive slots in a page, K/V) with a row per layer, on ``stream`` itself: where each
// K/V's layers lie at one distance from the next (``layer_pitch[c]`` bytes, c < num_kv), the
// rows of a run over the layers are equally spaced on both sides (on the host, a page's rows of
// one K/V are num_kv * page_size * item_bytes apart). The copy engine's cost is per row then
// (~45 ns on an H100), not per descriptor as for batched 1-D copies (~1.4 us), which is what
// keeps runs under 32 KiB on the DMA engines at all. Plain cudaMemcpy2DAsync calls (capturable;
// any CUDA version), ~1-2.5 us of host time each. Bounds as pagekv_ce_page_transfer's. A pitch
// must be at least the layer's extent and at most cudaDevAttrMaxPitch (checked: an invalid
// value, nothing enqueued). ``stats`` (may be null) receives [copies sent, 0, 1].
int pagekv_pitched_page_transfer(int device, int load, char* host, const int64_t* layer_ptrs,
                                 const int64_t* layer_pitch, const int64_t* page_ids,
                                 const int64_t* slots, int64_t n_pages, int64_t num_host_pages,
                                 int64_t num_slots, int64_t page_bytes, int64_t slot_stride,
                                 int item_bytes, int page_size, int num_kv, int num_layers,
                                 cudaStream_t stream, int64_t* stats) {
  if (stats) stats[0] = stats[1] = stats[2] = 0;
  if (item_bytes <= 0 || page_size <= 0 || (num_kv != 1 && num_kv != 2) || num_layers < 1 ||
      !layer_pitch || slot_stride < item_bytes)
    return static_cast<int>(cudaErrorInvalidValue);
  if (n_pages == 0) return 0;
  cudaError_t err = use_device(device);
  if (err != cudaSuccess) return static_cast<int>(err);
  int max_pitch = 0;
  err = cudaDeviceGetAttribute(&max_pitch, cudaDevAttrMaxPitch, device);
  if (err != cudaSuccess) return static_cast<int>(err);
  const int64_t row = static_cast<int64_t>(page_size) * item_bytes;  // host bytes per (layer, kv)
  const size_t host_pitch = static_cast<size_t>(num_kv) * row;
  if (host_pitch > static_cast<size_t>(max_pitch))
    return static_cast<int>(cudaErrorInvalidPitchValue);
  for (int c = 0; c < num_kv && num_layers > 1; ++c)
    if (layer_pitch[c] > max_pitch || layer_pitch[c] < num_slots * slot_stride)
      return static_cast<int>(cudaErrorInvalidPitchValue);
  const bool contiguous = slot_stride == item_bytes;
  const cudaMemcpyKind kind = load ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost;
  int64_t sent = 0;
  for_each_run(page_ids, slots, n_pages, page_size, num_host_pages, num_slots, contiguous,
               [&](int64_t page, int j, int64_t first, int run) {
    const size_t width = static_cast<size_t>(run) * item_bytes;
    for (int c = 0; c < num_kv && err == cudaSuccess; ++c) {
      char* h = host + page * page_bytes + c * row + static_cast<int64_t>(j) * item_bytes;
      char* d = reinterpret_cast<char*>(layer_ptrs[c * num_layers]) + first * slot_stride;
      const size_t d_pitch = num_layers > 1 ? static_cast<size_t>(layer_pitch[c]) : width;
      err = load ? cudaMemcpy2DAsync(d, d_pitch, h, host_pitch, width, num_layers, kind, stream)
                 : cudaMemcpy2DAsync(h, host_pitch, d, d_pitch, width, num_layers, kind, stream);
      if (err == cudaSuccess) ++sent;
    }
    return err == cudaSuccess;
  });
  if (err != cudaSuccess) cudaGetLastError();  // the next kernel launch must not see it
  if (stats) {
    stats[0] = sent;
    stats[2] = 1;
  }
  return static_cast<int>(err);
}

// A progress count shared between threads (a 32-bit int of the caller's; no GPU): how many
// entries of a layer-by-layer transfer are enqueued, with bit 30 set once none will be (a
// failed job). pagekv_progress_publish raises it to ``value`` (never lowers it; release)
// and wakes its waiters; pagekv_progress_wait returns its value (acquire) once it reaches
// ``target`` or has the stopped bit, or after ``timeout_us``, the caller's thread asleep
// meanwhile (a futex: ctypes releases the GIL around the call).
void pagekv_progress_publish(int* cell, int value) {
  int seen = __atomic_load_n(cell, __ATOMIC_RELAXED);
  while (seen < value &&
         !__atomic_compare_exchange_n(cell, &seen, value, false, __ATOMIC_RELEASE,
                                      __ATOMIC_RELAXED)) {
  }
  syscall(SYS_futex, cell, FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
}

int pagekv_progress_wait(int* cell, int target, int64_t timeout_us) {
  int seen = __atomic_load_n(cell, __ATOMIC_ACQUIRE);
  if (seen >= target || timeout_us <= 0) return seen;
  struct timespec limit = {static_cast<time_t>(timeout_us / 1000000),
                           static_cast<long>(timeout_us % 1000000) * 1000};
  syscall(SYS_futex, cell, FUTEX_WAIT_PRIVATE, seen, &limit, nullptr, 0);
  return __atomic_load_n(cell, __ATOMIC_ACQUIRE);
}

// Events the library makes (no timing) and names by handle, for transfers whose completions
// another thread hands over (a Progress's): made, recorded and waited on without Python's
// event objects, so the thread that enqueues the transfer makes no call that gives up the GIL
// before its copies start. pagekv_events_create makes the null entries of handles[0..n) on
// ``device`` (the calling thread's current device is left as it was);
// pagekv_events_destroy destroys the non-null ones (one still recorded is freed once the
// device has passed it); the others are the runtime's calls on one event.
int pagekv_events_create(int device, cudaEvent_t* handles, int n) {
  int current = -1;
  cudaError_t err = cudaGetDevice(&current);
  if (err == cudaSuccess && current != device) err = cudaSetDevice(device);
  for (int i = 0; err == cudaSuccess && i < n; ++i)
    if (!handles[i]) err = cudaEventCreateWithFlags(&handles[i], cudaEventDisableTiming);
  if (current >= 0 && current != device) {
    cudaError_t e = cudaSetDevice(current);
    if (err == cudaSuccess) err = e;
  }
  return static_cast<int>(err);
}

int pagekv_events_destroy(cudaEvent_t* handles, int n) {
  cudaError_t err = cudaSuccess;
  for (int i = 0; i < n; ++i) {
    if (!handles[i]) continue;
    cudaError_t e = cudaEventDestroy(handles[i]);
    if (err == cudaSuccess) err = e;
    handles[i] = nullptr;
  }
  return static_cast<int>(err);
}

int pagekv_event_record(cudaEvent_t event, cudaStream_t stream) {
  return static_cast<int>(cudaEventRecord(event, stream));
}

int pagekv_stream_wait_event(cudaStream_t stream, cudaEvent_t event) {
  return static_cast<int>(cudaStreamWaitEvent(stream, event, 0));
}

int pagekv_event_query(cudaEvent_t event) { return static_cast<int>(cudaEventQuery(event)); }

int pagekv_event_synchronize(cudaEvent_t event) {
  return static_cast<int>(cudaEventSynchronize(event));
}

}  // extern "C"

namespace {

// The one-layer entries of pagekv_ce_page_transfer_layers spread over host threads: the
// driver takes ~0.5-1 us of the sending thread per copy, so one thread sending a layer-by-layer
// load of short runs sets its rate (a layer of under 2 x thread_copies copies is one thread's),
// where two, each with entries of its own, keep up with the bus. Worker w (the calling thread,
// w = 0, or a helper) sends entries w, w + workers, ... on a stream of its own (worker 0 on the
// call's stream, the others on side streams that first wait for the stream's earlier work and
// that the stream waits for at the end), each entry on one thread and one stream. The events keep
// the sequential call's meaning: events[i] is recorded after entry i's copies and after
// events[i - 1] (its stream waits on that one), so it completes only once entries 0..i have; the
// workers record them in entry order (each waits on the host for the one before), and ``done``
// counts them in that order. A worker stops at its first error, the others before their next
// record; the first error is kept.
struct EntryOrder {
  std::mutex m;
  std::condition_variable cv;
  int workers = 0;   // set once every helper that could start has (0: not yet)
  int recorded = 0;  // entries [0, recorded) have their event recorded
  bool failed = false;
  int err = 0;
  int64_t sent = 0, splits = 0;
};

// One entry (a layer) on ``target`` from the calling thread; ``part`` as
// pagekv_ce_page_transfer's stats.
using SendEntry = std::function<int(int layer, cudaStream_t target, int64_t* part)>;

void send_entries(int device, int w, int n_entries, const int* layers, cudaEvent_t* events,
                  cudaStream_t target, int* done, EntryOrder& order, const SendEntry& entry) {
  int workers = 0;
  {
    std::unique_lock<std::mutex> lock(order.m);
    order.cv.wait(lock, [&] { return order.workers > 0; });
    workers = order.workers;
  }
  for (int i = w; i < n_entries; i += workers) {
    int64_t part[4] = {0, 0, 0, 0};
    int e = entry(layers[i], target, part);
    std::unique_lock<std::mutex> lock(order.m);
    order.cv.wait(lock, [&] { return order.failed || order.recorded == i; });
    if (order.failed) return;
    order.sent += part[0];
    order.splits += part[1];
    if (e == 0) e = pagekv_events_create(device, &events[i], 1);
    if (e == 0 && i > 0)  // entry i - 1 was another worker's, on another stream
      e = static_cast<int>(cudaStreamWaitEvent(target, events[i - 1], 0));
    if (e == 0) e = static_cast<int>(cudaEventRecord(events[i], target));
    if (e != 0) {
      order.failed = true;
      order.err = e;
    } else {
      order.recorded = i + 1;
      if (done) pagekv_progress_publish(done, i + 1);
    }
    order.cv.notify_all();
    if (e != 0) return;
  }
}

int spread_entries(int device, int workers, int n_entries, const int* layers,
                   cudaEvent_t* events, cudaStream_t stream, int64_t* stats, int* done,
                   const SendEntry& entry) {
  std::lock_guard<std::mutex> streams_held(entry_mutex);  // the device's worker streams
  Lanes* l = nullptr;
  cudaError_t err = lanes_for(entry_lanes_of, device, workers, l);
  if (err == cudaSuccess) err = cudaEventRecord(l->fork, stream);
  for (int w = 1; w < workers && err == cudaSuccess; ++w)
    err = cudaStreamWaitEvent(l->side[w], l->fork, 0);
  if (err != cudaSuccess) return static_cast<int>(err);
  EntryOrder order;
  std::thread helpers[kMaxThreads];
  int started = 1;  // workers running: the calling thread and the helpers up to the first that
  for (; started < workers; ++started) {  // could not start
    try {
      const int w = started;
      helpers[w] = std::thread([&, w] {
        cudaError_t e = use_device(device);
        if (e == cudaSuccess) {
          send_entries(device, w, n_entries, layers, events, l->side[w], done, order, entry);
          return;
        }
        std::lock_guard<std::mutex> g(order.m);
        order.failed = true;
        order.err = static_cast<int>(e);
        order.cv.notify_all();
      });
    } catch (...) {  // no thread to be had (std::system_error): fewer workers
      break;
    }
  }
  {
    std::lock_guard<std::mutex> g(order.m);
    order.workers = started;
  }
  order.cv.notify_all();
  send_entries(device, 0, n_entries, layers, events, stream, done, order, entry);
  for (int w = 1; w < started; ++w) helpers[w].join();
  // whatever a worker enqueued stays ordered before the stream's later work
  for (int w = 1; w < started; ++w) {
    cudaError_t e2 = cudaEventRecord(l->join[w], l->side[w]);
    if (e2 == cudaSuccess) e2 = cudaStreamWaitEvent(stream, l->join[w], 0);
    if (order.err == 0) order.err = static_cast<int>(e2);
  }
  if (order.err != 0) cudaGetLastError();  // the next kernel launch must not see it
  if (stats) {
    stats[0] = order.sent;
    stats[1] = order.splits;
    stats[2] = started;  // a stream a worker
    stats[3] = started;
  }
  return order.err;
}

}  // namespace

extern "C" {

// The transfer of pagekv_ce_page_transfer once per entry of ``layers`` (a layer, or -1 for all
// layers at once), in that order, after ``stream`` waits on ``fork`` (if not null), recording
// ``events[i]`` after entry i (on ``stream``; see below for spread entries; made first where
// null, by pagekv_events_create): a
// layer-by-layer load in one call (one GIL hand-off for the caller, whose thread the driver
// work keeps for ~0.5-1 us per copy), ``lanes``, ``layer_lanes``, ``threads`` and
// ``thread_copies`` as there. ``done`` (may be null) counts the entries issued and recorded:
// stored (release) after each entry's event is recorded, and whoever waits on it in
// pagekv_progress_wait woken, so another thread hands entry i to its consumer while this call
// goes on with the rest (no GIL taken); it holds the entries issued before an error when the
// call returns. Where every entry is one layer and the call's copies make a helper worth it (one
// more thread per ``thread_copies``, at most ``threads``), the entries are spread over threads
// (spread_entries: events[i] still completes only once entries 0..i have). ``stats`` as there:
// the descriptors and splits summed, the most streams and threads any entry used (spread: the
// workers' streams and threads).
int pagekv_ce_page_transfer_layers(int device, int load, char* host, const int64_t* layer_ptrs,
                                   const int64_t* page_ids, const int64_t* slots, int64_t n_pages,
                                   int64_t num_host_pages, int64_t num_slots, int64_t page_bytes,
                                   int64_t slot_stride, int item_bytes, int page_size, int num_kv,
                                   int num_layers, const int* layers, int n_entries,
                                   cudaEvent_t* events, int flags, int lanes, int layer_lanes,
                                   int threads, int64_t thread_copies, int64_t max_ops,
                                   cudaStream_t stream, cudaEvent_t fork, int64_t* stats,
                                   int* done) {
  if (stats) stats[0] = stats[1] = stats[2] = stats[3] = 0;
  if (n_entries < 0 || (n_entries > 0 && (!layers || !events)))
    return static_cast<int>(cudaErrorInvalidValue);
  if (fork) {
    cudaError_t e = use_device(device);
    if (e == cudaSuccess) e = cudaStreamWaitEvent(stream, fork, 0);
    if (e != cudaSuccess) return static_cast<int>(e);
  }
  // one-layer entries whose copies are worth a helper go out from ``threads`` threads at once
  bool one_layer_each = n_entries > 1 && threads > 1;
  for (int i = 0; i < n_entries && one_layer_each; ++i) one_layer_each = layers[i] >= 0;
  int64_t runs = 0;
  if (one_layer_each)
    for_each_run(page_ids, slots, n_pages, page_size, num_host_pages, num_slots,
                 slot_stride == item_bytes, [&](int64_t, int, int64_t, int) {
                   ++runs;
                   return true;
                 });
  const int64_t copies = runs * num_kv * n_entries;
  const int workers =
      one_layer_each ? static_cast<int>(std::clamp<int64_t>(
                           copies / std::max<int64_t>(thread_copies, 1), 1,
                           std::min(threads, std::min(n_entries, kMaxThreads))))
                     : 1;
  if (workers > 1) {
    const SendEntry entry = [&](int layer, cudaStream_t target, int64_t* part) {
      return pagekv_ce_page_transfer(device, load, host, layer_ptrs, page_ids, slots, n_pages,
                                     num_host_pages, num_slots, page_bytes, slot_stride,
                                     item_bytes, page_size, num_kv, num_layers, layer, 1, flags,
                                     lanes, layer_lanes, 1, thread_copies, max_ops, target, part);
    };
    return spread_entries(device, workers, n_entries, layers, events, stream, stats, done, entry);
  }
  for (int i = 0; i < n_entries; ++i) {
    const bool all = layers[i] < 0;
    int64_t part[4] = {0, 0, 0, 0};
    int err = pagekv_ce_page_transfer(device, load, host, layer_ptrs, page_ids, slots, n_pages,
                                      num_host_pages, num_slots, page_bytes, slot_stride,
                                      item_bytes, page_size, num_kv, num_layers,
                                      all ? 0 : layers[i], all ? num_layers : 1, flags, lanes,
                                      layer_lanes, threads, thread_copies, max_ops, stream, part);
    if (stats) {
      stats[0] += part[0];
      stats[1] += part[1];
      stats[2] = std::max(stats[2], part[2]);
      stats[3] = std::max(stats[3], part[3]);
    }
    if (err != 0) return err;
    int e = pagekv_events_create(device, &events[i], 1);  // a null entry's event
    if (e == 0) e = static_cast<int>(cudaEventRecord(events[i], stream));
    if (e != 0) return e;
    if (done) pagekv_progress_publish(done, i + 1);
  }
  return 0;
}

}  // extern "C"
