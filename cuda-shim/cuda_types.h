/*
 * cuda_types.h - our own minimal declarations of the CUDA driver API types
 * and of the entry points the fake driver exports.
 *
 * Written from the public API documentation; deliberately NOT a copy of the
 * vendor header: only the handful of types, constants and prototypes that the
 * fake driver and the C test clients need.  The ABI (argument types and sizes)
 * matches the real driver, which is what matters to an LD_PRELOAD interposer.
 */
#ifndef VRAMCAP_CUDA_TYPES_H
#define VRAMCAP_CUDA_TYPES_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef int CUresult;
typedef int CUdevice;
typedef int CUdevice_attribute;
typedef unsigned long long CUdeviceptr;   /* 64-bit device pointer (_v2 ABI) */
typedef unsigned int CUdeviceptr_v1;      /* legacy 32-bit device pointer */
typedef unsigned long long cuuint64_t;
typedef int CUdriverProcAddressQueryResult;

typedef struct fc_ctx *CUcontext;         /* opaque */
typedef struct fc_stream *CUstream;       /* opaque */
typedef struct { char bytes[16]; } CUuuid;

/* Stream-ordered pools, virtual memory management, arrays, IPC. */
typedef struct fc_pool *CUmemoryPool;     /* opaque */
typedef struct fc_array *CUarray;         /* opaque */
typedef struct fc_array *CUmipmappedArray;/* opaque (same registry as arrays) */
typedef unsigned long long CUmemGenericAllocationHandle;
typedef struct { int type; int id; } CUmemLocation;
/* CUmemLocationType. NONE (CUDA 13) shares INVALID's value: "no preferred location", only for
 * managed pools. For DEVICE_LOCALITY_DOMAIN (CUDA 13.4) `id` is the union's `localized` member:
 * byte 0 the device ordinal, byte 1 the locality domain. */
#define CU_MEM_LOCATION_TYPE_INVALID 0
#define CU_MEM_LOCATION_TYPE_NONE   0
#define CU_MEM_LOCATION_TYPE_DEVICE 1
#define CU_MEM_LOCATION_TYPE_HOST   2
#define CU_MEM_LOCATION_TYPE_HOST_NUMA 3
#define CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT 4
#define CU_MEM_LOCATION_TYPE_INVISIBLE 5
#define CU_MEM_LOCATION_TYPE_DEVICE_LOCALITY_DOMAIN 6
#define CU_MEM_ALLOCATION_TYPE_PINNED 1
#define CU_MEM_ALLOCATION_TYPE_MANAGED 2
typedef struct {
    int type;                   /* CUmemAllocationType */
    int requestedHandleTypes;
    CUmemLocation location;
    void *win32HandleMetaData;
    struct { unsigned char compressionType, gpuDirectRDMACapable; unsigned short usage;
             unsigned char reserved[4]; } allocFlags;
} CUmemAllocationProp;
typedef struct {
    int allocType;
    int handleTypes;
    CUmemLocation location;
    void *win32SecurityAttributes;
    size_t maxSize;
    unsigned short usage;
    unsigned char reserved[54];
} CUmemPoolProps;
typedef struct { CUmemLocation location; int flags; } CUmemAccessDesc;
/* CUmemPool_attribute */
#define CU_MEMPOOL_ATTR_RELEASE_THRESHOLD     4
#define CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT  5
#define CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH     6
#define CU_MEMPOOL_ATTR_USED_MEM_CURRENT      7
#define CU_MEMPOOL_ATTR_USED_MEM_HIGH         8
typedef struct {
    size_t Width, Height;
    int Format;                 /* CUarray_format */
    unsigned int NumChannels;
} CUDA_ARRAY_DESCRIPTOR;
typedef struct {
    size_t Width, Height, Depth;
    int Format;
    unsigned int NumChannels;
    unsigned int Flags;
} CUDA_ARRAY3D_DESCRIPTOR;
#define CU_AD_FORMAT_UNSIGNED_INT8  0x01
#define CU_AD_FORMAT_UNSIGNED_INT16 0x02
#define CU_AD_FORMAT_UNSIGNED_INT32 0x03
#define CU_AD_FORMAT_FLOAT          0x20
typedef struct { char reserved[64]; } CUipcMemHandle;
/* cuCtxCreate_v3 (execution affinity) and cuCtxCreate_v4 (creation parameters). */
typedef struct { int type; union { struct { unsigned int val; } smCount; } param; } CUexecAffinityParam;
typedef struct { unsigned int sharedDataType; void *sharedData; } CUctxCigParam;
typedef struct {
    CUexecAffinityParam *execAffinityParams;
    int numExecAffinityParams;
    CUctxCigParam *cigParams;
} CUctxCreateParams;

