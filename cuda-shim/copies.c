/*
 * copies.c - the copy and memset entry points: host to device and back, device to device, and
 * the stream-ordered (Async) copies numba-cuda (through cuda-bindings) uses. Copies are host
 * memmoves with no range checking against allocations (tests address device memory directly).
 *
 * The fake's streams complete work at once, so an Async copy is done when it returns, which the
 * documented semantics allow (the caller may only rely on completion after synchronizing).
 * A stream argument must still be a stream of a live context (or 0, the default stream).
 */
#include <stdint.h>
#include <string.h>

#include "internal.h"

static CUresult copy(void *dst, const void *src, size_t n, CUstream stream, int check_stream)
{
    if (!fc_initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!fc_current_ctx())
        return CUDA_ERROR_INVALID_CONTEXT;
    if (check_stream && stream && fc_stream_dev(stream) < 0)
        return CUDA_ERROR_INVALID_HANDLE;
    if (n && (!dst || !src))
        return CUDA_ERROR_INVALID_VALUE;
    if (n)
        memmove(dst, src, n);
    return CUDA_SUCCESS;
}

#define DEV(p) ((void *)(uintptr_t)(p))

FC_API CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n)
{
    FC_COUNT(cuMemcpyHtoD_v2);
    return copy(DEV(dst), src, n, NULL, 0);
}

FC_API CUresult cuMemcpyHtoD_v2_ptds(CUdeviceptr dst, const void *src, size_t n)
{
    FC_COUNT(cuMemcpyHtoD_v2_ptds);
    return copy(DEV(dst), src, n, NULL, 0);
}

FC_API CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n)
{
    FC_COUNT(cuMemcpyDtoH_v2);
    return copy(dst, DEV(src), n, NULL, 0);
}

FC_API CUresult cuMemcpyDtoH_v2_ptds(void *dst, CUdeviceptr src, size_t n)
{
    FC_COUNT(cuMemcpyDtoH_v2_ptds);
    return copy(dst, DEV(src), n, NULL, 0);
}

static CUresult memset8(CUdeviceptr dst, unsigned char uc, size_t n)
{
    /* The same checks as a copy of the range onto itself. */
    CUresult rc = copy(DEV(dst), DEV(dst), 0, NULL, 0);
    if (rc == CUDA_SUCCESS && n && !dst)
        rc = CUDA_ERROR_INVALID_VALUE;
    if (rc == CUDA_SUCCESS && n)
        memset(DEV(dst), uc, n);
    return rc;
}

FC_API CUresult cuMemsetD8_v2(CUdeviceptr dst, unsigned char uc, size_t n)
{
    FC_COUNT(cuMemsetD8_v2);
    return memset8(dst, uc, n);
}

FC_API CUresult cuMemsetD8_v2_ptds(CUdeviceptr dst, unsigned char uc, size_t n)
{
    FC_COUNT(cuMemsetD8_v2_ptds);
    return memset8(dst, uc, n);
}

FC_API CUresult cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t n)
{
    FC_COUNT(cuMemcpyDtoD_v2);
    return copy(DEV(dst), DEV(src), n, NULL, 0);
}

FC_API CUresult cuMemcpyDtoD_v2_ptds(CUdeviceptr dst, CUdeviceptr src, size_t n)
{
    FC_COUNT(cuMemcpyDtoD_v2_ptds);
    return copy(DEV(dst), DEV(src), n, NULL, 0);
}

FC_API CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, CUstream s)
{
    FC_COUNT(cuMemcpyHtoDAsync_v2);
    return copy(DEV(dst), src, n, s, 1);
}

FC_API CUresult cuMemcpyHtoDAsync_v2_ptsz(CUdeviceptr dst, const void *src, size_t n, CUstream s)
{
    FC_COUNT(cuMemcpyHtoDAsync_v2_ptsz);
    return copy(DEV(dst), src, n, s, 1);
}

FC_API CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, CUstream s)
{
    FC_COUNT(cuMemcpyDtoHAsync_v2);
    return copy(dst, DEV(src), n, s, 1);
}

FC_API CUresult cuMemcpyDtoHAsync_v2_ptsz(void *dst, CUdeviceptr src, size_t n, CUstream s)
{
    FC_COUNT(cuMemcpyDtoHAsync_v2_ptsz);
    return copy(dst, DEV(src), n, s, 1);
}

FC_API CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s)
{
    FC_COUNT(cuMemcpyDtoDAsync_v2);
    return copy(DEV(dst), DEV(src), n, s, 1);
}

FC_API CUresult cuMemcpyDtoDAsync_v2_ptsz(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s)
{
    FC_COUNT(cuMemcpyDtoDAsync_v2_ptsz);
    return copy(DEV(dst), DEV(src), n, s, 1);
}
