/*
 * ops_pool.c - ops that attack the lifetimes of stream-ordered and graph
 * memory (issue 14), shared by the three client front ends.
 *   poolburst DEV N SIZE   -> poolburst ok=A oom=O other=E first=K
 *                             N x (cuMemPoolCreate on DEV, alloc SIZE from it, cuMemPoolDestroy
 *                             without freeing); the pointers get slots K.. (0 when refused)
 *   stream                 -> stream rc=N id=S         (cuStreamCreate in the current context)
 *   asyncs S SIZE          -> async rc=N slot=K        (cuMemAllocAsync on stream S)
 *   noctx S N SIZE         -> noctx ok=A oom=O other=E (a new thread with no current context:
 *                             N x cuMemAllocAsync on stream S; pointers get slots)
 *   frag N START STEP      -> frag ok=A oom=O other=E  (a pool that keeps freed memory; N x alloc
 *                             START + i*STEP then free it: each request fits no free block)
 *   asyncrace T SIZE WARM  -> asyncrace ok=A oom=O other=E  (alloc+free WARM on the default pool, then
 *                             T threads alloc SIZE from it at once)
 *   asyncstorm T N SIZE    -> asyncstorm ok=A oom=O other=E  (T threads x N rounds of cuMemAllocAsync
 *                             SIZE, cuMemFreeAsync, on the default pool of the current context)
 *   manypools N SIZE       -> manypools ok=A oom=O other=E created=C
 *                             (N pools, then SIZE from each, the newest first)
 *   ctxsync2               -> sync rc=N                (cuCtxSynchronize_v2(NULL))
 *   graph DEV SIZE FREE I  -> graph rc=N id=E slot=K   (graph with one SIZE allocation node on DEV,
 *                             plus its free node if FREE; instantiated with variant I: 0 WithFlags,
 *                             1 _v2, 2 WithParams, 3 WithParams_ptsz, 4 v1); K: the node's address
 *   gx DEV SIZE FREE DEPTH I FLAGS -> graph rc=N id=E slot=K  (like graph, the graph moved DEPTH times
 *                             into a new parent's child graph node (cuGraphAddNode_v2, ownership
 *                             MOVE); the outermost instantiated with variant I (0 WithFlags,
 *                             2 WithParams, 3 WithParams_ptsz; upload stream NULL) and FLAGS)
 *   gwide K M SIZE         -> graph rc=N id=E slot=K   (K graphs, each of M child graph nodes (clones of
 *                             an empty graph), the first ending in a SIZE allocation node on device
 *                             0, all moved into one root, instantiated WithFlags)
 *   capture SIZE FREE      -> capture rc=N id=E slot=K (cuMemAllocAsync [+ cuMemFreeAsync] captured
 *                             on a new stream, instantiated WithFlags)
 *   ptcapture SIZE         -> capture rc=N id=E slot=K (cuMemAllocAsync_ptsz captured on the per-thread
 *                             default stream, NULL to the _ptsz variants; instantiated WithFlags)
 *   pcapture P SIZE        -> capture rc=N id=E slot=K (cuMemAllocFromPoolAsync from pool P captured on a
 *                             new stream, instantiated WithFlags, not launched)
 *   pooldestroy P          -> pooldestroy rc=N         (cuMemPoolDestroy)
 *   glaunch E | glaunchp E | gupload E | guploadp E -> glaunch rc=N
 *   gexecfree E            -> gexecfree rc=N           (cuGraphExecDestroy)
 *   gmem DEV               -> gmem rc=N used=U reserved=R
 *   gtrim DEV              -> gtrim rc=N
 *   asyncbench N SIZE      -> asyncbench ns_per_pair=X errors=E (N cuMemAllocAsync + cuMemFreeAsync
 *                             pairs on the default stream, wall time; scripts/bench-async)
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "client.h"

#define OUT(...) (printf(__VA_ARGS__), putchar('\n'), fflush(stdout))
#define MAXN 4096

static const struct cu_api *A;
static CUstream g_streams[64];
static int g_nstreams;
static CUgraphExec g_execs[64];
static int g_nexecs;

static unsigned long long n(const char *s)
{
    if (!s) {
        fprintf(stderr, "client: missing argument\n");
        exit(2);
    }
    return client_parse_size(s);
}

static CUstream stream_arg(const char *s)
{
    unsigned long long k = n(s);
    if ((int)k >= g_nstreams) {
        fprintf(stderr, "client: no stream %s\n", s);
        exit(2);
    }
    return g_streams[k];
}

static CUgraphExec exec_arg(const char *s)
{
    unsigned long long k = n(s);
    if ((int)k >= g_nexecs) {
        fprintf(stderr, "client: no graph %s\n", s);
        exit(2);
    }
    return g_execs[k];
}

struct tally {
    unsigned long long ok, oom, other;
};

static void count(struct tally *t, CUresult rc)
{
    if (rc == CUDA_SUCCESS)
        t->ok++;
    else if (rc == CUDA_ERROR_OUT_OF_MEMORY)
        t->oom++;
    else
        t->other++;
}

static CUresult pool_create(CUmemoryPool *pl, int dev)
{
    CUmemPoolProps props;

    memset(&props, 0, sizeof props);
    props.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
    props.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    props.location.id = dev;
    return A->cuMemPoolCreate(pl, &props);
}

/* A thread without a current context, allocating on another context's stream. */
struct noctx_args {
    CUstream s;
    unsigned long long n, size;
    CUdeviceptr ptrs[MAXN];
    struct tally t;
};

