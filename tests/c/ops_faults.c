/*
 * ops_faults.c - ops for the fault and soak tests (tests/faults.rs, scripts/soak): the job keeps
 * allocating while something hostile happens to it.
 *   forkbusy T K          -> forkbusy forks=K bad_children=B other=E
 *                            (T threads allocate and free in a loop while the main thread forks
 *                            K times; each child goes through vramcap's locks (see child_check)
 *                            and exits 0; a child that hangs is killed by the test's timeout)
 *   execchild OPS...      -> execchild status=N      (with T=4 threads allocating, a forked child
 *                            execs this client again with OPS up to the word `end`)
 *   sigstorm T N          -> sigstorm ok=A oom=O other=E signals=S
 *                            (T threads each do N alloc+free pairs while a thread sends them
 *                            SIGUSR1 continuously; the handler counts)
 *   threadleak SIZE       -> threadleak rc=N slot=K  (a thread allocates SIZE and exits holding it)
 *   soak T N SEED         -> soak ops=X ok=A oom=O other=E
 *                            (T threads × N mixed operations over every counted family: alloc
 *                            v2/v1, pitch, managed, VMM create/release, async alloc/free with
 *                            syncs, pool allocations, arrays, 3D arrays, mipmaps, host memory;
 *                            everything is freed and the pools trimmed at the end)
 *   exitbusy T MS         -> exitbusy exiting        (T threads allocate and free in a loop; after
 *                            MS ms the main thread calls exit(0) while they still run)
 *   rawfork N             -> rawfork status=N         (a child made by _Fork(), which runs no
 *                            atfork handlers, does N alloc+free pairs and exits 0)
 *   timens SECS           -> timens rc=N              (unshare(CLONE_NEWTIME) and a boot-time
 *                            offset of SECS written, without exec: the new namespace is only
 *                            the children's; this process stays in its own, and
 *                            /proc/self/timens_offsets now shows the children's offsets)
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "client.h"

#define A client_A

static atomic_int g_stop;
static atomic_ullong g_signals;

static unsigned long long xs(unsigned long long *s)
{
    *s ^= *s >> 12;
    *s ^= *s << 25;
    *s ^= *s >> 27;
    return *s * 0x2545f4914f6cdd1dULL;
}

static void fatal(const char *what)
{
    fprintf(stderr, "client: %s\n", what);
    exit(2);
}

/* ------------------------------------------------------------ busy threads */

struct busy {
    pthread_t th;
    CUcontext ctx;
    unsigned long long n; /* 0: until g_stop */
    unsigned long long ok, oom, other, seed;
};

static void *busy_main(void *p)
{
    struct busy *b = p;
    unsigned long long s = b->seed | 1;

    A->cuCtxSetCurrent(b->ctx);
    for (unsigned long long i = 0; b->n ? i < b->n : !atomic_load(&g_stop); i++) {
        CUdeviceptr d = 0;
        CUresult rc = A->cuMemAlloc_v2(&d, (size_t)(1 + xs(&s) % (1 << 20)));
        if (rc == CUDA_SUCCESS) {
            b->ok++;
            if (A->cuMemFree_v2(d) != CUDA_SUCCESS)
                b->other++;
        } else if (rc == CUDA_ERROR_OUT_OF_MEMORY) {
            b->oom++;
        } else {
            b->other++;
        }
    }
    return NULL;
}

static struct busy *start_busy(int t, unsigned long long n)
{
    struct busy *b = calloc((size_t)t, sizeof *b);
    CUcontext ctx = NULL;

    if (!b)
        fatal("out of memory");
    A->cuCtxGetCurrent(&ctx);
    atomic_store(&g_stop, 0);
    for (int i = 0; i < t; i++) {
        b[i].ctx = ctx;
        b[i].n = n;
        b[i].seed = 0x9e3779b97f4a7c15ULL * (unsigned long long)(i + 1);
        if (pthread_create(&b[i].th, NULL, busy_main, &b[i]))
            fatal("pthread_create failed");
    }
    return b;
}

static unsigned long long stop_busy(struct busy *b, int t, unsigned long long *ok, unsigned long long *oom)
{
    unsigned long long other = 0;

    atomic_store(&g_stop, 1);
    for (int i = 0; i < t; i++) {
        pthread_join(b[i].th, NULL);
        other += b[i].other;
        if (ok)
            *ok += b[i].ok;
        if (oom)
            *oom += b[i].oom;
    }
    free(b);
    return other;
}

/* --------------------------------------------------------------- fork/exec */

/* Like the real driver, the fake is not usable in a forked child (its locks may be held by a
 * thread that does not exist there), so the child goes only through vramcap's own state: a free
 * of a pointer nobody handed out takes vramcap's live-table lock (reset by its atfork handler)
 * and reaches the driver's lock-free lookup, which refuses it. */
