/* Checked copies for pagekv.store.native: copy values piece by piece and hash what landed,
 * or receive them from a socket piece by piece and hash what landed (pagekv_recv_verify; with
 * pagekv_recv_verify_staged, through a cached ring that a helper thread drains into place).
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
 * Build: cc -O3 -fPIC -shared -pthread [-mavx2] copy_verify.c -o libpagekv_copy_verify.so
 * (XXH3 picks its vector code at compile time: -mavx2 where the CPU has it, see native.py).
 */
#define XXH_INLINE_ALL
#include "third_party/xxhash/xxhash.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <time.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define PAGEKV_COPY_VERIFY_ABI 3
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

/* Digests of values (consecutive runs of pieces) over bytes that arrive piece by piece: both
 * receives below feed it the same calls in the same order. */
typedef struct {
    pagekv_value *values;
    uint64_t nvalues, value, left_in_value;
    XXH3_state_t state;
} hasher_t;

static int values_cover(const pagekv_value *values, uint64_t nvalues, uint64_t npieces) {
    uint64_t expect = 0;
    for (uint64_t v = 0; v < nvalues; v++) {
        if (values[v].first != expect || values[v].count > npieces - expect) return 0;
        expect += values[v].count;
    }
    return nvalues == 0 || expect == npieces;
}

static void hasher_piece_begins(hasher_t *h) {
    if (h->nvalues == 0 || h->left_in_value != 0) return;
    /* values of zero pieces get the digest of no bytes */
    while (h->values[h->value].count == 0) h->values[h->value++].digest = XXH3_64bits(NULL, 0);
    XXH3_64bits_reset(&h->state);
    h->left_in_value = h->values[h->value].count;
}

static void hasher_update(hasher_t *h, const unsigned char *bytes, uint64_t n) {
    if (h->nvalues > 0) XXH3_64bits_update(&h->state, bytes, (size_t)n);
}

static void hasher_piece_ends(hasher_t *h) {
    if (h->nvalues > 0 && --h->left_in_value == 0) {
        h->values[h->value++].digest = XXH3_64bits_digest(&h->state);
    }
}

static void hasher_finish(hasher_t *h) { /* trailing values of zero pieces */
    while (h->value < h->nvalues) h->values[h->value++].digest = XXH3_64bits(NULL, 0);
}

/* recv exactly n bytes into buf (retrying after EINTR and short returns): 0, 1 on EOF, or
 * -errno. *received counts what arrived. */
static int recv_all(int fd, unsigned char *buf, uint64_t n, uint64_t *received) {
    uint64_t got = 0;
    while (got < n) {
        ssize_t r = recv(fd, buf + got, (size_t)(n - got), MSG_WAITALL);
        if (r < 0) {
            if (errno == EINTR) continue;
            return -errno;
        }
        if (r == 0) return 1;
        got += (uint64_t)r;
        *received += (uint64_t)r;
    }
    return 0;
}

/* Receive `npieces` pieces, in order, from the connected blocking socket `fd`, each straight
 * into its place (pieces[k].dst, pieces[k].nbytes; src is not used), `chunk_bytes` at a time
 * (recv with MSG_WAITALL). With `nvalues` > 0 the values (consecutive runs of pieces that
 * together cover all of them, in order) are hashed as they arrive: each chunk right after it
 * landed, while it is still in the core's cache, so memory is crossed once; digests as
 * pagekv_copy_verify's. Without values nothing is hashed.
 *
 * Returns 0 when every byte arrived; 1 when the peer closed the connection (or it was shut
 * down) before; -errno for a failed receive (-EAGAIN / -EWOULDBLOCK: the socket's SO_RCVTIMEO
 * passed with nothing read in one receive); -EINVAL, before anything is read, for values that
 * do not cover the pieces in order or a chunk_bytes of 0. `*received`: the bytes received
 * before the return. A receive interrupted by a signal is retried. */
