/*
 * client.c - op interpreter shared by the C test clients.
 *
 * Usage: client_X OP [ARGS] [OP [ARGS]...]; one result line per op on stdout,
 * flushed after each line so a test can watch a running client.
 *   init                 -> init rc=N
 *   ctx DEV              -> ctx rc=N          (retain primary ctx, make current)
 *   alloc SIZE           -> alloc rc=N slot=K ptr=0xP        (cuMemAlloc_v2)
 *   alloc1 SIZE          -> alloc1 rc=N slot=K ptr=0xP canary=ok|BROKEN (v1 ABI)
 *   free SLOT            -> free rc=N                         (cuMemFree_v2)
 *   free1 SLOT           -> free1 rc=N                        (cuMemFree, v1)
 *   freeptr HEX          -> freeptr rc=N                      (cuMemFree_v2)
 *   info                 -> info rc=N free=F total=T          (cuMemGetInfo_v2)
 *   info1                -> info1 rc=N free=F total=T         (cuMemGetInfo, v1)
 *   infonull             -> info rc=N           (cuMemGetInfo_v2(NULL, NULL))
 *   race T               -> race ok=N fail=M   (T threads make their first driver calls at once)
 *   version              -> version rc=N v=V                  (cuDriverGetVersion)
 *   total DEV            -> total rc=N bytes=B                (cuDeviceTotalMem_v2)
 *   stats DEV            -> stats alloc_calls=.. free_calls=.. bytes_held=..
 *                           live_allocs=.. peak=.. total=..   (fake's own view)
 *   calls NAME           -> calls name=NAME n=N  (how often the fake's NAME ran: reached the driver)
 *   threads T N MAX SEED -> threads ok=A oom=O other=E
 *   bench N SIZE         -> bench ns_per_pair=X errors=E ns_per_pair_cpu=C (C: this process's
 *                           CPU time, so time spent descheduled is not in it)
 *   sleep MS             -> sleep ok
 *   bg N OP...           -> (nothing) the next N words run as ops in a new thread, at once;
 *                           the main thread goes on with the ops after them
 *   join                 -> join ok   (waits for every bg thread)
 *   exitsleep MS         -> exitsleep ok; at exit (after handlers registered later, such as
 *                           vramcap's, have run) prints "exiting" and sleeps MS while still
 *                           holding its memory, like a C++ destructor or a slow atexit handler
 *   record N MAX HOLD_US SEED -> one "held t0=.. t1=.. size=.." line per granted allocation
 *                           (CLOCK_MONOTONIC ns: t0 after cuMemAlloc_v2 returned, t1 before
 *                           cuMemFree_v2 is called; the memory is certainly held in between),
 *                           then record ok=A oom=O other=E. Sizes 1..MAX, holds 0..HOLD_US.
 *   (pitch, managed, VMM, pools, arrays, contexts, host memory: see client_ops.c and ops_ctx.c;
 *   fork/exec/signals/soak under load: see ops_faults.c)
 * SIZE: integer with optional k/m/g/t suffix (binary; "i", "b", "ib" allowed).
 * Slots number every alloc/alloc1 from 0, failed ones included (ptr 0).
 * Bad usage: message on stderr, exit status 2.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdarg.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "client.h"
#include "fakecuda.h"
#include "size_suffix.h"

static const struct cu_api *A;

static unsigned long long *g_slots;
static size_t g_nslots, g_capslots;

static void die(const char *fmt, const char *arg)
{
    fprintf(stderr, "client: ");
    fprintf(stderr, fmt, arg);
    fputc('\n', stderr);
    exit(2);
}

void client_need(const void *fn, const char *what)
{
    if (!fn) {
        fprintf(stderr, "client: cannot resolve %s\n", what);
        exit(3);
    }
}

/* One result line, flushed (tests read them as they come). */
void client_printf(const char *fmt, ...)
{
    va_list ap;

    va_start(ap, fmt);
    vprintf(fmt, ap);
    va_end(ap);
    putchar('\n');
    fflush(stdout);
}
#define out client_printf

static unsigned long long parse_size(const char *s)
{
    unsigned long long v;
    char *end;
    int shift = 0;

    errno = 0;
    if (!s || *s < '0' || *s > '9')
        die("bad size '%s'", s ? s : "(missing)");
    v = strtoull(s, &end, 10);
    shift = size_suffix_shift((const char **)&end);
    if (errno || *end || (shift && v > (~0ULL >> shift)))
        die("bad size '%s'", s);
    return v << shift;
}

