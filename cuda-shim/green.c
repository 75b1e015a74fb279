/*
 * green.c - green contexts (CUDA 12.4), as the driver API documents them, and only as far as
 * memory goes:
 *  - cuDeviceGetDevResource gives a device's SM resource, cuDevResourceGenerateDesc a descriptor
 *    of resources (work here is synchronous: SM counts are carried, never enforced);
 *  - cuGreenCtxCreate retains the device's primary context for the green context's lifetime;
 *    cuGreenCtxDestroy releases it (so it can be the last release, which resets the primary
 *    context and frees its memory);
 *  - cuCtxFromGreenCtx gives the CUcontext that represents the green context, treated as the
 *    primary context: what is allocated while it is current is the primary context's memory, freed
 *    when the primary context ends (fc_green_primary_ended), not before, even if the green context
 *    was destroyed; it cannot be destroyed with cuCtxDestroy. It is valid while the green context
 *    lives;
 *  - a green context takes device memory of its own (its streams and per-SM state): a quarter of
 *    FAKECUDA_CTX_BYTES, from cuGreenCtxCreate (CUDA_ERROR_OUT_OF_MEMORY when it does not fit) to
 *    cuGreenCtxDestroy, through fc_mem_overhead like a context's (free memory, NVML's per-process
 *    list).
 * Green contexts are kept in a registry and never freed, so a stale handle is detected.
 */
#define _GNU_SOURCE
#include <stdlib.h>

#include "internal.h"

#define GREEN_MAGIC 0x47524e43U
#define RESDESC_MAGIC 0x52534443U
#define FC_SM_COUNT 132                 /* SMs of every fake device */
#define CU_GREEN_CTX_DEFAULT_STREAM 0x1

struct fc_resdesc {
    unsigned int magic;
    unsigned int sm_count;
};

struct fc_green {
    unsigned int magic;     /* 0 once destroyed */
    unsigned long long cost;    /* its own device memory */
    struct fc_ctx ctx;      /* what cuCtxFromGreenCtx hands out */
    struct fc_green *next;
};

static pthread_mutex_t g_green_lock = PTHREAD_MUTEX_INITIALIZER;
static struct fc_green *g_greens;

static struct fc_green *green_live(CUgreenCtx g)
{
    struct fc_green *it;

    pthread_mutex_lock(&g_green_lock);
    for (it = g_greens; it && it != g; it = it->next)
        ;
    if (it && it->magic != GREEN_MAGIC)
        it = NULL;
    pthread_mutex_unlock(&g_green_lock);
    return it;
}

int fc_green_ctx_valid(struct fc_ctx *c)
{
    struct fc_green *it;
    int ok = 0;

    pthread_mutex_lock(&g_green_lock);
    for (it = g_greens; it; it = it->next)
        if (&it->ctx == c) {
            ok = it->magic == GREEN_MAGIC;
            break;
        }
    pthread_mutex_unlock(&g_green_lock);
    return ok;
}

void fc_green_primary_ended(int dev)
{
    struct fc_green *it;

    pthread_mutex_lock(&g_green_lock);
    for (it = g_greens; it; it = it->next)
        if (it->ctx.dev == dev)
            fc_ctx_free_memory(&it->ctx);
    pthread_mutex_unlock(&g_green_lock);
}

FC_API CUresult cuDeviceGetDevResource(CUdevice device, CUdevResource *resource, CUdevResourceType type)
{
    FC_COUNT(cuDeviceGetDevResource);
    DEV_CHECK(resource, device);
    if (type != CU_DEV_RESOURCE_TYPE_SM)
        return CUDA_ERROR_INVALID_VALUE;
    resource->type = CU_DEV_RESOURCE_TYPE_SM;
    resource->sm.smCount = FC_SM_COUNT;
    return CUDA_SUCCESS;
}

FC_API CUresult cuDevResourceGenerateDesc(CUdevResourceDesc *phDesc, CUdevResource *resources,
                                          unsigned int nbResources)
{
    struct fc_resdesc *d;
    unsigned int sms = 0;

    FC_COUNT(cuDevResourceGenerateDesc);
    if (!fc_initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!phDesc || !resources || nbResources == 0)
        return CUDA_ERROR_INVALID_VALUE;
    for (unsigned int i = 0; i < nbResources; i++) {
        if (resources[i].type != CU_DEV_RESOURCE_TYPE_SM)
            return CUDA_ERROR_INVALID_RESOURCE_TYPE;
        sms += resources[i].sm.smCount;
    }
    if (!(d = malloc(sizeof *d)))
        return CUDA_ERROR_OUT_OF_MEMORY;
    d->magic = RESDESC_MAGIC;
    d->sm_count = sms;
    *phDesc = d;
    return CUDA_SUCCESS;
}

FC_API CUresult cuGreenCtxCreate(CUgreenCtx *phCtx, CUdevResourceDesc desc, CUdevice dev, unsigned int flags)
{
    struct fc_green *g;
    struct fc_ctx *primary;
    CUresult rc;

    FC_COUNT(cuGreenCtxCreate);
    DEV_CHECK(phCtx, dev);
    if (!desc || desc->magic != RESDESC_MAGIC || (flags & ~CU_GREEN_CTX_DEFAULT_STREAM))
        return CUDA_ERROR_INVALID_VALUE;
    if (!(g = calloc(1, sizeof *g)))
        return CUDA_ERROR_OUT_OF_MEMORY;
    /* It retains the primary context, which its creation may create (and find no room for). */
    if ((rc = fc_primary_retain(dev, &primary)) != CUDA_SUCCESS) {
        free(g);
        return rc;
    }
    g->cost = fc_cfg.ctx_bytes / 4;
    if (g->cost && fc_mem_overhead(dev, (long long)g->cost) != 0) {
        fc_primary_release(dev);
        free(g);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    g->magic = GREEN_MAGIC;
    g->ctx.dev = dev;
    g->ctx.primary = 1;         /* "treated as if it were a primary context" */
    pthread_mutex_lock(&g_green_lock);
    g->next = g_greens;
    g_greens = g;
    pthread_mutex_unlock(&g_green_lock);
    *phCtx = g;
    return CUDA_SUCCESS;
}

FC_API CUresult cuCtxFromGreenCtx(CUcontext *pContext, CUgreenCtx hCtx)
{
    struct fc_green *g;

    FC_COUNT(cuCtxFromGreenCtx);
    if (!fc_initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!pContext)
        return CUDA_ERROR_INVALID_VALUE;
    if (!(g = green_live(hCtx)))
        return CUDA_ERROR_INVALID_HANDLE;
    *pContext = &g->ctx;
    return CUDA_SUCCESS;
}

FC_API CUresult cuGreenCtxDestroy(CUgreenCtx hCtx)
{
    struct fc_green *g;
    int dev;

    FC_COUNT(cuGreenCtxDestroy);
    if (!fc_initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!(g = green_live(hCtx)))
        return CUDA_ERROR_INVALID_HANDLE;
    pthread_mutex_lock(&g_green_lock);
    g->magic = 0;
    pthread_mutex_unlock(&g_green_lock);
    atomic_store(&g->ctx.destroyed, 1);
    dev = g->ctx.dev;
    if (g->cost)
        fc_mem_overhead(dev, -(long long)g->cost);
    /* The primary context the green context retained: its last release frees its memory, which
     * includes everything allocated in the green context. */
    return fc_primary_release(dev);
}
