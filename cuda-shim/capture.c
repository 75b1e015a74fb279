/*
 * capture.c - stream queries and stream capture of the fake driver.
 *
 *  - cuStreamGetDevice / cuStreamGetCtx(_v2): a stream belongs to the context
 *    (and device) current when it was made; the default stream handles (NULL,
 *    CU_STREAM_LEGACY, CU_STREAM_PER_THREAD) mean the current context;
 *  - the default stream of an entry point's _ptsz variant is the calling thread's per-thread
 *    default stream (CU_STREAM_PER_THREAD), which can be captured; the legacy default stream
 *    (NULL in the other variants, CU_STREAM_LEGACY) cannot;
 *  - between cuStreamBeginCapture and cuStreamEndCapture, cuMemAllocAsync and
 *    cuMemFreeAsync on the stream allocate and free nothing: they become memory
 *    nodes of the captured graph (graph.c), allocated when it is launched.
 */
#define _GNU_SOURCE
#include <stdlib.h>

#include "internal.h"

#define CAPTURES 64
static pthread_mutex_t g_caplock = PTHREAD_MUTEX_INITIALIZER;
static struct { CUstream s; CUgraph g; } g_cap[CAPTURES];

/* ------------------------------------------------------------ stream queries */

static CUresult stream_device(CUstream s, CUdevice *device)
{
    int dev;

    if (!fc_initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!device)
        return CUDA_ERROR_INVALID_VALUE;
    if ((dev = fc_stream_dev(s)) < 0)
        return (uintptr_t)s > 2 ? CUDA_ERROR_INVALID_HANDLE : CUDA_ERROR_INVALID_CONTEXT;
    *device = dev;
    return CUDA_SUCCESS;
}

FC_API CUresult cuStreamGetDevice(CUstream hStream, CUdevice *device)
{
    FC_COUNT(cuStreamGetDevice);
    return stream_device(hStream, device);
}

FC_API CUresult cuStreamGetDevice_ptsz(CUstream hStream, CUdevice *device)
{
    FC_COUNT(cuStreamGetDevice_ptsz);
    return stream_device(hStream, device);
}

static CUresult stream_ctx(CUstream s, CUcontext *pctx, CUgreenCtx *green)
{
    struct fc_ctx *c;

    if (!fc_initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!pctx)
        return CUDA_ERROR_INVALID_VALUE;
    if (!(c = fc_stream_ctx(s)))
        return (uintptr_t)s > 2 ? CUDA_ERROR_INVALID_HANDLE : CUDA_ERROR_INVALID_CONTEXT;
    *pctx = c;
    if (green)
        *green = NULL;
    return CUDA_SUCCESS;
}

FC_API CUresult cuStreamGetCtx(CUstream hStream, CUcontext *pctx)
{
    FC_COUNT(cuStreamGetCtx);
    return stream_ctx(hStream, pctx, NULL);
}

FC_API CUresult cuStreamGetCtx_v2(CUstream hStream, CUcontext *pctx, CUgreenCtx *pGreenCtx)
{
    FC_COUNT(cuStreamGetCtx_v2);
    return stream_ctx(hStream, pctx, pGreenCtx);
}

FC_API CUresult cuStreamGetCtx_v2_ptsz(CUstream hStream, CUcontext *pctx, CUgreenCtx *pGreenCtx)
{
    FC_COUNT(cuStreamGetCtx_v2_ptsz);
    return stream_ctx(hStream, pctx, pGreenCtx);
}

/* ---------------------------------------------------------------- capture */

/* The calling thread's per-thread default stream, as a capture key (never dereferenced). */
static __thread char g_per_thread_stream;

CUstream fc_ptsz_stream(CUstream s)
{
    return s ? s : CU_STREAM_PER_THREAD;
}

/* Caller holds g_caplock. The capture slot of a stream, or -1. */
static int capture_of(CUstream s)
{
    if (s == CU_STREAM_PER_THREAD)
        s = (CUstream)(void *)&g_per_thread_stream;
    else if ((uintptr_t)s <= 2)
        return -1;
    for (int i = 0; i < CAPTURES; i++)
        if (g_cap[i].s == s)
            return i;
    return -1;
}

