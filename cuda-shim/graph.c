/*
 * graph.c - CUDA graphs of the fake driver: graphs and their nodes (executable graphs: graph_exec.c;
 * each device's graph memory: graph_mem.c; stream capture and stream queries: capture.c).
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

#include "graph_internal.h"

pthread_mutex_t g_glock = PTHREAD_MUTEX_INITIALIZER;
/* Graph allocations get fixed virtual addresses of their own (never dereferenced by tests). */
static CUdeviceptr g_next_va = 0x7e0000000000ULL;

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
