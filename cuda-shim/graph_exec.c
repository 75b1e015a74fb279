/*
 * graph_exec.c - executable graphs of the fake driver: instantiation (what a launch allocates is
 * collected from every memory node reachable from the graph), destruction, launch and upload.
 * The rules reproduced are listed in graph.c.
 */
#define _GNU_SOURCE
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "graph_internal.h"

struct fc_gexec *g_execs;

/* Caller holds g_glock. Memory allocation nodes reachable from g (nested child graphs included;
 * moved children form a tree, so the walk ends). */
static size_t count_allocs(CUgraph g)
{
    size_t k = 0;

    for (struct fc_gnode *n = g->nodes; n; n = n->next)
        k += n->type == CU_GRAPH_NODE_TYPE_MEM_ALLOC ? 1 : n->type == CU_GRAPH_NODE_TYPE_GRAPH ? count_allocs(n->child) : 0;
    return k;
}

/* Caller holds g_glock. Whether a free node anywhere under g releases dptr. */
static int frees(CUgraph g, CUdeviceptr dptr)
{
    for (struct fc_gnode *n = g->nodes; n; n = n->next)
        if ((n->type == CU_GRAPH_NODE_TYPE_MEM_FREE && n->dptr == dptr) ||
            (n->type == CU_GRAPH_NODE_TYPE_GRAPH && frees(n->child, dptr)))
            return 1;
    return 0;
}

/* Caller holds g_glock. */
static void collect(struct fc_gexec *e, CUgraph root, CUgraph g)
{
    for (struct fc_gnode *n = g->nodes; n; n = n->next) {
        if (n->type == CU_GRAPH_NODE_TYPE_GRAPH)
            collect(e, root, n->child);
        else if (n->type == CU_GRAPH_NODE_TYPE_MEM_ALLOC)
            e->allocs[e->n++] = (struct galloc){ n->dptr, n->size, n->dev, frees(root, n->dptr), 0 };
    }
}

static CUresult instantiate(CUgraphExec *out, CUgraph g, unsigned long long flags)
{
    struct fc_gexec *e;
    size_t k;

    if (!fc_initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!out || !graph_ok(g) || g->moved)
        return CUDA_ERROR_INVALID_VALUE;
    if (!(e = calloc(1, sizeof *e)))
        return CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&g_glock);
    k = count_allocs(g);
    if (k && !(e->allocs = calloc(k, sizeof *e->allocs))) {
        pthread_mutex_unlock(&g_glock);
        free(e);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    collect(e, g, g);
    e->graph = g;
    e->auto_free = (flags & CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH) != 0;
    e->magic = EXEC_MAGIC;
    e->next = g_execs;
    g_execs = e;
    pthread_mutex_unlock(&g_glock);
    *out = e;
    return CUDA_SUCCESS;
}

FC_API CUresult cuGraphInstantiate(CUgraphExec *phGraphExec, CUgraph hGraph, CUgraphNode *phErrorNode,
                                   char *logBuffer, size_t bufferSize)
{
    (void)phErrorNode;
    FC_COUNT(cuGraphInstantiate);
    if (logBuffer && bufferSize)
        logBuffer[0] = 0;
    return instantiate(phGraphExec, hGraph, 0);
}

FC_API CUresult cuGraphInstantiate_v2(CUgraphExec *phGraphExec, CUgraph hGraph, CUgraphNode *phErrorNode,
                                      char *logBuffer, size_t bufferSize)
{
    (void)phErrorNode;
    FC_COUNT(cuGraphInstantiate_v2);
    if (logBuffer && bufferSize)
        logBuffer[0] = 0;
    return instantiate(phGraphExec, hGraph, 0);
}

FC_API CUresult cuGraphInstantiateWithFlags(CUgraphExec *phGraphExec, CUgraph hGraph, unsigned long long flags)
{
    FC_COUNT(cuGraphInstantiateWithFlags);
    if (flags & CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD)     /* only cuGraphInstantiateWithParams uploads */
        return CUDA_ERROR_INVALID_VALUE;
    return instantiate(phGraphExec, hGraph, flags);
}

static CUresult launch(CUgraphExec e, CUstream s, int run);

