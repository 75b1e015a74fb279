/*
 * context.c - contexts (per-thread stack, one primary context per device)
 * and streams of the fake driver.  Work is synchronous, so contexts only
 * name a device and streams are checked tokens.
 */
#define _GNU_SOURCE
#include <stdlib.h>

#include "internal.h"

/* ---------------------------------------------------------------- contexts */

/* One primary context per device; user contexts are kept in a registry and
 * never freed, so a stale handle is detected instead of being a dangling
 * pointer. */
static struct fc_ctx g_primary[FC_MAX_DEVICES];
static int g_primary_refs[FC_MAX_DEVICES];
static unsigned int g_primary_flags[FC_MAX_DEVICES];
static pthread_mutex_t g_ctx_lock = PTHREAD_MUTEX_INITIALIZER;
static struct fc_ctx *g_user_ctxs;

/* Per-thread context stack, as in the real driver. */
#define CTX_STACK_MAX 64
static _Thread_local struct fc_ctx *tls_stack[CTX_STACK_MAX];
static _Thread_local int tls_depth;

struct fc_ctx *fc_current_ctx(void)
{
    struct fc_ctx *c;

    if (tls_depth == 0)
        return NULL;
    c = tls_stack[tls_depth - 1];
    if (!c || atomic_load_explicit(&c->destroyed, memory_order_relaxed))
        return NULL;
    return c;
}

static int ctx_valid(struct fc_ctx *c)
{
    struct fc_ctx *it;
    int ok = 0;

    if (!c)
        return 0;
    for (int i = 0; i < fc_cfg.device_count; i++)
        if (c == &g_primary[i])
            return 1;
    if (fc_green_ctx_valid(c))
        return 1;
    pthread_mutex_lock(&g_ctx_lock);
    for (it = g_user_ctxs; it; it = it->next)
        if (it == c) {
            ok = !atomic_load(&c->destroyed);
            break;
        }
    pthread_mutex_unlock(&g_ctx_lock);
    return ok;
}

static CUresult ctx_create(CUcontext *pctx, unsigned int flags, CUdevice dev)
{
    struct fc_ctx *c;

    (void)flags;
    DEV_CHECK(pctx, dev);
    if (tls_depth >= CTX_STACK_MAX)
        return CUDA_ERROR_OUT_OF_MEMORY;
    c = calloc(1, sizeof *c);
    if (!c)
        return CUDA_ERROR_OUT_OF_MEMORY;
    c->dev = dev;
    c->usage = 1;               /* documented: a new context has a usage count of one */
    /* Begun under the registry's lock: a library loaded meanwhile is in it or loads into it. */
    pthread_mutex_lock(&g_ctx_lock);
    if (fc_ctx_begin(c) != CUDA_SUCCESS) {   /* a context takes device memory of its own */
        pthread_mutex_unlock(&g_ctx_lock);
        free(c);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    c->next = g_user_ctxs;
    g_user_ctxs = c;
    pthread_mutex_unlock(&g_ctx_lock);
    tls_stack[tls_depth++] = c;   /* a new context is pushed as current */
    *pctx = c;
    return CUDA_SUCCESS;
}

FC_API CUresult cuCtxCreate(CUcontext *pctx, unsigned int flags, CUdevice dev)
{
    FC_COUNT(cuCtxCreate);
    return ctx_create(pctx, flags, dev);
}

FC_API CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev)
{
    FC_COUNT(cuCtxCreate_v2);
    return ctx_create(pctx, flags, dev);
}

/* Execution affinity (MPS) is accepted and ignored: work here is synchronous anyway. */
FC_API CUresult cuCtxCreate_v3(CUcontext *pctx, CUexecAffinityParam *paramsArray, int numParams,
                               unsigned int flags, CUdevice dev)
{
    FC_COUNT(cuCtxCreate_v3);
    if (numParams < 0 || (numParams > 0 && !paramsArray))
        return fc_initialized() ? CUDA_ERROR_INVALID_VALUE : CUDA_ERROR_NOT_INITIALIZED;
    return ctx_create(pctx, flags, dev);
}