static CUresult begin_capture(CUstream s)
{
    CUgraph g;
    CUresult rc = CUDA_ERROR_OUT_OF_MEMORY;

    if (!fc_initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    /* The legacy default stream cannot be captured; the per-thread one can. */
    if (!s || s == CU_STREAM_LEGACY)
        return CUDA_ERROR_NOT_SUPPORTED;
    if (fc_stream_dev(s) < 0)
        return s == CU_STREAM_PER_THREAD ? CUDA_ERROR_INVALID_CONTEXT : CUDA_ERROR_INVALID_HANDLE;
    if (cuGraphCreate(&g, 0) != CUDA_SUCCESS)
        return CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&g_caplock);
    if (capture_of(s) >= 0) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else {
        for (int i = 0; i < CAPTURES; i++)
            if (!g_cap[i].s) {
                g_cap[i].s = s == CU_STREAM_PER_THREAD ? (CUstream)(void *)&g_per_thread_stream : s;
                g_cap[i].g = g;
                rc = CUDA_SUCCESS;
                break;
            }
    }
    pthread_mutex_unlock(&g_caplock);
    if (rc != CUDA_SUCCESS)
        cuGraphDestroy(g);
    return rc;
}

FC_API CUresult cuStreamBeginCapture(CUstream hStream)
{
    FC_COUNT(cuStreamBeginCapture);
    return begin_capture(hStream);
}

FC_API CUresult cuStreamBeginCapture_ptsz(CUstream hStream)
{
    FC_COUNT(cuStreamBeginCapture_ptsz);
    return begin_capture(fc_ptsz_stream(hStream));
}

FC_API CUresult cuStreamBeginCapture_v2(CUstream hStream, int mode)
{
    (void)mode;
    FC_COUNT(cuStreamBeginCapture_v2);
    return begin_capture(hStream);
}

FC_API CUresult cuStreamBeginCapture_v2_ptsz(CUstream hStream, int mode)
{
    (void)mode;
    FC_COUNT(cuStreamBeginCapture_v2_ptsz);
    return begin_capture(fc_ptsz_stream(hStream));
}

static CUresult end_capture(CUstream s, CUgraph *out)
{
    int i;

    if (!fc_initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!out)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_caplock);
    if ((i = capture_of(s)) >= 0) {
        *out = g_cap[i].g;
        g_cap[i].s = NULL;
        g_cap[i].g = NULL;
    }
    pthread_mutex_unlock(&g_caplock);
    return i >= 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;   /* not capturing */
}

FC_API CUresult cuStreamEndCapture(CUstream hStream, CUgraph *phGraph)
{
    FC_COUNT(cuStreamEndCapture);
    return end_capture(hStream, phGraph);
}

FC_API CUresult cuStreamEndCapture_ptsz(CUstream hStream, CUgraph *phGraph)
{
    FC_COUNT(cuStreamEndCapture_ptsz);
    return end_capture(fc_ptsz_stream(hStream), phGraph);
}

static CUresult is_capturing(CUstream s, int *status)
{
    if (!fc_initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!status)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_caplock);
    *status = capture_of(s) >= 0 ? CU_STREAM_CAPTURE_STATUS_ACTIVE : CU_STREAM_CAPTURE_STATUS_NONE;
    pthread_mutex_unlock(&g_caplock);
    return CUDA_SUCCESS;
}

FC_API CUresult cuStreamIsCapturing(CUstream hStream, int *captureStatus)
{
    FC_COUNT(cuStreamIsCapturing);
    return is_capturing(hStream, captureStatus);
}

FC_API CUresult cuStreamIsCapturing_ptsz(CUstream hStream, int *captureStatus)
{
    FC_COUNT(cuStreamIsCapturing_ptsz);
    return is_capturing(fc_ptsz_stream(hStream), captureStatus);
}

int fc_capture_alloc(CUstream s, CUdeviceptr *dptr, size_t size, int dev)
{
    CUgraph g = NULL;
    int i;

    pthread_mutex_lock(&g_caplock);
    if ((i = capture_of(s)) >= 0)
        g = g_cap[i].g;
    pthread_mutex_unlock(&g_caplock);
    if (g)
        *dptr = fc_graph_add(g, CU_GRAPH_NODE_TYPE_MEM_ALLOC, dev, size, 0);
    return g != NULL;
}

int fc_capture_free(CUstream s, CUdeviceptr dptr)
{
    CUgraph g = NULL;
    int i;

    pthread_mutex_lock(&g_caplock);
    if ((i = capture_of(s)) >= 0)
        g = g_cap[i].g;
    pthread_mutex_unlock(&g_caplock);
    if (g)
        fc_graph_add(g, CU_GRAPH_NODE_TYPE_MEM_FREE, -1, 0, dptr);
    return g != NULL;
}

