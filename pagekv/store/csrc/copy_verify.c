/* Checked copies for pagekv.store.native: copy values piece by piece and hash what landed.
 *
 * A value is a run of pieces (dst, src, nbytes). Each piece is copied in blocks of
 * `block_bytes` (cache-sized: 256 KiB by default), and each block is hashed right after it was
 * written, read back from dst while it is still in the core's cache: memory is read once, and
 * the digest is of what the destination holds, not of the source (a source that changes under
 * the copy, e.g. a shared segment being reused, gives a digest that does not match). The
 * digest is XXH3-64, seed 0, streamed over the value's pieces in order: the same number as
 * Python's xxhash.xxh3_64() fed the same bytes.
 *
 * With threads > 1 the values are shared out between that many threads (whole values each,
 * taken in order from a shared counter). Nothing here touches Python: the caller (ctypes)
 * releases the GIL around the call and keeps the buffers alive.
 *
 * Build: cc -O3 -fPIC -shared -pthread copy_verify.c -o libpagekv_copy_verify.so
 */
#define XXH_INLINE_ALL
#include "third_party/xxhash/xxhash.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

#define PAGEKV_COPY_VERIFY_ABI 1
#define MAX_THREADS 64

typedef struct {
    void *dst;
    const void *src;
    uint64_t nbytes;
} pagekv_piece; /* mirrored by pagekv.store.native.Piece */

typedef struct {
    uint64_t first;  /* index of the value's first piece */
    uint64_t count;  /* its number of pieces */
    uint64_t digest; /* out: XXH3-64 of the bytes written */
} pagekv_value; /* mirrored by pagekv.store.native.Value */

typedef struct {
    const pagekv_piece *pieces;
    pagekv_value *values;
    uint64_t nvalues;
    uint64_t block;
    atomic_uint_fast64_t next;
} job_t;

int pagekv_copy_verify_abi(void) { return PAGEKV_COPY_VERIFY_ABI; }

static void copy_value(const pagekv_piece *pieces, pagekv_value *value, uint64_t block) {
    XXH3_state_t state;
    XXH3_64bits_reset(&state);
    for (uint64_t p = value->first; p < value->first + value->count; p++) {
        unsigned char *dst = (unsigned char *)pieces[p].dst;
        const unsigned char *src = (const unsigned char *)pieces[p].src;
        for (uint64_t off = 0; off < pieces[p].nbytes; off += block) {
            uint64_t n = pieces[p].nbytes - off < block ? pieces[p].nbytes - off : block;
            memcpy(dst + off, src + off, n);
            /* the hash must read dst: no load of it may be replaced by what was copied */
            __asm__ __volatile__("" ::: "memory");
            XXH3_64bits_update(&state, dst + off, n);
        }
    }
    value->digest = XXH3_64bits_digest(&state);
}

static void *worker(void *arg) {
    job_t *job = (job_t *)arg;
    for (;;) {
        uint64_t v = atomic_fetch_add(&job->next, 1);
        if (v >= job->nvalues) return NULL;
        copy_value(job->pieces, &job->values[v], job->block);
    }
}

/* Copy and hash `nvalues` values whose pieces are in `pieces[0..npieces)`.
 * Returns 0, or -1 when a value's pieces lie outside `pieces` or block_bytes is 0 (nothing is
 * copied then). Threads that cannot be started are not an error: the calling thread does
 * their share. */
int pagekv_copy_verify(const pagekv_piece *pieces, uint64_t npieces, pagekv_value *values,
                       uint64_t nvalues, uint64_t block_bytes, int threads) {
    if (block_bytes == 0) return -1;
    for (uint64_t v = 0; v < nvalues; v++) {
        if (values[v].first > npieces || values[v].count > npieces - values[v].first) return -1;
    }
    job_t job = {pieces, values, nvalues, block_bytes, 0};
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if ((uint64_t)threads > nvalues) threads = (int)nvalues;
    pthread_t ids[MAX_THREADS];
    int started = 0;
    for (int t = 1; t < threads; t++) {
        if (pthread_create(&ids[started], NULL, worker, &job) != 0) break;
        started++;
    }
    worker(&job);
    for (int t = 0; t < started; t++) pthread_join(ids[t], NULL);
    return 0;
}
