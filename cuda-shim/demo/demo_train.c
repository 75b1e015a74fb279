/*
 * demo_train: the workload of `vramcap demo`.  It behaves like a training
 * job as the CUDA runtime drives the driver: dlopen("libcuda.so.1"), dlsym
 * only cuGetProcAddress_v2, everything else by base name and version.
 *
 *   1. model load      74 weight tensors, 1.6 GiB
 *   2. optimizer state two moments per weight (Adam), 3.3 GiB, at step 1
 *   3. training steps  per step 24 activation buffers that grow with the
 *                      step (longer sequences), freed in reverse (backward)
 *   4. a leak          12 MiB of "loss history" per step, never freed
 *   5. a burst         one long batch needs 4x the activations: the cap
 *                      refuses one of them (CUDA_ERROR_OUT_OF_MEMORY); the
 *                      job frees the batch and goes on, as PyTorch code
 *                      catching torch.cuda.OutOfMemoryError would
 *   6. shutdown        weights and optimizer freed, the leak is left
 *
 * Sizes assume an 8 GiB cap (what `vramcap demo` sets); the job itself only
 * reads what cuMemGetInfo reports.  `demo_train --hold` stops before step 6
 * holding its memory until SIGTERM or SIGINT (kill, Ctrl-C), so `vramcap top`
 * and the sidecar's /metrics can be watched on a live job.  Exit status: 0, or 1 when a driver call
 * fails in a way the story does not expect (the burst must be refused).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cuda_types.h"

#define MIB (1ULL << 20)
#define STEPS 30
#define LAYERS 24
#define BURST_STEP 24
#define LEAK (12 * MIB)

static CUresult (*get_proc)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *);
static CUresult (*cu_init)(unsigned);
static CUresult (*ctx_retain)(CUcontext *, CUdevice);
static CUresult (*ctx_set)(CUcontext);
static CUresult (*mem_alloc)(CUdeviceptr *, size_t);
static CUresult (*mem_free)(CUdeviceptr);
static CUresult (*mem_info)(size_t *, size_t *);

static void *need(const char *base, int version)
{
    void *p = NULL;
    CUdriverProcAddressQueryResult st = -1;

    if (get_proc(base, &p, version, CU_GET_PROC_ADDRESS_DEFAULT, &st) != CUDA_SUCCESS || !p) {
        fprintf(stderr, "demo job: cuGetProcAddress_v2(%s) failed\n", base);
        exit(1);
    }
    return p;
}

static void pause_ms(long ms)
{
    struct timespec ts = { ms / 1000, (ms % 1000) * 1000000L };
    nanosleep(&ts, NULL);
}

static double gib(unsigned long long b) { return (double)b / (1ULL << 30); }

/* An allocation the job cannot do without: any failure ends it. */
static CUdeviceptr must_alloc(size_t size, const char *what)
{
    CUdeviceptr p = 0;
    CUresult rc = mem_alloc(&p, size);

    if (rc != CUDA_SUCCESS) {
        fprintf(stderr, "demo job: %s (%zu MiB) failed: CUresult %d\n", what, size >> 20, rc);
        exit(1);
    }
    return p;
}

static void report_info(const char *when)
{
    size_t free_b = 0, total_b = 0;

    if (mem_info(&free_b, &total_b) == CUDA_SUCCESS)
        printf("[demo job] %s: cuMemGetInfo says %.2f GiB free of %.2f GiB\n", when, gib(free_b), gib(total_b));
    fflush(stdout);
}