/* NULL parameters make a regular context; both affinity and CIG parameters at once are invalid. */
FC_API CUresult cuCtxCreate_v4(CUcontext *pctx, CUctxCreateParams *params, unsigned int flags, CUdevice dev)
{
    FC_COUNT(cuCtxCreate_v4);
    if (params && params->execAffinityParams && params->cigParams)
        return fc_initialized() ? CUDA_ERROR_INVALID_VALUE : CUDA_ERROR_NOT_INITIALIZED;
    return ctx_create(pctx, flags, dev);
}

/* The end of a user context: flagged (other threads still holding it see it destroyed), dropped
 * from the calling thread's stack, and its memory freed as cuCtxDestroy's documentation says. */
static void ctx_end(CUcontext ctx)
{
    int j = 0;

    atomic_store(&ctx->destroyed, 1);
    for (int i = 0; i < tls_depth; i++)
        if (tls_stack[i] != ctx)
            tls_stack[j++] = tls_stack[i];
    tls_depth = j;
    fc_ctx_free_memory(ctx);
    fc_ctx_finish(ctx);
}

static CUresult ctx_destroy(CUcontext ctx)
{
    if (!fc_initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!ctx_valid(ctx) || ctx->primary)
        return CUDA_ERROR_INVALID_CONTEXT;
    ctx_end(ctx);
    return CUDA_SUCCESS;
}

FC_API CUresult cuCtxDestroy(CUcontext ctx)
{
    FC_COUNT(cuCtxDestroy);
    return ctx_destroy(ctx);
}

FC_API CUresult cuCtxDestroy_v2(CUcontext ctx)
{
    FC_COUNT(cuCtxDestroy_v2);
    return ctx_destroy(ctx);
}

/* Deprecated usage counts: cuCtxAttach raises the current context's, cuCtxDetach lowers it and
 * destroys the context (as cuCtxDestroy) when it reaches zero. Detach takes a context current to
 * the calling thread and pops it (PyCUDA relies on that: it pushes, then detaches). A primary
 * context's lifetime is its retain count: detach never destroys one. */
FC_API CUresult cuCtxAttach(CUcontext *pctx, unsigned int flags)
{
    struct fc_ctx *c;

    FC_COUNT(cuCtxAttach);
    if (!fc_initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!pctx || flags)
        return CUDA_ERROR_INVALID_VALUE;
    if (!(c = fc_current_ctx()))
        return CUDA_ERROR_INVALID_CONTEXT;
    pthread_mutex_lock(&g_ctx_lock);
    c->usage++;
    pthread_mutex_unlock(&g_ctx_lock);
    *pctx = c;
    return CUDA_SUCCESS;
}

FC_API CUresult cuCtxDetach(CUcontext ctx)
{
    int end;

    FC_COUNT(cuCtxDetach);
    if (!fc_initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!ctx_valid(ctx) || fc_current_ctx() != ctx)
        return CUDA_ERROR_INVALID_CONTEXT;
    pthread_mutex_lock(&g_ctx_lock);
    if (ctx->usage <= 0) {
        pthread_mutex_unlock(&g_ctx_lock);
        return CUDA_ERROR_INVALID_CONTEXT;
    }
    end = --ctx->usage == 0 && !ctx->primary;
    pthread_mutex_unlock(&g_ctx_lock);
    tls_depth--;                /* it is the current one: popped */
    if (end)
        ctx_end(ctx);
    return CUDA_SUCCESS;
}

FC_API CUresult cuCtxGetCurrent(CUcontext *pctx)
{
    FC_COUNT(cuCtxGetCurrent);
    if (!fc_initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!pctx)
        return CUDA_ERROR_INVALID_VALUE;
    *pctx = fc_current_ctx();
    return CUDA_SUCCESS;
}

