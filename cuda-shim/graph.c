/*
 * graph.c - CUDA graphs and graph memory of the fake driver (stream capture
 * and stream queries: capture.c).
 *
 * The documented rules an interposer must get right, reproduced here:
 *  - a graph memory node allocates nothing when it is added or captured
 *    (cuMemAllocAsync on a capturing stream returns the node's fixed virtual
 *    address); the memory is allocated when the instantiated graph is launched
 *    (or uploaded), from the device's graph memory, and the launch fails with
 *    CUDA_ERROR_OUT_OF_MEMORY when the device has no room;
 *  - memory an allocation node's free node releases goes back to the device's
 *    graph memory and stays reserved (RESERVED_MEM_CURRENT) for the next
 *    launch until cuDeviceGraphMemTrim gives it back;
 *  - an allocation the graph does not free stays allocated (USED_MEM_CURRENT)
 *    until the application frees it (cuMemFreeAsync), and the graph cannot be
 *    launched again before that.
 *  - a child graph node (cuGraphAddNode_v2, type GRAPH) embeds a graph; one holding memory nodes
 *    must be moved in (CU_GRAPH_CHILD_GRAPH_OWNERSHIP_MOVE, CUDA 12.9), after which the child can
 *    no longer be instantiated or destroyed on its own; a launch allocates every memory node
 *    reachable from the graph, however nested;
 *  - CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD (cuGraphInstantiateWithParams only) uploads the graph into
 *    hUploadStream once instantiated, which backs its memory as cuGraphUpload does;
 *  - CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH frees the allocations the previous launch left
 *    unfreed before the graph is relaunched (without it, that relaunch is an error).
 * Work is synchronous: a launch allocates, runs and frees at once.
 */
#define _GNU_SOURCE
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#define GRAPH_MAGIC 0x47524150U
#define EXEC_MAGIC  0x47455845U

struct fc_gnode {
    int type;
    int dev;
    size_t size;                /* allocation nodes: bytes (rounded to the granularity) */
    CUdeviceptr dptr;           /* the address the node allocates or frees */
    CUgraph child;              /* child graph nodes: the embedded graph */
    struct fc_gnode *next;
};

struct fc_graph {
    unsigned int magic;
    int moved;                  /* owned by a parent's child graph node */
    struct fc_gnode *nodes, *last;  /* in insertion order; last: appended to in O(1) */
    size_t n;
};

struct galloc {
    CUdeviceptr dptr;
    size_t size;
    int dev;
    int freed_in_graph;         /* a free node of the same graph releases it */
    int live;                   /* allocated by a launch, not freed yet */
};

struct fc_gexec {
    unsigned int magic;
    int auto_free;              /* CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH */
    struct galloc *allocs;
    size_t n;
    struct fc_gexec *next;      /* registry (never freed: outstanding allocations outlive it) */
};

struct gmem {
    unsigned long long reserved, used, reserved_high, used_high;
};

static pthread_mutex_t g_glock = PTHREAD_MUTEX_INITIALIZER;
static struct gmem g_gm[FC_MAX_DEVICES];
static struct fc_gexec *g_execs;
/* Graph allocations get fixed virtual addresses of their own (never dereferenced by tests). */
static CUdeviceptr g_next_va = 0x7e0000000000ULL;

static size_t round_gran(size_t n)
{
    return (n + FC_GRANULARITY - 1) & ~(size_t)(FC_GRANULARITY - 1);
}

/* Caller holds g_glock. */
static struct fc_gnode *add_node(CUgraph g, int type, int dev, size_t size, CUdeviceptr dptr)
{
    struct fc_gnode *n = calloc(1, sizeof *n);

    if (!n)
        return NULL;
    n->type = type;
    n->dev = dev;
    n->size = size;
    n->dptr = dptr;
    if (type == CU_GRAPH_NODE_TYPE_MEM_ALLOC) {
        n->dptr = g_next_va;
        g_next_va += size;
    }
    if (g->last)
        g->last->next = n;
    else
        g->nodes = n;
    g->last = n;
    g->n++;
    return n;
}

static int graph_ok(CUgraph g)
{
    return g && g->magic == GRAPH_MAGIC;
}

/* For stream capture (capture.c): records a node; an allocation node's address, else 0. */
CUdeviceptr fc_graph_add(CUgraph g, int type, int dev, size_t size, CUdeviceptr dptr)
{
    struct fc_gnode *n;

    pthread_mutex_lock(&g_glock);
    n = graph_ok(g) ? add_node(g, type, dev, type == CU_GRAPH_NODE_TYPE_MEM_ALLOC ? round_gran(size) : 0, dptr) : NULL;
    pthread_mutex_unlock(&g_glock);
    return n && type == CU_GRAPH_NODE_TYPE_MEM_ALLOC ? n->dptr : 0;
}