/* Result codes used by the fake (values are the documented ones). */
#define CUDA_SUCCESS                    0
#define CUDA_ERROR_INVALID_VALUE        1
#define CUDA_ERROR_OUT_OF_MEMORY        2
#define CUDA_ERROR_NOT_INITIALIZED      3
#define CUDA_ERROR_DEINITIALIZED        4
#define CUDA_ERROR_NO_DEVICE            100
#define CUDA_ERROR_INVALID_DEVICE       101
#define CUDA_ERROR_INVALID_CONTEXT      201
#define CUDA_ERROR_INVALID_HANDLE       400
#define CUDA_ERROR_NOT_FOUND            500
#define CUDA_ERROR_NOT_READY            600
#define CUDA_ERROR_NOT_PERMITTED        800
#define CUDA_ERROR_NOT_SUPPORTED        801
#define CUDA_ERROR_INVALID_RESOURCE_TYPE 914
#define CUDA_ERROR_UNKNOWN              999

/* cuGetProcAddress flags and query results. */
#define CU_GET_PROC_ADDRESS_DEFAULT                    0
#define CU_GET_PROC_ADDRESS_LEGACY_STREAM              1
#define CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM  2
#define CU_GET_PROC_ADDRESS_SUCCESS                    0
#define CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND           1
#define CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT     2

/* ---- Entry points exported by the fake driver (real driver signatures). ---- */
CUresult cuInit(unsigned int flags);
CUresult cuDriverGetVersion(int *version);
CUresult cuDeviceGet(CUdevice *dev, int ordinal);
CUresult cuDeviceGetCount(int *count);
CUresult cuDeviceGetName(char *name, int len, CUdevice dev);
CUresult cuDeviceTotalMem(unsigned int *bytes, CUdevice dev);
CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev);
CUresult cuDeviceGetAttribute(int *pi, CUdevice_attribute attrib, CUdevice dev);
CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice dev);
CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice dev);
CUresult cuDeviceGetPCIBusId(char *pciBusId, int len, CUdevice dev);

CUresult cuCtxCreate(CUcontext *pctx, unsigned int flags, CUdevice dev);
CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev);
CUresult cuCtxCreate_v3(CUcontext *pctx, CUexecAffinityParam *paramsArray, int numParams, unsigned int flags,
                        CUdevice dev);
CUresult cuCtxCreate_v4(CUcontext *pctx, CUctxCreateParams *ctxCreateParams, unsigned int flags, CUdevice dev);
CUresult cuCtxAttach(CUcontext *pctx, unsigned int flags);
CUresult cuCtxDetach(CUcontext ctx);
CUresult cuCtxDestroy(CUcontext ctx);
CUresult cuCtxDestroy_v2(CUcontext ctx);
CUresult cuCtxGetCurrent(CUcontext *pctx);
CUresult cuCtxSetCurrent(CUcontext ctx);
CUresult cuCtxPushCurrent(CUcontext ctx);
CUresult cuCtxPushCurrent_v2(CUcontext ctx);
CUresult cuCtxPopCurrent(CUcontext *pctx);
CUresult cuCtxPopCurrent_v2(CUcontext *pctx);
CUresult cuCtxGetDevice(CUdevice *dev);
CUresult cuCtxGetDevice_v2(CUdevice *dev, CUcontext ctx);
CUresult cuCtxSynchronize(void);

CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev);
CUresult cuDevicePrimaryCtxRelease(CUdevice dev);
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev);
CUresult cuDevicePrimaryCtxReset(CUdevice dev);
CUresult cuDevicePrimaryCtxReset_v2(CUdevice dev);
CUresult cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int *flags, int *active);
CUresult cuDevicePrimaryCtxSetFlags(CUdevice dev, unsigned int flags);
CUresult cuDevicePrimaryCtxSetFlags_v2(CUdevice dev, unsigned int flags);

CUresult cuMemAlloc(CUdeviceptr_v1 *dptr, unsigned int bytesize);
CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize);
CUresult cuMemFree(CUdeviceptr_v1 dptr);
CUresult cuMemFree_v2(CUdeviceptr dptr);
CUresult cuMemGetInfo(unsigned int *free_bytes, unsigned int *total_bytes);
CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total_bytes);
CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n);
CUresult cuMemcpyHtoD_v2_ptds(CUdeviceptr dst, const void *src, size_t n);
CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n);
CUresult cuMemcpyDtoH_v2_ptds(void *dst, CUdeviceptr src, size_t n);
CUresult cuMemsetD8_v2(CUdeviceptr dst, unsigned char uc, size_t n);
CUresult cuMemsetD8_v2_ptds(CUdeviceptr dst, unsigned char uc, size_t n);

CUresult cuStreamCreate(CUstream *phStream, unsigned int flags);
CUresult cuStreamDestroy(CUstream hStream);
CUresult cuStreamDestroy_v2(CUstream hStream);
CUresult cuStreamSynchronize(CUstream hStream);

CUresult cuGetErrorString(CUresult error, const char **pStr);
CUresult cuGetErrorName(CUresult error, const char **pStr);
CUresult cuGetExportTable(const void **ppExportTable, const CUuuid *pExportTableId);
CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion,
                          cuuint64_t flags);
CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion,
                             cuuint64_t flags, CUdriverProcAddressQueryResult *symbolStatus);

CUresult cuStreamSynchronize_ptsz(CUstream hStream);
CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pitch, size_t width, size_t height, unsigned int elem);
CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags);
CUresult cuMemGetAllocationGranularity(size_t *granularity, const CUmemAllocationProp *prop, int option);
CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                     unsigned long long flags);
CUresult cuMemRelease(CUmemGenericAllocationHandle handle);
CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                             unsigned long long flags);
CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size);
CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                  unsigned long long flags);
CUresult cuMemUnmap(CUdeviceptr ptr, size_t size);
/* The map-info list is an array of CUarrayMapInfo (sparse arrays); opaque here: the fake's device
 * reports no sparse array support. */
CUresult cuMemMapArrayAsync(void *mapInfoList, unsigned int count, CUstream hStream);
CUresult cuMemMapArrayAsync_ptsz(void *mapInfoList, unsigned int count, CUstream hStream);
CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr);
CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count);
/* CUmemAllocationHandleType: a POSIX fd (an int written through shareableHandle; passed to import
 * as the fd cast to void *). */
#define CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR 1
CUresult cuMemExportToShareableHandle(void *shareableHandle, CUmemGenericAllocationHandle handle, int handleType,
                                      unsigned long long flags);
CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle, void *osHandle, int type);
CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *pool, CUdevice dev);
CUresult cuDeviceGetMemPool(CUmemoryPool *pool, CUdevice dev);
CUresult cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *props);
CUresult cuMemPoolDestroy(CUmemoryPool pool);
CUresult cuMemPoolSetAttribute(CUmemoryPool pool, int attr, void *value);
CUresult cuMemPoolGetAttribute(CUmemoryPool pool, int attr, void *value);
CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t minBytesToKeep);
CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream);
CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream hStream);
CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream hStream);
CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream hStream);
CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream);
CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream hStream);
CUresult cuArrayCreate_v2(CUarray *pHandle, const CUDA_ARRAY_DESCRIPTOR *desc);
CUresult cuArray3DCreate_v2(CUarray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *desc);
CUresult cuArrayDestroy(CUarray hArray);
CUresult cuMipmappedArrayCreate(CUmipmappedArray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *desc,
                                unsigned int numLevels);
