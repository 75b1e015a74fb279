/*
 * ops_overhead.c - memory no allocation returns (issue 24), shared by the three client front ends:
 *   cubin PATH SIZE...   -> cubin rc=0              (writes an ELF64 image with one .nv.global
 *                                                    section per SIZE, as a cubin carries its
 *                                                    __device__ globals)
 *   modload PATH         -> modload rc=N id=M       (cuModuleLoad)
 *   moddata PATH         -> moddata rc=N id=M       (cuModuleLoadData of the file's bytes)
 *   moddataex PATH       -> moddataex rc=N id=M     (cuModuleLoadDataEx, no options)
 *   modunload M          -> modunload rc=N          (cuModuleUnload)
 *   libdata PATH         -> libdata rc=N id=L       (cuLibraryLoadData of the file's bytes, no options)
 *   libfile PATH         -> libfile rc=N id=L       (cuLibraryLoadFromFile, no options)
 *   libunload L          -> libunload rc=N          (cuLibraryUnload)
 *   setlimit L VALUE     -> setlimit rc=N           (cuCtxSetLimit)
 *   getlimit L           -> getlimit rc=N value=V   (cuCtxGetLimit)
 *   procs DEV            -> procs n=K self=B        (the fake NVML's running-process list: how
 *                                                    many processes, and what the entry under this
 *                                                    process's host pid says it uses)
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <elf.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "client.h"

#define OUT client_printf

static CUmodule g_mod[64];
static int g_nmod;
static CUlibrary g_lib[64];
static int g_nlib;

static int keep_lib(CUresult rc, CUlibrary l)
{
    if (rc != CUDA_SUCCESS || g_nlib >= 64)
        return -1;
    g_lib[g_nlib] = l;
    return g_nlib++;
}

static int keep_mod(CUresult rc, CUmodule m)
{
    if (rc != CUDA_SUCCESS || g_nmod >= 64)
        return -1;
    g_mod[g_nmod] = m;
    return g_nmod++;
}

/* An ELF64 relocatable with a NULL section, .shstrtab and n NOBITS .nv.global sections. */
static void write_cubin(const char *path, int n, char **sizes)
{
    static const char names[] = "\0.shstrtab\0.nv.global\0";
    Elf64_Ehdr eh = {0};
    Elf64_Shdr sh[18] = {{0}};
    FILE *f;

    if (n > 16) {
        fprintf(stderr, "client: at most 16 sections\n");
        exit(2);
    }
    memcpy(eh.e_ident, ELFMAG, SELFMAG);
    eh.e_ident[EI_CLASS] = ELFCLASS64;
    eh.e_ident[EI_DATA] = ELFDATA2LSB;
    eh.e_ident[EI_VERSION] = EV_CURRENT;
    eh.e_type = ET_EXEC;
    eh.e_machine = 190;             /* EM_CUDA */
    eh.e_version = EV_CURRENT;
    eh.e_ehsize = sizeof eh;
    eh.e_shentsize = sizeof(Elf64_Shdr);
    eh.e_shnum = (Elf64_Half)(n + 2);
    eh.e_shstrndx = 1;
    eh.e_shoff = sizeof eh + sizeof names;
    sh[1].sh_name = 1;
    sh[1].sh_type = SHT_STRTAB;
    sh[1].sh_offset = sizeof eh;
    sh[1].sh_size = sizeof names;
    for (int i = 0; i < n; i++) {
        sh[2 + i].sh_name = 11;
        sh[2 + i].sh_type = SHT_NOBITS;
        sh[2 + i].sh_flags = SHF_ALLOC | SHF_WRITE;
        sh[2 + i].sh_size = client_parse_size(sizes[i]);
    }
    if (!(f = fopen(path, "wb")) || fwrite(&eh, sizeof eh, 1, f) != 1 || fwrite(names, sizeof names, 1, f) != 1 ||
        fwrite(sh, sizeof sh[0], (size_t)n + 2, f) != (size_t)n + 2 || fclose(f) != 0) {
        perror(path);
        exit(2);
    }
}

static void *slurp(const char *path)
{
    FILE *f = fopen(path, "rb");
    char *buf;
    long len;

    if (!f || fseek(f, 0, SEEK_END) != 0 || (len = ftell(f)) <= 0 || fseek(f, 0, SEEK_SET) != 0 ||
        !(buf = malloc((size_t)len)) || fread(buf, 1, (size_t)len, f) != (size_t)len) {
        perror(path);
        exit(2);
    }
    fclose(f);
    return buf;
}