static long parse_long(const char *s)
{
    char *end;
    long v;

    if (!s)
        die("missing argument%s", "");
    errno = 0;
    v = strtol(s, &end, 10);
    if (errno || *end || end == s)
        die("bad integer '%s'", s);
    return v;
}

static size_t new_slot(unsigned long long p);
static unsigned long long slot_ptr(const char *s);
static unsigned long long new_slot_ull(unsigned long long p) { return new_slot(p); }

static size_t new_slot(unsigned long long p)
{
    if (g_nslots == g_capslots) {
        g_capslots = g_capslots ? 2 * g_capslots : 64;
        g_slots = realloc(g_slots, g_capslots * sizeof *g_slots);
        if (!g_slots)
            die("out of memory%s", "");
    }
    g_slots[g_nslots] = p;
    return g_nslots++;
}

static unsigned long long slot_ptr(const char *s)
{
    long k = parse_long(s);

    if (k < 0 || (size_t)k >= g_nslots)
        die("no such slot '%s'", s);
    return g_slots[k];
}

/* ------------------------------------------------------------- threads */

struct thr {
    CUcontext ctx;
    unsigned long long n, maxsize, seed;
    unsigned long long ok, oom, other;
};

static unsigned long long rng(unsigned long long *s)
{
    /* xorshift64* */
    *s ^= *s >> 12;
    *s ^= *s << 25;
    *s ^= *s >> 27;
    return *s * 0x2545f4914f6cdd1dULL;
}

static void *thr_main(void *arg)
{
    struct thr *t = arg;
    CUdeviceptr live[64];
    int nlive = 0;
    unsigned long long s = t->seed;

    /* The current context is per thread: adopt the spawning thread's. */
    if (t->ctx)
        A->cuCtxSetCurrent(t->ctx);
    for (unsigned long long i = 0; i < t->n; i++) {
        unsigned long long r = rng(&s);

        if (nlive == 64 || (nlive > 0 && (r & 1))) {
            int k = (int)((r >> 1) % (unsigned long long)nlive);
            if (A->cuMemFree_v2(live[k]) != CUDA_SUCCESS)
                t->other++;
            live[k] = live[--nlive];
        } else {
            CUdeviceptr p = 0;
            size_t sz = (size_t)(1 + (r >> 8) % t->maxsize);
            CUresult rc = A->cuMemAlloc_v2(&p, sz);

            if (rc == CUDA_SUCCESS) {
                t->ok++;
                live[nlive++] = p;
            } else if (rc == CUDA_ERROR_OUT_OF_MEMORY) {
                t->oom++;
            } else {
                t->other++;
            }
        }
    }
    while (nlive > 0)
        if (A->cuMemFree_v2(live[--nlive]) != CUDA_SUCCESS)
            t->other++;
    return NULL;
}

/* race T: T threads released together make their first driver calls at the same instant
 * (cuInit, primary context, alloc, free): the preload's lazy initialisation races itself. */
static pthread_barrier_t race_barrier;
static int race_ok, race_fail;
static pthread_mutex_t race_mu = PTHREAD_MUTEX_INITIALIZER;

static void *race_worker(void *arg)
{
    CUcontext c = NULL;
    CUdeviceptr p = 0;
    int ok;
    (void)arg;
    pthread_barrier_wait(&race_barrier);
    ok = A->cuInit(0) == CUDA_SUCCESS
        && A->cuDevicePrimaryCtxRetain(&c, 0) == CUDA_SUCCESS
        && A->cuCtxSetCurrent(c) == CUDA_SUCCESS
        && A->cuMemAlloc_v2(&p, 1 << 20) == CUDA_SUCCESS
        && A->cuMemFree_v2(p) == CUDA_SUCCESS;
    pthread_mutex_lock(&race_mu);
    if (ok)
        race_ok++;
    else
        race_fail++;
    pthread_mutex_unlock(&race_mu);
    return NULL;
}

static void op_race(long nt)
{
    pthread_t th[256];
    if (nt < 1 || nt > 256)
        die("race: 1..256 threads, not '%s'", "out of range");
    pthread_barrier_init(&race_barrier, NULL, (unsigned)nt);
    for (long i = 0; i < nt; i++)
        pthread_create(&th[i], NULL, race_worker, NULL);
    for (long i = 0; i < nt; i++)
        pthread_join(th[i], NULL);
    pthread_barrier_destroy(&race_barrier);
    out("race ok=%d fail=%d", race_ok, race_fail);
}

