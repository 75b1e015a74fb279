/* startup_bench: what vramcap adds to a process's start and exit (scripts/bench-startup).
 *
 *   startup_bench run N      N times: fork, exec `startup_bench child FD` (with LD_PRELOAD set to
 *                            $STARTUP_PRELOAD when that is set), wait. One line per run:
 *                            start_us  fork to the first allocation done (cuInit, primary context,
 *                                      cuMemAlloc_v2 of 1 MiB returned), and its phases:
 *                                      main_us (to main), init_us (cuInit), ctx_us (device and
 *                                      primary context), alloc_us (the allocation)
 *                            exit_us   the child's last call done (the free) to waitpid returning:
 *                                      exit handlers, vramcap's trace drain, process teardown
 *   startup_bench child FD   the measured process: the calls above, then writes its two
 *                            CLOCK_MONOTONIC stamps to FD and returns from main.
 * With STARTUP_IDLE=1 the child calls no CUDA function at all (a shell, a compiler, a Python that
 * never imports torch: what every process in a container with the preload pays): start_us is then
 * fork to main, and exit_us main's return to waitpid returning.
 * Linked against libcuda (the fake driver) like client_linked. */
#define _GNU_SOURCE
#include "cuda_types.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static long long now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static int child(int fd)
{
    long long entered = now_ns();
    const char *idle = getenv("STARTUP_IDLE");
    if (idle && *idle == '1') {
        dprintf(fd, "%lld %lld %lld %lld %lld\n", entered, now_ns(), entered, entered, entered);
        close(fd);
        return 0;
    }
    CUdevice dev = 0;
    CUcontext ctx = NULL;
    CUdeviceptr p = 0;
    if (cuInit(0))
        return 1;
    long long inited = now_ns();
    if (cuDeviceGet(&dev, 0) || cuDevicePrimaryCtxRetain(&ctx, dev) || cuCtxSetCurrent(ctx))
        return 1;
    long long current = now_ns();
    if (cuMemAlloc_v2(&p, 1 << 20))
        return 1;
    long long allocated = now_ns();
    if (cuMemFree_v2(p))
        return 1;
    long long done = now_ns();
    dprintf(fd, "%lld %lld %lld %lld %lld\n", allocated, done, entered, inited, current);
    close(fd);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc == 3 && !strcmp(argv[1], "child"))
        return child(atoi(argv[2]));
    if (argc != 3 || strcmp(argv[1], "run")) {
        fprintf(stderr, "usage: startup_bench run N\n");
        return 2;
    }
    const char *preload = getenv("STARTUP_PRELOAD");
    for (int i = 0, n = atoi(argv[2]); i < n; i++) {
        int fds[2];
        if (pipe(fds))
            return 1;
        long long forked = now_ns();
        pid_t pid = fork();
        if (pid == 0) {
            close(fds[0]);
            if (preload && *preload)
                setenv("LD_PRELOAD", preload, 1);
            char fd[16];
            snprintf(fd, sizeof fd, "%d", fds[1]);
            execl("/proc/self/exe", argv[0], "child", fd, (char *)NULL);
            _exit(127);
        }
        close(fds[1]);
        char buf[256] = {0};
        ssize_t got = read(fds[0], buf, sizeof buf - 1);
        close(fds[0]);
        int st = 0;
        waitpid(pid, &st, 0);
        long long reaped = now_ns();
        long long allocated = 0, done = 0, entered = 0, inited = 0, current = 0;
        if (got <= 0 || sscanf(buf, "%lld %lld %lld %lld %lld", &allocated, &done, &entered, &inited, &current) != 5
            || !WIFEXITED(st) || WEXITSTATUS(st)) {
            fprintf(stderr, "startup_bench: run %d failed (status %d)\n", i, st);
            return 1;
        }
        /* The start's phases: exec, loader and constructors up to main; cuInit; device and primary
         * context; the first allocation. */
        printf("start_us=%.1f exit_us=%.1f main_us=%.1f init_us=%.1f ctx_us=%.1f alloc_us=%.1f\n",
               (allocated - forked) / 1e3, (reaped - done) / 1e3, (entered - forked) / 1e3, (inited - entered) / 1e3,
               (current - inited) / 1e3, (allocated - current) / 1e3);
    }
    return 0;
}