static unsigned int host_pid(void)
{
    char line[256];
    unsigned int pid = (unsigned int)getpid();
    FILE *f = fopen("/proc/self/status", "re");

    while (f && fgets(line, sizeof line, f))
        if (!strncmp(line, "NSpid:", 6)) {
            pid = (unsigned int)strtoul(line + 6, NULL, 10);
            break;
        }
    if (f)
        fclose(f);
    return pid;
}

static void op_procs(int dev)
{
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    int (*procs)(int, unsigned int *, unsigned long long *, int) = h ? dlsym(h, "fakecuda_processes") : NULL;
    unsigned int pids[64], me = host_pid();
    unsigned long long bytes[64], self = 0;
    int n;

    if (!procs || (n = procs(dev, pids, bytes, 64)) < 0) {
        OUT("procs n=-1 self=0");
        return;
    }
    for (int i = 0; i < n && i < 64; i++)
        if (pids[i] == me)
            self += bytes[i];
    OUT("procs n=%d self=%llu", n, self);
}

int client_overhead_op(const struct cu_api *A, const char *op, int argc, char **argv)
{
#define ARG(i) ((i) < argc ? argv[i] : NULL)
    CUmodule m = NULL;
    CUresult rc;

    if (!strcmp(op, "cubin")) {
        int n = 0;
        while (n + 1 < argc && argv[n + 1][0] >= '0' && argv[n + 1][0] <= '9')
            n++;
        write_cubin(ARG(0), n, argv + 1);
        OUT("cubin rc=0");
        return n + 1;
    }
    if (!strcmp(op, "modload")) {
        rc = A->cuModuleLoad(&m, ARG(0));
        OUT("modload rc=%d id=%d", rc, keep_mod(rc, m));
        return 1;
    }
    if (!strcmp(op, "moddata") || !strcmp(op, "moddataex")) {
        void *img = slurp(ARG(0));
        rc = op[7] ? A->cuModuleLoadDataEx(&m, img, 0, NULL, NULL) : A->cuModuleLoadData(&m, img);
        OUT("%s rc=%d id=%d", op, rc, keep_mod(rc, m));
        free(img);
        return 1;
    }
    if (!strcmp(op, "modunload")) {
        long k = client_parse_long(ARG(0));
        if (k < 0 || k >= g_nmod) {
            fprintf(stderr, "client: no module %s\n", ARG(0) ? ARG(0) : "(missing)");
            exit(2);
        }
        OUT("modunload rc=%d", A->cuModuleUnload(g_mod[k]));
        return 1;
    }
    if (!strcmp(op, "libdata") || !strcmp(op, "libfile")) {
        CUlibrary l = NULL;
        void *img = op[3] == 'd' ? slurp(ARG(0)) : NULL;
        rc = img ? A->cuLibraryLoadData(&l, img, NULL, NULL, 0, NULL, NULL, 0)
                 : A->cuLibraryLoadFromFile(&l, ARG(0), NULL, NULL, 0, NULL, NULL, 0);
        OUT("%s rc=%d id=%d", op, rc, keep_lib(rc, l));
        free(img);
        return 1;
    }
    if (!strcmp(op, "libunload")) {
        long k = client_parse_long(ARG(0));
        if (k < 0 || k >= g_nlib) {
            fprintf(stderr, "client: no library %s\n", ARG(0) ? ARG(0) : "(missing)");
            exit(2);
        }
        OUT("libunload rc=%d", A->cuLibraryUnload(g_lib[k]));
        return 1;
    }
    if (!strcmp(op, "setlimit")) {
        OUT("setlimit rc=%d", A->cuCtxSetLimit((CUlimit)client_parse_long(ARG(0)), (size_t)client_parse_size(ARG(1))));
        return 2;
    }
    if (!strcmp(op, "getlimit")) {
        size_t v = 0;
        rc = A->cuCtxGetLimit(&v, (CUlimit)client_parse_long(ARG(0)));
        OUT("getlimit rc=%d value=%zu", rc, v);
        return 1;
    }
    if (!strcmp(op, "procs")) {
        op_procs((int)client_parse_long(ARG(0)));
        return 1;
    }
    return -1;
#undef ARG
}
