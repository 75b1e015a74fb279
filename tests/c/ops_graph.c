/*
 * ops_graph.c - graph launches racing each other, shared by the three client front ends
 * (graphs are made by the ops of ops_pool.c, which numbers them):
 *   gxrace E0 K0 E1 K1 N -> gxrace raced_ok=A raced_oom=B other_ok=C other_oom=D errors=X
 *                           N rounds of two threads. Round set-up (first thread): cuMemFreeAsync
 *                           of slot K0 (the address of E0's allocation), cuDeviceGraphMemTrim(0),
 *                           launch E0. Then both at once: the first relaunches E0 (auto-free: it
 *                           reuses what the set-up launch left), the second frees that memory
 *                           (cuMemFreeAsync K0) and launches E1, whose allocation (slot K1) it
 *                           frees once the relaunch is back.
 *                           raced_*: the relaunches of E0; other_*: the launches of E1.
 *   gxstorm E T N        -> gxstorm ok=A oom=O other=X (T threads x N launches of E at once)
 *   gupdate E DEV SIZE FREE V -> gupdate rc=N result=R slot=K  (a new graph of one SIZE allocation
 *                           node on DEV, plus its free node if FREE: E updated with it,
 *                           cuGraphExecUpdate (V = 1) or cuGraphExecUpdate_v2 (V = 2); R: the
 *                           update result; K: the new node's address)
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client.h"

#define OUT(...) (printf(__VA_ARGS__), putchar('\n'), fflush(stdout))

static const struct cu_api *A;

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

struct race {
    CUcontext ctx;
    CUgraphExec e0, e1;
    CUdeviceptr k0, k1;
    unsigned long long rounds;
    pthread_barrier_t go;
    struct tally raced, other;
    pthread_mutex_t lock;
};

static void *race_other(void *arg)
{
    struct race *r = arg;
    CUresult rc = A->cuCtxSetCurrent(r->ctx);

    for (unsigned long long i = 0; i < r->rounds; i++) {
        pthread_barrier_wait(&r->go);
        if (rc == CUDA_SUCCESS) {
            A->cuMemFreeAsync(r->k0, NULL);         /* not live (a relaunch refused): refused */
            count(&r->other, A->cuGraphLaunch(r->e1, NULL));
        } else {
            r->other.other++;
        }
        pthread_barrier_wait(&r->go);
        /* Held until the relaunch is back: the memory it counted on is taken meanwhile. */
        A->cuMemFreeAsync(r->k1, NULL);
        pthread_barrier_wait(&r->go);
    }
    return NULL;
}

static void gxrace(struct race *r)
{
    pthread_t t;
    struct tally setup = { 0, 0, 0 };

    A->cuCtxGetCurrent(&r->ctx);
    pthread_barrier_init(&r->go, NULL, 2);
    if (pthread_create(&t, NULL, race_other, r) != 0) {
        fprintf(stderr, "client: cannot start a thread\n");
        exit(2);
    }
    for (unsigned long long i = 0; i < r->rounds; i++) {
        A->cuMemFreeAsync(r->k0, NULL);
        A->cuDeviceGraphMemTrim(0);
        count(&setup, A->cuGraphLaunch(r->e0, NULL));
        pthread_barrier_wait(&r->go);
        count(&r->raced, A->cuGraphLaunch(r->e0, NULL));
        pthread_barrier_wait(&r->go);
        pthread_barrier_wait(&r->go);
    }
    pthread_join(t, NULL);
    pthread_barrier_destroy(&r->go);
    OUT("gxrace raced_ok=%llu raced_oom=%llu other_ok=%llu other_oom=%llu errors=%llu", r->raced.ok, r->raced.oom,
        r->other.ok, r->other.oom, r->raced.other + r->other.other + setup.other);
}