FC_API CUresult cuCtxSetCurrent(CUcontext ctx)
{
    FC_COUNT(cuCtxSetCurrent);
    if (!fc_initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!ctx) {                 /* NULL pops the top, or is a no-op */
        if (tls_depth > 0)
            tls_depth--;
        return CUDA_SUCCESS;
    }
    if (!ctx_valid(ctx))
        return CUDA_ERROR_INVALID_CONTEXT;
    if (tls_depth == 0)
        tls_depth = 1;
    tls_stack[tls_depth - 1] = ctx;
    return CUDA_SUCCESS;
}

static CUresult ctx_push(CUcontext ctx)
{
    if (!fc_initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!ctx_valid(ctx))
        return CUDA_ERROR_INVALID_CONTEXT;
    if (tls_depth >= CTX_STACK_MAX)
        return CUDA_ERROR_OUT_OF_MEMORY;
    tls_stack[tls_depth++] = ctx;
    return CUDA_SUCCESS;
}

FC_API CUresult cuCtxPushCurrent(CUcontext ctx)
{
    FC_COUNT(cuCtxPushCurrent);
    return ctx_push(ctx);
}

FC_API CUresult cuCtxPushCurrent_v2(CUcontext ctx)
{
    FC_COUNT(cuCtxPushCurrent_v2);
    return ctx_push(ctx);
}

