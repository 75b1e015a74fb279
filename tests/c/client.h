/*
 * client.h - shared op interpreter of the C test clients.
 *
 * The three front ends (client_linked, client_dlsym, client_procaddr) differ
 * only in how they obtain the driver functions, because each way exercises a
 * different interception path of an LD_PRELOAD library.
 */
#ifndef VRAMCAP_TEST_CLIENT_H
#define VRAMCAP_TEST_CLIENT_H

#include "cuda_types.h"

/* Entry points of the other allocation families: X(exported name, cuGetProcAddress base name,
 * version, flags). One list for the three front ends; flags 2 asks for the per-thread variant. */
#define CLIENT_EXTRA(X) \
    X(cuMemAllocPitch_v2, "cuMemAllocPitch", 3020, 0) \
    X(cuMemAllocManaged, "cuMemAllocManaged", 6000, 0) \
    X(cuMemAllocPitch, "cuMemAllocPitch", 2000, 0) \
    X(cuArrayCreate, "cuArrayCreate", 2000, 0) \
    X(cuArray3DCreate, "cuArray3DCreate", 2000, 0) \
    X(cuMemAllocHost, "cuMemAllocHost", 2000, 0) \
    X(cuMemHostRegister, "cuMemHostRegister", 4000, 0) \
    X(cuIpcOpenMemHandle, "cuIpcOpenMemHandle", 4010, 0) \
    X(cuMemGetAllocationGranularity, "cuMemGetAllocationGranularity", 10020, 0) \
    X(cuMemCreate, "cuMemCreate", 10020, 0) \
    X(cuMemRelease, "cuMemRelease", 10020, 0) \
    X(cuMemAddressReserve, "cuMemAddressReserve", 10020, 0) \
    X(cuMemAddressFree, "cuMemAddressFree", 10020, 0) \
    X(cuMemMap, "cuMemMap", 10020, 0) \
    X(cuMemUnmap, "cuMemUnmap", 10020, 0) \
    X(cuMemMapArrayAsync, "cuMemMapArrayAsync", 11010, 0) \
    X(cuMemMapArrayAsync_ptsz, "cuMemMapArrayAsync", 11010, 2) \
    X(cuMemSetAccess, "cuMemSetAccess", 10020, 0) \
    X(cuDeviceGetDefaultMemPool, "cuDeviceGetDefaultMemPool", 11020, 0) \
    X(cuMemPoolCreate, "cuMemPoolCreate", 11020, 0) \
    X(cuMemPoolSetAttribute, "cuMemPoolSetAttribute", 11020, 0) \
    X(cuMemPoolGetAttribute, "cuMemPoolGetAttribute", 11020, 0) \
    X(cuMemPoolTrimTo, "cuMemPoolTrimTo", 11020, 0) \
    X(cuMemAllocAsync, "cuMemAllocAsync", 11020, 0) \
    X(cuMemAllocAsync_ptsz, "cuMemAllocAsync", 11020, 2) \
    X(cuMemAllocFromPoolAsync, "cuMemAllocFromPoolAsync", 11020, 0) \
    X(cuMemAllocFromPoolAsync_ptsz, "cuMemAllocFromPoolAsync", 11020, 2) \
    X(cuMemFreeAsync, "cuMemFreeAsync", 11020, 0) \
    X(cuMemFreeAsync_ptsz, "cuMemFreeAsync", 11020, 2) \
    X(cuStreamSynchronize, "cuStreamSynchronize", 2000, 0) \
    X(cuStreamSynchronize_ptsz, "cuStreamSynchronize", 7000, 2) \
    X(cuCtxSynchronize, "cuCtxSynchronize", 2000, 0) \
    X(cuArrayCreate_v2, "cuArrayCreate", 3020, 0) \
    X(cuArray3DCreate_v2, "cuArray3DCreate", 3020, 0) \
    X(cuArrayDestroy, "cuArrayDestroy", 2000, 0) \
    X(cuMipmappedArrayCreate, "cuMipmappedArrayCreate", 5000, 0) \
    X(cuMipmappedArrayDestroy, "cuMipmappedArrayDestroy", 5000, 0) \
    X(cuCtxCreate_v2, "cuCtxCreate", 3020, 0) \
    X(cuCtxDestroy_v2, "cuCtxDestroy", 4000, 0) \
    X(cuDevicePrimaryCtxReset_v2, "cuDevicePrimaryCtxReset", 11000, 0) \
    X(cuMemHostAlloc, "cuMemHostAlloc", 2020, 0) \
    X(cuMemAllocHost_v2, "cuMemAllocHost", 3020, 0) \
    X(cuMemFreeHost, "cuMemFreeHost", 2000, 0) \
    X(cuMemHostRegister_v2, "cuMemHostRegister", 6050, 0) \
    X(cuMemHostUnregister, "cuMemHostUnregister", 4000, 0) \
    X(cuIpcOpenMemHandle_v2, "cuIpcOpenMemHandle", 11000, 0) \
    X(cuIpcCloseMemHandle, "cuIpcCloseMemHandle", 4010, 0)