static void *noctx_thread(void *arg)
{
    struct noctx_args *a = arg;
    CUcontext cur = (CUcontext)1;

    if (A->cuCtxGetCurrent(&cur) != CUDA_SUCCESS || cur) {
        a->t.other = ~0ULL;     /* the premise failed: this thread has a context */
        return NULL;
    }
    for (unsigned long long i = 0; i < a->n && i < MAXN; i++) {
        CUresult rc = A->cuMemAllocAsync(&a->ptrs[i], a->size, a->s);
        if (rc != CUDA_SUCCESS)
            a->ptrs[i] = 0;
        count(&a->t, rc);
    }
    return NULL;
}

struct race {
    CUcontext ctx;
    size_t size;
    unsigned long long rounds;  /* asyncstorm */
    pthread_barrier_t go;
    pthread_mutex_t lock;
    struct tally t;
};

static void *race_thread(void *arg)
{
    struct race *r = arg;
    CUdeviceptr p = 0;
    CUresult rc = A->cuCtxSetCurrent(r->ctx);

    pthread_barrier_wait(&r->go);
    if (rc == CUDA_SUCCESS)
        rc = A->cuMemAllocAsync(&p, r->size, NULL);
    pthread_mutex_lock(&r->lock);
    count(&r->t, rc);
    pthread_mutex_unlock(&r->lock);
    return NULL;
}

/* asyncstorm: each thread allocates and frees in stream order, round after round; the default
 * pool hands the freed block to whichever thread asks next. */
static void *storm_thread(void *arg)
{
    struct race *r = arg;
    CUresult rc = A->cuCtxSetCurrent(r->ctx);

    for (unsigned long long i = 0; rc == CUDA_SUCCESS && i < r->rounds; i++) {
        CUdeviceptr p = 0;
        CUresult a = A->cuMemAllocAsync(&p, r->size, NULL);
        if (a == CUDA_SUCCESS && A->cuMemFreeAsync(p, NULL) != CUDA_SUCCESS)
            a = CUDA_ERROR_UNKNOWN;
        pthread_mutex_lock(&r->lock);
        count(&r->t, a);
        pthread_mutex_unlock(&r->lock);
    }
    return NULL;
}

/* THREADS threads (at most 64) run FN on R together; returns when all have ended. */
static void run_threads(struct race *r, unsigned long long threads, void *(*fn)(void *))
{
    pthread_t th[64];

    pthread_mutex_init(&r->lock, NULL);
    for (unsigned long long i = 0; i < threads; i++)
        pthread_create(&th[i], NULL, fn, r);
    for (unsigned long long i = 0; i < threads; i++)
        pthread_join(th[i], NULL);
}

static CUresult instantiate(CUgraphExec *e, CUgraph g, int variant)
{
    CUDA_GRAPH_INSTANTIATE_PARAMS ip;

    memset(&ip, 0, sizeof ip);
    switch (variant) {
    case 0: return A->cuGraphInstantiateWithFlags(e, g, 0);
    case 1: return A->cuGraphInstantiate_v2(e, g, NULL, NULL, 0);
    case 2: return A->cuGraphInstantiateWithParams(e, g, &ip);
    case 3: return A->cuGraphInstantiateWithParams_ptsz(e, g, &ip);
    default: return A->cuGraphInstantiate(e, g, NULL, NULL, 0);
    }
}

