/*
 * client_ops.c - ops of the allocation families beyond cuMemAlloc, shared by
 * the three client front ends. Each allocating op takes a slot (same
 * numbering as alloc); pools and contexts get their own small tables.
 *   pitch W H            -> pitch rc=N slot=K pitch=P       (cuMemAllocPitch_v2, elem 4; free with `free K`)
 *   managed SIZE         -> managed rc=N slot=K             (cuMemAllocManaged; free with `free K`)
 *   vmm SIZE DEV         -> vmm rc=N slot=K                 (cuMemCreate on DEV; handle in slot)
 *   vmmhost SIZE         -> vmmhost rc=N slot=K             (cuMemCreate, host location)
 *   vmmat SIZE TYPE ID   -> vmmat rc=N slot=K               (cuMemCreate at location TYPE/ID, raw values)
 *   vmmmap K             -> vmmmap rc=N                     (reserve, map twice, set access, write, unmap, free)
 *   release K            -> release rc=N                    (cuMemRelease)
 *   maparray | maparrayp -> maparray rc=N                   (cuMemMapArrayAsync / _ptsz, one zeroed entry)
 *   async SIZE | asyncp SIZE -> async rc=N slot=K           (cuMemAllocAsync / _ptsz, default stream)
 *   freeasync K | freeasyncp K -> freeasync rc=N
 *   defpool DEV          -> pool rc=N id=P                  (cuDeviceGetDefaultMemPool)
 *   poolcreate DEV       -> pool rc=N id=P                  (cuMemPoolCreate)
 *   poolat ALLOC TYPE ID -> pool rc=N id=P                  (cuMemPoolCreate: allocType ALLOC, location TYPE/ID)
 *   curpool DEV          -> pool rc=N id=P                  (cuDeviceGetMemPool)
 *   keep P               -> keep rc=N                       (release threshold = max: freed memory stays)
 *   palloc P SIZE | pallocp P SIZE -> palloc rc=N slot=K    (cuMemAllocFromPoolAsync / _ptsz)
 *   reserved P           -> reserved rc=N bytes=B used=U
 *   trim P BYTES         -> trim rc=N
 *   sync | syncp | ctxsync -> sync rc=N                     (cuStreamSynchronize(0) / _ptsz / cuCtxSynchronize)
 *   cycles N SIZE EVERY  -> cycles ok=A oom=O other=E       (N async alloc+free, stream sync every EVERY, 0 = never)
 *   array W H | array3d W H D | mipmap W H LEVELS -> array rc=N slot=K (float, 1 channel)
 *   arrayx W H D LEVELS FLAGS -> array rc=N slot=K          (float, 1 channel, descriptor Flags FLAGS:
 *                           LEVELS 0: cuArray3DCreate_v2, else cuMipmappedArrayCreate)
 *   arrfree K | mipfree K -> arrfree rc=N
 *   newctx DEV           -> newctx rc=N id=C                (cuCtxCreate_v2: becomes current)
 *   ctxdestroy C         -> ctxdestroy rc=N
 *   reset DEV            -> reset rc=N                      (cuDevicePrimaryCtxReset_v2)
 *   host SIZE            -> host rc=N                       (host alloc/free, register, IPC open/close: first error)
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client.h"

static CUmemoryPool g_pools[64];
static int g_npools;
static CUcontext g_ctxs[64];
static int g_nctxs;

#define OUT(...) (printf(__VA_ARGS__), putchar('\n'), fflush(stdout))

static unsigned long long num(const char *s)
{
    char *end;
    unsigned long long v;
    int shift = 0;

    if (!s) {
        fprintf(stderr, "client: missing argument\n");
        exit(2);
    }
    v = strtoull(s, &end, 10);
    switch (*end | 0x20) {
    case 'k': shift = 10; break;
    case 'm': shift = 20; break;
    case 'g': shift = 30; break;
    default: break;
    }
    if (shift)
        end++;
    if (end == s || *end) {
        fprintf(stderr, "client: bad number '%s'\n", s);
        exit(2);
    }
    return v << shift;
}

static CUmemoryPool pool(const char *s)
{
    unsigned long long k = num(s);
    if ((int)k >= g_npools) {
        fprintf(stderr, "client: no pool %s\n", s);
        exit(2);
    }
    return g_pools[k];
}

CUmemoryPool client_pool(const char *s)
{
    return pool(s);
}

static CUmemAllocationProp prop_for(int type, int dev)
{
    CUmemAllocationProp p;
    memset(&p, 0, sizeof p);
    p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    p.location.type = type;
    p.location.id = dev;
    return p;
}

static CUresult vmm_map(const struct cu_api *A, CUmemGenericAllocationHandle h)
{
    CUmemAllocationProp prop = prop_for(CU_MEM_LOCATION_TYPE_DEVICE, 0);
    CUmemAccessDesc acc = { { CU_MEM_LOCATION_TYPE_DEVICE, 0 }, 3 };
    CUdeviceptr va = 0;
    size_t gran = 0;
    CUresult rc = A->cuMemGetAllocationGranularity(&gran, &prop, 0);

    if (rc == CUDA_SUCCESS)
        rc = A->cuMemAddressReserve(&va, 2 * gran, 0, 0, 0);
    if (rc != CUDA_SUCCESS)
        return rc;
    /* The same physical memory mapped at two addresses: counted once. */
    if ((rc = A->cuMemMap(va, gran, 0, h, 0)) == CUDA_SUCCESS &&
        (rc = A->cuMemMap(va + gran, gran, 0, h, 0)) == CUDA_SUCCESS &&
        (rc = A->cuMemSetAccess(va, 2 * gran, &acc, 1)) == CUDA_SUCCESS) {
        *(volatile int *)(uintptr_t)va = 42;
        if (*(volatile int *)(uintptr_t)(va + gran) != 42)
            rc = CUDA_ERROR_UNKNOWN;
    }
    A->cuMemUnmap(va, 2 * gran);
    A->cuMemAddressFree(va, 2 * gran);
    return rc;
}

