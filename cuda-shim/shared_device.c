/*
 * shared_device.c - device counters shared by processes, as one physical GPU sees all of them.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "internal.h"

/*
 * FAKECUDA_SHARED_DEVICE=FILE: the processes that name one file share its per-device counters
 * (FC_MAX_DEVICES × {held, peak}, unsigned 64-bit, native order), updated atomically with every
 * allocation and free, as one physical GPU would see all of them. Tests read the peak to prove
 * that a group of processes never held more than its budget on the device itself. Unset: off.
 * A file that cannot be opened or mapped stops the process: a test must not pass unwatched.
 */
struct shared_dev {
    atomic_ullong held, peak;
};
/* After the device counters: one entry per process that uses the file, what it holds on each
 * device under its pid as the host sees it (fc_host_pid), as NVML's running-process list reports
 * processes. A process empties its entry at exit; one killed leaves it, and the next process
 * that needs an entry takes one whose pid no longer exists. */
#define FC_SHARED_PROCS 64
struct shared_proc {
    atomic_ullong pid;
    atomic_ullong held[FC_MAX_DEVICES];
};
static struct shared_dev *g_shared;
static struct shared_proc *g_procs, *g_mine;
static pthread_once_t g_shared_once = PTHREAD_ONCE_INIT;

/* This process's pid in the outermost pid namespace /proc shows (the first NSpid field: the
 * host's, where /proc is the host's, as under `unshare --pid --fork` without --mount-proc), which
 * is how the real NVML names processes. */
static unsigned int fc_host_pid(void)
{
    char line[256];
    unsigned int pid = (unsigned int)getpid();
    FILE *f = fopen("/proc/self/status", "re");

    if (!f)
        return pid;
    while (fgets(line, sizeof line, f))
        if (strncmp(line, "NSpid:", 6) == 0) {
            unsigned long v = strtoul(line + 6, NULL, 10);
            if (v)
                pid = (unsigned int)v;
            break;
        }
    fclose(f);
    return pid;
}

static int pid_gone(unsigned long long pid)
{
    char path[64];

    snprintf(path, sizeof path, "/proc/%llu", pid);
    return access(path, F_OK) != 0 && errno == ENOENT;
}

static void leave(void)
{
    if (g_mine) {
        for (int d = 0; d < FC_MAX_DEVICES; d++)
            atomic_store(&g_mine->held[d], 0);
        atomic_store(&g_mine->pid, 0);
    }
}

static void claim_entry(void)
{
    unsigned long long me = fc_host_pid();

    for (int i = 0; i < FC_SHARED_PROCS && !g_mine; i++) {
        struct shared_proc *p = &g_procs[i];
        unsigned long long cur = atomic_load(&p->pid);
        if ((cur == 0 || cur == me || pid_gone(cur)) && atomic_compare_exchange_strong(&p->pid, &cur, me)) {
            for (int d = 0; d < FC_MAX_DEVICES; d++)
                atomic_store(&p->held[d], 0);
            g_mine = p;
        }
    }
    if (g_mine)
        atexit(leave);
}

static void shared_open(void)
{
    const char *path = getenv("FAKECUDA_SHARED_DEVICE");
    size_t len = sizeof(struct shared_dev) * FC_MAX_DEVICES + sizeof(struct shared_proc) * FC_SHARED_PROCS;
    struct stat st;
    void *m;
    int fd;

    if (!path || !*path)
        return;
    fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    /* Growing only: a racing process that already grew it loses nothing. */
    if (fd < 0 || fstat(fd, &st) != 0 || ((size_t)st.st_size < len && ftruncate(fd, (off_t)len) != 0)) {
        fprintf(stderr, "fakecuda: FAKECUDA_SHARED_DEVICE=%s: cannot open: %s\n", path, strerror(errno));
        abort();
    }
    m = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (m == MAP_FAILED) {
        fprintf(stderr, "fakecuda: FAKECUDA_SHARED_DEVICE=%s: cannot map: %s\n", path, strerror(errno));
        abort();
    }
    g_shared = m;
    g_procs = (struct shared_proc *)(g_shared + FC_MAX_DEVICES);
    claim_entry();
}

void fc_shared_device_account(int devno, long long delta)
{
    struct shared_dev *s;
    unsigned long long now, peak;

    pthread_once(&g_shared_once, shared_open);
    if (!g_shared)
        return;
    s = &g_shared[devno];
    if (g_mine)
        atomic_fetch_add(&g_mine->held[devno], (unsigned long long)delta);
    /*
     * The peak is read before the count moves: a test may reset the peak (store the current
     * count) to watch from that moment on, and a thread descheduled between its add and its peak
     * update must not then publish a count from before the reset. The peak only ever goes down
     * by such a reset, so a peak found lower than the one read first means one happened: the
     * update is dropped (at worst an add right at a reset goes unrecorded; never one before it).
     */
    peak = atomic_load(&s->peak);
    now = atomic_fetch_add(&s->held, (unsigned long long)delta) + (unsigned long long)delta;
    while (delta > 0 && now > peak) {
        unsigned long long seen = peak;

        if (atomic_compare_exchange_weak(&s->peak, &peak, now) || peak < seen)
            break;
    }
}

/* NVML's running-process list for a device, read from the shared file (every process using it)
 * or, without one, this process alone: up to `cap` (host pid, bytes) pairs; returns how many
 * there are (may exceed cap). Entries holding nothing are not listed. */
FC_API int fakecuda_processes(int devno, unsigned int *pids, unsigned long long *bytes, int cap)
{
    int n = 0;

    if (devno < 0 || devno >= FC_MAX_DEVICES)
        return -1;
    pthread_once(&g_shared_once, shared_open);
    if (!g_shared) {
        unsigned long long held = atomic_load(&fc_stats[devno].bytes_held);
        if (held && cap > 0) {
            pids[0] = fc_host_pid();
            bytes[0] = held;
        }
        return held ? 1 : 0;
    }
    for (int i = 0; i < FC_SHARED_PROCS; i++) {
        unsigned long long pid = atomic_load(&g_procs[i].pid), held = atomic_load(&g_procs[i].held[devno]);
        if (!pid || !held || pid_gone(pid))
            continue;
        if (n < cap) {
            pids[n] = (unsigned int)pid;
            bytes[n] = held;
        }
        n++;
    }
    return n;
}

/* What the whole device holds, all processes together (FAKECUDA_SHARED_DEVICE), as NVML's
 * nvmlDeviceGetMemoryInfo reports a device; -1 without a shared device file. */
FC_API int fakecuda_device_held(int devno, unsigned long long *held)
{
    if (devno < 0 || devno >= FC_MAX_DEVICES || !held)
        return -1;
    pthread_once(&g_shared_once, shared_open);
    if (!g_shared)
        return -1;
    *held = atomic_load(&g_shared[devno].held);
    return 0;
}
