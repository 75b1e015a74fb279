/*
 * replay: feed a recorded list of cuGetProcAddress_v2 requests (as made by a
 * real CUDA runtime at start-up) to libcuda.so.1, the way the runtime does.
 * Usage: replay FILE.tsv   (rows: name<TAB>version<TAB>flags)
 * Output, one line per request, the empty-name probe first:
 *   name<TAB>version<TAB>flags<TAB>rc<TAB>status<TAB>0|1 (pfn non-NULL)<TAB>object
 * where object is the file name (no directory) of the library holding pfn, or "-".
 * status is -1 when the driver did not write it.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_types.h"

static CUresult (*get_proc)(const char *, void **, int, cuuint64_t,
                            CUdriverProcAddressQueryResult *);

static void one(const char *name, int version, unsigned long long flags)
{
    void *p = NULL;
    CUdriverProcAddressQueryResult st = -1;
    CUresult rc = get_proc(name, &p, version, flags, &st);

    const char *obj = "-";
    Dl_info info;
    if (p && dladdr(p, &info) && info.dli_fname) {
        const char *slash = strrchr(info.dli_fname, '/');
        obj = slash ? slash + 1 : info.dli_fname;
    }
    printf("%s\t%d\t%llu\t%d\t%d\t%d\t%s\n", name, version, flags, rc, st, p != NULL, obj);
}

int main(int argc, char **argv)
{
    CUresult (*drv_version)(int *);
    char line[1024];
    int version = 12000, lineno = 0;
    FILE *f;
    void *h;

    if (argc != 2) {
        fprintf(stderr, "usage: replay FILE.tsv\n");
        return 2;
    }
    if (!(f = fopen(argv[1], "r"))) {
        perror(argv[1]);
        return 2;
    }
    if (!(h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL))) {
        fprintf(stderr, "replay: dlopen libcuda.so.1: %s\n", dlerror());
        return 3;
    }
    *(void **)&get_proc = dlsym(h, "cuGetProcAddress_v2");
    if (!get_proc) {
        fprintf(stderr, "replay: no cuGetProcAddress_v2\n");
        return 3;
    }
    /* The runtime's first probe: an empty name, at the driver's version. */
    *(void **)&drv_version = dlsym(h, "cuDriverGetVersion");
    if (drv_version)
        drv_version(&version);
    one("", version, 0);

    while (fgets(line, sizeof line, f)) {
        char *name, *ver, *fl, *save = NULL, *end;
        long v;
        unsigned long long flags;

        lineno++;
        line[strcspn(line, "\r\n")] = '\0';
        if (!line[0] || line[0] == '#')
            continue;
        name = strtok_r(line, "\t", &save);
        ver = strtok_r(NULL, "\t", &save);
        fl = strtok_r(NULL, "\t", &save);
        if (!name || !ver || !fl)
            goto bad;
        v = strtol(ver, &end, 10);
        if (*end)
            goto bad;
        flags = strtoull(fl, &end, 10);
        if (*end)
            goto bad;
        one(name, (int)v, flags);
        continue;
bad:
        fprintf(stderr, "replay: %s:%d: malformed row\n", argv[1], lineno);
        return 2;
    }
    fclose(f);
    return 0;
}
