// The copy-engine library's layer-by-layer call (pagekv_ce_page_transfer_layers) with its
// one-layer entries spread over host threads, checked without a GPU: built with the host
// compiler together with pagekv/kernels/csrc/copy_engine.cu (host code only) against a
// recording CUDA runtime defined here, which logs every stream operation (copy batches, event
// records, waits) in the order the library issued them and can refuse the copies of one layer.
// Checked: every entry's copies on one stream, entries alternating between the call's stream
// and a side stream forked from it; events recorded in entry order, each after its entry's
// copies and after a wait on the previous entry's event; the side stream joined back to the
// call's stream; the progress count; and, with a layer's copies refused, the call returning the
// error (within a deadline: no worker left waiting), counting only the entries before it and
// still joining. Prints one line per failed check; exit status 0 when all hold.
//   g++ -std=c++17 -O1 -pthread -x c++ -I$CUDA/include pagekv/kernels/csrc/copy_engine.cu
//       -x none tests/native/copy_engine_spread.cpp -o /tmp/spread  (then /tmp/spread)
#include <cuda_runtime.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <future>
#include <map>
#include <mutex>
#include <string>
#include <vector>

extern "C" int pagekv_ce_page_transfer_layers(
    int device, int load, char* host, const int64_t* layer_ptrs, const int64_t* page_ids,
    const int64_t* slots, int64_t n_pages, int64_t num_host_pages, int64_t num_slots,
    int64_t page_bytes, int64_t slot_stride, int item_bytes, int page_size, int num_kv,
    int num_layers, const int* layers, int n_entries, cudaEvent_t* events, int flags, int lanes,
    int layer_lanes, int threads, int64_t thread_copies, int64_t max_ops, cudaStream_t stream,
    cudaEvent_t fork, int64_t* stats, int* done);

namespace {

// Device addresses: layer l's caches at (l + 1) << 36, so a copy's layer is its destination's.
constexpr int kLayerShift = 36;

struct Op {
  enum Kind { kCopy, kRecord, kWait } kind;
  uintptr_t stream;
  int layer;  // kCopy
  uintptr_t event;  // kRecord, kWait
};

std::mutex mu;
std::vector<Op> ops;
int refuse_layer = -1;  // copies of this layer fail with cudaErrorUnknown
uintptr_t next_handle = 0x1000;

uintptr_t make_handle() {
  std::lock_guard<std::mutex> g(mu);
  return next_handle += 0x10;
}

void log_op(Op op) {
  std::lock_guard<std::mutex> g(mu);
  ops.push_back(op);
}

}  // namespace

// The recording runtime: the calls copy_engine.cu makes.
extern "C" {
cudaError_t cudaGetDevice(int* device) { *device = 0; return cudaSuccess; }
cudaError_t cudaSetDevice(int) { return cudaSuccess; }
cudaError_t cudaGetDeviceCount(int* count) { *count = 1; return cudaSuccess; }
cudaError_t cudaDriverGetVersion(int* version) { *version = 13000; return cudaSuccess; }
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr, int) {
  *value = 1 << 30;
  return cudaSuccess;
}
cudaError_t cudaGetLastError() { return cudaSuccess; }
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned) {
  *s = reinterpret_cast<cudaStream_t>(make_handle());
  return cudaSuccess;
}
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned) {
  *e = reinterpret_cast<cudaEvent_t>(make_handle());
  return cudaSuccess;
}
cudaError_t cudaEventDestroy(cudaEvent_t) { return cudaSuccess; }
cudaError_t cudaEventQuery(cudaEvent_t) { return cudaSuccess; }
cudaError_t cudaEventSynchronize(cudaEvent_t) { return cudaSuccess; }
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) {
  log_op({Op::kRecord, reinterpret_cast<uintptr_t>(s), -1, reinterpret_cast<uintptr_t>(e)});
  return cudaSuccess;
}
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned) {
  log_op({Op::kWait, reinterpret_cast<uintptr_t>(s), -1, reinterpret_cast<uintptr_t>(e)});
  return cudaSuccess;
}
cudaError_t cudaMemcpyBatchAsync(void* const* dsts, const void* const*, const size_t*,
                                 size_t count, cudaMemcpyAttributes*, size_t*, size_t,
                                 cudaStream_t s) {
  for (size_t i = 0; i < count; ++i) {
    const int layer = static_cast<int>((reinterpret_cast<uintptr_t>(dsts[i]) >> kLayerShift) - 1);
    if (layer == refuse_layer) return cudaErrorUnknown;
  }
  for (size_t i = 0; i < count; ++i)
    log_op({Op::kCopy, reinterpret_cast<uintptr_t>(s),
            static_cast<int>((reinterpret_cast<uintptr_t>(dsts[i]) >> kLayerShift) - 1), 0});
  return cudaSuccess;
}
cudaError_t cudaMemcpy2DAsync(void*, size_t, const void*, size_t, size_t, size_t, cudaMemcpyKind,
                              cudaStream_t) {
  return cudaErrorNotSupported;
}
}  // extern "C"