static void op_threads(long nt, unsigned long long n, unsigned long long maxsize,
                       unsigned long long seed)
{
    pthread_t *tid;
    struct thr *t;
    CUcontext ctx = NULL;
    unsigned long long ok = 0, oom = 0, other = 0;

    if (nt <= 0 || nt > 1024 || maxsize == 0)
        die("bad threads arguments%s", "");
    A->cuCtxGetCurrent(&ctx);
    tid = calloc((size_t)nt, sizeof *tid);
    t = calloc((size_t)nt, sizeof *t);
    if (!tid || !t)
        die("out of memory%s", "");
    for (long i = 0; i < nt; i++) {
        t[i].ctx = ctx;
        t[i].n = n;
        t[i].maxsize = maxsize;
        t[i].seed = (seed + 1) * 0x9e3779b97f4a7c15ULL + (unsigned long long)i * 0xbf58476d1ce4e5b9ULL + 1;
        if (pthread_create(&tid[i], NULL, thr_main, &t[i]))
            die("pthread_create failed%s", "");
    }
    for (long i = 0; i < nt; i++) {
        pthread_join(tid[i], NULL);
        ok += t[i].ok;
        oom += t[i].oom;
        other += t[i].other;
    }
    free(tid);
    free(t);
    out("threads ok=%llu oom=%llu other=%llu", ok, oom, other);
}

static void op_bench(unsigned long long n, unsigned long long size)
{
    struct timespec a, b, ca, cb;
    unsigned long long errors = 0;
    double ns, cpu;

    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ca);
    clock_gettime(CLOCK_MONOTONIC, &a);
    for (unsigned long long i = 0; i < n; i++) {
        CUdeviceptr p = 0;

        if (A->cuMemAlloc_v2(&p, (size_t)size) != CUDA_SUCCESS) {
            errors++;
            continue;
        }
        if (A->cuMemFree_v2(p) != CUDA_SUCCESS)
            errors++;
    }
    clock_gettime(CLOCK_MONOTONIC, &b);
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &cb);
    ns = (double)(b.tv_sec - a.tv_sec) * 1e9 + (double)(b.tv_nsec - a.tv_nsec);
    cpu = (double)(cb.tv_sec - ca.tv_sec) * 1e9 + (double)(cb.tv_nsec - ca.tv_nsec);
    out("bench ns_per_pair=%.1f errors=%llu ns_per_pair_cpu=%.1f", n ? ns / (double)n : 0.0, errors,
        n ? cpu / (double)n : 0.0);
}

static unsigned long long now_ns(void)
{
    struct timespec t;

    clock_gettime(CLOCK_MONOTONIC, &t);
    return (unsigned long long)t.tv_sec * 1000000000ULL + (unsigned long long)t.tv_nsec;
}

static long g_exit_sleep_ms;

static void exit_sleep(void)
{
    struct timespec ts = { g_exit_sleep_ms / 1000, (g_exit_sleep_ms % 1000) * 1000000L };
    out("exiting");
    nanosleep(&ts, NULL);
}

/* What this process holds over time, for checks that must not trust the ledger. */
static void op_record(unsigned long long n, unsigned long long maxsize, unsigned long long hold_us,
                      unsigned long long seed)
{
    unsigned long long s = seed * 0x9e3779b97f4a7c15ULL + 1, ok = 0, oom = 0, other = 0;

    if (maxsize == 0)
        die("record: MAX must be positive%s", "");
    for (unsigned long long i = 0; i < n; i++) {
        CUdeviceptr p = 0;
        size_t sz = (size_t)(1 + rng(&s) % maxsize);
        CUresult rc = A->cuMemAlloc_v2(&p, sz);

        if (rc == CUDA_ERROR_OUT_OF_MEMORY) {
            oom++;
            continue;
        }
        if (rc != CUDA_SUCCESS) {
            other++;
            continue;
        }
        unsigned long long t0 = now_ns();
        unsigned long long us = hold_us ? rng(&s) % (hold_us + 1) : 0;
        struct timespec ts = { (time_t)(us / 1000000), (long)(us % 1000000) * 1000L };
        nanosleep(&ts, NULL);
        unsigned long long t1 = now_ns();
        if (A->cuMemFree_v2(p) != CUDA_SUCCESS)
            other++;
        ok++;
        out("held t0=%llu t1=%llu size=%zu", t0, t1, sz);
    }
    out("record ok=%llu oom=%llu other=%llu", ok, oom, other);
}