static int child_check(void)
{
    int v = 0;
    if (A->cuDriverGetVersion(&v) != CUDA_SUCCESS || v <= 0)
        return 1;
    return A->cuMemFree_v2((CUdeviceptr)0x10) == CUDA_SUCCESS ? 4 : 0;
}

static void op_forkbusy(int t, long k)
{
    struct busy *b = start_busy(t, 0);
    long bad = 0;

    for (long i = 0; i < k; i++) {
        fflush(stdout);
        pid_t pid = fork();
        if (pid == 0)
            _exit(child_check());
        int st = -1;
        if (pid < 0 || waitpid(pid, &st, 0) != pid || !WIFEXITED(st) || WEXITSTATUS(st) != 0)
            bad++;
    }
    unsigned long long other = stop_busy(b, t, NULL, NULL);
    client_printf("forkbusy forks=%ld bad_children=%ld other=%llu", k, bad, other);
}

static void op_execchild(int argc, char **argv, int *i)
{
    char *args[64];
    int n = 0;

    args[n++] = "client";
    while (*i + 1 < argc && strcmp(argv[*i + 1], "end") != 0 && n < 63)
        args[n++] = argv[++*i];
    if (*i + 1 < argc)
        ++*i; /* `end` */
    args[n] = NULL;
    struct busy *b = start_busy(4, 0);
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        execv("/proc/self/exe", args);
        _exit(127);
    }
    int st = -1;
    waitpid(pid, &st, 0);
    unsigned long long other = stop_busy(b, 4, NULL, NULL);
    client_printf("execchild status=%d other=%llu", WIFEXITED(st) ? WEXITSTATUS(st) : -1, other);
}

/* ----------------------------------------------------------------- signals */

static void on_usr1(int sig)
{
    (void)sig;
    atomic_fetch_add_explicit(&g_signals, 1, memory_order_relaxed);
}

struct storm {
    struct busy *b;
    int t;
};

static void *storm_main(void *p)
{
    struct storm *s = p;
    while (!atomic_load(&g_stop))
        for (int i = 0; i < s->t; i++)
            pthread_kill(s->b[i].th, SIGUSR1);
    return NULL;
}

static void op_sigstorm(int t, unsigned long long n)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_usr1; /* no SA_RESTART: interrupted syscalls return EINTR */
    sigaction(SIGUSR1, &sa, NULL);
    struct busy *b = start_busy(t, n);
    struct storm s = { b, t };
    pthread_t th;
    unsigned long long ok = 0, oom = 0, other = 0;

    pthread_create(&th, NULL, storm_main, &s);
    for (int i = 0; i < t; i++) {
        pthread_join(b[i].th, NULL);
        ok += b[i].ok;
        oom += b[i].oom;
        other += b[i].other;
    }
    atomic_store(&g_stop, 1);
    pthread_join(th, NULL);
    free(b);
    client_printf("sigstorm ok=%llu oom=%llu other=%llu signals=%llu", ok, oom, other,
                  (unsigned long long)atomic_load(&g_signals));
}

/* ---------------------------------------------------------------- threads */

struct leak {
    CUcontext ctx;
    size_t size;
    CUdeviceptr p;
    CUresult rc;
};

static void *leak_main(void *p)
{
    struct leak *l = p;
    A->cuCtxSetCurrent(l->ctx);
    l->rc = A->cuMemAlloc_v2(&l->p, l->size);
    return NULL; /* exits holding the memory */
}

static void op_threadleak(unsigned long long size, unsigned long long (*new_slot)(unsigned long long))
{
    struct leak l = { NULL, (size_t)size, 0, 0 };
    pthread_t th;

    A->cuCtxGetCurrent(&l.ctx);
    pthread_create(&th, NULL, leak_main, &l);
    pthread_join(th, NULL);
    client_printf("threadleak rc=%d slot=%llu", l.rc, new_slot(l.rc ? 0 : l.p));
}

/* -------------------------------------------------------------------- soak */

enum { K_V2, K_V1, K_PITCH, K_MANAGED, K_VMM, K_ASYNC, K_POOL, K_ARRAY, K_ARRAY3D, K_MIPMAP, K_HOST, K_N };

struct soak {
    pthread_t th;
    CUcontext ctx;
    CUmemoryPool pool;
    size_t gran;
    unsigned long long n, seed, ok, oom, other;
};

static void count(struct soak *w, CUresult rc)
{
    if (rc == CUDA_SUCCESS)
        w->ok++;
    else if (rc == CUDA_ERROR_OUT_OF_MEMORY)
        w->oom++;
    else
        w->other++;
}

