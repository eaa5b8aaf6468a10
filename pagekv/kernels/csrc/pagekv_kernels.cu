// pagekv transfer kernels: page-first host pages <-> layer-first device slots, layer-first <->
// layer-first, and the fused "store K and V at these slots" write.
//
// Every operation is a pure byte move cut into W-byte chunks (W = 16, 8 or 4, the widest that
// all addresses and sizes allow). Consecutive threads take consecutive chunks, so both the
// host-side block (contiguous per page) and each device row are read and written coalesced,
// and each thread keeps UNROLL independent loads in flight before its first store: reads over
// PCIe need many bytes in flight, far more than one 16-byte load per lane.
//
// Host memory is accessed in place through its device-visible address (pinned or registered
// memory, no staging buffer). Indices (page ids, slots) are int32 or int64; a negative or
// out-of-range index skips its token, so a kernel never touches memory outside its buffers.
//
// Exported with C linkage for ctypes; every entry point takes the cudaStream_t to launch on and
// returns a cudaError_t (0 = success). Nothing here allocates or synchronises, so every launch
// can be captured in a CUDA graph.

#include <cuda_runtime.h>

#include <algorithm>
#include <stdint.h>

namespace {

constexpr int kUnroll = 4;

template <int W> struct Vec;
template <> struct Vec<16> { using T = uint4; };
template <> struct Vec<8> { using T = uint2; };
template <> struct Vec<4> { using T = uint32_t; };

__device__ __forceinline__ int64_t read_index(const void* p, int64_t i, int is64) {
  return is64 ? static_cast<const int64_t*>(p)[i]
              : static_cast<int64_t>(static_cast<const int32_t*>(p)[i]);
}

// The loop every operation shares: thread t takes chunks t, t + stride, ... (stride = all
// threads), U at a time, issuing the U loads before any store. ``map(k, src, dst)`` gives
// chunk k's addresses, or false to skip it.
template <int W, int U, typename Idx, typename Map>
__device__ __forceinline__ void copy_chunks(const Idx total, const Map& map) {
  using V = typename Vec<W>::T;
  const Idx stride = static_cast<Idx>(gridDim.x) * blockDim.x;
  for (Idx base = static_cast<Idx>(blockIdx.x) * blockDim.x + threadIdx.x; base < total;
       base += stride * U) {
    V buf[U];
    char* dst[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const Idx k = base + static_cast<Idx>(u) * stride;
      const char* src = nullptr;
      dst[u] = nullptr;
      if (k < total && map(k, src, dst[u])) {
        buf[u] = *reinterpret_cast<const V*>(src);
      } else {
        dst[u] = nullptr;
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (dst[u]) *reinterpret_cast<V*>(dst[u]) = buf[u];
    }
  }
}

// Page-first host <-> layer-first device, layers [layer_begin, layer_begin + layer_count).
struct PageXfer {
  char* host;                 // device-visible address of host page 0
  const int64_t* layer_ptrs;  // [num_kv * num_layers]: address of slot 0 of (kv, layer)
  const void* page_ids;       // [n_pages]
  const void* slots;          // [n_pages * page_size]
  int64_t n_pages;
  int64_t num_host_pages;
  int64_t num_slots;
  int64_t page_bytes;
  int64_t slot_stride;  // bytes between consecutive slots of one layer
  int32_t item_bytes;   // one token's row of one layer of K, V or latent
  int32_t page_size;
  int32_t num_kv;       // 2 (K, V) or 1 (MLA latent)
  int32_t num_layers;
  int32_t layer_begin;
  int32_t layer_count;
  int32_t ids64;
  int32_t slots64;
};

template <int W, bool kLoad, typename Idx, int U>
// U = 8 keeps twice the loads in flight per thread and needs the registers of 512 threads.
__global__ void __launch_bounds__(U == 8 ? 512 : 1024) page_xfer_kernel(const PageXfer p) {
  const Idx chunks_per_row = p.item_bytes / W;
  const Idx rows_per_page = static_cast<Idx>(p.num_kv) * p.page_size * p.layer_count;
  const Idx chunks_per_page = rows_per_page * chunks_per_row;
  const int64_t layer_offset =
      static_cast<int64_t>(p.layer_begin) * p.num_kv * p.page_size * p.item_bytes;
  copy_chunks<W, U>(chunks_per_page * static_cast<Idx>(p.n_pages),
                    [&](const Idx k, const char*& src, char*& dst) {
    const Idx i = k / chunks_per_page;
    const Idx w = k - i * chunks_per_page;  // chunk within this page's layer range
    const Idx row = w / chunks_per_row;
    const Idx b = w - row * chunks_per_row;
    const Idx j = row % p.page_size;
    const Idx lc = row / p.page_size;
    const int c = static_cast<int>(lc % p.num_kv);
    const int l = p.layer_begin + static_cast<int>(lc / p.num_kv);
    const int64_t page = read_index(p.page_ids, i, p.ids64);
    const int64_t slot = read_index(p.slots, static_cast<int64_t>(i) * p.page_size + j, p.slots64);
    if (page < 0 || page >= p.num_host_pages || slot < 0 || slot >= p.num_slots) return false;
    char* host = p.host + page * p.page_bytes + layer_offset + static_cast<int64_t>(w) * W;
    char* dev = reinterpret_cast<char*>(p.layer_ptrs[c * p.num_layers + l]) +
                slot * p.slot_stride + static_cast<int64_t>(b) * W;
    src = kLoad ? host : dev;
    dst = kLoad ? dev : host;
    return true;
  });
}

// Layer-first -> layer-first: dst slot dst_slots[t] of each layer gets src slot src_slots[t].
struct SlotCopy {
  const int64_t* src_ptrs;
  const int64_t* dst_ptrs;
  const void* src_slots;
  const void* dst_slots;
  int64_t n_tokens;
  int64_t src_num_slots;
  int64_t dst_num_slots;
  int64_t src_stride;
  int64_t dst_stride;
  int32_t item_bytes;
  int32_t num_kv;
  int32_t num_layers;
  int32_t layer_begin;
  int32_t layer_count;
  int32_t src64;
  int32_t dst64;
};

template <int W, typename Idx>
__global__ void __launch_bounds__(1024) slot_copy_kernel(const SlotCopy p) {
  const Idx chunks_per_row = p.item_bytes / W;
  const Idx rows = static_cast<Idx>(p.n_tokens) * p.num_kv * p.layer_count;
  copy_chunks<W, kUnroll>(rows * chunks_per_row, [&](const Idx k, const char*& src, char*& dst) {
    const Idx row = k / chunks_per_row;
    const Idx b = k - row * chunks_per_row;
    const Idx t = row % static_cast<Idx>(p.n_tokens);
    const Idx lc = row / static_cast<Idx>(p.n_tokens);
    const int c = static_cast<int>(lc % p.num_kv);
    const int l = p.layer_begin + static_cast<int>(lc / p.num_kv);
    const int64_t s = read_index(p.src_slots, t, p.src64);
    const int64_t d = read_index(p.dst_slots, t, p.dst64);
    if (s < 0 || s >= p.src_num_slots || d < 0 || d >= p.dst_num_slots) return false;
    const int64_t off = static_cast<int64_t>(b) * W;
    src = reinterpret_cast<const char*>(p.src_ptrs[c * p.num_layers + l]) + s * p.src_stride + off;
    dst = reinterpret_cast<char*>(p.dst_ptrs[c * p.num_layers + l]) + d * p.dst_stride + off;
    return true;
  });
}

// Fused KV store: k_cache[loc[t]] = k[t] and v_cache[loc[t]] = v[t] in one launch.
struct StoreKV {
  const char* k;  // [n_tokens] rows, k_stride bytes apart
  const char* v;  // unused when num_kv == 1
  char* k_cache;
  char* v_cache;
  const void* loc;
  int64_t n_tokens;
  int64_t num_slots;
  int64_t k_stride;
  int64_t v_stride;
  int64_t k_cache_stride;
  int64_t v_cache_stride;
  int32_t row_bytes;
  int32_t num_kv;
  int32_t loc64;
};

template <int W, typename Idx>
__global__ void __launch_bounds__(1024) store_kv_kernel(const StoreKV p) {
  const Idx chunks_per_row = p.row_bytes / W;
  const Idx total = static_cast<Idx>(p.n_tokens) * p.num_kv * chunks_per_row;
  copy_chunks<W, kUnroll>(total, [&](const Idx k, const char*& src, char*& dst) {
    const Idx row = k / chunks_per_row;
    const Idx b = k - row * chunks_per_row;
    const int c = static_cast<int>(row / static_cast<Idx>(p.n_tokens));
    const Idx t = row - static_cast<Idx>(c) * static_cast<Idx>(p.n_tokens);
    const int64_t slot = read_index(p.loc, t, p.loc64);
    if (slot < 0 || slot >= p.num_slots) return false;
    const int64_t off = static_cast<int64_t>(b) * W;
    // Selects, not arrays indexed by c: a run-time index would spill the params to local memory.
    src = (c ? p.v + static_cast<int64_t>(t) * p.v_stride : p.k + static_cast<int64_t>(t) * p.k_stride) + off;
    dst = (c ? p.v_cache + slot * p.v_cache_stride : p.k_cache + slot * p.k_cache_stride) + off;
    return true;
  });
}

// ---- launch helpers ------------------------------------------------------------------------
constexpr int64_t kMax32 = (int64_t{1} << 31) - 1;

template <template <int, typename> class Launch, typename P>
cudaError_t dispatch(int width, bool wide, const P& p, int blocks, int threads, cudaStream_t s) {
  switch (width) {
    case 16: wide ? Launch<16, uint64_t>::run(p, blocks, threads, s)
                  : Launch<16, uint32_t>::run(p, blocks, threads, s); break;
    case 8: wide ? Launch<8, uint64_t>::run(p, blocks, threads, s)
                 : Launch<8, uint32_t>::run(p, blocks, threads, s); break;
    case 4: wide ? Launch<4, uint64_t>::run(p, blocks, threads, s)
                 : Launch<4, uint32_t>::run(p, blocks, threads, s); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

template <bool kLoad, int U> struct LaunchPage {
  template <int W, typename Idx> struct Of {
    static void run(const PageXfer& p, int b, int t, cudaStream_t s) {
      page_xfer_kernel<W, kLoad, Idx, U><<<b, t, 0, s>>>(p);
    }
  };
};
template <int W, typename Idx> struct LaunchSlotCopy {
  static void run(const SlotCopy& p, int b, int t, cudaStream_t s) {
    slot_copy_kernel<W, Idx><<<b, t, 0, s>>>(p);
  }
};
template <int W, typename Idx> struct LaunchStore {
  static void run(const StoreKV& p, int b, int t, cudaStream_t s) {
    store_kv_kernel<W, Idx><<<b, t, 0, s>>>(p);
  }
};

// Our cudart (static) keeps its own current device: follow the caller's (torch's) device.
cudaError_t use_device(int device) {
  int current = -1;
  cudaError_t err = cudaGetDevice(&current);
  if (err != cudaSuccess || current == device) return err;
  return cudaSetDevice(device);
}

#define PAGEKV_USE_DEVICE(device)                        \
  do {                                                   \
    cudaError_t e_ = use_device(device);                 \
    if (e_ != cudaSuccess) return static_cast<int>(e_);  \
  } while (0)

bool bad_launch(int width, int blocks, int threads) {
  return (width != 4 && width != 8 && width != 16) || blocks <= 0 || threads <= 0 ||
         threads > 1024 || threads % 32 != 0;
}

}  // namespace

extern "C" {

int pagekv_abi_version() { return 10; }

// 1 if kernels may use a registered host pointer as its device address (UVA), else 0.
int pagekv_can_use_host_pointer(int device) {
  int value = 0;
  if (cudaDeviceGetAttribute(&value, cudaDevAttrCanUseHostPointerForRegisteredMem, device) !=
      cudaSuccess)
    return 0;
  return value;
}

int pagekv_host_device_pointer(void* host, void** device_ptr) {
  return static_cast<int>(cudaHostGetDevicePointer(device_ptr, host, 0));
}

// A cache's fixed page-transfer parameters, made once per cache by the Python side
// (``DeviceKV.page_plan``): ctypes converts every argument of every call, ~0.2 us apiece, and a
// lone one-layer load waits on its launch. All int64: no padding to match.
struct PagePlan {
  int64_t device, layer_ptrs, num_slots, page_bytes, slot_stride, item_bytes, page_size, num_kv,
      num_layers;
};

// ``flags`` of the page entries: the direction, the index widths and chunks in flight per thread.
enum PageFlags { kFlagLoad = 1, kFlagIds64 = 2, kFlagSlots64 = 4, kFlagUnroll8 = 8 };

// Pages ``page_ids`` of ``host`` (its device-visible address; ``num_host_pages`` pages) <->
// slots ``slots`` of the cache, one layer (``layer`` >= 0) or all (-1), on as many thread blocks
// as the chunks fill, at most ``max_blocks``.
int pagekv_page_plan_transfer(const PagePlan* p, int flags, void* host, int64_t num_host_pages,
                              const void* page_ids, const void* slots, int64_t n_pages, int layer,
                              int width, int max_blocks, int threads, cudaStream_t stream) {
  const int unroll = flags & kFlagUnroll8 ? 8 : 4;
  const bool all = layer < 0;
  const int count = all ? static_cast<int>(p->num_layers) : 1;
  if (bad_launch(width, max_blocks, threads) || p->item_bytes % width != 0 ||
      (unroll == 8 && threads > 512) || layer < -1 || layer >= p->num_layers || n_pages < 0)
    return static_cast<int>(cudaErrorInvalidValue);
  if (n_pages == 0) return 0;
  PAGEKV_USE_DEVICE(static_cast<int>(p->device));
  PageXfer x{static_cast<char*>(host), reinterpret_cast<const int64_t*>(p->layer_ptrs), page_ids,
             slots, n_pages, num_host_pages, p->num_slots, p->page_bytes, p->slot_stride,
             static_cast<int32_t>(p->item_bytes), static_cast<int32_t>(p->page_size),
             static_cast<int32_t>(p->num_kv), static_cast<int32_t>(p->num_layers),
             all ? 0 : layer, count, (flags & kFlagIds64) ? 1 : 0, (flags & kFlagSlots64) ? 1 : 0};
  const int64_t chunks = n_pages * p->num_kv * p->page_size * count * (p->item_bytes / width);
  const int64_t fill = (chunks + static_cast<int64_t>(threads) * unroll - 1) /
                       (static_cast<int64_t>(threads) * unroll);
  const int blocks = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(max_blocks, fill)));
  const bool wide = chunks > kMax32;
  const bool load = flags & kFlagLoad;
  if (unroll == 8)
    return static_cast<int>(
        load ? dispatch<LaunchPage<true, 8>::Of>(width, wide, x, blocks, threads, stream)
             : dispatch<LaunchPage<false, 8>::Of>(width, wide, x, blocks, threads, stream));
  return static_cast<int>(
      load ? dispatch<LaunchPage<true, 4>::Of>(width, wide, x, blocks, threads, stream)
           : dispatch<LaunchPage<false, 4>::Of>(width, wide, x, blocks, threads, stream));
}

// The transfer of pagekv_page_plan_transfer once per entry of ``layers`` (a layer, or -1 for
// all layers), in that order on ``stream``, recording ``events[i]`` after entry i: a
// layer-by-layer load in one call (the caller's host time per layer is a launch and a record,
// not a Python call). At most ``blocks_all`` thread blocks for an all-layer entry,
// ``blocks_one`` for one layer. ``done`` (may be null) receives the entries launched and
// recorded before an error.
int pagekv_page_plan_transfer_layers(const PagePlan* p, int flags, void* host,
                                     int64_t num_host_pages, const void* page_ids,
                                     const void* slots, int64_t n_pages, const int* layers,
                                     int n_entries, cudaEvent_t* events, int width,
                                     int blocks_all, int blocks_one, int threads,
                                     cudaStream_t stream, int* done) {
  if (done) *done = 0;
  if (n_entries < 0 || (n_entries > 0 && (!layers || !events)) || blocks_all <= 0 ||
      blocks_one <= 0)
    return static_cast<int>(cudaErrorInvalidValue);
  for (int i = 0; i < n_entries; ++i) {
    int err = pagekv_page_plan_transfer(p, flags, host, num_host_pages, page_ids, slots, n_pages,
                                        layers[i] < 0 ? -1 : layers[i],
                                        width, layers[i] < 0 ? blocks_all : blocks_one, threads,
                                        stream);
    if (err != 0) return err;
    cudaError_t e = cudaEventRecord(events[i], stream);
    if (e != cudaSuccess) return static_cast<int>(e);
    if (done) *done = i + 1;
  }
  return 0;
}

int pagekv_slot_copy(int device, const int64_t* src_ptrs, const int64_t* dst_ptrs, const void* src_slots,
                     int src64, const void* dst_slots, int dst64, int64_t n_tokens,
                     int64_t src_num_slots, int64_t dst_num_slots, int64_t src_stride,
                     int64_t dst_stride, int item_bytes, int num_kv, int num_layers,
                     int layer_begin, int layer_count, int width, int blocks, int threads,
                     cudaStream_t stream) {
  if (bad_launch(width, blocks, threads) || item_bytes % width != 0 || layer_count <= 0 ||
      layer_begin < 0 || layer_begin + layer_count > num_layers)
    return static_cast<int>(cudaErrorInvalidValue);
  if (n_tokens == 0) return 0;
  PAGEKV_USE_DEVICE(device);
  SlotCopy p{src_ptrs, dst_ptrs, src_slots, dst_slots, n_tokens, src_num_slots, dst_num_slots,
             src_stride, dst_stride, item_bytes, num_kv, num_layers, layer_begin, layer_count,
             src64, dst64};
  const bool wide = n_tokens * num_kv * layer_count * (item_bytes / width) > kMax32;
  return static_cast<int>(dispatch<LaunchSlotCopy>(width, wide, p, blocks, threads, stream));
}

int pagekv_store_kv(int device, const void* k, const void* v, void* k_cache, void* v_cache, const void* loc,
                    int loc64, int64_t n_tokens, int64_t num_slots, int64_t k_stride,
                    int64_t v_stride, int64_t k_cache_stride, int64_t v_cache_stride,
                    int row_bytes, int width, int blocks, int threads, cudaStream_t stream) {
  if (bad_launch(width, blocks, threads) || row_bytes % width != 0)
    return static_cast<int>(cudaErrorInvalidValue);
  if (n_tokens == 0) return 0;
  PAGEKV_USE_DEVICE(device);
  const int num_kv = v ? 2 : 1;
  StoreKV p{static_cast<const char*>(k), static_cast<const char*>(v),
            static_cast<char*>(k_cache), static_cast<char*>(v_cache), loc, n_tokens, num_slots,
            k_stride, v_stride, k_cache_stride, v_cache_stride, row_bytes, num_kv, loc64};
  const bool wide = n_tokens * num_kv * (row_bytes / width) > kMax32;
  return static_cast<int>(dispatch<LaunchStore>(width, wide, p, blocks, threads, stream));
}

// The same with the launch's fixed parameters in one struct, made once per cache layout by the
// Python side: fewer arguments to convert on the per-step hot path.
struct StoreKVPlan {
  int64_t device, k_cache, v_cache, num_slots, k_stride, v_stride, k_cache_stride,
      v_cache_stride, row_bytes, loc64, threads;
};

int pagekv_store_kv_plan(const StoreKVPlan* p, const void* k, const void* v, const void* loc,
                         int64_t n_tokens, int width, int blocks, cudaStream_t stream) {
  return pagekv_store_kv(static_cast<int>(p->device), k, v, reinterpret_cast<void*>(p->k_cache),
                         reinterpret_cast<void*>(p->v_cache), loc, static_cast<int>(p->loc64),
                         n_tokens, p->num_slots, p->k_stride, p->v_stride, p->k_cache_stride,
                         p->v_cache_stride, static_cast<int>(p->row_bytes), width, blocks,
                         static_cast<int>(p->threads), stream);
}

// Direct backend: one cudaMemcpyAsync per run of consecutive slots, per (kv, layer).
// page_ids / slots are host arrays (int64). Runs break at page ends and at skipped slots.
int pagekv_direct_page_transfer(int device, int load, char* host, const int64_t* layer_ptrs,
                                const int64_t* page_ids, const int64_t* slots, int64_t n_pages,
                                int64_t page_bytes, int64_t slot_stride, int item_bytes,
                                int page_size, int num_kv, int num_layers, int layer_begin,
                                int layer_count, cudaStream_t stream) {
  PAGEKV_USE_DEVICE(device);
  const cudaMemcpyKind kind = cudaMemcpyDefault;  // UVA: host pool pinned or on a GPU
  const int64_t contiguous = slot_stride == item_bytes;
  for (int64_t i = 0; i < n_pages; ++i) {
    const int64_t* s = slots + i * page_size;
    int j = 0;
    while (j < page_size) {
      if (s[j] < 0) { ++j; continue; }
      int run = 1;
      while (contiguous && j + run < page_size && s[j + run] == s[j] + run) ++run;
      for (int l = layer_begin; l < layer_begin + layer_count; ++l) {
        for (int c = 0; c < num_kv; ++c) {
          char* h = host + page_ids[i] * page_bytes +
                    ((static_cast<int64_t>(l) * num_kv + c) * page_size + j) * item_bytes;
          char* d = reinterpret_cast<char*>(layer_ptrs[c * num_layers + l]) + s[j] * slot_stride;
          const size_t n = static_cast<size_t>(run) * item_bytes;
          cudaError_t err = load ? cudaMemcpyAsync(d, h, n, kind, stream)
                                 : cudaMemcpyAsync(h, d, n, kind, stream);
          if (err != cudaSuccess) return static_cast<int>(err);
        }
      }
      j += run;
    }
  }
  return 0;
}

}  // extern "C"
