/*
 * graph_mem.c - each device's graph memory in the fake driver: what launches reserve and use,
 * what the application frees (cuMemFreeAsync of a graph allocation), trims and attributes.
 */
#define _GNU_SOURCE
#include <stdlib.h>
#include <string.h>

#include "graph_internal.h"

struct gmem g_gm[FC_MAX_DEVICES];

CUresult fc_graph_map_memory(const unsigned long long need[FC_MAX_DEVICES], int take)
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