/* Adds to `into` a child graph node embedding `child` (moved or cloned). */
static CUresult child_node(CUgraph into, CUgraph child, int ownership)
{
    CUgraphNode cn = NULL;
    CUgraphNodeParams gp;

    memset(&gp, 0, sizeof gp);
    gp.type = CU_GRAPH_NODE_TYPE_GRAPH;
    gp.graph.graph = child;
    gp.graph.ownership = ownership;
    return A->cuGraphAddNode_v2(&cn, into, NULL, NULL, 0, &gp);
}

static void keep_exec(CUresult rc, CUgraphExec e)
{
    if (rc == CUDA_SUCCESS && g_nexecs < 64)
        g_execs[g_nexecs++] = e;
}

/* For ops_graph.c. */
CUgraphExec client_exec(const char *s)
{
    return exec_arg(s);
}

int client_keep_exec(CUresult rc, CUgraphExec e)
{
    keep_exec(rc, e);
    return g_nexecs - 1;
}

int client_pool_op(const struct cu_api *api, const char *op, int argc, char **argv,
                   unsigned long long (*new_slot)(unsigned long long),
                   unsigned long long (*slot)(const char *))
{
#define ARG(i) ((i) < argc ? argv[i] : NULL)
    struct tally t = { 0, 0, 0 };
    CUdeviceptr p = 0;
    CUresult rc;

    A = api;
    if (!strcmp(op, "poolburst")) {
        int dev = (int)n(ARG(0));
        unsigned long long times = n(ARG(1)), size = n(ARG(2)), first = 0;
        for (unsigned long long i = 0; i < times; i++) {
            CUmemoryPool pl = NULL;
            p = 0;
            if ((rc = pool_create(&pl, dev)) == CUDA_SUCCESS) {
                rc = A->cuMemAllocFromPoolAsync(&p, size, pl, NULL);
                if (A->cuMemPoolDestroy(pl) != CUDA_SUCCESS)
                    t.other++;
            }
            count(&t, rc);
            unsigned long long k = new_slot(rc ? 0 : p);
            if (i == 0)
                first = k;
        }
        OUT("poolburst ok=%llu oom=%llu other=%llu first=%llu", t.ok, t.oom, t.other, first);
        return 3;
    }
    if (!strcmp(op, "stream")) {
        CUstream s = NULL;
        rc = A->cuStreamCreate(&s, 0);
        if (rc == CUDA_SUCCESS && g_nstreams < 64)
            g_streams[g_nstreams++] = s;
        OUT("stream rc=%d id=%d", rc, g_nstreams - 1);
        return 0;
    }
    if (!strcmp(op, "asyncs")) {
        rc = A->cuMemAllocAsync(&p, n(ARG(1)), stream_arg(ARG(0)));
        OUT("async rc=%d slot=%llu", rc, new_slot(rc ? 0 : p));
        return 2;
    }
    if (!strcmp(op, "noctx")) {
        struct noctx_args *a = calloc(1, sizeof *a);
        pthread_t th;
        if (!a)
            exit(2);
        a->s = stream_arg(ARG(0));
        a->n = n(ARG(1));
        a->size = n(ARG(2));
        if (pthread_create(&th, NULL, noctx_thread, a) != 0 || pthread_join(th, NULL) != 0)
            exit(2);
        for (unsigned long long i = 0; i < a->n && i < MAXN; i++)
            new_slot(a->ptrs[i]);
        OUT("noctx ok=%llu oom=%llu other=%llu", a->t.ok, a->t.oom, a->t.other);
        free(a);
        return 3;
    }
    if (!strcmp(op, "frag")) {
        unsigned long long times = n(ARG(0)), start = n(ARG(1)), step = n(ARG(2));
        cuuint64_t max = ~0ULL;
        CUmemoryPool pl = NULL;
        CUcontext cur = NULL;
        int dev = 0;
        (void)cur;
        if ((rc = pool_create(&pl, dev)) != CUDA_SUCCESS ||
            (rc = A->cuMemPoolSetAttribute(pl, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &max)) != CUDA_SUCCESS) {
            OUT("frag ok=0 oom=0 other=%llu", times);
            return 3;
        }
        for (unsigned long long i = 0; i < times; i++) {
            rc = A->cuMemAllocFromPoolAsync(&p, start + i * step, pl, NULL);
            count(&t, rc);
            if (rc == CUDA_SUCCESS && A->cuMemFreeAsync(p, NULL) != CUDA_SUCCESS)
                t.other++;
        }
        OUT("frag ok=%llu oom=%llu other=%llu", t.ok, t.oom, t.other);
        return 3;
    }
    if (!strcmp(op, "asyncrace")) {
        unsigned long long threads = n(ARG(0));
        struct race r;
        if (threads > 64)
            threads = 64;
        memset(&r, 0, sizeof r);
        r.size = n(ARG(1));
        A->cuCtxGetCurrent(&r.ctx);
        /* Warm: the pool now holds a freed block that "fits" every request. */
        if (A->cuMemAllocAsync(&p, n(ARG(2)), NULL) == CUDA_SUCCESS)
            A->cuMemFreeAsync(p, NULL);
        pthread_barrier_init(&r.go, NULL, (unsigned)threads);
        run_threads(&r, threads, race_thread);
        OUT("asyncrace ok=%llu oom=%llu other=%llu", r.t.ok, r.t.oom, r.t.other);
        return 3;
    }
    if (!strcmp(op, "asyncstorm")) {
        unsigned long long threads = n(ARG(0));
        struct race r;
        if (threads > 64)
            threads = 64;
        memset(&r, 0, sizeof r);
        r.rounds = n(ARG(1));
        r.size = n(ARG(2));
        A->cuCtxGetCurrent(&r.ctx);
        run_threads(&r, threads, storm_thread);
        OUT("asyncstorm ok=%llu oom=%llu other=%llu", r.t.ok, r.t.oom, r.t.other);
        return 3;
    }
    if (!strcmp(op, "manypools")) {
        unsigned long long want = n(ARG(0)), size = n(ARG(1)), created = 0;
        CUmemoryPool *pools = calloc(want ? want : 1, sizeof *pools);
        if (!pools)
            exit(2);
        for (unsigned long long i = 0; i < want; i++)
            if (pool_create(&pools[created], 0) == CUDA_SUCCESS)
                created++;
        for (unsigned long long i = created; i-- > 0;)
            count(&t, A->cuMemAllocFromPoolAsync(&p, size, pools[i], NULL));
        OUT("manypools ok=%llu oom=%llu other=%llu created=%llu", t.ok, t.oom, t.other, created);
        free(pools);
        return 2;
    }
    if (!strcmp(op, "ctxsync2")) {
        OUT("sync rc=%d", A->cuCtxSynchronize_v2(NULL));
        return 0;
    }
    if (!strcmp(op, "graph")) {
        CUDA_MEM_ALLOC_NODE_PARAMS np;
        CUgraph g = NULL;
        CUgraphNode an = NULL, fn = NULL;
        CUgraphExec e = NULL;
        memset(&np, 0, sizeof np);
        np.poolProps.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
        np.poolProps.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        np.poolProps.location.id = (int)n(ARG(0));
        np.bytesize = n(ARG(1));
        if ((rc = A->cuGraphCreate(&g, 0)) == CUDA_SUCCESS &&
            (rc = A->cuGraphAddMemAllocNode(&an, g, NULL, 0, &np)) == CUDA_SUCCESS &&
            (!n(ARG(2)) || (rc = A->cuGraphAddMemFreeNode(&fn, g, &an, 1, np.dptr)) == CUDA_SUCCESS))
            rc = instantiate(&e, g, (int)n(ARG(3)));
        keep_exec(rc, e);
        OUT("graph rc=%d id=%d slot=%llu", rc, g_nexecs - 1, new_slot(np.dptr));
        return 4;
    }
    if (!strcmp(op, "gx")) {
        CUDA_MEM_ALLOC_NODE_PARAMS np;
        CUDA_GRAPH_INSTANTIATE_PARAMS ip;
        CUgraph g = NULL;
        CUgraphNode an = NULL, fn = NULL;
        CUgraphExec e = NULL;
        unsigned long long depth = n(ARG(3)), flags = n(ARG(5));
        int variant = (int)n(ARG(4));
        memset(&np, 0, sizeof np);
        memset(&ip, 0, sizeof ip);
        np.poolProps.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
        np.poolProps.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        np.poolProps.location.id = (int)n(ARG(0));
        np.bytesize = n(ARG(1));
        if ((rc = A->cuGraphCreate(&g, 0)) == CUDA_SUCCESS &&
            (rc = A->cuGraphAddMemAllocNode(&an, g, NULL, 0, &np)) == CUDA_SUCCESS &&
            (!n(ARG(2)) || (rc = A->cuGraphAddMemFreeNode(&fn, g, &an, 1, np.dptr)) == CUDA_SUCCESS))
            for (unsigned long long d = 0; d < depth && rc == CUDA_SUCCESS; d++) {
                CUgraph parent = NULL;
                CUgraphNode cn = NULL;
                CUgraphNodeParams gp;
                memset(&gp, 0, sizeof gp);
                gp.type = CU_GRAPH_NODE_TYPE_GRAPH;
                gp.graph.graph = g;
                gp.graph.ownership = CU_GRAPH_CHILD_GRAPH_OWNERSHIP_MOVE;
                if ((rc = A->cuGraphCreate(&parent, 0)) == CUDA_SUCCESS &&
                    (rc = A->cuGraphAddNode_v2(&cn, parent, NULL, NULL, 0, &gp)) == CUDA_SUCCESS)
                    g = parent;
            }
        if (rc == CUDA_SUCCESS) {
            ip.flags = flags;
            rc = variant == 0 ? A->cuGraphInstantiateWithFlags(&e, g, flags)
               : variant == 2 ? A->cuGraphInstantiateWithParams(&e, g, &ip)
                              : A->cuGraphInstantiateWithParams_ptsz(&e, g, &ip);
        }
        keep_exec(rc, e);
        OUT("graph rc=%d id=%d slot=%llu", rc, g_nexecs - 1, new_slot(np.dptr));
        return 6;
    }
    if (!strcmp(op, "gwide")) {
        CUDA_MEM_ALLOC_NODE_PARAMS np;
        CUgraph root = NULL, empty = NULL;
        CUgraphNode an = NULL;
        CUgraphExec e = NULL;
        unsigned long long k = n(ARG(0)), m = n(ARG(1));
        memset(&np, 0, sizeof np);
        np.poolProps.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
        np.poolProps.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        np.poolProps.location.id = 0;
        np.bytesize = n(ARG(2));
        if ((rc = A->cuGraphCreate(&root, 0)) == CUDA_SUCCESS)
            rc = A->cuGraphCreate(&empty, 0);
        for (unsigned long long i = 0; i < k && rc == CUDA_SUCCESS; i++) {
            CUgraph g = NULL;
            if ((rc = A->cuGraphCreate(&g, 0)) != CUDA_SUCCESS)
                break;
            for (unsigned long long j = 0; j < m && rc == CUDA_SUCCESS; j++)
                rc = child_node(g, empty, CU_GRAPH_CHILD_GRAPH_OWNERSHIP_CLONE);
            if (rc == CUDA_SUCCESS && i == 0)
                rc = A->cuGraphAddMemAllocNode(&an, g, NULL, 0, &np);
            if (rc == CUDA_SUCCESS)
                rc = child_node(root, g, CU_GRAPH_CHILD_GRAPH_OWNERSHIP_MOVE);
        }
        if (rc == CUDA_SUCCESS)
            rc = A->cuGraphInstantiateWithFlags(&e, root, 0);
        keep_exec(rc, e);
        OUT("graph rc=%d id=%d slot=%llu", rc, g_nexecs - 1, new_slot(np.dptr));
        return 3;
    }
    if (!strcmp(op, "capture")) {
        CUstream s = NULL;
        CUgraph g = NULL;
        CUgraphExec e = NULL;
        if ((rc = A->cuStreamCreate(&s, 0)) == CUDA_SUCCESS &&
            (rc = A->cuStreamBeginCapture_v2(s, 0)) == CUDA_SUCCESS) {
            rc = A->cuMemAllocAsync(&p, n(ARG(0)), s);
            if (rc == CUDA_SUCCESS && n(ARG(1)))
                rc = A->cuMemFreeAsync(p, s);
            CUresult end = A->cuStreamEndCapture(s, &g);
            if (rc == CUDA_SUCCESS && (rc = end) == CUDA_SUCCESS)
                rc = instantiate(&e, g, 0);
        }
        keep_exec(rc, e);
        OUT("capture rc=%d id=%d slot=%llu", rc, g_nexecs - 1, new_slot(p));
        return 2;
    }
    if (!strcmp(op, "pcapture")) {
        CUstream s = NULL;
        CUgraph g = NULL;
        CUgraphExec e = NULL;
        CUmemoryPool pl = client_pool(ARG(0));
        if ((rc = A->cuStreamCreate(&s, 0)) == CUDA_SUCCESS &&
            (rc = A->cuStreamBeginCapture_v2(s, 0)) == CUDA_SUCCESS) {
            rc = A->cuMemAllocFromPoolAsync(&p, n(ARG(1)), pl, s);
            CUresult end = A->cuStreamEndCapture(s, &g);
            if (rc == CUDA_SUCCESS && (rc = end) == CUDA_SUCCESS)
                rc = instantiate(&e, g, 0);
        }
        keep_exec(rc, e);
        OUT("capture rc=%d id=%d slot=%llu", rc, g_nexecs - 1, new_slot(p));
        return 2;
    }
    if (!strcmp(op, "pooldestroy")) {
        OUT("pooldestroy rc=%d", A->cuMemPoolDestroy(client_pool(ARG(0))));
        return 1;
    }
    if (!strcmp(op, "ptcapture")) {
        CUgraph g = NULL;
        CUgraphExec e = NULL;
        if ((rc = A->cuStreamBeginCapture_v2_ptsz(NULL, 0)) == CUDA_SUCCESS) {
            rc = A->cuMemAllocAsync_ptsz(&p, n(ARG(0)), NULL);
            CUresult end = A->cuStreamEndCapture_ptsz(NULL, &g);
            if (rc == CUDA_SUCCESS && (rc = end) == CUDA_SUCCESS)
                rc = instantiate(&e, g, 0);
        }
        keep_exec(rc, e);
        OUT("capture rc=%d id=%d slot=%llu", rc, g_nexecs - 1, new_slot(p));
        return 1;
    }
    if (!strcmp(op, "glaunch") || !strcmp(op, "glaunchp") || !strcmp(op, "gupload") || !strcmp(op, "guploadp")) {
        CUgraphExec e = exec_arg(ARG(0));
        int ptsz = op[strlen(op) - 1] == 'p';
        if (op[1] == 'l')
            rc = (ptsz ? A->cuGraphLaunch_ptsz : A->cuGraphLaunch)(e, NULL);
        else
            rc = (ptsz ? A->cuGraphUpload_ptsz : A->cuGraphUpload)(e, NULL);
        OUT("glaunch rc=%d", rc);
        return 1;
    }
    if (!strcmp(op, "gexecfree")) {
        OUT("gexecfree rc=%d", A->cuGraphExecDestroy(exec_arg(ARG(0))));
        return 1;
    }
    if (!strcmp(op, "gmem")) {
        cuuint64_t used = 0, reserved = 0;
        int dev = (int)n(ARG(0));
        rc = A->cuDeviceGetGraphMemAttribute(dev, CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT, &used);
        if (rc == CUDA_SUCCESS)
            rc = A->cuDeviceGetGraphMemAttribute(dev, CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT, &reserved);
        OUT("gmem rc=%d used=%llu reserved=%llu", rc, used, reserved);
        return 1;
    }
    if (!strcmp(op, "gtrim")) {
        OUT("gtrim rc=%d", A->cuDeviceGraphMemTrim((CUdevice)n(ARG(0))));
        return 1;
    }
    if (!strcmp(op, "asyncbench")) {
        unsigned long long pairs = n(ARG(0)), size = n(ARG(1)), errors = 0;
        struct timespec a, b;
        clock_gettime(CLOCK_MONOTONIC, &a);
        for (unsigned long long i = 0; i < pairs; i++)
            if (A->cuMemAllocAsync(&p, size, NULL) != CUDA_SUCCESS || A->cuMemFreeAsync(p, NULL) != CUDA_SUCCESS)
                errors++;
        clock_gettime(CLOCK_MONOTONIC, &b);
        double ns = (b.tv_sec - a.tv_sec) * 1e9 + (b.tv_nsec - a.tv_nsec);
        OUT("asyncbench ns_per_pair=%.1f errors=%llu", pairs ? ns / (double)pairs : 0.0, errors);
        return 2;
    }
    return client_graph_op(A, op, argc, argv, new_slot, slot);
#undef ARG
}