int pagekv_recv_verify(int fd, const pagekv_piece *pieces, uint64_t npieces,
                       pagekv_value *values, uint64_t nvalues, uint64_t chunk_bytes,
                       uint64_t *received) {
    *received = 0;
    if (chunk_bytes == 0 || !values_cover(values, nvalues, npieces)) return -EINVAL;
    hasher_t h = {.values = values, .nvalues = nvalues};
    for (uint64_t p = 0; p < npieces; p++) {
        hasher_piece_begins(&h);
        unsigned char *dst = (unsigned char *)pieces[p].dst;
        for (uint64_t off = 0, n = pieces[p].nbytes; off < n; off += chunk_bytes) {
            uint64_t want = n - off < chunk_bytes ? n - off : chunk_bytes;
            int rc = recv_all(fd, dst + off, want, received);
            if (rc != 0) return rc;
            hasher_update(&h, dst + off, want);
        }
        hasher_piece_ends(&h);
    }
    hasher_finish(&h);
    return 0;
}

/* ---- the staged receive: a second core moves the bytes into place ----------------------
 * Receiving into memory that is not in any cache (a pinned page pool, a store's blocks) runs
 * slower than into memory that is: the kernel's copy waits on each destination line. Here the
 * calling thread receives each chunk into a slot of a small ring that stays in its cache, and
 * a helper thread hashes the slot and copies it into place with streaming stores, while the
 * next chunk arrives. Slot c is reused only after the helper has drained chunk c (the
 * `drained` count): a slot is never written while it is being hashed or copied, so the digest
 * is of exactly the bytes copied (the ring is the caller's, written by nobody else).
 *
 * Why hash the slot and stream the copy: a plain copy into cold memory reads each destination
 * line before writing it, and hashing the destination afterwards reads it again. On the lent
 * H100 host (2026-11-25, 256 KiB chunks from a hot ring into 1 GiB of faulted memory, one
 * thread) memcpy then hash of the destination ran at 3.7-6.0 GB/s, slower than one loopback
 * stream, so the helper paced the receive; hash of the slot then streaming copy ran at
 * 9.8-11.1 GB/s (memcpy alone 7.4-7.9, streaming copy alone 15.0-16.7). */

/* Copy n bytes from a cached slot to memory that usually is not: streaming stores (whole
 * lines written without reading them first; they bypass the cache and are fenced before the
 * caller publishes the chunk) on x86-64, memcpy elsewhere and for short or unaligned ends. */
static void copy_out(unsigned char *dst, const unsigned char *src, uint64_t n) {
#if defined(__x86_64__)
    uint64_t head = (64 - ((uintptr_t)dst & 63)) & 63;
    if (n < 4096 || head >= n) {
        memcpy(dst, src, n);
        return;
    }
    memcpy(dst, src, head);
    dst += head, src += head, n -= head;
    uint64_t body = n & ~(uint64_t)63;
    for (uint64_t i = 0; i < body; i += 64) {
#if defined(__AVX2__)
        __m256i a = _mm256_loadu_si256((const __m256i *)(src + i));
        __m256i b = _mm256_loadu_si256((const __m256i *)(src + i + 32));
        _mm256_stream_si256((__m256i *)(dst + i), a);
        _mm256_stream_si256((__m256i *)(dst + i + 32), b);
#else
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
#endif
    }
    _mm_sfence(); /* the streamed lines are visible before the chunk counts as drained */
    memcpy(dst + body, src + body, n - body);
#else
    memcpy(dst, src, n);
#endif
}
typedef struct {
    const pagekv_piece *pieces;
    uint64_t npieces, chunk, nslots;
    unsigned char *ring;
    hasher_t hash;
    atomic_uint_fast64_t filled;  /* chunks received into the ring */
    atomic_uint_fast64_t drained; /* chunks copied out of it */
    atomic_int stop;              /* the receive failed: the helper returns */
    pthread_mutex_t mu;
    pthread_cond_t cv;
} stage_t;

#define SPIN_NS 200000 /* a waiting side spins this long before it sleeps */

static uint64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