/* The fake's own counters, read below any interposer. */
static void op_stats(long dev)
{
    int (*stats)(int, fakecuda_stats_t *);
    fakecuda_stats_t s;
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);

    stats = h ? (int (*)(int, fakecuda_stats_t *))dlsym(h, "fakecuda_stats") : NULL;
    if (!stats || stats((int)dev, &s) != 0) {
        out("stats rc=-1");
        return;
    }
    out("stats alloc_calls=%llu free_calls=%llu bytes_held=%llu live_allocs=%llu peak=%llu total=%llu",
        s.alloc_calls, s.free_calls, s.bytes_held, s.live_allocs, s.peak_bytes, s.total_bytes);
}

/* How often the fake driver's exported NAME was called, read below any interposer. */
static void op_calls(const char *name)
{
    unsigned long long (*calls)(const char *);
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);

    calls = h ? (unsigned long long (*)(const char *))dlsym(h, "fakecuda_calls") : NULL;
    if (!calls) {
        out("calls rc=-1");
        return;
    }
    out("calls name=%s n=%llu", name, calls(name));
}

const struct cu_api *client_A;

/* bg: ops run by another thread while the main thread runs its own (issue 24's attacks: what
 * another thread does while a context is measured). */
struct bg { const struct cu_api *api; int argc; char **argv; };
static pthread_t g_bg[16];
static struct bg g_bgs[16];
static int g_nbg;

static void *bg_main(void *p)
{
    struct bg *b = p;
    client_run(b->api, b->argc, b->argv);
    return NULL;
}

unsigned long long client_parse_size(const char *s) { return parse_size(s); }
long client_parse_long(const char *s) { return parse_long(s); }