static void cycles(const struct cu_api *A, unsigned long long n, size_t size, unsigned long long every)
{
    unsigned long long ok = 0, oom = 0, other = 0;

    for (unsigned long long i = 0; i < n; i++) {
        CUdeviceptr p = 0;
        CUresult rc = A->cuMemAllocAsync(&p, size, NULL);
        if (rc == CUDA_SUCCESS) {
            ok++;
            if (A->cuMemFreeAsync(p, NULL) != CUDA_SUCCESS)
                other++;
        } else if (rc == CUDA_ERROR_OUT_OF_MEMORY) {
            oom++;
        } else {
            other++;
        }
        if (every && (i + 1) % every == 0 && A->cuStreamSynchronize(NULL) != CUDA_SUCCESS)
            other++;
    }
    OUT("cycles ok=%llu oom=%llu other=%llu", ok, oom, other);
}

static CUresult host(const struct cu_api *A, size_t size)
{
    void *a = NULL, *b = NULL, *c = malloc(size);
    CUipcMemHandle ipc;
    CUdeviceptr d = 0, opened = 0;
    CUresult rc;

    if ((rc = A->cuMemHostAlloc(&a, size, 0)) || (rc = A->cuMemAllocHost_v2(&b, size)) ||
        (rc = A->cuMemHostRegister_v2(c, size, 0)) || (rc = A->cuMemHostUnregister(c)) ||
        (rc = A->cuMemFreeHost(a)) || (rc = A->cuMemFreeHost(b)))
        return rc;
    free(c);
    d = (CUdeviceptr)(uintptr_t)&ipc;       /* any pointer: the fake carries it in the handle */
    memset(&ipc, 0, sizeof ipc);
    memcpy(ipc.reserved, &d, sizeof d);
    if ((rc = A->cuIpcOpenMemHandle_v2(&opened, ipc, 1)) || opened != d)
        return rc ? rc : CUDA_ERROR_UNKNOWN;
    return A->cuIpcCloseMemHandle(opened);
}