static CUresult soak_free(int kind, unsigned long long h)
{
    switch (kind) {
    case K_V1: return A->cuMemFree((CUdeviceptr_v1)h);
    case K_VMM: return A->cuMemRelease(h);
    case K_ASYNC: case K_POOL: return A->cuMemFreeAsync(h, NULL);
    case K_ARRAY: case K_ARRAY3D: return A->cuArrayDestroy((CUarray)(uintptr_t)h);
    case K_MIPMAP: return A->cuMipmappedArrayDestroy((CUarray)(uintptr_t)h);
    default: return A->cuMemFree_v2(h);
    }
}

static CUresult soak_alloc(struct soak *w, int kind, unsigned long long r, unsigned long long *h)
{
    size_t sz = (size_t)(1 + (r >> 16) % (256 << 10));
    CUdeviceptr p = 0;
    CUarray a = NULL;
    CUresult rc;

    switch (kind) {
    case K_V1: {
        CUdeviceptr_v1 p1 = 0;
        rc = A->cuMemAlloc(&p1, (unsigned int)(sz & 0xffff) + 1);
        *h = p1;
        return rc;
    }
    case K_PITCH: {
        size_t pitch = 0;
        rc = A->cuMemAllocPitch_v2(&p, &pitch, 1 + (r >> 20) % 4096, 1 + (r >> 32) % 64, 4);
        break;
    }
    case K_MANAGED: rc = A->cuMemAllocManaged(&p, sz, 1); break;
    case K_VMM: {
        CUmemAllocationProp prop;
        memset(&prop, 0, sizeof prop);
        prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        CUmemGenericAllocationHandle g = 0;
        rc = A->cuMemCreate(&g, w->gran, &prop, 0);
        *h = g;
        return rc;
    }
    case K_ASYNC: rc = A->cuMemAllocAsync(&p, sz, NULL); break;
    case K_POOL: rc = A->cuMemAllocFromPoolAsync(&p, sz, w->pool, NULL); break;
    case K_ARRAY: {
        CUDA_ARRAY_DESCRIPTOR d = { 1 + (r >> 20) % 512, 1 + (r >> 32) % 64, CU_AD_FORMAT_FLOAT, 1 };
        rc = A->cuArrayCreate_v2(&a, &d);
        *h = (unsigned long long)(uintptr_t)a;
        return rc;
    }
    case K_ARRAY3D: case K_MIPMAP: {
        CUDA_ARRAY3D_DESCRIPTOR d = { 1 + (r >> 20) % 256, 1 + (r >> 32) % 32, 0, CU_AD_FORMAT_FLOAT, 1, 0 };
        if (kind == K_ARRAY3D) {
            d.Depth = 1 + (r >> 40) % 8;
            rc = A->cuArray3DCreate_v2(&a, &d);
        } else {
            rc = A->cuMipmappedArrayCreate(&a, &d, 1 + (unsigned int)((r >> 40) % 4));
        }
        *h = (unsigned long long)(uintptr_t)a;
        return rc;
    }
    default: rc = A->cuMemAlloc_v2(&p, sz); break;
    }
    *h = p;
    return rc;
}

/* Host memory and IPC are traced, not counted: allocate and give back at once. */
static CUresult soak_host(size_t sz)
{
    void *a = NULL;
    CUresult rc = A->cuMemHostAlloc(&a, sz, 0);
    return rc ? rc : A->cuMemFreeHost(a);
}

static void *soak_main(void *p)
{
    struct soak *w = p;
    struct { int kind; unsigned long long h; } live[32];
    int nlive = 0;
    unsigned long long s = w->seed | 1;

    A->cuCtxSetCurrent(w->ctx);
    for (unsigned long long i = 0; i < w->n; i++) {
        unsigned long long r = xs(&s);
        if (nlive == 32 || (nlive > 0 && (r & 1))) {
            int k = (int)((r >> 1) % (unsigned long long)nlive);
            count(w, soak_free(live[k].kind, live[k].h));
            live[k] = live[--nlive];
        } else {
            int kind = (int)((r >> 1) % K_N);
            if (kind == K_HOST) {
                count(w, soak_host((size_t)(1 + (r >> 16) % 65536)));
            } else {
                unsigned long long h = 0;
                CUresult rc = soak_alloc(w, kind, r, &h);
                count(w, rc);
                if (rc == CUDA_SUCCESS) {
                    live[nlive].kind = kind;
                    live[nlive++].h = h;
                }
            }
        }
        if ((i & 63) == 63)
            count(w, A->cuStreamSynchronize(NULL));
    }
    while (nlive > 0) {
        nlive--;
        count(w, soak_free(live[nlive].kind, live[nlive].h));
    }
    count(w, A->cuStreamSynchronize(NULL));
    return NULL;
}