/* Context and VMM lifetime entry points (ops_ctx.c), same form as CLIENT_EXTRA. */
#define CLIENT_CTX(X) \
    X(cuDevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease", 7000, 0) \
    X(cuDevicePrimaryCtxRelease_v2, "cuDevicePrimaryCtxRelease", 11000, 0) \
    X(cuDevicePrimaryCtxReset, "cuDevicePrimaryCtxReset", 7000, 0) \
    X(cuDevicePrimaryCtxGetState, "cuDevicePrimaryCtxGetState", 7000, 0) \
    X(cuCtxCreate, "cuCtxCreate", 2000, 0) \
    X(cuCtxCreate_v3, "cuCtxCreate", 11040, 0) \
    X(cuCtxCreate_v4, "cuCtxCreate", 12050, 0) \
    X(cuCtxDestroy, "cuCtxDestroy", 2000, 0) \
    X(cuCtxAttach, "cuCtxAttach", 2000, 0) \
    X(cuCtxDetach, "cuCtxDetach", 2000, 0) \
    X(cuCtxPushCurrent_v2, "cuCtxPushCurrent", 4000, 0) \
    X(cuCtxPopCurrent_v2, "cuCtxPopCurrent", 4000, 0) \
    X(cuMemRetainAllocationHandle, "cuMemRetainAllocationHandle", 11000, 0) \
    X(cuMemExportToShareableHandle, "cuMemExportToShareableHandle", 10020, 0) \
    X(cuMemImportFromShareableHandle, "cuMemImportFromShareableHandle", 10020, 0) \
    X(cuDeviceGetDevResource, "cuDeviceGetDevResource", 12040, 0) \
    X(cuDevResourceGenerateDesc, "cuDevResourceGenerateDesc", 12040, 0) \
    X(cuGreenCtxCreate, "cuGreenCtxCreate", 12040, 0) \
    X(cuCtxFromGreenCtx, "cuCtxFromGreenCtx", 12040, 0) \
    X(cuGreenCtxDestroy, "cuGreenCtxDestroy", 12040, 0) \
    X(cuModuleLoad, "cuModuleLoad", 2000, 0) \
    X(cuModuleLoadData, "cuModuleLoadData", 2000, 0) \
    X(cuModuleLoadDataEx, "cuModuleLoadDataEx", 2010, 0) \
    X(cuModuleUnload, "cuModuleUnload", 2000, 0) \
    X(cuCtxSetLimit, "cuCtxSetLimit", 3010, 0) \
    X(cuCtxGetLimit, "cuCtxGetLimit", 3010, 0) \
    X(cuLibraryLoadData, "cuLibraryLoadData", 12000, 0) \
    X(cuLibraryLoadFromFile, "cuLibraryLoadFromFile", 12000, 0) \
    X(cuLibraryUnload, "cuLibraryUnload", 12000, 0)
/* Pool lifetimes, stream devices, graphs and graph memory (ops_pool.c). */
#define CLIENT_POOL(X) \
    X(cuMemPoolDestroy, "cuMemPoolDestroy", 11020, 0) \
    X(cuDeviceGetMemPool, "cuDeviceGetMemPool", 11020, 0) \
    X(cuStreamCreate, "cuStreamCreate", 2000, 0) \
    X(cuCtxSynchronize_v2, "cuCtxSynchronize", 13000, 0) \
    X(cuStreamBeginCapture_v2, "cuStreamBeginCapture", 10010, 0) \
    X(cuStreamEndCapture, "cuStreamEndCapture", 10000, 0) \
    X(cuStreamBeginCapture_v2_ptsz, "cuStreamBeginCapture", 10010, 2) \
    X(cuStreamEndCapture_ptsz, "cuStreamEndCapture", 10000, 2) \
    X(cuGraphCreate, "cuGraphCreate", 10000, 0) \
    X(cuGraphAddMemAllocNode, "cuGraphAddMemAllocNode", 11040, 0) \
    X(cuGraphAddMemFreeNode, "cuGraphAddMemFreeNode", 11040, 0) \
    X(cuGraphAddNode_v2, "cuGraphAddNode", 12030, 0) \
    X(cuGraphInstantiate, "cuGraphInstantiate", 10000, 0) \
    X(cuGraphInstantiate_v2, "cuGraphInstantiate", 11000, 0) \
    X(cuGraphInstantiateWithFlags, "cuGraphInstantiateWithFlags", 11040, 0) \
    X(cuGraphInstantiateWithParams, "cuGraphInstantiateWithParams", 12000, 0) \
    X(cuGraphInstantiateWithParams_ptsz, "cuGraphInstantiateWithParams", 12000, 2) \
    X(cuGraphLaunch, "cuGraphLaunch", 10000, 0) \
    X(cuGraphLaunch_ptsz, "cuGraphLaunch", 10000, 2) \
    X(cuGraphUpload, "cuGraphUpload", 11010, 0) \
    X(cuGraphUpload_ptsz, "cuGraphUpload", 11010, 2) \
    X(cuGraphExecDestroy, "cuGraphExecDestroy", 10000, 0) \
    X(cuGraphExecUpdate, "cuGraphExecUpdate", 10020, 0) \
    X(cuGraphExecUpdate_v2, "cuGraphExecUpdate", 12000, 0) \
    X(cuDeviceGraphMemTrim, "cuDeviceGraphMemTrim", 11040, 0) \
    X(cuDeviceGetGraphMemAttribute, "cuDeviceGetGraphMemAttribute", 11040, 0)

/* Prefetches of managed memory (ops_managed.c), same form as CLIENT_EXTRA. */
#define CLIENT_MANAGED(X) \
    X(cuMemPrefetchAsync, "cuMemPrefetchAsync", 8000, 0) \
    X(cuMemPrefetchAsync_ptsz, "cuMemPrefetchAsync", 8000, 2) \
    X(cuMemPrefetchAsync_v2, "cuMemPrefetchAsync", 12020, 0) \
    X(cuMemPrefetchAsync_v2_ptsz, "cuMemPrefetchAsync", 12020, 2) \
    X(cuMemPrefetchBatchAsync, "cuMemPrefetchBatchAsync", 13000, 0) \
    X(cuMemPrefetchBatchAsync_ptsz, "cuMemPrefetchBatchAsync", 13000, 2) \
    X(cuMemDiscardAndPrefetchBatchAsync, "cuMemDiscardAndPrefetchBatchAsync", 13000, 0) \
    X(cuMemDiscardAndPrefetchBatchAsync_ptsz, "cuMemDiscardAndPrefetchBatchAsync", 13000, 2)

struct cu_api {
    CUresult (*cuInit)(unsigned int);
    CUresult (*cuDevicePrimaryCtxRetain)(CUcontext *, CUdevice);
    CUresult (*cuCtxSetCurrent)(CUcontext);
    CUresult (*cuCtxGetCurrent)(CUcontext *);
    CUresult (*cuMemAlloc_v2)(CUdeviceptr *, size_t);
    CUresult (*cuMemFree_v2)(CUdeviceptr);
    CUresult (*cuMemAlloc)(CUdeviceptr_v1 *, unsigned int);   /* legacy 32-bit ABI */
    CUresult (*cuMemFree)(CUdeviceptr_v1);
    CUresult (*cuMemGetInfo_v2)(size_t *, size_t *);
    CUresult (*cuMemGetInfo)(unsigned int *, unsigned int *);
    CUresult (*cuDeviceTotalMem_v2)(size_t *, CUdevice);
    CUresult (*cuDriverGetVersion)(int *);
#define FIELD(name, base, ver, flags) __typeof__(&name) name;
    CLIENT_EXTRA(FIELD)
    CLIENT_CTX(FIELD)
    CLIENT_POOL(FIELD)
    CLIENT_MANAGED(FIELD)
#undef FIELD
};

/* Runs the ops in argv[1..]; returns the process exit status. */
int client_run(const struct cu_api *api, int argc, char **argv);

/* For op families kept in their own files (ops_*.c). */
extern const struct cu_api *client_A;
void client_printf(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
unsigned long long client_parse_size(const char *s);
long client_parse_long(const char *s);
/* Each returns 1 if it handled `op` (consuming its arguments via *i), else 0. */
int client_lifecycle_op(const char *op, int *i, int argc, char **argv);
/* Fault and soak ops (ops_faults.c); new_slot records an allocation like alloc does. */
int client_fault_op(const char *op, int *i, int argc, char **argv,
                    unsigned long long (*new_slot)(unsigned long long));
/* The other families' ops (client_ops.c): returns the number of arguments consumed after the op
 * name, or -1 when `op` is not one of them. */
int client_extra_op(const struct cu_api *api, const char *op, int argc, char **argv,
                    unsigned long long (*new_slot)(unsigned long long),
                    unsigned long long (*slot)(const char *));

/* Context and VMM lifetime ops (ops_ctx.c), same contract as client_extra_op. */
int client_ctx_op(const struct cu_api *api, const char *op, int argc, char **argv,
                  unsigned long long (*new_slot)(unsigned long long),
                  unsigned long long (*slot)(const char *));
/* Exported and received fds (ops_fd.c): F numbers them. */
struct client_fd {
    int fd;
    CUmemGenericAllocationHandle h; /* the exported handle; 0 for a received fd */
};
int client_fd_add(int fd, CUmemGenericAllocationHandle h);
struct client_fd *client_fd_at(const char *s);
/* The fd passing ops (ops_fd.c): 1 + arguments used, or 0 for another op. */
int client_fd_op(const char *op, int argc, char **argv);
/* Managed-memory prefetch ops (ops_managed.c), same contract as client_extra_op. */
int client_managed_op(const struct cu_api *api, const char *op, int argc, char **argv,
                      unsigned long long (*slot)(const char *));
/* Module, limit and driver-books ops (ops_overhead.c), same contract as client_extra_op. */
int client_overhead_op(const struct cu_api *api, const char *op, int argc, char **argv);
/* Pool lifetime and graph ops (ops_pool.c), same contract as client_extra_op. */
int client_pool_op(const struct cu_api *api, const char *op, int argc, char **argv,
                   unsigned long long (*new_slot)(unsigned long long),
                   unsigned long long (*slot)(const char *));

/* Pool P of the client_ops.c pool table (exits when there is none). */
CUmemoryPool client_pool(const char *s);
/* Graph races and updates (ops_graph.c); executable graphs are numbered by ops_pool.c. */
int client_graph_op(const struct cu_api *api, const char *op, int argc, char **argv,
                    unsigned long long (*new_slot)(unsigned long long),
                    unsigned long long (*slot)(const char *));
CUgraphExec client_exec(const char *s);
int client_keep_exec(CUresult rc, CUgraphExec e);

/* Front-end helper: complain and exit when a function could not be resolved. */
void client_need(const void *fn, const char *what);

#endif
