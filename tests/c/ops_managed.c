/*
 * ops_managed.c - prefetches of managed memory (slot K holds a cuMemAllocManaged pointer), on the
 * legacy default stream:
 *   prefetch1 K OFF SIZE DEV       -> prefetch rc=N   (cuMemPrefetchAsync, v1: DEV -1 = CU_DEVICE_CPU)
 *   prefetch1p K OFF SIZE DEV      -> prefetch rc=N   (cuMemPrefetchAsync_ptsz)
 *   prefetch2 K OFF SIZE TYPE ID   -> prefetch rc=N   (cuMemPrefetchAsync_v2: CUmemLocation {TYPE, ID})
 *   prefetch2p K OFF SIZE TYPE ID  -> prefetch rc=N   (cuMemPrefetchAsync_v2_ptsz)
 *   prefetchb V N K1 S1 .. KN SN TYPE ID -> prefetch rc=N
 *                                  (the whole of N ranges [slot K, +S) in one batch, all to {TYPE, ID}:
 *                                   V = 0 cuMemPrefetchBatchAsync, 1 its _ptsz, 2
 *                                   cuMemDiscardAndPrefetchBatchAsync, 3 its _ptsz)
 *   prefetchb2 K1 O1 S1 T1 I1 K2 O2 S2 T2 I2 -> prefetch rc=N
 *                                  (cuMemPrefetchBatchAsync of two ranges [slot K + O, +S), each to
 *                                   its own location)
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client.h"

#define OUT client_printf
#define MAXB 16

int client_managed_op(const struct cu_api *A, const char *op, int argc, char **argv,
                      unsigned long long (*slot)(const char *))
{
#define ARG(i) ((i) < argc ? argv[i] : (fprintf(stderr, "client: %s: missing argument\n", op), exit(2), (char *)NULL))
    if (!strcmp(op, "prefetch1") || !strcmp(op, "prefetch1p")) {
        CUdeviceptr p = (CUdeviceptr)slot(ARG(0)) + client_parse_size(ARG(1));
        size_t n = (size_t)client_parse_size(ARG(2));
        CUdevice dev = (CUdevice)client_parse_long(ARG(3));
        OUT("prefetch rc=%d", op[9] == 'p' ? A->cuMemPrefetchAsync_ptsz(p, n, dev, NULL)
                                           : A->cuMemPrefetchAsync(p, n, dev, NULL));
        return 4;
    }
    if (!strcmp(op, "prefetch2") || !strcmp(op, "prefetch2p")) {
        CUdeviceptr p = (CUdeviceptr)slot(ARG(0)) + client_parse_size(ARG(1));
        size_t n = (size_t)client_parse_size(ARG(2));
        CUmemLocation loc = { (int)client_parse_long(ARG(3)), (int)client_parse_long(ARG(4)) };
        OUT("prefetch rc=%d", op[9] == 'p' ? A->cuMemPrefetchAsync_v2_ptsz(p, n, loc, 0, NULL)
                                           : A->cuMemPrefetchAsync_v2(p, n, loc, 0, NULL));
        return 5;
    }
    if (!strcmp(op, "prefetchb")) {
        long v = client_parse_long(ARG(0)), n = client_parse_long(ARG(1));
        CUdeviceptr ptrs[MAXB];
        size_t sizes[MAXB], idx = 0;
        CUmemLocation loc;
        CUresult rc;

        if (n < 1 || n > MAXB) {
            fprintf(stderr, "client: prefetchb takes 1..%d ranges\n", MAXB);
            exit(2);
        }
        for (long k = 0; k < n; k++) {
            ptrs[k] = (CUdeviceptr)slot(ARG(2 + 2 * k));
            sizes[k] = (size_t)client_parse_size(ARG(3 + 2 * k));
        }
        loc.type = (int)client_parse_long(ARG(2 + 2 * n));
        loc.id = (int)client_parse_long(ARG(3 + 2 * n));
        switch (v) {
        case 0: rc = A->cuMemPrefetchBatchAsync(ptrs, sizes, (size_t)n, &loc, &idx, 1, 0, NULL); break;
        case 1: rc = A->cuMemPrefetchBatchAsync_ptsz(ptrs, sizes, (size_t)n, &loc, &idx, 1, 0, NULL); break;
        case 2: rc = A->cuMemDiscardAndPrefetchBatchAsync(ptrs, sizes, (size_t)n, &loc, &idx, 1, 0, NULL); break;
        case 3: rc = A->cuMemDiscardAndPrefetchBatchAsync_ptsz(ptrs, sizes, (size_t)n, &loc, &idx, 1, 0, NULL); break;
        default: fprintf(stderr, "client: no batch variant %ld\n", v); exit(2);
        }
        OUT("prefetch rc=%d", rc);
        return (int)(4 + 2 * n);
    }
    if (!strcmp(op, "prefetchb2")) {
        CUdeviceptr ptrs[2];
        size_t sizes[2], idx[2] = { 0, 1 };
        CUmemLocation locs[2];

        for (int k = 0; k < 2; k++) {
            ptrs[k] = (CUdeviceptr)slot(ARG(5 * k)) + client_parse_size(ARG(5 * k + 1));
            sizes[k] = (size_t)client_parse_size(ARG(5 * k + 2));
            locs[k].type = (int)client_parse_long(ARG(5 * k + 3));
            locs[k].id = (int)client_parse_long(ARG(5 * k + 4));
        }
        OUT("prefetch rc=%d", A->cuMemPrefetchBatchAsync(ptrs, sizes, 2, locs, idx, 2, 0, NULL));
        return 10;
    }
    return -1;
#undef ARG
}