static CUresult instantiate_params(CUgraphExec *out, CUgraph g, CUDA_GRAPH_INSTANTIATE_PARAMS *p)
{
    CUresult rc;
    CUgraphExec e = NULL;

    if (!p || !out)
        return CUDA_ERROR_INVALID_VALUE;
    rc = instantiate(&e, g, p->flags);
    /* The upload backs the graph's memory now; if it cannot, the instantiation fails. */
    if (rc == CUDA_SUCCESS && (p->flags & CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD) &&
        (rc = launch(e, p->hUploadStream, 0)) != CUDA_SUCCESS)
        e->magic = 0;
    if (rc == CUDA_SUCCESS)
        *out = e;
    p->hErrNode_out = NULL;
    p->result_out = rc == CUDA_SUCCESS ? 0 : 1;
    return rc;
}

FC_API CUresult cuGraphInstantiateWithParams(CUgraphExec *phGraphExec, CUgraph hGraph,
                                             CUDA_GRAPH_INSTANTIATE_PARAMS *params)
{
    FC_COUNT(cuGraphInstantiateWithParams);
    return instantiate_params(phGraphExec, hGraph, params);
}

FC_API CUresult cuGraphInstantiateWithParams_ptsz(CUgraphExec *phGraphExec, CUgraph hGraph,
                                                  CUDA_GRAPH_INSTANTIATE_PARAMS *params)
{
    FC_COUNT(cuGraphInstantiateWithParams_ptsz);
    return instantiate_params(phGraphExec, hGraph, params);
}

FC_API CUresult cuGraphExecDestroy(CUgraphExec hGraphExec)
{
    FC_COUNT(cuGraphExecDestroy);
    if (!hGraphExec || hGraphExec->magic != EXEC_MAGIC)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_glock);
    hGraphExec->magic = 0;      /* allocations it left live stay the application's */
    pthread_mutex_unlock(&g_glock);
    return CUDA_SUCCESS;
}

/* Caller holds g_glock. Whether b has a's topology: as many nodes directly in it, of the same
 * types in the same order, child graphs alike (the fake keeps no edges to compare). *bad: the node
 * of b where they part (NULL: the counts differ). */
static int same_topology(CUgraph a, CUgraph b, int *result, CUgraphNode *bad)
{
    struct fc_gnode *m = a->nodes, *n = b->nodes;

    if (a->n != b->n) {
        *result = CU_GRAPH_EXEC_UPDATE_ERROR_TOPOLOGY_CHANGED;
        *bad = NULL;
        return 0;
    }
    for (; m && n; m = m->next, n = n->next) {
        if (m->type != n->type) {
            *result = CU_GRAPH_EXEC_UPDATE_ERROR_NODE_TYPE_CHANGED;
            *bad = n;
            return 0;
        }
        if (n->type == CU_GRAPH_NODE_TYPE_GRAPH && !same_topology(m->child, n->child, result, bad))
            return 0;
    }
    return 1;
}

/*
 * Whole-graph update, as documented: hGraph must be topologically identical to the graph the
 * executable graph was made from (same node count, same node types pairwise, child graphs alike;
 * a moved child cannot be an argument). The documentation lists no restriction on the parameters
 * of memory nodes, so this driver takes them over, sizes included: the next launch allocates what
 * hGraph's allocation nodes ask for (what an interposer has to follow). An allocation the last
 * launch left live keeps its address and size: changing a live allocation's node is refused
 * (PARAMETERS_CHANGED).
 */
static CUresult exec_update(CUgraphExec e, CUgraph g, int *result, CUgraphNode *bad)
{
    struct galloc *na = NULL;
    size_t k;
    CUresult rc = CUDA_SUCCESS;

    *result = CU_GRAPH_EXEC_UPDATE_ERROR;
    *bad = NULL;
    if (!fc_initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!e || e->magic != EXEC_MAGIC || !graph_ok(g) || g->moved)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_glock);
    if (!same_topology(e->graph, g, result, bad)) {
        rc = CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE;
    } else if ((k = count_allocs(g)) != e->n || (k && !(na = calloc(k, sizeof *na)))) {
        rc = k != e->n ? CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE : CUDA_ERROR_OUT_OF_MEMORY;
    } else {
        struct fc_gexec tmp = { .allocs = na };
        collect(&tmp, g, g);
        for (size_t i = 0; i < k && rc == CUDA_SUCCESS; i++)
            if (e->allocs[i].live && (na[i].size != e->allocs[i].size || na[i].dev != e->allocs[i].dev)) {
                *result = CU_GRAPH_EXEC_UPDATE_ERROR_PARAMETERS_CHANGED;
                rc = CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE;
            }
        if (rc == CUDA_SUCCESS) {
            for (size_t i = 0; i < k; i++) {
                if (e->allocs[i].live)
                    na[i].dptr = e->allocs[i].dptr;
                na[i].live = e->allocs[i].live;
            }
            free(e->allocs);
            e->allocs = na;
            na = NULL;
            e->graph = g;
            *result = CU_GRAPH_EXEC_UPDATE_SUCCESS;
        }
    }
    pthread_mutex_unlock(&g_glock);
    free(na);
    return rc;
}