/* ------------------------------------------------------------------ graphs */

FC_API CUresult cuGraphCreate(CUgraph *phGraph, unsigned int flags)
{
    CUgraph g;

    (void)flags;
    FC_COUNT(cuGraphCreate);
    if (!fc_initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!phGraph)
        return CUDA_ERROR_INVALID_VALUE;
    if (!(g = calloc(1, sizeof *g)))
        return CUDA_ERROR_OUT_OF_MEMORY;
    g->magic = GRAPH_MAGIC;
    *phGraph = g;
    return CUDA_SUCCESS;
}

FC_API CUresult cuGraphDestroy(CUgraph hGraph)
{
    FC_COUNT(cuGraphDestroy);
    if (!graph_ok(hGraph) || hGraph->moved)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_glock);
    hGraph->magic = 0;          /* nodes and struct kept: node handles may still be asked about */
    pthread_mutex_unlock(&g_glock);
    return CUDA_SUCCESS;
}

FC_API CUresult cuGraphGetNodes(CUgraph hGraph, CUgraphNode *nodes, size_t *numNodes)
{
    size_t i = 0;

    FC_COUNT(cuGraphGetNodes);
    if (!graph_ok(hGraph) || !numNodes)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_glock);
    if (!nodes) {
        *numNodes = hGraph->n;
    } else {
        for (struct fc_gnode *n = hGraph->nodes; n && i < *numNodes; n = n->next)
            nodes[i++] = n;
        *numNodes = i;
    }
    pthread_mutex_unlock(&g_glock);
    return CUDA_SUCCESS;
}

FC_API CUresult cuGraphNodeGetType(CUgraphNode hNode, int *type)
{
    FC_COUNT(cuGraphNodeGetType);
    if (!hNode || !type)
        return CUDA_ERROR_INVALID_VALUE;
    *type = hNode->type;
    return CUDA_SUCCESS;
}

FC_API CUresult cuGraphAddMemAllocNode(CUgraphNode *phGraphNode, CUgraph hGraph, const CUgraphNode *dependencies,
                                       size_t numDependencies, CUDA_MEM_ALLOC_NODE_PARAMS *nodeParams)
{
    struct fc_gnode *n;

    (void)dependencies;
    (void)numDependencies;
    FC_COUNT(cuGraphAddMemAllocNode);
    if (!fc_initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!phGraphNode || !graph_ok(hGraph) || hGraph->moved || !nodeParams || !nodeParams->bytesize ||
        nodeParams->poolProps.location.type != CU_MEM_LOCATION_TYPE_DEVICE)
        return CUDA_ERROR_INVALID_VALUE;
    if (!valid_dev(nodeParams->poolProps.location.id))
        return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&g_glock);
    n = add_node(hGraph, CU_GRAPH_NODE_TYPE_MEM_ALLOC, nodeParams->poolProps.location.id,
                 round_gran(nodeParams->bytesize), 0);
    if (n) {
        nodeParams->dptr = n->dptr;     /* fixed for the graph's lifetime; no memory yet */
        *phGraphNode = n;
    }
    pthread_mutex_unlock(&g_glock);
    return n ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}

FC_API CUresult cuGraphMemAllocNodeGetParams(CUgraphNode hNode, CUDA_MEM_ALLOC_NODE_PARAMS *params_out)
{
    FC_COUNT(cuGraphMemAllocNodeGetParams);
    if (!hNode || !params_out || hNode->type != CU_GRAPH_NODE_TYPE_MEM_ALLOC)
        return CUDA_ERROR_INVALID_VALUE;
    memset(params_out, 0, sizeof *params_out);
    params_out->poolProps.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
    params_out->poolProps.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    params_out->poolProps.location.id = hNode->dev;
    params_out->bytesize = hNode->size;
    params_out->dptr = hNode->dptr;
    return CUDA_SUCCESS;
}

