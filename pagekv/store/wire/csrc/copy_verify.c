/* Checked copies for pagekv.store.native: copy values piece by piece and hash what landed,
 * or receive them from a socket piece by piece and hash what landed (pagekv_recv_verify).
 *
 * A value is a run of pieces (dst, src, nbytes). Each piece is copied in blocks of
 * `block_bytes` (cache-sized: 256 KiB by default), and each block is hashed while it is in the
 * core's cache: a piece of at least BOUNCE_MIN_BYTES is copied into a per-thread bounce,
 * hashed there and streamed into place (the destination written once, never read); a smaller
 * one is copied into place and hashed from there. Either way the digest is of the bytes the
 * destination was given, not of a second read of the source (a source that changes under the
 * copy, e.g. a shared segment being reused, gives a digest that does not match). The digest is
 * XXH3-64, seed 0, streamed over the value's pieces in order: the same number as Python's
 * xxhash.xxh3_64() fed the same bytes.
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
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/types.h>
#include <time.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define PAGEKV_COPY_VERIFY_ABI 7
#define MAX_THREADS 64
/* pagekv_recv_verify: pieces from this size are received through the caller's bounce buffer
 * (see there); smaller ones straight into place. */
#define BOUNCE_MIN_BYTES (64u << 10)

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
    atomic_int failed; /* a thread could not allocate its bounce: the call fails */
} job_t;

int pagekv_copy_verify_abi(void) { return PAGEKV_COPY_VERIFY_ABI; }

/* Copy n bytes from a cached buffer to memory that usually is in no cache: on x86-64 whole
 * 64-byte lines with streaming stores (written without being read first, past the cache;
 * fenced before this returns), the unaligned head and the tail with memcpy; memcpy elsewhere
 * and below 4 KiB. */
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
    _mm_sfence(); /* the streamed lines are in memory before anyone is told the bytes are */
    memcpy(dst + body, src + body, n - body);
#else
    memcpy(dst, src, n);
#endif
}

/* Copy one value's pieces and hash the bytes written. Pieces of at least BOUNCE_MIN_BYTES go
 * through `bounce` (the thread's own, `block` bytes, allocated on first need; NULL until then):
 * a block is copied into it (the source read once, the bounce staying in the core's cache),
 * hashed there and streamed into place (copy_out): the destination is written once and never
 * read, which a copy straight into it followed by hashing it would do (a read for ownership of
 * each line before it is written; 3 memory transfers per byte instead of 2). What is hashed is
 * exactly what is written: the bounce is touched by no one else. Smaller pieces are copied in
 * place and hashed from the destination. Returns -1 when a bounce is needed and cannot be
 * allocated (nothing of that piece is copied), else 0. */
static int copy_value(const pagekv_piece *pieces, pagekv_value *value, uint64_t block,
                      unsigned char **bounce) {
    XXH3_state_t state;
    XXH3_64bits_reset(&state);
    for (uint64_t p = value->first; p < value->first + value->count; p++) {
        unsigned char *dst = (unsigned char *)pieces[p].dst;
        const unsigned char *src = (const unsigned char *)pieces[p].src;
        uint64_t size = pieces[p].nbytes;
        if (size >= BOUNCE_MIN_BYTES && *bounce == NULL) {
            *bounce = (unsigned char *)malloc(block);
            if (*bounce == NULL) return -1;
        }
        for (uint64_t off = 0; off < size; off += block) {
            uint64_t n = size - off < block ? size - off : block;
            if (size >= BOUNCE_MIN_BYTES) {
                memcpy(*bounce, src + off, n);
                XXH3_64bits_update(&state, *bounce, n);
                copy_out(dst + off, *bounce, n);
            } else {
                memcpy(dst + off, src + off, n);
                /* the hash must read dst: no load of it may be replaced by what was copied */
                __asm__ __volatile__("" ::: "memory");
                XXH3_64bits_update(&state, dst + off, n);
            }
        }
    }
    value->digest = XXH3_64bits_digest(&state);
    return 0;
}

static void *worker(void *arg) {
    job_t *job = (job_t *)arg;
    unsigned char *bounce = NULL;
    for (;;) {
        uint64_t v = atomic_fetch_add(&job->next, 1);
        if (v >= job->nvalues) break;
        if (copy_value(job->pieces, &job->values[v], job->block, &bounce) != 0) {
            atomic_store(&job->failed, 1);
            break;
        }
    }
    free(bounce);
    return NULL;
}