FC_API CUresult cuGraphExecUpdate(CUgraphExec hGraphExec, CUgraph hGraph, CUgraphNode *hErrorNode_out,
                                  int *updateResult_out)
{
    int result;
    CUgraphNode bad;
    CUresult rc;

    FC_COUNT(cuGraphExecUpdate);
    if (!hErrorNode_out || !updateResult_out)
        return CUDA_ERROR_INVALID_VALUE;
    rc = exec_update(hGraphExec, hGraph, &result, &bad);
    *hErrorNode_out = bad;
    *updateResult_out = result;
    return rc;
}

FC_API CUresult cuGraphExecUpdate_v2(CUgraphExec hGraphExec, CUgraph hGraph, CUgraphExecUpdateResultInfo *resultInfo)
{
    CUresult rc;

    FC_COUNT(cuGraphExecUpdate_v2);
    if (!resultInfo)
        return CUDA_ERROR_INVALID_VALUE;
    rc = exec_update(hGraphExec, hGraph, &resultInfo->result, &resultInfo->errorNode);
    resultInfo->errorFromNode = NULL;
    return rc;
}

static CUresult launch(CUgraphExec e, CUstream s, int run)
{
    unsigned long long need[FC_MAX_DEVICES] = { 0 };
    CUresult rc = CUDA_SUCCESS;

    if (!fc_initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!e || e->magic != EXEC_MAGIC)
        return CUDA_ERROR_INVALID_VALUE;
    if (fc_stream_dev(s) < 0)
        return (uintptr_t)s > 2 ? CUDA_ERROR_INVALID_HANDLE : CUDA_ERROR_INVALID_CONTEXT;
    if (run && e->auto_free && fc_cfg.relaunch_delay_us) {
        int left = 0;
        pthread_mutex_lock(&g_glock);
        for (size_t i = 0; i < e->n; i++)
            left |= e->allocs[i].live;
        pthread_mutex_unlock(&g_glock);
        if (left)
            usleep((useconds_t)fc_cfg.relaunch_delay_us);
    }
    pthread_mutex_lock(&g_glock);
    for (size_t i = 0; i < e->n; i++) {
        struct galloc *a = &e->allocs[i];
        if (a->live && e->auto_free && run) {  /* freed before the relaunch: back to graph memory */
            a->live = 0;
            g_gm[a->dev].used -= a->size;
        }
        if (a->live)                /* its last launch's allocation was never freed */
            rc = CUDA_ERROR_INVALID_VALUE;
        need[a->dev] += a->size;
    }
    if (rc == CUDA_SUCCESS)
        rc = fc_graph_map_memory(need, run);
    if (rc == CUDA_SUCCESS && run)
        for (size_t i = 0; i < e->n; i++) {
            struct galloc *a = &e->allocs[i];
            if (a->freed_in_graph)
                g_gm[a->dev].used -= a->size;   /* back to the device's graph memory */
            else
                a->live = 1;
        }
    pthread_mutex_unlock(&g_glock);
    return rc;
}

FC_API CUresult cuGraphLaunch(CUgraphExec hGraphExec, CUstream hStream)
{
    FC_COUNT(cuGraphLaunch);
    return launch(hGraphExec, hStream, 1);
}

FC_API CUresult cuGraphLaunch_ptsz(CUgraphExec hGraphExec, CUstream hStream)
{
    FC_COUNT(cuGraphLaunch_ptsz);
    return launch(hGraphExec, hStream, 1);
}

/* Uploading makes the graph's memory ready (reserved) without running it. */
FC_API CUresult cuGraphUpload(CUgraphExec hGraphExec, CUstream hStream)
{
    FC_COUNT(cuGraphUpload);
    return launch(hGraphExec, hStream, 0);
}

FC_API CUresult cuGraphUpload_ptsz(CUgraphExec hGraphExec, CUstream hStream)
{
    FC_COUNT(cuGraphUpload_ptsz);
    return launch(hGraphExec, hStream, 0);
}

