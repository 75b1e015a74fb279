/* client_mainexit: a program whose main thread ends with pthread_exit (legal, and common in C and
 * C++ servers): the process lives on while another thread runs and exits, with status 0, when the
 * last thread ends. glibc runs `atexit` handlers only then, so a library thread that waits for
 * `atexit` keeps such a process alive for ever (issue 16).
 *
 *   client_mainexit WORKER_MS     main: cuInit, allocate and free on device 0, start a worker,
 *                                 print `ready pid=N`, pthread_exit. The worker allocates and
 *                                 frees too, sleeps WORKER_MS (-1: until a signal ends the
 *                                 process), prints `worker done` and returns. `ready` comes
 *                                 after the worker's first allocation.
 *   client_mainexit WORKER_MS PAIRS  the same, and the worker then does PAIRS more alloc/free
 *                                 pairs flat out (after `ready`, before its sleep), more than
 *                                 one event ring holds.
 * Linked against libcuda (the fake driver) like client_linked. */
#define _GNU_SOURCE
#include "cuda_types.h"
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

static CUcontext ctx;
static long worker_ms;
static long pairs;
/* `ready` is printed once the worker has made its first allocation. */
static pthread_barrier_t started;

static void alloc_free(const char *who)
{
    CUdeviceptr p = 0;
    CUresult rc = cuMemAlloc_v2(&p, 1 << 20);
    if (rc == CUDA_SUCCESS)
        rc = cuMemFree_v2(p);
    printf("%s alloc_free rc=%d\n", who, (int)rc);
    fflush(stdout);
}

static void *worker(void *arg)
{
    (void)arg;
    cuCtxSetCurrent(ctx);
    alloc_free("worker");
    pthread_barrier_wait(&started);
    long bad = 0;
    for (long i = 0; i < pairs; i++) {
        CUdeviceptr p = 0;
        if (cuMemAlloc_v2(&p, 4096) != CUDA_SUCCESS || cuMemFree_v2(p) != CUDA_SUCCESS)
            bad++;
    }
    if (pairs > 0) {
        printf("worker pairs=%ld bad=%ld\n", pairs, bad);
        fflush(stdout);
    }
    if (worker_ms < 0) {
        for (;;)
            pause();
    }
    struct timespec ts = { worker_ms / 1000, (worker_ms % 1000) * 1000000L };
    nanosleep(&ts, NULL);
    alloc_free("worker");
    printf("worker done\n");
    fflush(stdout);
    return NULL;
}

int main(int argc, char **argv)
{
    if (argc != 2 && argc != 3) {
        fprintf(stderr, "usage: client_mainexit WORKER_MS [PAIRS]\n");
        return 2;
    }
    worker_ms = strtol(argv[1], NULL, 10);
    pairs = argc == 3 ? strtol(argv[2], NULL, 10) : 0;
    CUdevice dev = 0;
    if (cuInit(0) || cuDeviceGet(&dev, 0) || cuDevicePrimaryCtxRetain(&ctx, dev) || cuCtxSetCurrent(ctx)) {
        fprintf(stderr, "client_mainexit: CUDA setup failed\n");
        return 1;
    }
    alloc_free("main");
    pthread_t t;
    pthread_barrier_init(&started, NULL, 2);
    if (pthread_create(&t, NULL, worker, NULL)) {
        fprintf(stderr, "client_mainexit: pthread_create failed\n");
        return 1;
    }
    pthread_barrier_wait(&started);
    printf("ready pid=%d\n", (int)getpid());
    fflush(stdout);
    pthread_exit(NULL);
}