int client_extra_op(const struct cu_api *A, const char *op, int argc, char **argv,
                    unsigned long long (*new_slot)(unsigned long long),
                    unsigned long long (*slot)(const char *))
{
#define ARG(i) ((i) < argc ? argv[i] : NULL)
    CUdeviceptr p = 0;
    CUresult rc;

    if (!strcmp(op, "pitch")) {
        size_t pitch = 0;
        rc = A->cuMemAllocPitch_v2(&p, &pitch, num(ARG(0)), num(ARG(1)), 4);
        OUT("pitch rc=%d slot=%llu pitch=%zu", rc, new_slot(rc ? 0 : p), pitch);
        return 2;
    }
    /* The legacy ABIs (32-bit sizes and pointers, pre-3.2 descriptors, pre-6.5/11.0 host/IPC). */
    if (!strcmp(op, "pitch1")) {
        CUdeviceptr_v1 p1 = 0;
        unsigned int pitch = 0;
        rc = A->cuMemAllocPitch(&p1, &pitch, (unsigned int)num(ARG(0)), (unsigned int)num(ARG(1)), 4);
        OUT("pitch1 rc=%d slot=%llu pitch=%u", rc, new_slot(rc ? 0 : p1), pitch);
        return 2;
    }
    if (!strcmp(op, "array1") || !strcmp(op, "array3d1")) {
        CUarray a = NULL;
        int three = op[5] == '3';
        if (!three) {
            CUDA_ARRAY_DESCRIPTOR_v1 d = { (unsigned int)num(ARG(0)), (unsigned int)num(ARG(1)), CU_AD_FORMAT_FLOAT, 1 };
            rc = A->cuArrayCreate(&a, &d);
        } else {
            CUDA_ARRAY3D_DESCRIPTOR_v1 d = { (unsigned int)num(ARG(0)), (unsigned int)num(ARG(1)),
                                             (unsigned int)num(ARG(2)), CU_AD_FORMAT_FLOAT, 1, 0 };
            rc = A->cuArray3DCreate(&a, &d);
        }
        OUT("array1 rc=%d slot=%llu", rc, new_slot(rc ? 0 : (unsigned long long)(uintptr_t)a));
        return three ? 3 : 2;
    }
    if (!strcmp(op, "host1")) {
        void *b = NULL, *c = malloc(num(ARG(0)));
        CUipcMemHandle ipc;
        CUdeviceptr d = (CUdeviceptr)(uintptr_t)&ipc, opened = 0;
        memset(&ipc, 0, sizeof ipc);
        memcpy(ipc.reserved, &d, sizeof d);
        if (!(rc = A->cuMemAllocHost(&b, (unsigned int)num(ARG(0)))) && !(rc = A->cuMemHostRegister(c, num(ARG(0)), 0)) &&
            !(rc = A->cuMemHostUnregister(c)) && !(rc = A->cuMemFreeHost(b)) &&
            !(rc = A->cuIpcOpenMemHandle(&opened, ipc, 1)))
            rc = opened == d ? A->cuIpcCloseMemHandle(opened) : CUDA_ERROR_UNKNOWN;
        free(c);
        OUT("host1 rc=%d", rc);
        return 1;
    }
    if (!strcmp(op, "managed")) {
        rc = A->cuMemAllocManaged(&p, num(ARG(0)), 1);
        OUT("managed rc=%d slot=%llu", rc, new_slot(rc ? 0 : p));
        return 1;
    }
    if (!strcmp(op, "vmm") || !strcmp(op, "vmmhost")) {
        int dev = !strcmp(op, "vmm");
        CUmemAllocationProp prop = prop_for(dev ? CU_MEM_LOCATION_TYPE_DEVICE : CU_MEM_LOCATION_TYPE_HOST,
                                            dev ? (int)num(ARG(1)) : 0);
        CUmemGenericAllocationHandle h = 0;
        rc = A->cuMemCreate(&h, num(ARG(0)), &prop, 0);
        OUT("%s rc=%d slot=%llu", op, rc, new_slot(rc ? 0 : h));
        return dev ? 2 : 1;
    }
    if (!strcmp(op, "vmmat")) {
        CUmemAllocationProp prop = prop_for((int)num(ARG(1)), (int)num(ARG(2)));
        CUmemGenericAllocationHandle h = 0;
        rc = A->cuMemCreate(&h, num(ARG(0)), &prop, 0);
        OUT("vmmat rc=%d slot=%llu", rc, new_slot(rc ? 0 : h));
        return 3;
    }
    if (!strcmp(op, "vmmmap")) {
        OUT("vmmmap rc=%d", vmm_map(A, slot(ARG(0))));
        return 1;
    }
    if (!strcmp(op, "release")) {
        OUT("release rc=%d", A->cuMemRelease(slot(ARG(0))));
        return 1;
    }
    if (!strcmp(op, "maparray") || !strcmp(op, "maparrayp")) {
        /* A zeroed map-info buffer: vramcap must refuse before the driver reads it. */
        unsigned long long info[16] = { 0 };
        rc = (op[8] ? A->cuMemMapArrayAsync_ptsz : A->cuMemMapArrayAsync)(info, 1, NULL);
        OUT("maparray rc=%d", rc);
        return 0;
    }
    if (!strcmp(op, "async") || !strcmp(op, "asyncp")) {
        rc = (op[5] ? A->cuMemAllocAsync_ptsz : A->cuMemAllocAsync)(&p, num(ARG(0)), NULL);
        OUT("async rc=%d slot=%llu", rc, new_slot(rc ? 0 : p));
        return 1;
    }
    if (!strcmp(op, "freeasync") || !strcmp(op, "freeasyncp")) {
        rc = (op[9] ? A->cuMemFreeAsync_ptsz : A->cuMemFreeAsync)(slot(ARG(0)), NULL);
        OUT("freeasync rc=%d", rc);
        return 1;
    }
    if (!strcmp(op, "defpool") || !strcmp(op, "poolcreate") || !strcmp(op, "curpool") || !strcmp(op, "poolat")) {
        CUmemoryPool pl = NULL;
        if (!strcmp(op, "poolat")) {
            CUmemPoolProps props;
            memset(&props, 0, sizeof props);
            props.allocType = (int)num(ARG(0));
            props.location.type = (int)num(ARG(1));
            props.location.id = (int)num(ARG(2));
            rc = A->cuMemPoolCreate(&pl, &props);
        } else if (op[0] == 'd') {
            rc = A->cuDeviceGetDefaultMemPool(&pl, (CUdevice)num(ARG(0)));
        } else if (op[0] == 'c') {
            rc = A->cuDeviceGetMemPool(&pl, (CUdevice)num(ARG(0)));
        } else {
            CUmemPoolProps props;
            memset(&props, 0, sizeof props);
            props.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
            props.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
            props.location.id = (int)num(ARG(0));
            rc = A->cuMemPoolCreate(&pl, &props);
        }
        if (rc == CUDA_SUCCESS && g_npools < 64)
            g_pools[g_npools++] = pl;
        OUT("pool rc=%d id=%d", rc, g_npools - 1);
        return strcmp(op, "poolat") ? 1 : 3;
    }
    if (!strcmp(op, "keep")) {
        cuuint64_t max = ~0ULL;
        OUT("keep rc=%d", A->cuMemPoolSetAttribute(pool(ARG(0)), CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &max));
        return 1;
    }
    if (!strcmp(op, "palloc") || !strcmp(op, "pallocp")) {
        CUmemoryPool pl = pool(ARG(0));
        rc = (op[6] ? A->cuMemAllocFromPoolAsync_ptsz : A->cuMemAllocFromPoolAsync)(&p, num(ARG(1)), pl, NULL);
        OUT("palloc rc=%d slot=%llu", rc, new_slot(rc ? 0 : p));
        return 2;
    }
    if (!strcmp(op, "reserved")) {
        cuuint64_t r = 0, u = 0;
        rc = A->cuMemPoolGetAttribute(pool(ARG(0)), CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, &r);
        if (rc == CUDA_SUCCESS)
            rc = A->cuMemPoolGetAttribute(pool(ARG(0)), CU_MEMPOOL_ATTR_USED_MEM_CURRENT, &u);
        OUT("reserved rc=%d bytes=%llu used=%llu", rc, r, u);
        return 1;
    }
    if (!strcmp(op, "trim")) {
        OUT("trim rc=%d", A->cuMemPoolTrimTo(pool(ARG(0)), num(ARG(1))));
        return 2;
    }
    if (!strcmp(op, "sync") || !strcmp(op, "syncp") || !strcmp(op, "ctxsync")) {
        rc = op[0] == 'c' ? A->cuCtxSynchronize() : (op[4] ? A->cuStreamSynchronize_ptsz : A->cuStreamSynchronize)(NULL);
        OUT("sync rc=%d", rc);
        return 0;
    }
    if (!strcmp(op, "cycles")) {
        cycles(A, num(ARG(0)), num(ARG(1)), num(ARG(2)));
        return 3;
    }
    if (!strcmp(op, "array") || !strcmp(op, "array3d") || !strcmp(op, "mipmap")) {
        CUarray a = NULL;
        int used;
        if (!strcmp(op, "array")) {
            CUDA_ARRAY_DESCRIPTOR d = { num(ARG(0)), num(ARG(1)), CU_AD_FORMAT_FLOAT, 1 };
            rc = A->cuArrayCreate_v2(&a, &d);
            used = 2;
        } else {
            CUDA_ARRAY3D_DESCRIPTOR d = { num(ARG(0)), num(ARG(1)), 0, CU_AD_FORMAT_FLOAT, 1, 0 };
            if (op[5] == '3') {
                d.Depth = num(ARG(2));
                rc = A->cuArray3DCreate_v2(&a, &d);
            } else {
                rc = A->cuMipmappedArrayCreate(&a, &d, (unsigned int)num(ARG(2)));
            }
            used = 3;
        }
        OUT("array rc=%d slot=%llu", rc, new_slot(rc ? 0 : (unsigned long long)(uintptr_t)a));
        return used;
    }
    if (!strcmp(op, "arrayx")) {
        CUarray a = NULL;
        CUDA_ARRAY3D_DESCRIPTOR d = { num(ARG(0)), num(ARG(1)), num(ARG(2)), CU_AD_FORMAT_FLOAT, 1,
                                      (unsigned int)num(ARG(4)) };
        unsigned int levels = (unsigned int)num(ARG(3));
        rc = levels ? A->cuMipmappedArrayCreate(&a, &d, levels) : A->cuArray3DCreate_v2(&a, &d);
        OUT("array rc=%d slot=%llu", rc, new_slot(rc ? 0 : (unsigned long long)(uintptr_t)a));
        return 5;
    }
    if (!strcmp(op, "arrfree") || !strcmp(op, "mipfree")) {
        CUarray a = (CUarray)(uintptr_t)slot(ARG(0));
        OUT("arrfree rc=%d", op[0] == 'a' ? A->cuArrayDestroy(a) : A->cuMipmappedArrayDestroy(a));
        return 1;
    }
    if (!strcmp(op, "newctx")) {
        CUcontext c = NULL;
        rc = A->cuCtxCreate_v2(&c, 0, (CUdevice)num(ARG(0)));
        if (rc == CUDA_SUCCESS && g_nctxs < 64)
            g_ctxs[g_nctxs++] = c;
        OUT("newctx rc=%d id=%d", rc, g_nctxs - 1);
        return 1;
    }
    if (!strcmp(op, "ctxdestroy")) {
        unsigned long long k = num(ARG(0));
        OUT("ctxdestroy rc=%d", (int)k < g_nctxs ? A->cuCtxDestroy_v2(g_ctxs[k]) : CUDA_ERROR_INVALID_VALUE);
        return 1;
    }
    if (!strcmp(op, "reset")) {
        OUT("reset rc=%d", A->cuDevicePrimaryCtxReset_v2((CUdevice)num(ARG(0))));
        return 1;
    }
    if (!strcmp(op, "host")) {
        OUT("host rc=%d", host(A, num(ARG(0))));
        return 1;
    }
    return client_pool_op(A, op, argc, argv, new_slot, slot);
#undef ARG
}