CUresult cuMipmappedArrayDestroy(CUmipmappedArray h);
CUresult cuMemHostAlloc(void **pp, size_t bytesize, unsigned int flags);
CUresult cuMemAllocHost_v2(void **pp, size_t bytesize);
CUresult cuMemFreeHost(void *p);
CUresult cuMemHostRegister_v2(void *p, size_t bytesize, unsigned int flags);
CUresult cuMemHostUnregister(void *p);
CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *pdptr, CUipcMemHandle handle, unsigned int flags);
CUresult cuIpcCloseMemHandle(CUdeviceptr dptr);

/* ---- Stream queries, CUDA 13 pool/sync variants, graphs and graph memory. ---- */
typedef struct fc_graph *CUgraph;         /* opaque */
typedef struct fc_gnode *CUgraphNode;     /* opaque */
typedef struct fc_gexec *CUgraphExec;     /* opaque */
typedef struct fc_green *CUgreenCtx;      /* opaque (the fake has no green contexts) */
#define CU_STREAM_LEGACY      ((CUstream)0x1)
#define CU_STREAM_PER_THREAD  ((CUstream)0x2)
/* CUgraphNodeType values used here. */
#define CU_GRAPH_NODE_TYPE_GRAPH      1
#define CU_GRAPH_NODE_TYPE_EMPTY      5
#define CU_GRAPH_NODE_TYPE_MEM_ALLOC 10
#define CU_GRAPH_NODE_TYPE_MEM_FREE  11
/* CUstreamCaptureStatus / CUstreamCaptureMode */
#define CU_STREAM_CAPTURE_STATUS_NONE   0
#define CU_STREAM_CAPTURE_STATUS_ACTIVE 1
#define CU_STREAM_CAPTURE_MODE_GLOBAL   0
/* CUgraphMem_attribute */
#define CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT     0
#define CU_GRAPH_MEM_ATTR_USED_MEM_HIGH        1
#define CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT 2
#define CU_GRAPH_MEM_ATTR_RESERVED_MEM_HIGH    3
typedef struct {
    CUmemPoolProps poolProps;
    const CUmemAccessDesc *accessDescs;
    size_t accessDescCount;
    size_t bytesize;
    CUdeviceptr dptr;           /* out */
} CUDA_MEM_ALLOC_NODE_PARAMS;
typedef struct {
    cuuint64_t flags;
    CUstream hUploadStream;
    CUgraphNode hErrNode_out;
    int result_out;             /* CUgraphInstantiateResult */
} CUDA_GRAPH_INSTANTIATE_PARAMS;
/* CUgraphInstantiate_flags */
#define CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH 1
#define CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD              2
/* cuGraphExecUpdate: CUgraphExecUpdateResult, the _v2 result info, its failure code. */
#define CU_GRAPH_EXEC_UPDATE_SUCCESS                 0
#define CU_GRAPH_EXEC_UPDATE_ERROR                   1
#define CU_GRAPH_EXEC_UPDATE_ERROR_TOPOLOGY_CHANGED  2
#define CU_GRAPH_EXEC_UPDATE_ERROR_NODE_TYPE_CHANGED 3
#define CU_GRAPH_EXEC_UPDATE_ERROR_PARAMETERS_CHANGED 5
#define CU_GRAPH_EXEC_UPDATE_ERROR_NOT_SUPPORTED     6
#define CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE         910
typedef struct {
    int result;
    CUgraphNode errorNode;
    CUgraphNode errorFromNode;
} CUgraphExecUpdateResultInfo;
/* CUgraphChildGraphNodeOwnership (CUDA 12.9) */
#define CU_GRAPH_CHILD_GRAPH_OWNERSHIP_CLONE 0
#define CU_GRAPH_CHILD_GRAPH_OWNERSHIP_MOVE  1
typedef struct {
    CUgraph graph;
    int ownership;
} CUDA_CHILD_GRAPH_NODE_PARAMS;
/* CUgraphNodeParams: a tagged union of 256 bytes; only the members used here are named. */
typedef struct {
    int type;
    int reserved0[3];
    union {
        long long reserved1[29];
        CUDA_CHILD_GRAPH_NODE_PARAMS graph;
    };
    long long reserved2;
} CUgraphNodeParams;
typedef struct CUgraphEdgeData_st CUgraphEdgeData;   /* opaque here: the fake keeps no edges */