/* Copy and hash `nvalues` values whose pieces are in `pieces[0..npieces)`.
 * Returns 0; -1 when a value's pieces lie outside `pieces` or block_bytes is 0 (nothing is
 * copied then); -2 when a thread could not allocate its bounce (some values are not copied). Threads that cannot be started are not an error: the calling thread does
 * their share. */
int pagekv_copy_verify(const pagekv_piece *pieces, uint64_t npieces, pagekv_value *values,
                       uint64_t nvalues, uint64_t block_bytes, int threads) {
    if (block_bytes == 0) return -1;
    for (uint64_t v = 0; v < nvalues; v++) {
        if (values[v].first > npieces || values[v].count > npieces - values[v].first) return -1;
    }
    job_t job = {pieces, values, nvalues, block_bytes, 0, 0};
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
    return atomic_load(&job.failed) ? -2 : 0;
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

/* A receive's deadline (CLOCK_MONOTONIC ns; 0: none) and the SO_RCVTIMEO last set for it. */
typedef struct {
    uint64_t deadline, armed;
} recv_clock;

/* Before each receive: -ETIMEDOUT once the deadline has passed; else the socket's SO_RCVTIMEO
 * comes down to the time left whenever that is an eighth below what was set. One receive ends
 * at most an eighth of the time left after the deadline, however the bytes trickle in; a call
 * that takes a small part of its time sets it once. */
static int arm(int fd, recv_clock *c) {
    if (c->deadline == 0) return 0;
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    uint64_t now = (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
    if (now >= c->deadline) return -ETIMEDOUT;
    uint64_t left = c->deadline - now;
    if (c->armed && left > c->armed - c->armed / 8) return 0;
    struct timeval tv = {.tv_sec = (time_t)(left / 1000000000u),
                         .tv_usec = (suseconds_t)(left % 1000000000u / 1000u)};
    if (tv.tv_sec == 0 && tv.tv_usec == 0) tv.tv_usec = 1; /* 0 would wait for ever */
    if (setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv) != 0) return -errno;
    c->armed = left;
    return 0;
}

/* recv exactly n bytes into buf (retrying after EINTR and short returns, while the clock
 * allows): 0, 1 on EOF, or -errno. *received counts what arrived. */
static int recv_all(int fd, unsigned char *buf, uint64_t n, uint64_t *received,
                    recv_clock *clock) {
    uint64_t got = 0;
    while (got < n) {
        int armed = arm(fd, clock);
        if (armed != 0) return armed;
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

/* The receive's chunks: each large piece's chunks land in the bounce's slots in turn, small
 * pieces' in place; each chunk received is handed on (hand_over) to be hashed and, from a slot,
 * streamed into place (do_chunk), in order. With a helper (pagekv_recv_verify with a bounce of
 * two chunks or more) the receiving thread only receives and a helper thread does the rest: a
 * slot is received into again only once the helper is done with the chunk it held, and the
 * hasher is the helper's alone until it is joined. Without one (q NULL, one slot) the
 * receiving thread does each chunk itself before it receives the next. */
#define HANDOFF_RING 64 /* chunks handed over and not yet done */
#define MAX_SLOTS 64

typedef struct {
    unsigned char *at;  /* where the bytes landed: a bounce slot, or their place */
    unsigned char *dst; /* their place when they landed in a slot, else NULL */
    uint64_t n;
    unsigned char begins, ends, hash; /* its piece's first / last chunk; hash its bytes */
} chunk_t;

typedef struct {
    pthread_mutex_t lock;
    pthread_cond_t more; /* the helper waits: a chunk handed over, or the end */
    pthread_cond_t room; /* the receiver waits: a chunk done */
    chunk_t ring[HANDOFF_RING];
    uint64_t given, done; /* chunks handed over / done, under lock */
    int end;
    hasher_t *h;
} handoff_t;

static void do_chunk(hasher_t *h, const chunk_t *c) {
    if (c->begins) hasher_piece_begins(h);
    if (c->hash) hasher_update(h, c->at, c->n);
    if (c->dst != NULL) copy_out(c->dst, c->at, c->n);
    if (c->ends) hasher_piece_ends(h);
}

static void *helper(void *arg) {
    handoff_t *q = (handoff_t *)arg;
    pthread_mutex_lock(&q->lock);
    for (;;) {
        while (q->done == q->given && !q->end) pthread_cond_wait(&q->more, &q->lock);
        if (q->done == q->given) break; /* the end, and nothing left */
        chunk_t c = q->ring[q->done % HANDOFF_RING];
        pthread_mutex_unlock(&q->lock);
        do_chunk(q->h, &c);
        pthread_mutex_lock(&q->lock);
        q->done++;
        pthread_cond_signal(&q->room);
    }
    pthread_mutex_unlock(&q->lock);
    return NULL;
}

/* Before a receive: wait until the first `upto` chunks handed over are done and the ring has
 * room; returns the sequence number the next chunk will get (0 without a helper). */
static uint64_t make_room(handoff_t *q, uint64_t upto) {
    if (q == NULL) return 0;
    pthread_mutex_lock(&q->lock);
    if (q->given + 1 > HANDOFF_RING && upto < q->given + 1 - HANDOFF_RING)
        upto = q->given + 1 - HANDOFF_RING;
    while (q->done < upto) pthread_cond_wait(&q->room, &q->lock);
    uint64_t seq = q->given;
    pthread_mutex_unlock(&q->lock);
    return seq;
}

static void hand_over(handoff_t *q, hasher_t *h, chunk_t c) {
    if (q == NULL) {
        do_chunk(h, &c);
        return;
    }
    pthread_mutex_lock(&q->lock);
    q->ring[q->given % HANDOFF_RING] = c;
    q->given++;
    pthread_cond_signal(&q->more);
    pthread_mutex_unlock(&q->lock);
}

/* pagekv_recv_verify's receiving loop (see chunk_t above); `slots` bounce slots of `chunk`
 * bytes (1 without a helper). Returns as pagekv_recv_verify; with a helper, what it was handed
 * is done only once it is joined. */
static int recv_chunks(int fd, const pagekv_piece *pieces, uint64_t npieces, uint64_t chunk,
                       unsigned char *bounce, uint64_t slots, uint64_t *received, hasher_t *h,
                       handoff_t *q, recv_clock *clock) {
    uint64_t slot_user[MAX_SLOTS] = {0}; /* 1 + the chunk that last used each slot, 0: none */
    uint64_t slot = 0;
    for (uint64_t p = 0; p < npieces; p++) {
        unsigned char *dst = (unsigned char *)pieces[p].dst;
        uint64_t n = pieces[p].nbytes;
        int bounced = n >= BOUNCE_MIN_BYTES;
        if (n == 0) hand_over(q, h, (chunk_t){dst, NULL, 0, 1, 1, 1});
        for (uint64_t off = 0; off < n; off += chunk) {
            uint64_t want = n - off < chunk ? n - off : chunk, before = *received;
            unsigned char *at = bounced ? bounce + slot * chunk : dst + off;
            uint64_t seq = make_room(q, bounced ? slot_user[slot] : 0);
            int rc = recv_all(fd, at, want, received, clock);
            if (rc != 0) { /* what arrived of this chunk still goes into place */
                if (bounced && *received > before)
                    hand_over(q, h, (chunk_t){at, dst + off, *received - before, 0, 0, 0});
                return rc;
            }
            hand_over(q, h, (chunk_t){at, bounced ? dst + off : NULL, want, off == 0,
                                      off + want == n, 1});
            if (bounced) {
                slot_user[slot] = seq + 1;
                slot = (slot + 1) % slots;
            }
        }
    }
    return 0;
}

/* Whether a receive's arguments are usable: values covering the pieces in order, a chunk of
 * at least a byte, a bounce of at least a chunk (see pagekv_recv_verify). */
static int recv_args_ok(const pagekv_value *values, uint64_t nvalues, uint64_t npieces,
                        uint64_t chunk_bytes, const unsigned char *bounce, uint64_t bounce_bytes) {
    return chunk_bytes != 0 && values_cover(values, nvalues, npieces) && bounce != NULL &&
           bounce_bytes >= chunk_bytes;
}

/* pagekv_recv_verify's work once its arguments are checked (see there). */
static int recv_values(int fd, const pagekv_piece *pieces, uint64_t npieces,
                       pagekv_value *values, uint64_t nvalues, uint64_t chunk_bytes,
                       unsigned char *bounce, uint64_t bounce_bytes, uint64_t deadline_ns,
                       uint64_t *received) {
    hasher_t h = {.values = values, .nvalues = nvalues};
    uint64_t slots = bounce_bytes / chunk_bytes, to_bounce = 0;
    if (slots > MAX_SLOTS) slots = MAX_SLOTS;
    for (uint64_t p = 0; p < npieces; p++)
        if (pieces[p].nbytes >= BOUNCE_MIN_BYTES) to_bounce += pieces[p].nbytes;
    handoff_t q = {.given = 0, .done = 0, .end = 0, .h = &h};
    pthread_mutex_init(&q.lock, NULL);
    pthread_cond_init(&q.more, NULL);
    pthread_cond_init(&q.room, NULL);
    pthread_t id; /* no thread to be had: this one does all of it */
    int helped = slots >= 2 && to_bounce >= 2 * chunk_bytes &&
                 pthread_create(&id, NULL, helper, &q) == 0;
    recv_clock clock = {.deadline = deadline_ns, .armed = 0};
    int rc = recv_chunks(fd, pieces, npieces, chunk_bytes, bounce, helped ? slots : 1, received,
                         &h, helped ? &q : NULL, &clock);
    if (helped) {
        pthread_mutex_lock(&q.lock);
        q.end = 1;
        pthread_cond_signal(&q.more);
        pthread_mutex_unlock(&q.lock);
        pthread_join(id, NULL);
    }
    pthread_cond_destroy(&q.room);
    pthread_cond_destroy(&q.more);
    pthread_mutex_destroy(&q.lock);
    if (rc == 0) hasher_finish(&h);
    return rc;
}

/* Receive `npieces` pieces, in order, from the connected blocking socket `fd`, each into its
 * place (pieces[k].dst, pieces[k].nbytes; src is not used), `chunk_bytes` at a time (recv with
 * MSG_WAITALL). Pieces of at least BOUNCE_MIN_BYTES are received chunk by chunk into `bounce`
 * (at least `chunk_bytes`, the caller's, touched by no one else during the call), which stays
 * in the cache, hashed there and streamed into place (copy_out): the kernel's copy out of the
 * socket never waits on destination lines that are in no cache, and the destination is
 * written once, never read. Smaller pieces land in place and are hashed there. With a bounce
 * of two chunks or more and at least two chunks to bounce, a helper thread, started for the
 * call, hashes and streams while this thread receives the next chunks into the other slots
 * (handoff_t); else this thread does all of it in turn. With `nvalues` > 0 the values
 * (consecutive runs of pieces that together cover all of them, in order) are hashed as they
 * arrive; digests as pagekv_copy_verify's. Without values nothing is hashed.
 *
 * Returns 0 when every byte arrived; 1 when the peer closed the connection (or it was shut
 * down) before; -errno for a failed receive (-EAGAIN / -EWOULDBLOCK: the socket's SO_RCVTIMEO
 * passed with nothing read in one receive; -ETIMEDOUT: `deadline_ns`, a CLOCK_MONOTONIC time
 * (0: none), passed, or will within one receive: see arm; the socket's SO_RCVTIMEO is then
 * left lowered); -EINVAL, before anything is read, for values that
 * do not cover the pieces in order, a chunk_bytes of 0, or a bounce that is NULL or smaller
 * than a chunk.
 * `*received`: the bytes received before the return, every one of them in its place (also
 * those of a chunk the failure cut short). A receive interrupted by a signal is retried.
 * Nothing writes to the pieces or the bounce after the return. */
int pagekv_recv_verify(int fd, const pagekv_piece *pieces, uint64_t npieces,
                       pagekv_value *values, uint64_t nvalues, uint64_t chunk_bytes,
                       unsigned char *bounce, uint64_t bounce_bytes, uint64_t deadline_ns,
                       uint64_t *received) {
    *received = 0;
    if (!recv_args_ok(values, nvalues, npieces, chunk_bytes, bounce, bounce_bytes)) return -EINVAL;
    return recv_values(fd, pieces, npieces, values, nvalues, chunk_bytes, bounce, bounce_bytes,
                       deadline_ns, received);
}

/* A bulk-lane message's framing (pagekv.store.wire.lane): a prefix "<4sIIQ" (magic, header
 * bytes, frame count, payload bytes), the frames' sizes "<{count}Q", the header, the frames. */
#define LANE_PREFIX 20u

static uint64_t le_bytes(const unsigned char *p, int n) {
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; i--) v = v << 8 | p[i];
    return v;
}

/* One bulk-lane message from the connected blocking socket `fd`, in one call (the GIL released
 * for all of it): its prefix, sizes and header into `head` (head_cap bytes, at least
 * LANE_PREFIX), each receive waiting as the socket's SO_RCVTIMEO says; then, when its frames
 * are exactly `pieces` (as many, each of the same size: the caller's destinations for the
 * message it expects) and there are any, its payload into them as pagekv_recv_verify receives
 * it (`values` hashed, `deadline_ns` for the payload) and `*landed` = 1. Otherwise the payload
 * is left on the socket for the caller.
 * Limits, checked before what they bound is read: header bytes <= max_header, frames <=
 * max_frames, payload bytes <= max_payload; each frame <= max_frame_bytes and the sizes
 * adding up to the payload's bytes.
 * Returns 0 (the head in head[0 .. *head_bytes)); 1: the connection ended (closed, shut down
 * or reset) before any byte of the message; 2: it ended mid-message; 3: not this framing (only
 * the prefix was read); 4: over a limit (only the prefix, or the prefix and the sizes, were
 * read); 5: the head is larger than head_cap (only the prefix was read, into head;
 * *head_bytes is its size); -errno: a receive failed (-EAGAIN / -EWOULDBLOCK: SO_RCVTIMEO
 * passed with nothing read in one receive; `*received` tells whether any byte had come) or, as
 * pagekv_recv_verify's, the payload's. `*received`: the bytes of the message received. */
int pagekv_recv_message(int fd, unsigned char *head, uint64_t head_cap, uint64_t max_header,
                        uint64_t max_frames, uint64_t max_frame_bytes, uint64_t max_payload,
                        const pagekv_piece *pieces, uint64_t npieces, pagekv_value *values,
                        uint64_t nvalues, uint64_t chunk_bytes, unsigned char *bounce,
                        uint64_t bounce_bytes, uint64_t deadline_ns, uint64_t *head_bytes,
                        uint64_t *received, int *landed) {
    *head_bytes = 0;
    *received = 0;
    *landed = 0;
    if (head == NULL || head_cap < LANE_PREFIX) return -EINVAL;
    if (npieces && !recv_args_ok(values, nvalues, npieces, chunk_bytes, bounce, bounce_bytes))
        return -EINVAL;
    recv_clock socket_timeout = {.deadline = 0, .armed = 0};
    int rc = recv_all(fd, head, LANE_PREFIX, received, &socket_timeout);
    if (rc != 0) {
        if (*received == 0 && (rc == 1 || rc == -ECONNRESET)) return 1;
        return rc == 1 ? 2 : rc;
    }
    if (memcmp(head, "PKB1", 4) != 0) return 3;
    uint64_t header = le_bytes(head + 4, 4), count = le_bytes(head + 8, 4);
    uint64_t payload = le_bytes(head + 12, 8);
    if (header > max_header || count > max_frames || payload > max_payload) return 4;
    uint64_t need = LANE_PREFIX + 8 * count + header;
    *head_bytes = need;
    if (need > head_cap) return 5;
    rc = recv_all(fd, head + LANE_PREFIX, need - LANE_PREFIX, received, &socket_timeout);
    if (rc != 0) return rc == 1 ? 2 : rc;
    uint64_t sum = 0;
    int expected = count == npieces;
    for (uint64_t i = 0; i < count; i++) {
        uint64_t size = le_bytes(head + LANE_PREFIX + 8 * i, 8);
        if (size > max_frame_bytes) return 4;
        sum += size; /* at most max_frames * max_frame_bytes: no overflow */
        if (expected && size != pieces[i].nbytes) expected = 0;
    }
    if (sum != payload) return 4;
    if (!expected || count == 0) return 0;
    uint64_t head_received = *received, got = 0;
    rc = recv_values(fd, pieces, npieces, values, nvalues, chunk_bytes, bounce, bounce_bytes,
                     deadline_ns, &got);
    *received = head_received + got;
    if (rc != 0) return rc == 1 ? 2 : rc;
    *landed = 1;
    return 0;
}