namespace {

int failures = 0;

void check(bool ok, const std::string& what) {
  if (!ok) {
    std::printf("FAILED: %s\n", what.c_str());
    ++failures;
  }
}

struct Result {
  int err = -1;
  int done = 0;
  int64_t stats[4] = {0, 0, 0, 0};
  std::vector<cudaEvent_t> events;
  bool finished = false;
};

constexpr int kLayers = 6, kPages = 8, kPageSize = 16, kKV = 2;

// One call: entries ``layers``, loads of kPages whole-page runs, on ``stream``; the library's
// call runs on a thread of its own so that a hang is reported, not waited for.
Result run(const std::vector<int>& layers, int threads, int64_t thread_copies,
           cudaStream_t stream) {
  {
    std::lock_guard<std::mutex> g(mu);
    ops.clear();
  }
  static std::vector<int64_t> layer_ptrs, page_ids, slots;
  layer_ptrs.assign(kKV * kLayers, 0);
  for (int c = 0; c < kKV; ++c)
    for (int l = 0; l < kLayers; ++l)
      layer_ptrs[c * kLayers + l] = (int64_t{l + 1} << kLayerShift) + (int64_t{c} << 30);
  page_ids.clear();
  slots.clear();
  for (int p = 0; p < kPages; ++p) {
    page_ids.push_back((p * 5) % kPages);
    for (int t = 0; t < kPageSize; ++t) slots.push_back(((p * 3) % kPages) * kPageSize + t);
  }
  auto r = std::make_shared<Result>();
  r->events.assign(layers.size(), nullptr);
  auto call = std::async(std::launch::async, [r, layers, threads, thread_copies, stream] {
    const int64_t item = 256;
    r->err = pagekv_ce_page_transfer_layers(
        0, 1, reinterpret_cast<char*>(int64_t{1} << 44), layer_ptrs.data(), page_ids.data(),
        slots.data(), kPages, kPages, kPages * kPageSize, kLayers * kKV * kPageSize * item,
        item, static_cast<int>(item), kPageSize, kKV, kLayers, layers.data(),
        static_cast<int>(layers.size()), r->events.data(), 0, 16, 1, threads, thread_copies,
        16384, stream, nullptr, r->stats, &r->done);
    r->finished = true;
  });
  if (call.wait_for(std::chrono::seconds(10)) != std::future_status::ready) {
    std::printf("FAILED: the call did not return within 10 s (a worker left waiting)\n");
    std::fflush(stdout);
    std::_Exit(2);
  }
  return *r;
}

// Position in the log of the first op matching ``pred`` (ops.size() if none).
template <typename Pred>
size_t find(Pred pred, size_t from = 0) {
  for (size_t i = from; i < ops.size(); ++i)
    if (pred(ops[i])) return i;
  return ops.size();
}

uintptr_t key(cudaEvent_t e) { return reinterpret_cast<uintptr_t>(e); }

void check_spread(cudaStream_t stream_handle) {
  const uintptr_t stream = reinterpret_cast<uintptr_t>(stream_handle);
  const std::vector<int> layers = {3, 0, 4, 1, 3, 2};
  Result r = run(layers, 2, 1, stream_handle);
  check(r.err == 0, "spread: the call succeeds");
  check(r.done == static_cast<int>(layers.size()), "spread: every entry counted");
  check(r.stats[3] == 2 && r.stats[2] == 2, "spread: two threads, two streams");
  check(r.stats[0] == static_cast<int64_t>(layers.size()) * kPages * kKV,
        "spread: every copy sent once");
  std::map<size_t, uintptr_t> entry_stream;
  size_t last_record = 0;
  for (size_t i = 0; i < layers.size(); ++i) {
    const size_t rec = find([&](const Op& o) { return o.kind == Op::kRecord &&
                                                      o.event == key(r.events[i]); });
    check(rec < ops.size(), "spread: entry " + std::to_string(i) + "'s event recorded");
    if (rec == ops.size()) continue;
    check(i == 0 || rec > last_record, "spread: events recorded in entry order");
    last_record = rec;
    const uintptr_t s = ops[rec].stream;
    entry_stream[i] = s;
    check((s == stream) == (i % 2 == 0),
          "spread: entry " + std::to_string(i) + " on its worker's stream");
    // its copies before its record: on its stream (the legacy stream's on the lanes it forks)
    size_t copies = 0;
    for (size_t k = 0; k < rec; ++k)
      if (ops[k].kind == Op::kCopy && ops[k].layer == layers[i] &&
          (ops[k].stream == s || s == reinterpret_cast<uintptr_t>(cudaStreamLegacy)))
        ++copies;
    check(copies >= static_cast<size_t>(kPages * kKV),
          "spread: entry " + std::to_string(i) + "'s copies before its event");
    if (i > 0) {
      const size_t wait = find([&](const Op& o) { return o.kind == Op::kWait && o.stream == s &&
                                                         o.event == key(r.events[i - 1]); });
      check(wait < rec, "spread: entry " + std::to_string(i) + "'s stream waits on event " +
                            std::to_string(i - 1) + " before its record");
    }
  }
  // the side stream: forked from the call's stream first, joined back to it at the end
  const uintptr_t side = entry_stream.count(1) ? entry_stream[1] : 0;
  const size_t first_side = find([&](const Op& o) { return o.stream == side; });
  check(first_side < ops.size() && ops[first_side].kind == Op::kWait,
        "spread: the side stream first waits on the fork");
  if (first_side < ops.size()) {
    const uintptr_t fork = ops[first_side].event;
    const size_t fork_rec = find([&](const Op& o) { return o.kind == Op::kRecord &&
                                                           o.event == fork; });
    check(fork_rec < first_side && ops[fork_rec].stream == stream,
          "spread: the fork recorded on the call's stream");
  }
  size_t side_last = 0;
  for (size_t k = 0; k < ops.size(); ++k)
    if (ops[k].stream == side) side_last = k;
  check(ops[side_last].kind == Op::kRecord, "spread: the side stream ends with its join");
  const uintptr_t join = ops[side_last].event;
  const size_t joined = find([&](const Op& o) { return o.kind == Op::kWait && o.stream == stream &&
                                                       o.event == join; }, side_last);
  check(joined < ops.size(), "spread: the call's stream waits on the join");
}

void check_refused(int refused_entry) {
  const std::vector<int> layers = {3, 0, 4, 1, 5, 2};
  refuse_layer = layers[refused_entry];
  cudaStream_t stream = reinterpret_cast<cudaStream_t>(make_handle());
  Result r = run(layers, 2, 1, stream);
  refuse_layer = -1;
  const std::string at = "refused at entry " + std::to_string(refused_entry) + ": ";
  check(r.finished && r.err == cudaErrorUnknown, at + "the call returns the error");
  check(r.done == refused_entry, at + "only the entries before it counted");
  for (size_t i = 0; i < layers.size(); ++i) {
    const bool recorded = find([&](const Op& o) { return o.kind == Op::kRecord &&
                                                         o.event == key(r.events[i]); }) <
                          ops.size();
    check(recorded == (static_cast<int>(i) < refused_entry),
          at + "event " + std::to_string(i) + (recorded ? " recorded" : " not recorded"));
  }
  // the side stream still joined back: the call's stream's last op is a wait on its join
  check(!ops.empty() && ops.back().kind == Op::kWait &&
            ops.back().stream == reinterpret_cast<uintptr_t>(stream),
        at + "the side stream joined back");
}

void check_sequential() {
  cudaStream_t stream = reinterpret_cast<cudaStream_t>(make_handle());
  const uintptr_t s = reinterpret_cast<uintptr_t>(stream);
  // too few copies for a helper; and an all-layer entry among one-layer ones
  for (const auto& [layers, copies] : std::vector<std::pair<std::vector<int>, int64_t>>{
           {{3, 0, 4}, 1 << 20}, {{3, -1, 0}, 1}}) {
    Result r = run(layers, 2, copies, stream);
    check(r.err == 0 && r.done == static_cast<int>(layers.size()), "sequential: succeeds");
    size_t last = 0;
    for (size_t i = 0; i < layers.size(); ++i) {
      const size_t rec = find([&](const Op& o) { return o.kind == Op::kRecord &&
                                                        o.event == key(r.events[i]); });
      check(rec < ops.size() && ops[rec].stream == s && (i == 0 || rec > last),
            "sequential: events on the call's stream, in order");
      last = rec;
    }
    check(layers[1] < 0 || r.stats[3] == 1, "sequential: one thread for few copies");
  }
}

}  // namespace

int main() {
  check_spread(reinterpret_cast<cudaStream_t>(make_handle()));
  check_spread(cudaStreamLegacy);  // the legacy stream: the entries there go through the lanes
  for (int entry : {0, 1, 2, 3, 5}) check_refused(entry);
  check_sequential();
  if (failures == 0) std::printf("all checks passed\n");
  return failures == 0 ? 0 : 1;
}