CUresult cuStreamGetDevice(CUstream hStream, CUdevice *device);
CUresult cuStreamGetDevice_ptsz(CUstream hStream, CUdevice *device);
CUresult cuStreamGetCtx(CUstream hStream, CUcontext *pctx);
CUresult cuStreamGetCtx_v2(CUstream hStream, CUcontext *pctx, CUgreenCtx *pGreenCtx);
CUresult cuStreamGetCtx_v2_ptsz(CUstream hStream, CUcontext *pctx, CUgreenCtx *pGreenCtx);
CUresult cuCtxSynchronize_v2(CUcontext ctx);
CUresult cuDeviceSetMemPool(CUdevice dev, CUmemoryPool pool);
CUresult cuMemGetDefaultMemPool(CUmemoryPool *pool, CUmemLocation *location, int type);
CUresult cuMemGetMemPool(CUmemoryPool *pool, CUmemLocation *location, int type);
CUresult cuStreamBeginCapture(CUstream hStream);
CUresult cuStreamBeginCapture_ptsz(CUstream hStream);
CUresult cuStreamBeginCapture_v2(CUstream hStream, int mode);
CUresult cuStreamBeginCapture_v2_ptsz(CUstream hStream, int mode);
CUresult cuStreamEndCapture(CUstream hStream, CUgraph *phGraph);
CUresult cuStreamEndCapture_ptsz(CUstream hStream, CUgraph *phGraph);
CUresult cuStreamIsCapturing(CUstream hStream, int *captureStatus);
CUresult cuStreamIsCapturing_ptsz(CUstream hStream, int *captureStatus);
CUresult cuGraphCreate(CUgraph *phGraph, unsigned int flags);
CUresult cuGraphDestroy(CUgraph hGraph);
CUresult cuGraphGetNodes(CUgraph hGraph, CUgraphNode *nodes, size_t *numNodes);
CUresult cuGraphNodeGetType(CUgraphNode hNode, int *type);
CUresult cuGraphAddMemAllocNode(CUgraphNode *phGraphNode, CUgraph hGraph, const CUgraphNode *dependencies,
                                size_t numDependencies, CUDA_MEM_ALLOC_NODE_PARAMS *nodeParams);
CUresult cuGraphMemAllocNodeGetParams(CUgraphNode hNode, CUDA_MEM_ALLOC_NODE_PARAMS *params_out);
CUresult cuGraphAddNode_v2(CUgraphNode *phGraphNode, CUgraph hGraph, const CUgraphNode *dependencies,
                           const CUgraphEdgeData *dependencyData, size_t numDependencies,
                           CUgraphNodeParams *nodeParams);
CUresult cuGraphChildGraphNodeGetGraph(CUgraphNode hNode, CUgraph *phGraph);
CUresult cuGraphMemFreeNodeGetParams(CUgraphNode hNode, CUdeviceptr *dptr_out);
CUresult cuGraphAddMemFreeNode(CUgraphNode *phGraphNode, CUgraph hGraph, const CUgraphNode *dependencies,
                               size_t numDependencies, CUdeviceptr dptr);
CUresult cuGraphInstantiate(CUgraphExec *phGraphExec, CUgraph hGraph, CUgraphNode *phErrorNode,
                            char *logBuffer, size_t bufferSize);
CUresult cuGraphExecUpdate(CUgraphExec hGraphExec, CUgraph hGraph, CUgraphNode *hErrorNode_out, int *updateResult_out);
CUresult cuGraphExecUpdate_v2(CUgraphExec hGraphExec, CUgraph hGraph, CUgraphExecUpdateResultInfo *resultInfo);
CUresult cuGraphInstantiate_v2(CUgraphExec *phGraphExec, CUgraph hGraph, CUgraphNode *phErrorNode,
                               char *logBuffer, size_t bufferSize);
CUresult cuGraphInstantiateWithFlags(CUgraphExec *phGraphExec, CUgraph hGraph, unsigned long long flags);
CUresult cuGraphInstantiateWithParams(CUgraphExec *phGraphExec, CUgraph hGraph,
                                      CUDA_GRAPH_INSTANTIATE_PARAMS *params);
