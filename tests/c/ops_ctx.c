/*
 * ops_ctx.c - context and VMM lifetime ops, shared by the three client front ends:
 *   mkctx V DEV          -> mkctx rc=N id=C            (cuCtxCreate v1 / _v2 / _v3 / _v4: V = 1..4;
 *                                                       becomes current)
 *   attach               -> attach rc=N id=C           (cuCtxAttach: the current context, once more)
 *   detach C             -> detach rc=N                (cuCtxDetach)
 *   destroy1 C | destroy2 C -> destroy rc=N            (cuCtxDestroy / cuCtxDestroy_v2)
 *   push C               -> push rc=N                  (cuCtxPushCurrent_v2)
 *   pop                  -> pop rc=N                   (cuCtxPopCurrent_v2)
 *   release1 DEV | release2 DEV -> primrelease rc=N    (cuDevicePrimaryCtxRelease / _v2)
 *   reset1 DEV           -> reset rc=N                 (cuDevicePrimaryCtxReset, v1)
 *   primstate DEV        -> primstate rc=N active=A
 *   green DEV            -> green rc=N id=G           (cuDeviceGetDevResource(SM), cuDevResourceGenerateDesc,
 *                                                       cuGreenCtxCreate: it retains DEV's primary context)
 *   greenctx G           -> greenctx rc=N id=C         (cuCtxFromGreenCtx: a context for push / destroy)
 *   greendestroy G       -> greendestroy rc=N          (cuGreenCtxDestroy: releases the primary context)
 *   vamap K SIZE         -> vamap rc=N id=V            (reserve SIZE, map handle slot K over it,
 *                                                       grant access, write through it)
 *   vaunmap V [OFF SIZE] -> vaunmap rc=N               (cuMemUnmap of the whole mapping, or of
 *                                                       [va+OFF, va+OFF+SIZE))
 *   vafree V             -> vafree rc=N                (cuMemAddressFree)
 *   retainh V OFF        -> retainh rc=N slot=K same=1 (cuMemRetainAllocationHandle(va+OFF):
 *                                                       handle in a new slot; same: the mapped one)
 *   vmmfd SIZE DEV       -> vmm rc=N slot=K            (cuMemCreate SIZE on DEV, shareable as a POSIX fd)
 *   export K             -> export rc=N id=F           (cuMemExportToShareableHandle(slot K), POSIX fd)
 *   import F             -> import rc=N slot=K same=1  (cuMemImportFromShareableHandle(fd F): handle in a
 *                                                       new slot; same: the exported handle's value)
 *   (passing fds between processes: ops_fd.c)
 *   vmmstorm T N SIZE    -> vmmstorm ok=A oom=O other=E (T threads × N rounds of cuMemCreate SIZE,
 *                                                       map, release right after mapping, unmap; every
 *                                                       other round NCCL's way: retain from the
 *                                                       address, release that, unmap, release)
 *   ctxstorm T N SIZE    -> ctxstorm ok=A oom=O other=E (T threads × N rounds, each allocating SIZE in:
 *                                                       a new context then destroyed; a new one
 *                                                       attached and detached twice; the primary
 *                                                       context, retained, freed, released)
 *   forkstorm T N SIZE K -> forkstorm ok=A oom=O other=E bad_children=B (T vmmstorm and T ctxstorm
 *                                                       threads while the main thread forks K times;
 *                                                       each child exits at once: no fork may hang on
 *                                                       a lock another thread held)
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <fcntl.h>
#include <pthread.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "client.h"

static CUcontext g_ctx[64];
static int g_nctx;

static struct {
    CUdeviceptr va;
    size_t size;
    CUmemGenericAllocationHandle h;
} g_va[64];
static int g_nva;


#define OUT client_printf

static CUcontext ctx_at(const char *s)
{
    long k = client_parse_long(s);
    if (k < 0 || k >= g_nctx) {
        fprintf(stderr, "client: no context %s\n", s ? s : "(missing)");
        exit(2);
    }
    return g_ctx[k];
}


static int va_at(const char *s)
{
    long k = client_parse_long(s);
    if (k < 0 || k >= g_nva) {
        fprintf(stderr, "client: no mapping %s\n", s ? s : "(missing)");
        exit(2);
    }
    return (int)k;
}

static CUgreenCtx g_green[64];
static int g_ngreen;

static CUgreenCtx green_at(const char *s)
{
    long k = client_parse_long(s);
    if (k < 0 || k >= g_ngreen) {
        fprintf(stderr, "client: no green context %s\n", s ? s : "(missing)");
        exit(2);
    }
    return g_green[k];
}

static int keep_ctx(CUresult rc, CUcontext c)
{
    if (rc == CUDA_SUCCESS && g_nctx < 64)
        g_ctx[g_nctx++] = c;
    return g_nctx - 1;
}

static CUresult va_map(const struct cu_api *A, CUmemGenericAllocationHandle h, size_t size, CUdeviceptr *out)
{
    CUmemAccessDesc acc = { { CU_MEM_LOCATION_TYPE_DEVICE, 0 }, 3 };
    CUdeviceptr va = 0;
    CUresult rc = A->cuMemAddressReserve(&va, size, 0, 0, 0);

    if (rc != CUDA_SUCCESS)
        return rc;
    if ((rc = A->cuMemMap(va, size, 0, h, 0)) != CUDA_SUCCESS ||
        (rc = A->cuMemSetAccess(va, size, &acc, 1)) != CUDA_SUCCESS) {
        A->cuMemAddressFree(va, size);
        return rc;
    }
    *(volatile int *)(uintptr_t)va = 7;
    *out = va;
    return CUDA_SUCCESS;
}

struct storm {
    const struct cu_api *A;
    unsigned long long n, size, ok, oom, other;
};

static void *storm_worker(void *p)
{
    struct storm *st = p;
    const struct cu_api *A = st->A;
    CUmemAllocationProp prop;

    memset(&prop, 0, sizeof prop);
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    for (unsigned long long i = 0; i < st->n; i++) {
        CUmemGenericAllocationHandle h = 0, h2 = 0;
        CUdeviceptr va = 0;
        CUresult rc = A->cuMemCreate(&h, st->size, &prop, 0);
        int bad = 0;

        if (rc == CUDA_ERROR_OUT_OF_MEMORY) {
            st->oom++;
            continue;
        }
        if (rc != CUDA_SUCCESS) {
            st->other++;
            continue;
        }
        if (A->cuMemAddressReserve(&va, st->size, 0, 0, 0) != CUDA_SUCCESS) {
            A->cuMemRelease(h);
            st->other++;
            continue;
        }
        bad |= A->cuMemMap(va, st->size, 0, h, 0) != CUDA_SUCCESS;
        if (i % 2 == 0) {
            bad |= A->cuMemRelease(h) != CUDA_SUCCESS;
            bad |= A->cuMemUnmap(va, st->size) != CUDA_SUCCESS;
        } else {
            bad |= A->cuMemRetainAllocationHandle(&h2, (void *)(uintptr_t)(va + st->size / 2)) != CUDA_SUCCESS;
            bad |= h2 != h;
            bad |= A->cuMemRelease(h2) != CUDA_SUCCESS;
            bad |= A->cuMemUnmap(va, st->size) != CUDA_SUCCESS;
            bad |= A->cuMemRelease(h) != CUDA_SUCCESS;
        }
        bad |= A->cuMemAddressFree(va, st->size) != CUDA_SUCCESS;
        if (bad)
            st->other++;
        else
            st->ok++;
    }
    return NULL;
}

static void *ctx_worker(void *p)
{
    struct storm *st = p;
    const struct cu_api *A = st->A;

    for (unsigned long long i = 0; i < st->n; i++) {
        CUcontext c = NULL, c2 = NULL;
        CUdeviceptr d = 0;
        CUresult rc;
        int bad = 0;

        switch (i % 3) {
        case 0:
            if (A->cuCtxCreate_v2(&c, 0, 0) != CUDA_SUCCESS) {
                st->other++;
                continue;
            }
            rc = A->cuMemAlloc_v2(&d, st->size);
            bad |= A->cuCtxDestroy_v2(c) != CUDA_SUCCESS;
            break;
        case 1:
            if (A->cuCtxCreate_v4(&c, NULL, 0, 0) != CUDA_SUCCESS) {
                st->other++;
                continue;
            }
            rc = A->cuMemAlloc_v2(&d, st->size);
            bad |= A->cuCtxAttach(&c2, 0) != CUDA_SUCCESS || c2 != c;
            bad |= A->cuCtxDetach(c) != CUDA_SUCCESS;
            bad |= A->cuCtxPushCurrent_v2(c) != CUDA_SUCCESS;
            bad |= A->cuCtxDetach(c) != CUDA_SUCCESS;
            break;
        default:
            if (A->cuDevicePrimaryCtxRetain(&c, 0) != CUDA_SUCCESS || A->cuCtxSetCurrent(c) != CUDA_SUCCESS) {
                st->other++;
                continue;
            }
            rc = A->cuMemAlloc_v2(&d, st->size);
            if (rc == CUDA_SUCCESS)
                bad |= A->cuMemFree_v2(d) != CUDA_SUCCESS;
            bad |= A->cuDevicePrimaryCtxRelease_v2(0) != CUDA_SUCCESS;
            break;
        }
        if (bad || (rc != CUDA_SUCCESS && rc != CUDA_ERROR_OUT_OF_MEMORY))
            st->other++;
        else if (rc == CUDA_ERROR_OUT_OF_MEMORY)
            st->oom++;
        else
            st->ok++;
    }
    return NULL;
}

static void storm(const struct cu_api *A, const char *name, void *(*worker)(void *), long t,
                  unsigned long long n, unsigned long long size)
{
    struct storm st[64];
    pthread_t th[64];
    unsigned long long ok = 0, oom = 0, other = 0;

    if (t < 1 || t > 64) {
        fprintf(stderr, "client: %s takes 1..64 threads\n", name);
        exit(2);
    }
    for (long i = 0; i < t; i++) {
        st[i] = (struct storm){ A, n, size, 0, 0, 0 };
        pthread_create(&th[i], NULL, worker, &st[i]);
    }
    for (long i = 0; i < t; i++) {
        pthread_join(th[i], NULL);
        ok += st[i].ok;
        oom += st[i].oom;
        other += st[i].other;
    }
    OUT("%s ok=%llu oom=%llu other=%llu", name, ok, oom, other);
}

static void fork_storm(const struct cu_api *A, long t, unsigned long long n, unsigned long long size, long k)
{
    struct storm st[64];
    pthread_t th[64];
    unsigned long long ok = 0, oom = 0, other = 0;
    long bad = 0;

    if (t < 1 || t > 32) {
        fprintf(stderr, "client: forkstorm takes 1..32 threads\n");
        exit(2);
    }
    for (long i = 0; i < 2 * t; i++) {
        st[i] = (struct storm){ A, n, size, 0, 0, 0 };
        pthread_create(&th[i], NULL, i < t ? storm_worker : ctx_worker, &st[i]);
    }
    for (long i = 0; i < k; i++) {
        int status = -1;
        pid_t pid;

        fflush(stdout);
        if ((pid = fork()) == 0)
            _exit(0);
        if (pid < 0 || waitpid(pid, &status, 0) != pid || !WIFEXITED(status) || WEXITSTATUS(status) != 0)
            bad++;
    }
    for (long i = 0; i < 2 * t; i++) {
        pthread_join(th[i], NULL);
        ok += st[i].ok;
        oom += st[i].oom;
        other += st[i].other;
    }
    OUT("forkstorm ok=%llu oom=%llu other=%llu bad_children=%ld", ok, oom, other, bad);
}

int client_ctx_op(const struct cu_api *A, const char *op, int argc, char **argv,
                  unsigned long long (*new_slot)(unsigned long long),
                  unsigned long long (*slot)(const char *))
{
#define ARG(i) ((i) < argc ? argv[i] : NULL)
    CUcontext c = NULL;
    CUresult rc;

    if (!strcmp(op, "mkctx")) {
        long v = client_parse_long(ARG(0));
        CUdevice dev = (CUdevice)client_parse_long(ARG(1));
        switch (v) {
        case 1: rc = A->cuCtxCreate(&c, 0, dev); break;
        case 2: rc = A->cuCtxCreate_v2(&c, 0, dev); break;
        case 3: rc = A->cuCtxCreate_v3(&c, NULL, 0, 0, dev); break;
        case 4: rc = A->cuCtxCreate_v4(&c, NULL, 0, dev); break;
        default: fprintf(stderr, "client: no cuCtxCreate variant %ld\n", v); exit(2);
        }
        OUT("mkctx rc=%d id=%d", rc, keep_ctx(rc, c));
        return 2;
    }
    if (!strcmp(op, "attach")) {
        rc = A->cuCtxAttach(&c, 0);
        OUT("attach rc=%d id=%d", rc, keep_ctx(rc, c));
        return 0;
    }
    if (!strcmp(op, "detach")) {
        OUT("detach rc=%d", A->cuCtxDetach(ctx_at(ARG(0))));
        return 1;
    }
    if (!strcmp(op, "destroy1") || !strcmp(op, "destroy2")) {
        c = ctx_at(ARG(0));
        OUT("destroy rc=%d", op[7] == '1' ? A->cuCtxDestroy(c) : A->cuCtxDestroy_v2(c));
        return 1;
    }
    if (!strcmp(op, "push")) {
        OUT("push rc=%d", A->cuCtxPushCurrent_v2(ctx_at(ARG(0))));
        return 1;
    }
    if (!strcmp(op, "pop")) {
        OUT("pop rc=%d", A->cuCtxPopCurrent_v2(&c));
        return 0;
    }
    if (!strcmp(op, "release1") || !strcmp(op, "release2")) {
        CUdevice dev = (CUdevice)client_parse_long(ARG(0));
        OUT("primrelease rc=%d",
            op[7] == '1' ? A->cuDevicePrimaryCtxRelease(dev) : A->cuDevicePrimaryCtxRelease_v2(dev));
        return 1;
    }
    if (!strcmp(op, "reset1")) {
        OUT("reset rc=%d", A->cuDevicePrimaryCtxReset((CUdevice)client_parse_long(ARG(0))));
        return 1;
    }
    if (!strcmp(op, "primstate")) {
        unsigned int flags = 0;
        int active = -1;
        rc = A->cuDevicePrimaryCtxGetState((CUdevice)client_parse_long(ARG(0)), &flags, &active);
        OUT("primstate rc=%d active=%d", rc, active);
        return 1;
    }
    if (!strcmp(op, "green")) {
        CUdevice dev = (CUdevice)client_parse_long(ARG(0));
        CUdevResource sm;
        CUdevResourceDesc desc = NULL;
        CUgreenCtx g = NULL;
        rc = A->cuDeviceGetDevResource(dev, &sm, CU_DEV_RESOURCE_TYPE_SM);
        if (rc == CUDA_SUCCESS)
            rc = A->cuDevResourceGenerateDesc(&desc, &sm, 1);
        if (rc == CUDA_SUCCESS)
            rc = A->cuGreenCtxCreate(&g, desc, dev, 0);
        if (rc == CUDA_SUCCESS && g_ngreen < 64)
            g_green[g_ngreen++] = g;
        OUT("green rc=%d id=%d", rc, g_ngreen - 1);
        return 1;
    }
    if (!strcmp(op, "greenctx")) {
        rc = A->cuCtxFromGreenCtx(&c, green_at(ARG(0)));
        OUT("greenctx rc=%d id=%d", rc, keep_ctx(rc, c));
        return 1;
    }
    if (!strcmp(op, "greendestroy")) {
        OUT("greendestroy rc=%d", A->cuGreenCtxDestroy(green_at(ARG(0))));
        return 1;
    }
    if (!strcmp(op, "vamap")) {
        CUmemGenericAllocationHandle h = slot(ARG(0));
        size_t size = (size_t)client_parse_size(ARG(1));
        CUdeviceptr va = 0;
        rc = va_map(A, h, size, &va);
        if (rc == CUDA_SUCCESS && g_nva < 64) {
            g_va[g_nva].va = va;
            g_va[g_nva].size = size;
            g_va[g_nva].h = h;
            g_nva++;
        }
        OUT("vamap rc=%d id=%d", rc, g_nva - 1);
        return 2;
    }
    if (!strcmp(op, "vaunmap")) {
        int k = va_at(ARG(0));
        /* An optional sub-range: OFF SIZE (both sizes). */
        if (ARG(1) && ARG(2) && ARG(1)[0] >= '0' && ARG(1)[0] <= '9') {
            size_t off = (size_t)client_parse_size(ARG(1)), size = (size_t)client_parse_size(ARG(2));
            OUT("vaunmap rc=%d", A->cuMemUnmap(g_va[k].va + off, size));
            return 3;
        }
        OUT("vaunmap rc=%d", A->cuMemUnmap(g_va[k].va, g_va[k].size));
        return 1;
    }
    if (!strcmp(op, "vafree")) {
        int k = va_at(ARG(0));
        OUT("vafree rc=%d", A->cuMemAddressFree(g_va[k].va, g_va[k].size));
        return 1;
    }
    if (!strcmp(op, "retainh")) {
        int k = va_at(ARG(0));
        size_t off = (size_t)client_parse_size(ARG(1));
        CUmemGenericAllocationHandle h = 0;
        rc = A->cuMemRetainAllocationHandle(&h, (void *)(uintptr_t)(g_va[k].va + off));
        OUT("retainh rc=%d slot=%llu same=%d", rc, new_slot(rc ? 0 : h), rc == CUDA_SUCCESS && h == g_va[k].h);
        return 2;
    }
    if (!strcmp(op, "vmmfd")) {
        CUmemAllocationProp prop;
        CUmemGenericAllocationHandle h = 0;
        memset(&prop, 0, sizeof prop);
        prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
        prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        prop.location.id = (int)client_parse_long(ARG(1));
        rc = A->cuMemCreate(&h, (size_t)client_parse_size(ARG(0)), &prop, 0);
        OUT("vmm rc=%d slot=%llu", rc, new_slot(rc ? 0 : h));
        return 2;
    }
    if (!strcmp(op, "export")) {
        CUmemGenericAllocationHandle h = slot(ARG(0));
        int fd = -1;
        rc = A->cuMemExportToShareableHandle(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
        OUT("export rc=%d id=%d", rc, rc == CUDA_SUCCESS ? client_fd_add(fd, h) : -1);
        return 1;
    }
    if (!strcmp(op, "import")) {
        struct client_fd *f = client_fd_at(ARG(0));
        CUmemGenericAllocationHandle h = 0;
        rc = A->cuMemImportFromShareableHandle(&h, (void *)(intptr_t)f->fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
        OUT("import rc=%d slot=%llu same=%d", rc, new_slot(rc ? 0 : h), rc == CUDA_SUCCESS && h == f->h);
        return 1;
    }
    if ((rc = client_fd_op(op, argc, argv)) != 0)
        return (int)rc - 1;
    if (!strcmp(op, "vmmstorm") || !strcmp(op, "ctxstorm")) {
        long t = client_parse_long(ARG(0));
        unsigned long long n = client_parse_size(ARG(1));
        storm(A, op, op[0] == 'v' ? storm_worker : ctx_worker, t, n, client_parse_size(ARG(2)));
        return 3;
    }
    if (!strcmp(op, "forkstorm")) {
        long t = client_parse_long(ARG(0));
        unsigned long long n = client_parse_size(ARG(1)), size = client_parse_size(ARG(2));
        fork_storm(A, t, n, size, client_parse_long(ARG(3)));
        return 4;
    }
    return client_overhead_op(A, op, argc, argv);
#undef ARG
}
