/*
 * arrays.c - CUDA arrays of the fake driver: bytes from the descriptor, charged to the current
 * context's device and freed with that context (cuCtxDestroy's documentation).
 * Documented rules kept here: a layered or cubemap array's Depth is its layer (face) count, so a
 * mipmapped one has every layer at every level; a SPARSE or DEFERRED_MAPPING array is allocated
 * without physical backing (its memory comes later from cuMemCreate, mapped by cuMemMapArrayAsync);
 * a mipmapped array's level count is clamped to [1, 1 + floor(log2(max(width, height, depth)))].
 */
#define _GNU_SOURCE
#include <stdlib.h>

#include "internal.h"

/* -------------------------------------------------------------- arrays */

#define ARRAY_MAGIC 0x41525259U
struct fc_array {
    unsigned int magic;
    int dev;
    size_t bytes;
    struct fc_ctx *ctx;         /* destroyed with this context */
    struct fc_array *prev, *next;
};
static struct fc_array g_arrays = { .prev = &g_arrays, .next = &g_arrays };
static pthread_mutex_t g_array_lock = PTHREAD_MUTEX_INITIALIZER;

static size_t format_bytes(int f)
{
    switch (f) {
    case 0x01: case 0x08: return 1;
    case 0x02: case 0x09: case 0x10: return 2;
    case 0x03: case 0x0a: case 0x20: return 4;
    default: return 0;
    }
}

static size_t dim(size_t v)
{
    return v ? v : 1;
}

#define ARRAY_LAYERS   (0x01 | 0x04)   /* CUDA_ARRAY3D_LAYERED, CUDA_ARRAY3D_CUBEMAP */
#define ARRAY_UNBACKED (0x40 | 0x80)   /* CUDA_ARRAY3D_SPARSE, CUDA_ARRAY3D_DEFERRED_MAPPING */

/* bytes: what the array takes from the device (0 for an array without physical backing). */
static CUresult array_new(struct fc_array **out, size_t bytes, int unbacked)
{
    struct fc_ctx *c;
    struct fc_array *a;
    CUresult rc;

    if (!fc_initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!(c = fc_current_ctx()))
        return CUDA_ERROR_INVALID_CONTEXT;
    if (bytes == 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (unbacked)
        bytes = 0;
    if ((rc = fc_mem_inject()) != 0)
        return rc;
    if (!(a = calloc(1, sizeof *a)))
        return CUDA_ERROR_OUT_OF_MEMORY;
    if (bytes && fc_mem_charge(c->dev, (long long)bytes) != 0) {
        free(a);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    a->magic = ARRAY_MAGIC;
    a->dev = c->dev;
    a->bytes = bytes;
    a->ctx = c;
    pthread_mutex_lock(&g_array_lock);
    a->next = g_arrays.next;
    a->prev = &g_arrays;
    a->next->prev = a;
    g_arrays.next = a;
    pthread_mutex_unlock(&g_array_lock);
    *out = a;
    return CUDA_SUCCESS;
}

/* Unlinks and frees; g_array_lock held. */
static void array_free(struct fc_array *a)
{
    a->magic = 0;
    a->prev->next = a->next;
    a->next->prev = a->prev;
    if (a->bytes)
        fc_mem_charge(a->dev, -(long long)a->bytes);
    free(a);
}

static CUresult array_destroy(struct fc_array *a)
{
    CUresult rc = CUDA_ERROR_INVALID_HANDLE;

    if (!fc_initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    pthread_mutex_lock(&g_array_lock);
    if (a && a->magic == ARRAY_MAGIC) {
        array_free(a);
        rc = CUDA_SUCCESS;
    }
    pthread_mutex_unlock(&g_array_lock);
    return rc;
}

/* Arrays are freed with the context they were made in (cuCtxDestroy's documentation). */
void fc_arrays_ctx_gone(struct fc_ctx *c)
{
    struct fc_array *a, *next;

    pthread_mutex_lock(&g_array_lock);
    for (a = g_arrays.next; a != &g_arrays; a = next) {
        next = a->next;
        if (a->ctx == c)
            array_free(a);
    }
    pthread_mutex_unlock(&g_array_lock);
}

FC_API CUresult cuArrayCreate_v2(CUarray *pHandle, const CUDA_ARRAY_DESCRIPTOR *d)
{
    FC_COUNT(cuArrayCreate_v2);
    if (!pHandle || !d || !format_bytes(d->Format) || d->Width == 0)
        return fc_initialized() ? CUDA_ERROR_INVALID_VALUE : CUDA_ERROR_NOT_INITIALIZED;
    return array_new(pHandle, d->Width * dim(d->Height) * format_bytes(d->Format) * d->NumChannels, 0);
}

FC_API CUresult cuArray3DCreate_v2(CUarray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *d)
{
    FC_COUNT(cuArray3DCreate_v2);
    if (!pHandle || !d || !format_bytes(d->Format) || d->Width == 0)
        return fc_initialized() ? CUDA_ERROR_INVALID_VALUE : CUDA_ERROR_NOT_INITIALIZED;
    return array_new(pHandle, d->Width * dim(d->Height) * dim(d->Depth) * format_bytes(d->Format) *
                                  d->NumChannels, (d->Flags & ARRAY_UNBACKED) != 0);
}

FC_API CUresult cuArrayDestroy(CUarray hArray)
{
    FC_COUNT(cuArrayDestroy);
    return array_destroy(hArray);
}

FC_API CUresult cuMipmappedArrayCreate(CUmipmappedArray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *d,
                                       unsigned int levels)
{
    size_t bytes = 0;

    FC_COUNT(cuMipmappedArrayCreate);
    if (!pHandle || !d || !format_bytes(d->Format) || d->Width == 0)
        return fc_initialized() ? CUDA_ERROR_INVALID_VALUE : CUDA_ERROR_NOT_INITIALIZED;
    /* Documented: the level count is clamped to [1, 1 + floor(log2(max(width, height, depth)))]. */
    {
        size_t m = d->Width > d->Height ? d->Width : d->Height;
        unsigned int top = 0;
        if (d->Depth > m)
            m = d->Depth;
        while (m) {
            top++;
            m >>= 1;
        }
        if (levels < 1)
            levels = 1;
        if (levels > top)
            levels = top;
    }
    for (unsigned int l = 0; l < levels; l++) {
        size_t w = dim(d->Width >> l), h = d->Height ? dim(d->Height >> l) : 1,
               z = !d->Depth ? 1 : (d->Flags & ARRAY_LAYERS) ? d->Depth : dim(d->Depth >> l);
        bytes += w * h * z * format_bytes(d->Format) * d->NumChannels;
    }
    return array_new(pHandle, bytes, (d->Flags & ARRAY_UNBACKED) != 0);
}

FC_API CUresult cuMipmappedArrayDestroy(CUmipmappedArray h)
{
    FC_COUNT(cuMipmappedArrayDestroy);
    return array_destroy(h);
}