int main(int argc, char **argv)
{
    int hold = argc > 1 && !strcmp(argv[1], "--hold");
    if (argc > 1 && !hold) {
        fprintf(stderr, "usage: demo_train [--hold]\n");
        return 2;
    }
    /* --hold: the stop signals are taken with sigwait, so they are blocked from the start
       (before any thread exists, so every thread inherits the mask). */
    sigset_t stop;
    sigemptyset(&stop);
    sigaddset(&stop, SIGTERM);
    sigaddset(&stop, SIGINT);
    if (hold)
        sigprocmask(SIG_BLOCK, &stop, NULL);
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    CUcontext ctx;
    static CUdeviceptr weights[2 + 3 * LAYERS], moments[2 * (2 + 3 * LAYERS)], acts[LAYERS];
    static size_t wsize[2 + 3 * LAYERS];
    int leaked = 0;
    int nweights = 0, nmoments = 0;
    unsigned long long wbytes = 0;

    if (!h) {
        fprintf(stderr, "demo job: dlopen libcuda.so.1: %s\n", dlerror());
        return 1;
    }
    *(void **)&get_proc = dlsym(h, "cuGetProcAddress_v2");
    if (!get_proc) {
        fprintf(stderr, "demo job: the driver has no cuGetProcAddress_v2\n");
        return 1;
    }
    *(void **)&cu_init = need("cuInit", 2000);
    *(void **)&ctx_retain = need("cuDevicePrimaryCtxRetain", 7000);
    *(void **)&ctx_set = need("cuCtxSetCurrent", 4000);
    *(void **)&mem_alloc = need("cuMemAlloc", 3020);
    *(void **)&mem_free = need("cuMemFree", 3020);
    *(void **)&mem_info = need("cuMemGetInfo", 3020);
    if (cu_init(0) != CUDA_SUCCESS || ctx_retain(&ctx, 0) != CUDA_SUCCESS || ctx_set(ctx) != CUDA_SUCCESS) {
        fprintf(stderr, "demo job: cuInit or context creation failed\n");
        return 1;
    }
    report_info("start");

    /* 1. Model load: embedding, 24 blocks of 3 tensors, head. */
    wsize[nweights] = 256 * MIB;
    weights[nweights] = must_alloc(wsize[nweights], "embedding");
    wbytes += wsize[nweights++];
    for (int l = 0; l < LAYERS; l++) {
        size_t sz[3] = { 24 * MIB, 16 * MIB, 8 * MIB };
        for (int k = 0; k < 3; k++) {
            wsize[nweights] = sz[k];
            weights[nweights] = must_alloc(sz[k], "weights");
            wbytes += wsize[nweights++];
        }
        pause_ms(8);
    }
    wsize[nweights] = 256 * MIB;
    weights[nweights] = must_alloc(wsize[nweights], "output head");
    wbytes += wsize[nweights++];
    printf("[demo job] model loaded: %d tensors, %.2f GiB\n", nweights, gib(wbytes));

    for (int step = 1; step <= STEPS; step++) {
        int burst = step == BURST_STEP;
        size_t act = (size_t)(8 + step) * MIB * (burst ? 4 : 1);
        int got = 0, refused = -1;

        /* 2. Adam's two moments, created lazily by the first optimizer step. */
        if (step == 1) {
            for (int i = 0; i < nweights; i++)
                for (int m = 0; m < 2; m++)
                    moments[nmoments++] = must_alloc(wsize[i], "optimizer state");
        }
        /* forward: activations grow layer by layer */
        for (int l = 0; l < LAYERS; l++) {
            CUresult rc = mem_alloc(&acts[l], act);
            if (rc == CUDA_ERROR_OUT_OF_MEMORY && burst) {
                refused = l;
                break;
            }
            if (rc != CUDA_SUCCESS) {
                fprintf(stderr, "demo job: step %d layer %d: activation of %zu MiB failed: CUresult %d\n",
                        step, l, act >> 20, rc);
                return 1;
            }
            got++;
        }
        pause_ms(15); /* the forward pass holds them a while: the plot shows the saw tooth */
        /* backward frees them in reverse */
        for (int l = got - 1; l >= 0; l--)
            mem_free(acts[l]);
        if (burst) {
            if (refused < 0) {
                fprintf(stderr, "demo job: the long batch was not refused: is the cap set?\n");
                return 1;
            }
            printf("[demo job] step %d: long batch (4x activations): CUDA_ERROR_OUT_OF_MEMORY at layer %d "
                   "(PyTorch raises torch.cuda.OutOfMemoryError); batch skipped, training goes on\n",
                   step, refused);
        } else {
            /* 4. the leak: a loss tensor kept on the device "for logging" */
            must_alloc(LEAK, "loss history");
            leaked++;
        }
        if (step == 1 || step % 10 == 0)
            report_info(step == 1 ? "after step 1 (optimizer state created)" : "training");
        pause_ms(25);
    }

    if (hold) {
        int sig = 0;
        report_info("holding its memory until SIGTERM or SIGINT (kill, Ctrl-C)");
        sigwait(&stop, &sig);
        printf("[demo job] signal %d: shutting down\n", sig);
    }

    /* 6. Shutdown: the job frees what it knows about. */
    for (int i = 0; i < nmoments; i++)
        mem_free(moments[i]);
    for (int i = 0; i < nweights; i++)
        mem_free(weights[i]);
    printf("[demo job] done: weights and optimizer state freed; %d x %llu MiB of loss history never freed\n",
           leaked, LEAK / MIB);
    return 0;
}