FC_API CUresult cuGraphAddMemFreeNode(CUgraphNode *phGraphNode, CUgraph hGraph, const CUgraphNode *dependencies,
                                      size_t numDependencies, CUdeviceptr dptr)
{
    struct fc_gnode *n;

    (void)dependencies;
    (void)numDependencies;
    FC_COUNT(cuGraphAddMemFreeNode);
    if (!phGraphNode || !graph_ok(hGraph) || hGraph->moved || !dptr)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_glock);
    if ((n = add_node(hGraph, CU_GRAPH_NODE_TYPE_MEM_FREE, -1, 0, dptr)))
        *phGraphNode = n;
    pthread_mutex_unlock(&g_glock);
    return n ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}

/* Caller holds g_glock. Whether g holds memory nodes, however nested. */
static int has_memory_nodes(CUgraph g)
{
    for (struct fc_gnode *n = g->nodes; n; n = n->next)
        if (n->type == CU_GRAPH_NODE_TYPE_MEM_ALLOC || n->type == CU_GRAPH_NODE_TYPE_MEM_FREE ||
            (n->type == CU_GRAPH_NODE_TYPE_GRAPH && has_memory_nodes(n->child)))
            return 1;
    return 0;
}

/* Child graph nodes only (the fake's other node types have their own entry points). A moved child
 * becomes the parent's; a clone is not kept (the fake graphs hold only memory nodes, so a clone of
 * one without them adds nothing a launch would allocate). */
FC_API CUresult cuGraphAddNode_v2(CUgraphNode *phGraphNode, CUgraph hGraph, const CUgraphNode *dependencies,
                                  const CUgraphEdgeData *dependencyData, size_t numDependencies,
                                  CUgraphNodeParams *nodeParams)
{
    struct fc_gnode *n = NULL;
    CUgraph child;
    CUresult rc = CUDA_SUCCESS;

    (void)dependencies;
    (void)dependencyData;
    (void)numDependencies;
    FC_COUNT(cuGraphAddNode_v2);
    if (!fc_initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!phGraphNode || !graph_ok(hGraph) || !nodeParams)
        return CUDA_ERROR_INVALID_VALUE;
    if (nodeParams->type != CU_GRAPH_NODE_TYPE_GRAPH)
        return CUDA_ERROR_NOT_SUPPORTED;
    child = nodeParams->graph.graph;
    pthread_mutex_lock(&g_glock);
    if (!graph_ok(child) || child == hGraph || child->moved ||
        (nodeParams->graph.ownership != CU_GRAPH_CHILD_GRAPH_OWNERSHIP_MOVE &&
         nodeParams->graph.ownership != CU_GRAPH_CHILD_GRAPH_OWNERSHIP_CLONE))
        rc = CUDA_ERROR_INVALID_VALUE;
    else if (nodeParams->graph.ownership == CU_GRAPH_CHILD_GRAPH_OWNERSHIP_CLONE && has_memory_nodes(child))
        rc = CUDA_ERROR_INVALID_VALUE;   /* graphs with memory nodes must be moved in */
    else if (!(n = add_node(hGraph, CU_GRAPH_NODE_TYPE_GRAPH, -1, 0, 0)))
        rc = CUDA_ERROR_OUT_OF_MEMORY;
    else if (nodeParams->graph.ownership == CU_GRAPH_CHILD_GRAPH_OWNERSHIP_MOVE) {
        child->moved = 1;
        n->child = child;
    } else {
        /* An empty clone (see above). */
        if (!(n->child = calloc(1, sizeof *n->child)))
            rc = CUDA_ERROR_OUT_OF_MEMORY;
        else {
            n->child->magic = GRAPH_MAGIC;
            n->child->moved = 1;
        }
    }
    pthread_mutex_unlock(&g_glock);
    if (rc == CUDA_SUCCESS)
        *phGraphNode = n;
    return rc;
}

FC_API CUresult cuGraphMemFreeNodeGetParams(CUgraphNode hNode, CUdeviceptr *dptr_out)
{
    FC_COUNT(cuGraphMemFreeNodeGetParams);
    if (!hNode || !dptr_out || hNode->type != CU_GRAPH_NODE_TYPE_MEM_FREE)
        return CUDA_ERROR_INVALID_VALUE;
    *dptr_out = hNode->dptr;
    return CUDA_SUCCESS;
}

FC_API CUresult cuGraphChildGraphNodeGetGraph(CUgraphNode hNode, CUgraph *phGraph)
{
    FC_COUNT(cuGraphChildGraphNodeGetGraph);
    if (!hNode || !phGraph || hNode->type != CU_GRAPH_NODE_TYPE_GRAPH)
        return CUDA_ERROR_INVALID_VALUE;
    *phGraph = hNode->child;
    return CUDA_SUCCESS;
}

/* ------------------------------------------------------------ instantiation */

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