int client_run(const struct cu_api *api, int argc, char **argv)
{
    A = api;
    client_A = api;
    for (int i = 1; i < argc; i++) {
        const char *op = argv[i];
#define ARG() (i + 1 < argc ? argv[++i] : (die("missing argument to %s", op), (char *)NULL))

        if (!strcmp(op, "init")) {
            out("init rc=%d", A->cuInit(0));
        } else if (!strcmp(op, "ctx")) {
            CUcontext c = NULL;
            CUresult rc = A->cuDevicePrimaryCtxRetain(&c, (CUdevice)parse_long(ARG()));
            if (rc == CUDA_SUCCESS)
                rc = A->cuCtxSetCurrent(c);
            out("ctx rc=%d", rc);
        } else if (!strcmp(op, "alloc")) {
            CUdeviceptr p = 0;
            CUresult rc = A->cuMemAlloc_v2(&p, (size_t)parse_size(ARG()));
            if (rc != CUDA_SUCCESS)
                p = 0;
            size_t k = new_slot(p);
            out("alloc rc=%d slot=%zu ptr=0x%llx", rc, k, p);
        } else if (!strcmp(op, "alloc1")) {
            /* The driver must write exactly 32 bits: a canary follows. */
            struct { CUdeviceptr_v1 p; volatile int canary; } s = { 0, 0x5a5aa5a5 };
            unsigned long long sz = parse_size(ARG());
            CUresult rc;
            if (sz > 0xffffffffULL)
                die("alloc1 size over 32 bits%s", "");
            rc = A->cuMemAlloc(&s.p, (unsigned int)sz);
            unsigned long long p = rc == CUDA_SUCCESS ? s.p : 0;
            size_t k = new_slot(p);
            out("alloc1 rc=%d slot=%zu ptr=0x%llx canary=%s", rc, k, p,
                s.canary == 0x5a5aa5a5 ? "ok" : "BROKEN");
        } else if (!strcmp(op, "free")) {
            out("free rc=%d", A->cuMemFree_v2((CUdeviceptr)slot_ptr(ARG())));
        } else if (!strcmp(op, "free1")) {
            out("free1 rc=%d", A->cuMemFree((CUdeviceptr_v1)slot_ptr(ARG())));
        } else if (!strcmp(op, "freeptr")) {
            const char *s = ARG();
            char *end;
            unsigned long long p;
            errno = 0;
            p = strtoull(s, &end, 16);
            if (errno || *end || end == s)
                die("bad hex pointer '%s'", s);
            out("freeptr rc=%d", A->cuMemFree_v2((CUdeviceptr)p));
        } else if (!strcmp(op, "info")) {
            size_t f = 0, t = 0;
            CUresult rc = A->cuMemGetInfo_v2(&f, &t);
            out("info rc=%d free=%zu total=%zu", rc, f, t);
        } else if (!strcmp(op, "info1")) {
            unsigned int f = 0, t = 0;
            CUresult rc = A->cuMemGetInfo(&f, &t);
            out("info1 rc=%d free=%u total=%u", rc, f, t);
        } else if (!strcmp(op, "infonull")) {
            out("info rc=%d", A->cuMemGetInfo_v2(NULL, NULL));
        } else if (!strcmp(op, "total")) {
            size_t b = 0;
            CUresult rc = A->cuDeviceTotalMem_v2(&b, (CUdevice)parse_long(ARG()));
            out("total rc=%d bytes=%zu", rc, b);
        } else if (!strcmp(op, "race")) {
            op_race(parse_long(ARG()));
        } else if (!strcmp(op, "version")) {
            int v = 0;
            CUresult rc = A->cuDriverGetVersion(&v);
            out("version rc=%d v=%d", rc, v);
        } else if (!strcmp(op, "stats")) {
            op_stats(parse_long(ARG()));
        } else if (!strcmp(op, "calls")) {
            op_calls(ARG());
        } else if (!strcmp(op, "threads")) {
            long nt = parse_long(ARG());
            unsigned long long n = parse_size(ARG());
            unsigned long long mx = parse_size(ARG());
            unsigned long long seed = parse_size(ARG());
            op_threads(nt, n, mx, seed);
        } else if (!strcmp(op, "bench")) {
            unsigned long long n = parse_size(ARG());
            op_bench(n, parse_size(ARG()));
        } else if (!strcmp(op, "record")) {
            unsigned long long n = parse_size(ARG());
            unsigned long long mx = parse_size(ARG());
            unsigned long long hold = parse_size(ARG());
            op_record(n, mx, hold, parse_size(ARG()));
        } else if (!strcmp(op, "sleep")) {
            long ms = parse_long(ARG());
            struct timespec ts = { ms / 1000, (ms % 1000) * 1000000L };
            nanosleep(&ts, NULL);
            out("sleep ok");
        } else if (!strcmp(op, "bg")) {
            long n = parse_long(ARG());
            if (n < 1 || i + n >= argc || g_nbg >= 16)
                die("bg: bad word count%s", "");
            /* argv[i] (the count) stands for argv[0] of the thread's op list. */
            g_bgs[g_nbg] = (struct bg){ api, (int)n + 1, argv + i };
            if (pthread_create(&g_bg[g_nbg], NULL, bg_main, &g_bgs[g_nbg]))
                die("pthread_create failed%s", "");
            g_nbg++;
            i += (int)n;
        } else if (!strcmp(op, "join")) {
            for (int k = 0; k < g_nbg; k++)
                pthread_join(g_bg[k], NULL);
            g_nbg = 0;
            out("join ok");
        } else if (!strcmp(op, "poll")) {
            /* A busy job: N driver calls (cuCtxSynchronize) MS milliseconds apart. */
            long n = parse_long(ARG()), ms = parse_long(ARG());
            struct timespec ts = { ms / 1000, (ms % 1000) * 1000000L };
            for (long k = 0; k < n; k++) {
                A->cuCtxSynchronize();
                nanosleep(&ts, NULL);
            }
            out("poll ok");
        } else if (!strcmp(op, "exitsleep")) {
            g_exit_sleep_ms = parse_long(ARG());
            atexit(exit_sleep);
            out("exitsleep ok");
        } else if (client_lifecycle_op(op, &i, argc, argv)) {
            /* handled in ops_lifecycle.c */
        } else if (client_fault_op(op, &i, argc, argv, new_slot_ull)) {
            /* handled in ops_faults.c */
        } else {
            int used = client_extra_op(A, op, argc - i - 1, argv + i + 1, new_slot_ull, slot_ptr);
            if (used < 0)
                used = client_ctx_op(A, op, argc - i - 1, argv + i + 1, new_slot_ull, slot_ptr);
            if (used < 0)
                used = client_managed_op(A, op, argc - i - 1, argv + i + 1, slot_ptr);
            if (used < 0)
                die("unknown op '%s'", op);
            i += used;
        }
#undef ARG
    }
    return 0;
}