static CUresult ctx_pop(CUcontext *pctx)
{
    if (!fc_initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    if (tls_depth == 0)
        return CUDA_ERROR_INVALID_CONTEXT;
    tls_depth--;
    if (pctx)                   /* the out-pointer is optional */
        *pctx = tls_stack[tls_depth];
    return CUDA_SUCCESS;
}

FC_API CUresult cuCtxPopCurrent(CUcontext *pctx)
{
    FC_COUNT(cuCtxPopCurrent);
    return ctx_pop(pctx);
}

FC_API CUresult cuCtxPopCurrent_v2(CUcontext *pctx)
{
    FC_COUNT(cuCtxPopCurrent_v2);
    return ctx_pop(pctx);
}

FC_API CUresult cuCtxGetDevice(CUdevice *dev)
{
    struct fc_ctx *c;

    FC_COUNT(cuCtxGetDevice);
    if (!fc_initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!dev)
        return CUDA_ERROR_INVALID_VALUE;
    if (!(c = fc_current_ctx()))
        return CUDA_ERROR_INVALID_CONTEXT;
    *dev = c->dev;
    return CUDA_SUCCESS;
}

FC_API CUresult cuCtxGetDevice_v2(CUdevice *dev, CUcontext ctx)
{
    FC_COUNT(cuCtxGetDevice_v2);
    if (!fc_initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!dev)
        return CUDA_ERROR_INVALID_VALUE;
    if (!ctx)
        ctx = fc_current_ctx();
    else if (!ctx_valid(ctx))
        ctx = NULL;
    if (!ctx)
        return CUDA_ERROR_INVALID_CONTEXT;
    *dev = ctx->dev;
    return CUDA_SUCCESS;
}

FC_API CUresult cuCtxSynchronize(void)
{
    struct fc_ctx *c;

    FC_COUNT(cuCtxSynchronize);
    if (!fc_initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!(c = fc_current_ctx()))
        return CUDA_ERROR_INVALID_CONTEXT;
    fc_pools_sync(c->dev);      /* pools give back memory above their release threshold */
    return CUDA_SUCCESS;
}

CUresult fc_ctx_each_live(CUresult (*fn)(struct fc_ctx *, void *), void *arg)
{
    CUresult rc = CUDA_SUCCESS;
    struct fc_ctx *it;

    pthread_mutex_lock(&g_ctx_lock);
    for (int i = 0; i < fc_cfg.device_count && rc == CUDA_SUCCESS; i++)
        if (g_primary_refs[i] > 0)
            rc = fn(&g_primary[i], arg);
    for (it = g_user_ctxs; it && rc == CUDA_SUCCESS; it = it->next)
        if (!atomic_load(&it->destroyed))
            rc = fn(it, arg);
    pthread_mutex_unlock(&g_ctx_lock);
    return rc;
}

/* ------------------------------------------------------- primary contexts */

CUresult fc_primary_retain(int dev, struct fc_ctx **out)
{
    pthread_mutex_lock(&g_ctx_lock);
    g_primary[dev].dev = dev;
    g_primary[dev].primary = 1;
    /* The first retain creates the context: it takes its memory then, or fails. */
    if (g_primary_refs[dev] == 0 && fc_ctx_begin(&g_primary[dev]) != CUDA_SUCCESS) {
        pthread_mutex_unlock(&g_ctx_lock);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    g_primary_refs[dev]++;
    pthread_mutex_unlock(&g_ctx_lock);
    *out = &g_primary[dev];
    return CUDA_SUCCESS;
}

FC_API CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev)
{
    FC_COUNT(cuDevicePrimaryCtxRetain);
    DEV_CHECK(pctx, dev);
    return fc_primary_retain(dev, pctx);
}

/* Documented: the context is reset once the last reference is released (its memory freed);
 * releasing one that is not retained fails with CUDA_ERROR_INVALID_CONTEXT. */
CUresult fc_primary_release(int dev)
{
    CUresult rc = CUDA_SUCCESS;
    int last = 0;

    if (!fc_initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!valid_dev(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&g_ctx_lock);
    if (g_primary_refs[dev] > 0)
        last = --g_primary_refs[dev] == 0;
    else
        rc = CUDA_ERROR_INVALID_CONTEXT;
    if (last) {                 /* under the lock: a racing retain gets a context already reset */
        fc_ctx_free_memory(&g_primary[dev]);
        fc_green_primary_ended(dev);
        fc_ctx_finish(&g_primary[dev]);
    }
    pthread_mutex_unlock(&g_ctx_lock);
    return rc;
}

FC_API CUresult cuDevicePrimaryCtxRelease(CUdevice dev)
{
    FC_COUNT(cuDevicePrimaryCtxRelease);
    return fc_primary_release(dev);
}

FC_API CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev)
{
    FC_COUNT(cuDevicePrimaryCtxRelease_v2);
    return fc_primary_release(dev);
}

/* Reset destroys the primary context's allocations and state but keeps its retain count
 * (documented: "Resetting the primary context does not release it"). VMM handles and
 * stream-ordered memory are the device's: they stay. */
static CUresult primary_reset(CUdevice dev)
{
    if (!fc_initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!valid_dev(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&g_ctx_lock);
    g_primary_flags[dev] = 0;
    g_primary[dev].dev = dev;
    g_primary[dev].primary = 1;
    fc_ctx_free_memory(&g_primary[dev]);
    fc_green_primary_ended(dev);
    fc_ctx_reset_modules(&g_primary[dev]);
    pthread_mutex_unlock(&g_ctx_lock);
    return CUDA_SUCCESS;
}

FC_API CUresult cuDevicePrimaryCtxReset(CUdevice dev)
{
    FC_COUNT(cuDevicePrimaryCtxReset);
    return primary_reset(dev);
}

FC_API CUresult cuDevicePrimaryCtxReset_v2(CUdevice dev)
{
    FC_COUNT(cuDevicePrimaryCtxReset_v2);
    return primary_reset(dev);
}

FC_API CUresult cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int *flags, int *active)
{
    FC_COUNT(cuDevicePrimaryCtxGetState);
    if (!fc_initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!flags || !active)
        return CUDA_ERROR_INVALID_VALUE;
    if (!valid_dev(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&g_ctx_lock);
    *flags = g_primary_flags[dev];
    *active = g_primary_refs[dev] > 0;
    pthread_mutex_unlock(&g_ctx_lock);
    return CUDA_SUCCESS;
}

static CUresult primary_set_flags(CUdevice dev, unsigned int flags)
{
    if (!fc_initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!valid_dev(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&g_ctx_lock);
    g_primary_flags[dev] = flags;
    pthread_mutex_unlock(&g_ctx_lock);
    return CUDA_SUCCESS;
}

FC_API CUresult cuDevicePrimaryCtxSetFlags(CUdevice dev, unsigned int flags)
{
    FC_COUNT(cuDevicePrimaryCtxSetFlags);
    return primary_set_flags(dev, flags);
}

FC_API CUresult cuDevicePrimaryCtxSetFlags_v2(CUdevice dev, unsigned int flags)
{
    FC_COUNT(cuDevicePrimaryCtxSetFlags_v2);
    return primary_set_flags(dev, flags);
}

/* ----------------------------------------------------------------- streams */

/* Work is synchronous, so a stream is just a checked token. */
#define STREAM_MAGIC 0x5354524dU
struct fc_stream {
    unsigned int magic;
    int dev;
    struct fc_ctx *ctx;     /* cuStreamGetCtx */
};

FC_API CUresult cuStreamCreate(CUstream *phStream, unsigned int flags)
{
    struct fc_ctx *c;
    struct fc_stream *s;

    (void)flags;
    FC_COUNT(cuStreamCreate);
    if (!fc_initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!phStream)
        return CUDA_ERROR_INVALID_VALUE;
    if (!(c = fc_current_ctx()))
        return CUDA_ERROR_INVALID_CONTEXT;
    if (!(s = malloc(sizeof *s)))
        return CUDA_ERROR_OUT_OF_MEMORY;
    s->magic = STREAM_MAGIC;
    s->dev = c->dev;
    s->ctx = c;
    *phStream = s;
    return CUDA_SUCCESS;
}

static CUresult stream_destroy(CUstream s)
{
    if (!fc_initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!s || s->magic != STREAM_MAGIC)
        return CUDA_ERROR_INVALID_HANDLE;
    s->magic = 0;
    free(s);
    return CUDA_SUCCESS;
}

FC_API CUresult cuStreamDestroy(CUstream hStream)
{
    FC_COUNT(cuStreamDestroy);
    return stream_destroy(hStream);
}

FC_API CUresult cuStreamDestroy_v2(CUstream hStream)
{
    FC_COUNT(cuStreamDestroy_v2);
    return stream_destroy(hStream);
}

static CUresult stream_sync(CUstream hStream)
{
    struct fc_ctx *c;

    if (!fc_initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    if (hStream && hStream->magic != STREAM_MAGIC)
        return CUDA_ERROR_INVALID_HANDLE;
    if (hStream)
        fc_pools_sync(hStream->dev);
    else if ((c = fc_current_ctx()))
        fc_pools_sync(c->dev);
    return CUDA_SUCCESS;
}

FC_API CUresult cuStreamSynchronize(CUstream hStream)
{
    FC_COUNT(cuStreamSynchronize);
    return stream_sync(hStream);
}

FC_API CUresult cuStreamSynchronize_ptsz(CUstream hStream)
{
    FC_COUNT(cuStreamSynchronize_ptsz);
    return stream_sync(hStream);
}

/* The device a stream belongs to (NULL and the legacy/per-thread default stream handles: the
 * current context's), or -1. */
int fc_stream_dev(CUstream s)
{
    struct fc_ctx *c;

    if ((uintptr_t)s > 2)
        return s->magic == STREAM_MAGIC ? s->dev : -1;
    return (c = fc_current_ctx()) ? c->dev : -1;
}

/* The context a stream belongs to (default streams: the current one), or NULL. */
struct fc_ctx *fc_stream_ctx(CUstream s)
{
    if ((uintptr_t)s > 2)
        return s->magic == STREAM_MAGIC ? s->ctx : NULL;
    return fc_current_ctx();
}
