/* How fast one helper thread moves 256 KiB chunks from a hot 1 MiB ring into cold memory
 * (1 GiB, faulted in first), five ways: memcpy then hash of the destination (the staged
 * receive's helper before 26e2ec9), hash of the ring slot then streaming stores (since
 * 26e2ec9), hash of the slot then memcpy, and each copy alone. Two passes over all five.
 * Results on the H100 host: benchmarks/results/diag_lane_put_4d8a3d1.log.
 *
 *   cc -O3 -mavx2 -I pagekv/store/csrc/third_party/xxhash scripts/diag_copy_pace.c -o /tmp/pace
 *   /tmp/pace
 */
#define XXH_INLINE_ALL
#include "xxhash.h"

#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define RING_BYTES (1u << 20)
#define CHUNK_BYTES (256u << 10)
#define DEST_BYTES (1ull << 30)

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* dst and src 32-byte aligned, n a multiple of 64 (true of every chunk here) */
static void stream_copy(unsigned char *dst, const unsigned char *src, size_t n) {
    for (size_t i = 0; i < n; i += 64) {
        __m256i a = _mm256_load_si256((const __m256i *)(src + i));
        __m256i b = _mm256_load_si256((const __m256i *)(src + i + 32));
        _mm256_stream_si256((__m256i *)(dst + i), a);
        _mm256_stream_si256((__m256i *)(dst + i + 32), b);
    }
    _mm_sfence();
}

int main(void) {
    unsigned char *ring = aligned_alloc(4096, RING_BYTES);
    unsigned char *dst = aligned_alloc(4096, DEST_BYTES);
    if (ring == NULL || dst == NULL) return 1;
    memset(ring, 7, RING_BYTES);
    memset(dst, 1, DEST_BYTES); /* every page faulted in before the timing */
    const char *names[] = {"memcpy+hash(dst)", "hash(ring)+nt_copy", "memcpy only",
                           "nt_copy only", "hash(ring)+memcpy"};
    volatile unsigned long long sink = 0;
    for (int pass = 0; pass < 2; pass++) {
        for (int way = 0; way < 5; way++) {
            double start = now();
            for (size_t off = 0; off < DEST_BYTES; off += CHUNK_BYTES) {
                const unsigned char *slot = ring + (off / CHUNK_BYTES % 4) * CHUNK_BYTES;
                unsigned char *to = dst + off;
                switch (way) {
                case 0: memcpy(to, slot, CHUNK_BYTES); sink += XXH3_64bits(to, CHUNK_BYTES); break;
                case 1: sink += XXH3_64bits(slot, CHUNK_BYTES); stream_copy(to, slot, CHUNK_BYTES); break;
                case 2: memcpy(to, slot, CHUNK_BYTES); break;
                case 3: stream_copy(to, slot, CHUNK_BYTES); break;
                default: sink += XXH3_64bits(slot, CHUNK_BYTES); memcpy(to, slot, CHUNK_BYTES);
                }
            }
            printf("helper %-20s %.2f GB/s\n", names[way], DEST_BYTES / (now() - start) / 1e9);
        }
    }
    free(ring);
    free(dst);
    return 0;
}
