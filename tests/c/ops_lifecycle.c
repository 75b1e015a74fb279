/*
 * Ops about process lifecycle and load, for the trace and benchmark tests:
 *   benchmt T N SIZE      -> benchmt threads=T pairs=P ns_per_pair_cpu=X ns_per_pair_wall=Y
 *                            ns_per_pair_worker_cpu=Z errors=E
 *                            (T threads each do N alloc_v2+free_v2 pairs; X: process CPU time from
 *                            getrusage, a per-pair cost even when threads outnumber cores; Z: the
 *                            allocating threads' own CPU time, without vramcap's writer threads)
 *   rate EPS SECS SIZE    -> rate pairs=P seconds=S achieved_eps=R ns_per_pair_busy=B ns_per_pair_busy_cpu=C errors=E
 *                            (alloc/free pairs paced to EPS events per second, 2 events per pair, in
 *                            slices of 1 ms worth; B = time inside the slices / pairs, i.e. the
 *                            per-pair cost at a rate the trace writer keeps up with; C = the same
 *                            in this thread's CPU time, which excludes time it was descheduled)
 *   fork                  -> fork child=PID status=N  (child: alloc 1 MiB, free it, exit(0))
 *   exitthread            -> another thread calls exit(0) while the main thread sleeps
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "client.h"

#define A client_A

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static double thread_cpu_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static double cpu_s(void)
{
    struct rusage u;
    getrusage(RUSAGE_SELF, &u);
    return (double)u.ru_utime.tv_sec + (double)u.ru_utime.tv_usec * 1e-6 + (double)u.ru_stime.tv_sec +
           (double)u.ru_stime.tv_usec * 1e-6;
}

struct bench_arg {
    CUcontext ctx;
    unsigned long long n, size, errors;
    double cpu; /* this worker's own CPU time */
};

static void *bench_worker(void *p)
{
    struct bench_arg *a = p;
    A->cuCtxSetCurrent(a->ctx);
    double c0 = thread_cpu_s();
    for (unsigned long long i = 0; i < a->n; i++) {
        CUdeviceptr d = 0;
        if (A->cuMemAlloc_v2(&d, (size_t)a->size) != CUDA_SUCCESS) {
            a->errors++;
            continue;
        }
        if (A->cuMemFree_v2(d) != CUDA_SUCCESS)
            a->errors++;
    }
    a->cpu = thread_cpu_s() - c0;
    return NULL;
}

static void op_benchmt(long nt, unsigned long long n, unsigned long long size)
{
    pthread_t th[256];
    struct bench_arg args[256];
    CUcontext ctx = NULL;
    unsigned long long errors = 0;
    double w0, c0, w, c, workers = 0;

    if (nt < 1 || nt > 256) {
        fprintf(stderr, "client: benchmt: 1..256 threads\n");
        exit(2);
    }
    A->cuCtxGetCurrent(&ctx);
    w0 = now_s();
    c0 = cpu_s();
    for (long i = 0; i < nt; i++) {
        args[i] = (struct bench_arg){ ctx, n, size, 0, 0 };
        pthread_create(&th[i], NULL, bench_worker, &args[i]);
    }
    for (long i = 0; i < nt; i++) {
        pthread_join(th[i], NULL);
        errors += args[i].errors;
        workers += args[i].cpu;
    }
    w = now_s() - w0;
    c = cpu_s() - c0;
    client_printf("benchmt threads=%ld pairs=%llu ns_per_pair_cpu=%.1f ns_per_pair_wall=%.1f "
                  "ns_per_pair_worker_cpu=%.1f errors=%llu",
                  nt, n * (unsigned long long)nt, c * 1e9 / (double)(n * (unsigned long long)nt),
                  w * 1e9 / (double)(n * (unsigned long long)nt), workers * 1e9 / (double)(n * (unsigned long long)nt),
                  errors);
}

static void op_rate(unsigned long long eps, unsigned long long secs, unsigned long long size)
{
    double start = now_s(), per_pair = 2.0 / (double)eps;
    unsigned long long pairs = 0, errors = 0, total = eps / 2 * secs;
    double busy = 0, busy_cpu = 0;

    while (pairs < total) {
        /* Pace in slices of 1 ms worth of pairs. */
        double due = start + (double)pairs * per_pair;
        double t = now_s();
        if (t < due) {
            struct timespec ts = { 0, (long)((due - t) * 1e9) };
            nanosleep(&ts, NULL);
        }
        double s0 = now_s(), c0 = thread_cpu_s();
        for (unsigned long long k = 0; k < eps / 2000 + 1 && pairs < total; k++, pairs++) {
            CUdeviceptr d = 0;
            if (A->cuMemAlloc_v2(&d, (size_t)size) != CUDA_SUCCESS) {
                errors++;
                continue;
            }
            if (A->cuMemFree_v2(d) != CUDA_SUCCESS)
                errors++;
        }
        busy += now_s() - s0;
        busy_cpu += thread_cpu_s() - c0;
    }
    double el = now_s() - start;
    client_printf("rate pairs=%llu seconds=%.2f achieved_eps=%.0f ns_per_pair_busy=%.1f ns_per_pair_busy_cpu=%.1f "
                  "errors=%llu",
                  pairs, el, 2.0 * (double)pairs / el, busy * 1e9 / (double)(pairs ? pairs : 1),
                  busy_cpu * 1e9 / (double)(pairs ? pairs : 1), errors);
}

static void op_fork(void)
{
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        CUdeviceptr d = 0;
        if (A->cuMemAlloc_v2(&d, 1 << 20) == CUDA_SUCCESS)
            A->cuMemFree_v2(d);
        exit(0);
    }
    int status = -1;
    waitpid(pid, &status, 0);
    client_printf("fork child=%d status=%d", (int)pid, WIFEXITED(status) ? WEXITSTATUS(status) : -1);
}

static void *exit_worker(void *p)
{
    (void)p;
    client_printf("exitthread exiting");
    exit(0);
}

int client_lifecycle_op(const char *op, int *i, int argc, char **argv)
{
#define NEXT() (*i + 1 < argc ? argv[++*i] : NULL)
    if (!strcmp(op, "benchmt")) {
        long nt = client_parse_long(NEXT());
        unsigned long long n = client_parse_size(NEXT());
        op_benchmt(nt, n, client_parse_size(NEXT()));
    } else if (!strcmp(op, "rate")) {
        unsigned long long eps = client_parse_size(NEXT());
        unsigned long long secs = client_parse_size(NEXT());
        op_rate(eps, secs, client_parse_size(NEXT()));
    } else if (!strcmp(op, "fork")) {
        op_fork();
    } else if (!strcmp(op, "waitfile")) {
        /* A start line for processes that must act at the same moment (tests race them):
         * poll every 50 us until the path exists, at most 30 s. */
        const char *path = NEXT();
        int n = 0;
        while (path && access(path, F_OK) != 0 && n++ < 600000) {
            struct timespec ts = { 0, 50000 };
            nanosleep(&ts, NULL);
        }
        client_printf("waitfile ok=%d", path && access(path, F_OK) == 0);
    } else if (!strcmp(op, "exitthread")) {
        pthread_t t;
        pthread_create(&t, NULL, exit_worker, NULL);
        for (;;)
            pause();
    } else {
        return 0;
    }
    return 1;
#undef NEXT
}