static void *storm_thread(void *arg)
{
    struct race *r = arg;
    struct tally t = { 0, 0, 0 };
    CUresult rc = A->cuCtxSetCurrent(r->ctx);

    pthread_barrier_wait(&r->go);
    for (unsigned long long i = 0; i < r->rounds; i++)
        count(&t, rc == CUDA_SUCCESS ? A->cuGraphLaunch(r->e0, NULL) : rc);
    pthread_mutex_lock(&r->lock);
    r->raced.ok += t.ok;
    r->raced.oom += t.oom;
    r->raced.other += t.other;
    pthread_mutex_unlock(&r->lock);
    return NULL;
}

static void gxstorm(struct race *r, long threads)
{
    pthread_t t[64];

    if (threads < 1 || threads > 64) {
        fprintf(stderr, "client: gxstorm: 1..64 threads\n");
        exit(2);
    }
    A->cuCtxGetCurrent(&r->ctx);
    pthread_barrier_init(&r->go, NULL, (unsigned)threads);
    pthread_mutex_init(&r->lock, NULL);
    for (long i = 0; i < threads; i++)
        if (pthread_create(&t[i], NULL, storm_thread, r) != 0) {
            fprintf(stderr, "client: cannot start a thread\n");
            exit(2);
        }
    for (long i = 0; i < threads; i++)
        pthread_join(t[i], NULL);
    pthread_barrier_destroy(&r->go);
    OUT("gxstorm ok=%llu oom=%llu other=%llu", r->raced.ok, r->raced.oom, r->raced.other);
}

int client_graph_op(const struct cu_api *api, const char *op, int argc, char **argv,
                    unsigned long long (*new_slot)(unsigned long long),
                    unsigned long long (*slot)(const char *))
{
#define ARG(i) ((i) < argc ? argv[i] : NULL)
    struct race r;

    A = api;
    memset(&r, 0, sizeof r);
    if (!strcmp(op, "gxrace")) {
        r.e0 = client_exec(ARG(0));
        r.k0 = (CUdeviceptr)slot(ARG(1));
        r.e1 = client_exec(ARG(2));
        r.k1 = (CUdeviceptr)slot(ARG(3));
        r.rounds = client_parse_size(ARG(4));
        gxrace(&r);
        return 5;
    }
    if (!strcmp(op, "gupdate")) {
        CUDA_MEM_ALLOC_NODE_PARAMS np;
        CUgraphExecUpdateResultInfo info;
        CUgraph g = NULL;
        CUgraphNode an = NULL, fn = NULL, bad = NULL;
        CUgraphExec e = client_exec(ARG(0));
        int result = -1;
        CUresult rc;
        memset(&np, 0, sizeof np);
        memset(&info, 0, sizeof info);
        np.poolProps.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
        np.poolProps.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        np.poolProps.location.id = (int)client_parse_long(ARG(1));
        np.bytesize = client_parse_size(ARG(2));
        if ((rc = A->cuGraphCreate(&g, 0)) == CUDA_SUCCESS &&
            (rc = A->cuGraphAddMemAllocNode(&an, g, NULL, 0, &np)) == CUDA_SUCCESS &&
            (!client_parse_long(ARG(3)) || (rc = A->cuGraphAddMemFreeNode(&fn, g, &an, 1, np.dptr)) == CUDA_SUCCESS)) {
            if (client_parse_long(ARG(4)) == 1) {
                rc = A->cuGraphExecUpdate(e, g, &bad, &result);
            } else {
                rc = A->cuGraphExecUpdate_v2(e, g, &info);
                result = info.result;
            }
        }
        OUT("gupdate rc=%d result=%d slot=%llu", rc, result, new_slot(np.dptr));
        return 5;
    }
    if (!strcmp(op, "gxstorm")) {
        r.e0 = client_exec(ARG(0));
        r.rounds = client_parse_size(ARG(2));
        gxstorm(&r, client_parse_long(ARG(1)));
        return 3;
    }
    return -1;
#undef ARG
}