CUresult cuGraphInstantiateWithParams_ptsz(CUgraphExec *phGraphExec, CUgraph hGraph,
                                           CUDA_GRAPH_INSTANTIATE_PARAMS *params);
CUresult cuGraphLaunch(CUgraphExec hGraphExec, CUstream hStream);
CUresult cuGraphLaunch_ptsz(CUgraphExec hGraphExec, CUstream hStream);
CUresult cuGraphUpload(CUgraphExec hGraphExec, CUstream hStream);
CUresult cuGraphUpload_ptsz(CUgraphExec hGraphExec, CUstream hStream);
CUresult cuGraphExecDestroy(CUgraphExec hGraphExec);
CUresult cuDeviceGraphMemTrim(CUdevice device);
CUresult cuDeviceGetGraphMemAttribute(CUdevice device, int attr, void *value);
CUresult cuDeviceSetGraphMemAttribute(CUdevice device, int attr, void *value);
/* Legacy ABIs (before CUDA 3.2 / 4.0 / 6.5 / 11.0) a driver still exports and cuGetProcAddress
 * still hands out for an old enough version (legacy.c). */
typedef struct {
    unsigned int Width, Height;
    int Format;
    unsigned int NumChannels;
} CUDA_ARRAY_DESCRIPTOR_v1;
typedef struct {
    unsigned int Width, Height, Depth;
    int Format;
    unsigned int NumChannels;
    unsigned int Flags;
} CUDA_ARRAY3D_DESCRIPTOR_v1;
CUresult cuMemAllocPitch(CUdeviceptr_v1 *dptr, unsigned int *pitch, unsigned int width, unsigned int height,
                         unsigned int elem);
CUresult cuArrayCreate(CUarray *pHandle, const CUDA_ARRAY_DESCRIPTOR_v1 *desc);
CUresult cuArray3DCreate(CUarray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR_v1 *desc);
CUresult cuMemAllocHost(void **pp, unsigned int bytesize);
CUresult cuMemHostRegister(void *p, size_t bytesize, unsigned int flags);
CUresult cuIpcOpenMemHandle(CUdeviceptr *pdptr, CUipcMemHandle handle, unsigned int flags);

/* Green contexts (CUDA 12.4, green.c). A CUdevResource is the documented tagged union: the type,
 * 92 bytes the driver keeps for itself, then the resource (for CU_DEV_RESOURCE_TYPE_SM, its SM
 * count), 48 bytes in all; a descriptor and a green context are opaque handles. */
typedef struct fc_green *CUgreenCtx;                  /* opaque */
typedef struct fc_resdesc *CUdevResourceDesc;         /* opaque */
typedef int CUdevResourceType;
#define CU_DEV_RESOURCE_TYPE_SM 1
typedef struct { unsigned int smCount; } CUdevSmResource;
typedef struct {
    CUdevResourceType type;
    unsigned char _internal_padding[92];
    union {
        CUdevSmResource sm;
        unsigned char _oversize[48];
    };
} CUdevResource;
CUresult cuDeviceGetDevResource(CUdevice device, CUdevResource *resource, CUdevResourceType type);
CUresult cuDevResourceGenerateDesc(CUdevResourceDesc *phDesc, CUdevResource *resources, unsigned int nbResources);
CUresult cuGreenCtxCreate(CUgreenCtx *phCtx, CUdevResourceDesc desc, CUdevice dev, unsigned int flags);
CUresult cuCtxFromGreenCtx(CUcontext *pContext, CUgreenCtx hCtx);
CUresult cuGreenCtxDestroy(CUgreenCtx hCtx);

/* Prefetches of managed memory (managed.c): v1 takes a device (CU_DEVICE_CPU = -1: the host),
 * _v2 (CUDA 12.2; CUDA 13's cuMemPrefetchAsync) a location; the CUDA 13 batch forms. */
CUresult cuMemPrefetchAsync(CUdeviceptr devPtr, size_t count, CUdevice dstDevice, CUstream hStream);
CUresult cuMemPrefetchAsync_ptsz(CUdeviceptr devPtr, size_t count, CUdevice dstDevice, CUstream hStream);
CUresult cuMemPrefetchAsync_v2(CUdeviceptr devPtr, size_t count, CUmemLocation location, unsigned int flags,
                               CUstream hStream);