static void op_soak(int t, unsigned long long n, unsigned long long seed)
{
    struct soak *w = calloc((size_t)t, sizeof *w);
    CUcontext ctx = NULL;
    CUmemoryPool pool = NULL, def = NULL;
    CUmemPoolProps props;
    CUmemAllocationProp prop;
    size_t gran = 0;
    unsigned long long ok = 0, oom = 0, other = 0;

    if (!w)
        fatal("out of memory");
    memset(&props, 0, sizeof props);
    props.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
    props.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    memset(&prop, 0, sizeof prop);
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    A->cuCtxGetCurrent(&ctx);
    if (A->cuMemPoolCreate(&pool, &props) || A->cuDeviceGetDefaultMemPool(&def, 0) ||
        A->cuMemGetAllocationGranularity(&gran, &prop, 0))
        fatal("soak: pool or granularity setup failed");
    for (int i = 0; i < t; i++) {
        w[i].ctx = ctx;
        w[i].pool = pool;
        w[i].gran = gran;
        w[i].n = n;
        w[i].seed = (seed + 1) * 0x9e3779b97f4a7c15ULL + (unsigned long long)i * 0xbf58476d1ce4e5b9ULL;
        if (pthread_create(&w[i].th, NULL, soak_main, &w[i]))
            fatal("pthread_create failed");
    }
    for (int i = 0; i < t; i++) {
        pthread_join(w[i].th, NULL);
        ok += w[i].ok;
        oom += w[i].oom;
        other += w[i].other;
    }
    free(w);
    /* What the pools keep after the last synchronize goes back: the end state is "nothing held". */
    if (A->cuCtxSynchronize() || A->cuMemPoolTrimTo(pool, 0) || A->cuMemPoolTrimTo(def, 0))
        other++;
    client_printf("soak ops=%llu ok=%llu oom=%llu other=%llu", n * (unsigned long long)t, ok, oom, other);
}

static void op_timens(long secs)
{
    int rc = 0;
#ifdef CLONE_NEWTIME
    if (unshare(CLONE_NEWTIME) != 0) {
        rc = errno;
    } else {
        FILE *f = fopen("/proc/self/timens_offsets", "w");
        if (!f || fprintf(f, "boottime %ld 0\n", secs) < 0 || fclose(f) != 0)
            rc = errno ? errno : -1;
    }
#else
    (void)secs;
    rc = ENOSYS;
#endif
    printf("timens rc=%d\n", rc);
}

static void op_exitbusy(int t, long ms)
{
    start_busy(t, 0);
    struct timespec ts = { ms / 1000, (ms % 1000) * 1000000L };
    nanosleep(&ts, NULL);
    client_printf("exitbusy exiting");
    exit(0);
}

static void op_rawfork(unsigned long long n)
{
    fflush(stdout);
    pid_t pid = _Fork();
    if (pid == 0) {
        for (unsigned long long k = 0; k < n; k++) {
            CUdeviceptr d = 0;
            if (A->cuMemAlloc_v2(&d, 4096) == CUDA_SUCCESS)
                A->cuMemFree_v2(d);
        }
        _exit(0);
    }
    int st = -1;
    waitpid(pid, &st, 0);
    client_printf("rawfork status=%d", WIFEXITED(st) ? WEXITSTATUS(st) : -1);
}

int client_fault_op(const char *op, int *i, int argc, char **argv,
                    unsigned long long (*new_slot)(unsigned long long))
{
#define NEXT() (*i + 1 < argc ? argv[++*i] : NULL)
    if (!strcmp(op, "forkbusy")) {
        long t = client_parse_long(NEXT());
        op_forkbusy((int)t, client_parse_long(NEXT()));
    } else if (!strcmp(op, "execchild")) {
        op_execchild(argc, argv, i);
    } else if (!strcmp(op, "sigstorm")) {
        long t = client_parse_long(NEXT());
        op_sigstorm((int)t, client_parse_size(NEXT()));
    } else if (!strcmp(op, "threadleak")) {
        op_threadleak(client_parse_size(NEXT()), new_slot);
    } else if (!strcmp(op, "exitbusy")) {
        long t = client_parse_long(NEXT());
        op_exitbusy((int)t, client_parse_long(NEXT()));
    } else if (!strcmp(op, "rawfork")) {
        op_rawfork(client_parse_size(NEXT()));
    } else if (!strcmp(op, "timens")) {
        op_timens(client_parse_long(NEXT()));
    } else if (!strcmp(op, "soak")) {
        long t = client_parse_long(NEXT());
        unsigned long long n = client_parse_size(NEXT());
        op_soak((int)t, n, client_parse_size(NEXT()));
    } else {
        return 0;
    }
    return 1;
#undef NEXT
}
