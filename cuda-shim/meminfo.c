/*
 * meminfo.c - cuMemGetInfo of the fake driver: the current context's device, its total and what
 * this process holds on it (fakemem.c keeps the count).
 */
#include "internal.h"

static CUresult mem_info(unsigned long long *freeb, unsigned long long *total)
{
    struct fc_ctx *ctx;
    int dev;

    if (!fc_initialized())
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!freeb || !total)
        return CUDA_ERROR_INVALID_VALUE;
    if (!(ctx = fc_current_ctx()))
        return CUDA_ERROR_INVALID_CONTEXT;
    dev = ctx->dev;
    fc_vmm_reap();
    *total = fc_cfg.mem[dev];
    *freeb = fc_cfg.mem[dev] - atomic_load(&fc_stats[dev].bytes_held);
    return CUDA_SUCCESS;
}

FC_API CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total_bytes)
{
    unsigned long long f, t;
    CUresult rc;

    FC_COUNT(cuMemGetInfo_v2);
    rc = mem_info(free_bytes ? &f : NULL, total_bytes ? &t : NULL);
    if (rc == CUDA_SUCCESS) {
        *free_bytes = (size_t)f;
        *total_bytes = (size_t)t;
    }
    return rc;
}

FC_API CUresult cuMemGetInfo(unsigned int *free_bytes, unsigned int *total_bytes)
{
    unsigned long long f, t;
    CUresult rc;

    FC_COUNT(cuMemGetInfo);
    rc = mem_info(free_bytes ? &f : NULL, total_bytes ? &t : NULL);
    if (rc == CUDA_SUCCESS) {       /* 32-bit ABI: saturate */
        *free_bytes = f > 0xffffffffULL ? 0xffffffffU : (unsigned int)f;
        *total_bytes = t > 0xffffffffULL ? 0xffffffffU : (unsigned int)t;
    }
    return rc;
}
