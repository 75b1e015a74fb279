/*
 * graph_internal.h - what the fake driver's graph units share: graphs and their nodes (graph.c),
 * executable graphs, their instantiation, update and launch (graph_exec.c), and each device's
 * graph memory (graph_mem.c). Every structure here is guarded by g_glock.
 */
#ifndef VRAMCAP_FAKECUDA_GRAPH_INTERNAL_H
#define VRAMCAP_FAKECUDA_GRAPH_INTERNAL_H

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
    CUgraph graph;              /* the graph its nodes are taken from (instantiated or updated with) */
    int auto_free;              /* CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH */
    struct galloc *allocs;
    size_t n;
    struct fc_gexec *next;      /* registry (never freed: outstanding allocations outlive it) */
};

struct gmem {
    unsigned long long reserved, used, reserved_high, used_high;
};

extern pthread_mutex_t g_glock;
extern struct gmem g_gm[FC_MAX_DEVICES];
extern struct fc_gexec *g_execs;    /* every executable graph (never freed) */

static inline size_t round_gran(size_t n)
{
    return (n + FC_GRANULARITY - 1) & ~(size_t)(FC_GRANULARITY - 1);
}

static inline int graph_ok(CUgraph g)
{
    return g && g->magic == GRAPH_MAGIC;
}

/* graph_mem.c. Caller holds g_glock: makes room for `need` bytes of graph memory on each device,
 * from what the device's graph memory already reserves first; all or nothing; `take`: the launch
 * uses it (else an upload only backs it). */
CUresult fc_graph_map_memory(const unsigned long long need[FC_MAX_DEVICES], int take);

#endif