/* ----------------------------------------------------------- launch, memory */

/* Caller holds g_glock. Makes room for `need` bytes of graph memory on each device, from what the
 * device's graph memory already reserves first; all or nothing. */
static CUresult map_memory(const unsigned long long need[FC_MAX_DEVICES], int take)
{
    unsigned long long grown[FC_MAX_DEVICES] = { 0 };

    for (int d = 0; d < fc_cfg.device_count; d++) {
        struct gmem *m = &g_gm[d];
        unsigned long long spare = m->reserved - m->used;
        if (!need[d] || need[d] <= spare)
            continue;
        if (fc_mem_charge(d, (long long)(need[d] - spare)) != 0) {
            for (int u = 0; u < d; u++)
                if (grown[u]) {
                    g_gm[u].reserved -= grown[u];
                    fc_mem_charge(u, -(long long)grown[u]);
                }
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        grown[d] = need[d] - spare;
        m->reserved += grown[d];
        if (m->reserved > m->reserved_high)
            m->reserved_high = m->reserved;
    }
    if (take)
        for (int d = 0; d < fc_cfg.device_count; d++) {
            g_gm[d].used += need[d];
            if (g_gm[d].used > g_gm[d].used_high)
                g_gm[d].used_high = g_gm[d].used;
        }
    return CUDA_SUCCESS;
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
        rc = map_memory(need, run);
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

int fc_graph_mem_free(CUdeviceptr dptr)
{
    int found = 0;

    pthread_mutex_lock(&g_glock);
    for (struct fc_gexec *e = g_execs; e && !found; e = e->next)
        for (size_t i = 0; i < e->n; i++)
            if (e->allocs[i].live && e->allocs[i].dptr == dptr) {
                e->allocs[i].live = 0;
                g_gm[e->allocs[i].dev].used -= e->allocs[i].size;
                found = 1;
                break;
            }
    pthread_mutex_unlock(&g_glock);
    return found;
}

FC_API CUresult cuDeviceGraphMemTrim(CUdevice device)
{
    struct gmem *m;

    FC_COUNT(cuDeviceGraphMemTrim);
    if (!fc_initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!valid_dev(device))
        return CUDA_ERROR_INVALID_DEVICE;
    m = &g_gm[device];
    pthread_mutex_lock(&g_glock);
    if (m->reserved > m->used) {
        fc_mem_charge(device, -(long long)(m->reserved - m->used));
        m->reserved = m->used;
    }
    pthread_mutex_unlock(&g_glock);
    return CUDA_SUCCESS;
}

static CUresult graph_mem_attr(CUdevice device, int attr, void *value, int set)
{
    unsigned long long *v = value;
    struct gmem *m;
    CUresult rc = CUDA_SUCCESS;

    if (!fc_initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!valid_dev(device))
        return CUDA_ERROR_INVALID_DEVICE;
    if (!value)
        return CUDA_ERROR_INVALID_VALUE;
    m = &g_gm[device];
    pthread_mutex_lock(&g_glock);
    switch (attr) {
    case CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT:
        set ? (void)(rc = CUDA_ERROR_INVALID_VALUE) : (void)(*v = m->used);
        break;
    case CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT:
        set ? (void)(rc = CUDA_ERROR_INVALID_VALUE) : (void)(*v = m->reserved);
        break;
    case CU_GRAPH_MEM_ATTR_USED_MEM_HIGH:           /* only reset to 0 is allowed */
        set ? (void)(*v ? (rc = CUDA_ERROR_INVALID_VALUE) : (m->used_high = m->used)) : (void)(*v = m->used_high);
        break;
    case CU_GRAPH_MEM_ATTR_RESERVED_MEM_HIGH:
        set ? (void)(*v ? (rc = CUDA_ERROR_INVALID_VALUE) : (m->reserved_high = m->reserved))
            : (void)(*v = m->reserved_high);
        break;
    default:
        rc = CUDA_ERROR_INVALID_VALUE;
    }
    pthread_mutex_unlock(&g_glock);
    return rc;
}

FC_API CUresult cuDeviceGetGraphMemAttribute(CUdevice device, int attr, void *value)
{
    FC_COUNT(cuDeviceGetGraphMemAttribute);
    return graph_mem_attr(device, attr, value, 0);
}

FC_API CUresult cuDeviceSetGraphMemAttribute(CUdevice device, int attr, void *value)
{
    FC_COUNT(cuDeviceSetGraphMemAttribute);
    return graph_mem_attr(device, attr, value, 1);
}
