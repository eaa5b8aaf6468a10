/* Would a node that hands the kernel references to its blocks' pages (vmsplice into a pipe,
 * splice into the socket: no copy on the sending side) move more over loopback than one that
 * send()s them (issue 29's 8-stream GET)? K process pairs, each sender with 256 MiB of blocks
 * of its own (cold: every byte read once a round), each receiver into one 2 MiB buffer that
 * stays in cache (as pagekv's bounce) or into 256 MiB of its own (cold). Modes interleaved,
 * 3 rounds of each, GB/s of all K together. With the argument "threads" the K senders are
 * threads of one process (as a node's lane connections), else K processes.
 *   gcc -O2 -pthread -o /tmp/diag_splice_send scripts/diag_splice_send.c && /tmp/diag_splice_send [threads] */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define MIB (1ul << 20)
static const size_t TOTAL = 256 * MIB, RING = 2 * MIB;

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static void send_rounds(int s, int splice_mode, int reps) {
  char* src = aligned_alloc(4096, TOTAL);
  memset(src, 7, TOTAL);
  int pp[2];
  if (pipe(pp) || fcntl(pp[1], F_SETPIPE_SZ, (int)MIB) < 0) { perror("pipe"); exit(1); }
  char go;
  for (int r = 0; r < reps; ++r) {
    if (recv(s, &go, 1, MSG_WAITALL) != 1) exit(1);
    for (size_t off = 0; off < TOTAL;) {
      if (!splice_mode) {
        ssize_t n = send(s, src + off, TOTAL - off, 0);
        if (n <= 0) { perror("send"); exit(1); }
        off += n;
        continue;
      }
      struct iovec v = {src + off, TOTAL - off > MIB ? MIB : TOTAL - off};
      ssize_t n = vmsplice(pp[1], &v, 1, 0);
      if (n <= 0) { perror("vmsplice"); exit(1); }
      for (ssize_t m = 0; m < n;) {
        ssize_t k = splice(pp[0], NULL, s, NULL, n - m, SPLICE_F_MORE | SPLICE_F_MOVE);
        if (k <= 0) { perror("splice"); exit(1); }
        m += k;
      }
      off += n;
    }
  }
  free(src);
  close(pp[0]);
  close(pp[1]);
}

struct send_args { int s, splice_mode, reps; };
static void* sender_thread(void* p) {
  struct send_args* a = p;
  send_rounds(a->s, a->splice_mode, a->reps);
  return NULL;
}

static void receiver(int c, int cold, int reps, int go_fd, int done_fd) {
  size_t size = cold ? TOTAL : RING;
  char* dst = aligned_alloc(4096, size);
  memset(dst, 1, size);
  for (int r = 0; r < reps; ++r) {
    char go = 1;
    if (read(go_fd, &go, 1) != 1 || send(c, &go, 1, 0) != 1) exit(1);
    for (size_t got = 0; got < TOTAL;) {
      size_t at = cold ? got : got % RING, room = cold ? TOTAL - got : RING - at;
      ssize_t n = recv(c, dst + at, room, 0);
      if (n <= 0) { perror("recv"); exit(1); }
      got += n;
    }
    if (write(done_fd, &go, 1) != 1) exit(1);
  }
  exit(0);
}

/* K pairs, `reps` rounds started together; GB/s of all K, the mean of the rounds after the
   first (which touches the buffers) */
static double run(int k, int splice_mode, int cold, int threads) {
  const int reps = 4;
  int done[2], go[2];
  if (pipe(done) || pipe(go)) exit(1);
  fflush(stdout);
  pid_t pids[128];
  int socks[64];
  int n = 0;
  for (int i = 0; i < k; ++i) {
    int ls = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(0x7f000001)};
    socklen_t al = sizeof a;
    if (bind(ls, (void*)&a, sizeof a) || listen(ls, 1) || getsockname(ls, (void*)&a, &al)) exit(1);
    if (!(pids[n++] = fork())) {
      int c = socket(AF_INET, SOCK_STREAM, 0);
      if (connect(c, (void*)&a, sizeof a)) exit(1);
      receiver(c, cold, reps, go[0], done[1]);
    }
    socks[i] = accept(ls, NULL, NULL);
    close(ls);
    if (!threads && !(pids[n++] = fork())) {
      send_rounds(socks[i], splice_mode, reps);
      exit(0);
    }
  }
  if (threads && !(pids[n++] = fork())) { /* one process, a thread per connection (a node) */
    pthread_t t[64];
    struct send_args args[64];
    for (int i = 0; i < k; ++i) {
      args[i] = (struct send_args){socks[i], splice_mode, reps};
      pthread_create(&t[i], NULL, sender_thread, &args[i]);
    }
    for (int i = 0; i < k; ++i) pthread_join(t[i], NULL);
    exit(0);
  }
  for (int i = 0; i < k; ++i) close(socks[i]);
  double gbps = 0;
  char b = 1;
  for (int r = 0; r < reps; ++r) {
    double t0 = now();
    for (int i = 0; i < k; ++i)
      if (write(go[1], &b, 1) != 1) exit(1);
    for (int i = 0; i < k; ++i)
      if (read(done[0], &b, 1) != 1) exit(1);
    if (r) gbps += TOTAL * (double)k / (now() - t0) / 1e9 / (reps - 1);
  }
  for (int i = 0; i < n; ++i) waitpid(pids[i], NULL, 0);
  close(done[0]);
  close(done[1]);
  close(go[0]);
  close(go[1]);
  return gbps;
}

int main(int argc, char** argv) {
  /* "threads": the senders are threads of one process, as a node's connections are */
  int threads = argc > 1 && !strcmp(argv[1], "threads");
  for (int round = 0; round < 3; ++round)
    for (int k = 1; k <= 8; k *= 8) {
      printf("round %d, %d stream(s)%s:", round, k, threads ? ", sender threads of one process" : "");
      for (int cold = 0; cold < 2; ++cold)
        for (int mode = 0; mode < 2; ++mode)
          printf(" %s into %s %.2f |", mode ? "vmsplice" : "send", cold ? "cold" : "cached", run(k, mode, cold, threads));
      printf("\n");
      fflush(stdout);
    }
  return 0;
}