static void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static void stage_signal(stage_t *s) {
    pthread_mutex_lock(&s->mu); /* a waiter checks under mu: the wake-up cannot be lost */
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

/* Until *count >= target (1) or the receive stopped (0). */
static int stage_wait(stage_t *s, atomic_uint_fast64_t *count, uint64_t target) {
    uint64_t spun_since = 0;
    for (unsigned i = 0;; i++) {
        if (atomic_load_explicit(count, memory_order_acquire) >= target) return 1;
        if (atomic_load_explicit(&s->stop, memory_order_acquire)) return 0;
        if ((i & 63) == 0) {
            uint64_t t = now_ns();
            if (spun_since == 0) spun_since = t;
            else if (t - spun_since > SPIN_NS) break;
        }
        cpu_relax();
    }
    pthread_mutex_lock(&s->mu);
    while (atomic_load(count) < target && !atomic_load(&s->stop)) pthread_cond_wait(&s->cv, &s->mu);
    int ok = atomic_load(count) >= target;
    pthread_mutex_unlock(&s->mu);
    return ok;
}

static void *stage_drain(void *arg) {
    stage_t *s = (stage_t *)arg;
    uint64_t c = 0;
    for (uint64_t p = 0; p < s->npieces; p++) {
        hasher_piece_begins(&s->hash);
        unsigned char *dst = (unsigned char *)s->pieces[p].dst;
        for (uint64_t off = 0, n = s->pieces[p].nbytes; off < n; off += s->chunk, c++) {
            uint64_t len = n - off < s->chunk ? n - off : s->chunk;
            if (!stage_wait(s, &s->filled, c + 1)) return NULL;
            const unsigned char *slot = s->ring + (c % s->nslots) * s->chunk;
            hasher_update(&s->hash, slot, len);
            copy_out(dst + off, slot, len);
            atomic_store_explicit(&s->drained, c + 1, memory_order_release);
            stage_signal(s);
        }
        hasher_piece_ends(&s->hash);
    }
    hasher_finish(&s->hash);
    return NULL;
}

/* pagekv_recv_verify, received through `ring` (ring_bytes, at least two chunks; owned by the
 * caller, not touched by anyone else during the call) by the calling thread while a helper
 * thread hashes each chunk in the ring and streams it into place. Same arguments, results and
 * digests; -EINVAL also for a ring of fewer than two chunks. When the helper cannot be
 * started it receives as pagekv_recv_verify does. Returns only after the helper has stopped:
 * nothing writes to the pieces after the return. */
int pagekv_recv_verify_staged(int fd, const pagekv_piece *pieces, uint64_t npieces,
                              pagekv_value *values, uint64_t nvalues, uint64_t chunk_bytes,
                              unsigned char *ring, uint64_t ring_bytes, uint64_t *received) {
    *received = 0;
    if (chunk_bytes == 0 || ring_bytes / chunk_bytes < 2 || !values_cover(values, nvalues, npieces))
        return -EINVAL;
    stage_t s = {.pieces = pieces, .npieces = npieces, .chunk = chunk_bytes,
                 .nslots = ring_bytes / chunk_bytes, .ring = ring,
                 .hash = {.values = values, .nvalues = nvalues}};
    atomic_init(&s.filled, 0);
    atomic_init(&s.drained, 0);
    atomic_init(&s.stop, 0);
    pthread_mutex_init(&s.mu, NULL);
    pthread_cond_init(&s.cv, NULL);
    pthread_t helper;
    if (pthread_create(&helper, NULL, stage_drain, &s) != 0) {
        pthread_cond_destroy(&s.cv);
        pthread_mutex_destroy(&s.mu);
        return pagekv_recv_verify(fd, pieces, npieces, values, nvalues, chunk_bytes, received);
    }
    int rc = 0;
    uint64_t c = 0, p = 0, off = 0, partial = 0;
    for (; p < npieces; p++) {
        for (off = 0; off < pieces[p].nbytes; off += chunk_bytes, c++) {
            uint64_t n = pieces[p].nbytes, len = n - off < chunk_bytes ? n - off : chunk_bytes;
            if (c >= s.nslots) stage_wait(&s, &s.drained, c - s.nslots + 1);
            uint64_t before = *received;
            rc = recv_all(fd, ring + (c % s.nslots) * chunk_bytes, len, received);
            if (rc != 0) {
                partial = *received - before;
                break;
            }
            atomic_store_explicit(&s.filled, c + 1, memory_order_release);
            stage_signal(&s);
        }
        if (rc != 0) break;
    }
    if (rc != 0) {
        atomic_store_explicit(&s.stop, 1, memory_order_release);
        stage_signal(&s);
    }
    pthread_join(helper, NULL); /* it drains every chunk filled before it saw stop */
    if (partial > 0) { /* as in place: what arrived of the last chunk is where it belongs */
        memcpy((unsigned char *)pieces[p].dst + off, ring + (c % s.nslots) * chunk_bytes, partial);
    }
    pthread_cond_destroy(&s.cv);
    pthread_mutex_destroy(&s.mu);
    return rc;
}