CUresult cuMemPrefetchAsync_v2_ptsz(CUdeviceptr devPtr, size_t count, CUmemLocation location, unsigned int flags,
                                    CUstream hStream);
#define CU_MEM_PREFETCH_BATCH_ARGS CUdeviceptr *dptrs, size_t *sizes, size_t count, CUmemLocation *prefetchLocs, \
    size_t *prefetchLocIdxs, size_t numPrefetchLocs, unsigned long long flags, CUstream hStream
CUresult cuMemPrefetchBatchAsync(CU_MEM_PREFETCH_BATCH_ARGS);
CUresult cuMemPrefetchBatchAsync_ptsz(CU_MEM_PREFETCH_BATCH_ARGS);
CUresult cuMemDiscardAndPrefetchBatchAsync(CU_MEM_PREFETCH_BATCH_ARGS);
CUresult cuMemDiscardAndPrefetchBatchAsync_ptsz(CU_MEM_PREFETCH_BATCH_ARGS);

/* Copies numba-cuda uses (copies.c). */
CUresult cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t n);
CUresult cuMemcpyDtoD_v2_ptds(CUdeviceptr dst, CUdeviceptr src, size_t n);
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, CUstream s);
CUresult cuMemcpyHtoDAsync_v2_ptsz(CUdeviceptr dst, const void *src, size_t n, CUstream s);
CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, CUstream s);
CUresult cuMemcpyDtoHAsync_v2_ptsz(void *dst, CUdeviceptr src, size_t n, CUstream s);
CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s);
CUresult cuMemcpyDtoDAsync_v2_ptsz(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s);


/* Modules and per-context limits (issue 24). */
typedef struct fc_module *CUmodule;       /* opaque */
typedef int CUlimit;
typedef int CUjit_option;
#define CU_LIMIT_STACK_SIZE 0
#define CU_LIMIT_PRINTF_FIFO_SIZE 1
#define CU_LIMIT_MALLOC_HEAP_SIZE 2
#define CU_LIMIT_DEV_RUNTIME_SYNC_DEPTH 3
#define CU_LIMIT_DEV_RUNTIME_PENDING_LAUNCH_COUNT 4
#define CU_LIMIT_MAX_L2_FETCH_GRANULARITY 5
#define CU_LIMIT_PERSISTING_L2_CACHE_SIZE 6
#define CUDA_ERROR_UNSUPPORTED_LIMIT 215
#define CUDA_ERROR_INVALID_IMAGE 200
#define CUDA_ERROR_SHARED_OBJECT_INIT_FAILED 303
#define CUDA_ERROR_FILE_NOT_FOUND 301
CUresult cuModuleLoad(CUmodule *module, const char *fname);
CUresult cuModuleLoadData(CUmodule *module, const void *image);
CUresult cuModuleLoadDataEx(CUmodule *module, const void *image, unsigned int numOptions, CUjit_option *options, void **optionValues);
CUresult cuModuleLoadFatBinary(CUmodule *module, const void *fatCubin);
CUresult cuModuleUnload(CUmodule hmod);
CUresult cuCtxSetLimit(CUlimit limit, size_t value);
CUresult cuCtxGetLimit(size_t *pvalue, CUlimit limit);

/* Libraries (CUDA 12.0): context-independent loading. */
typedef struct fc_library *CUlibrary;     /* opaque */
typedef int CUlibraryOption;
CUresult cuLibraryLoadData(CUlibrary *library, const void *code, CUjit_option *jitOptions, void **jitOptionsValues,
                           unsigned int numJitOptions, CUlibraryOption *libraryOptions, void **libraryOptionValues,
                           unsigned int numLibraryOptions);
CUresult cuLibraryLoadFromFile(CUlibrary *library, const char *fileName, CUjit_option *jitOptions,
                               void **jitOptionsValues, unsigned int numJitOptions, CUlibraryOption *libraryOptions,
                               void **libraryOptionValues, unsigned int numLibraryOptions);
CUresult cuLibraryUnload(CUlibrary library);

#ifdef __cplusplus
}
#endif
#endif
