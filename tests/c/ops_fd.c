/*
 * ops_fd.c - exported fds and passing them between processes, shared by the three client front
 * ends (the fds come from `export` in ops_ctx.c, or are received here; F numbers them):
 *   fdclose F            -> fdclose rc=N                (close the exported or received fd F)
 *   fdlisten PATH        -> fdlisten rc=N               (a unix socket listening at PATH)
 *   fdlock F             -> fdlock rc=N                 (the application's own OFD read lock on the
 *                                                        whole file of fd F: l_start 0, l_len 0)
 *   closememfd NAME      -> closememfd rc=N n=K         (close every fd of this process that is a
 *                                                        memfd named NAME: an application closing
 *                                                        fds it did not open)
 *   fdrecv               -> fdrecv rc=N id=F            (accept one connection on it, receive an fd
 *                                                       (SCM_RIGHTS) as F; `import F` imports it)
 *   fdack                -> fdack rc=N                  (answer the sender, close the connection)
 *   fdsend F PATH        -> fdsend rc=N                 (send fd F to PATH, wait for the answer,
 *                                                       close F here)
 *   fdunlock F FROM      -> fdunlock rc=N app=A kept=K     (an OFD read lock of the application's on bytes
 *                                                       16..31 of fd F, then an OFD unlock of [FROM, end)
 *                                                       through libc's fcntl; A, K: the description's
 *                                                       locks left starting in [FROM, 2^40) and past 2^40)
 *   exitfd F             -> exitfd rc=0; at exit again  (an atexit handler of the application: is fd F open?)
 *   ofdcycle PATH        -> ofdcycle rc=N relock=R      (an application's lock file: open PATH (created),
 *                                                       an OFD write lock on the whole file, the
 *                                                       matching whole-file unlock, the file kept open;
 *                                                       R: 0 if a second open of PATH can then take a
 *                                                       whole-file OFD write lock (closed again))
 *   waitfifo PATH        -> waitfifo rc=N               (block until the FIFO at PATH is opened for
 *                                                       writing and closed: the test says go)
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <dirent.h>
#include <fcntl.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "client.h"

#define OUT client_printf

static struct client_fd g_fd[64];
static int g_nfd;

int client_fd_add(int fd, CUmemGenericAllocationHandle h)
{
    if (g_nfd >= 64)
        return -1;
    g_fd[g_nfd].fd = fd;
    g_fd[g_nfd].h = h;
    return g_nfd++;
}

struct client_fd *client_fd_at(const char *s)
{
    long k = client_parse_long(s);
    if (k < 0 || k >= g_nfd) {
        fprintf(stderr, "client: no fd %s\n", s ? s : "(missing)");
        exit(2);
    }
    return &g_fd[k];
}

static int g_listen = -1, g_conn = -1, g_exit_fd = -1;

/* The application's own use of its fd at exit (after every handler registered later): open? */
static void exit_fd(void) { OUT("exitfd rc=%d", g_exit_fd < g_nfd && fcntl(g_fd[g_exit_fd].fd, F_GETFD) >= 0 ? 0 : 1); }


static struct sockaddr_un unix_addr(const char *path)
{
    struct sockaddr_un a;
    memset(&a, 0, sizeof a);
    a.sun_family = AF_UNIX;
    if (!path || strlen(path) >= sizeof a.sun_path) {
        fprintf(stderr, "client: bad socket path\n");
        exit(2);
    }
    strcpy(a.sun_path, path);
    return a;
}

/* Sends fd over a connected unix socket (SCM_RIGHTS): 0 or -1. */
static int send_fd(int sock, int fd)
{
    char byte = 'f', ctl[CMSG_SPACE(sizeof(int))];
    struct iovec io = { &byte, 1 };
    struct msghdr m;
    struct cmsghdr *c;
    memset(&m, 0, sizeof m);
    memset(ctl, 0, sizeof ctl);
    m.msg_iov = &io;
    m.msg_iovlen = 1;
    m.msg_control = ctl;
    m.msg_controllen = sizeof ctl;
    c = CMSG_FIRSTHDR(&m);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(c), &fd, sizeof fd);
    return sendmsg(sock, &m, 0) == 1 ? 0 : -1;
}

static int recv_fd(int sock)
{
    char byte, ctl[CMSG_SPACE(sizeof(int))];
    struct iovec io = { &byte, 1 };
    struct msghdr m;
    struct cmsghdr *c;
    int fd = -1;
    memset(&m, 0, sizeof m);
    m.msg_iov = &io;
    m.msg_iovlen = 1;
    m.msg_control = ctl;
    m.msg_controllen = sizeof ctl;
    if (recvmsg(sock, &m, MSG_CMSG_CLOEXEC) != 1 || !(c = CMSG_FIRSTHDR(&m)) || c->cmsg_type != SCM_RIGHTS)
        return -1;
    memcpy(&fd, CMSG_DATA(c), sizeof fd);
    return fd;
}

/* The locks of fd's open file description that /proc/self/fdinfo lists starting in [lo, hi). */
static int locks_in(int fd, long long lo, long long hi)
{
    char path[64], line[256];
    long long start;
    int n = 0;
    FILE *f;
    snprintf(path, sizeof path, "/proc/self/fdinfo/%d", fd);
    if (!(f = fopen(path, "r")))
        return -1;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "lock: %*s %*s %*s %*s %*s %*s %lld", &start) == 1 && start >= lo && start < hi)
            n++;
    fclose(f);
    return n;
}

/* The fd passing ops (see the list above): 1 + arguments used, or 0 for another op. */
int client_fd_op(const char *op, int argc, char **argv)
{
#define FARG(i) ((i) < argc ? argv[i] : NULL)
    if (!strcmp(op, "fdclose")) {
        int k = (int)(client_fd_at(FARG(0)) - g_fd);
        OUT("fdclose rc=%d", close(g_fd[k].fd) == 0 ? 0 : 1);
        return 2;
    }
    if (!strcmp(op, "fdlock")) {
        int k = (int)(client_fd_at(FARG(0)) - g_fd);
        struct flock l = { .l_type = F_RDLCK, .l_whence = SEEK_SET, .l_start = 0, .l_len = 0 };
        OUT("fdlock rc=%d", fcntl(g_fd[k].fd, F_OFD_SETLK, &l) == 0 ? 0 : 1);
        return 2;
    }
    if (!strcmp(op, "closememfd")) {
        char want[160], path[64], name[160];
        int n = 0;
        snprintf(want, sizeof want, "/memfd:%s (deleted)", FARG(0) ? FARG(0) : "");
        for (int fd = 3; fd < 1024; fd++) {
            ssize_t len;
            snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
            if ((len = readlink(path, name, sizeof name - 1)) <= 0)
                continue;
            name[len] = 0;
            if (!strcmp(name, want) && close(fd) == 0)
                n++;
        }
        OUT("closememfd rc=%d n=%d", n > 0 ? 0 : 1, n);
        return 2;
    }
    if (!strcmp(op, "fdlisten")) {
        struct sockaddr_un a = unix_addr(FARG(0));
        g_listen = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        OUT("fdlisten rc=%d", g_listen >= 0 && bind(g_listen, (struct sockaddr *)&a, sizeof a) == 0 &&
                                      listen(g_listen, 1) == 0 ? 0 : 1);
        return 2;
    }
    if (!strcmp(op, "fdrecv")) {
        int fd = (g_conn = accept4(g_listen, NULL, NULL, SOCK_CLOEXEC)) >= 0 ? recv_fd(g_conn) : -1;
        if (fd >= 0 && g_nfd < 64) {
            g_fd[g_nfd].fd = fd;
            g_fd[g_nfd].h = 0;
            g_nfd++;
        }
        OUT("fdrecv rc=%d id=%d", fd >= 0 ? 0 : 1, fd >= 0 ? g_nfd - 1 : -1);
        return 1;
    }
    if (!strcmp(op, "fdack")) {
        OUT("fdack rc=%d", g_conn >= 0 && write(g_conn, "a", 1) == 1 && close(g_conn) == 0 ? 0 : 1);
        g_conn = -1;
        return 1;
    }
    if (!strcmp(op, "fdsend")) {
        int k = (int)(client_fd_at(FARG(0)) - g_fd), ok = 0;
        struct sockaddr_un a = unix_addr(FARG(1));
        int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        char byte;
        if (s >= 0 && connect(s, (struct sockaddr *)&a, sizeof a) == 0 && send_fd(s, g_fd[k].fd) == 0 &&
            read(s, &byte, 1) == 1)
            ok = 1;
        if (s >= 0)
            close(s);
        close(g_fd[k].fd);
        OUT("fdsend rc=%d", ok ? 0 : 1);
        return 3;
    }
    if (!strcmp(op, "fdunlock")) {
        int fd = client_fd_at(FARG(0))->fd, rc;
        long long from = client_parse_long(FARG(1));
        struct flock l = { .l_type = F_RDLCK, .l_whence = SEEK_SET, .l_start = 16, .l_len = 16 };
        rc = fcntl(fd, F_OFD_SETLK, &l);
        l.l_type = F_UNLCK;
        l.l_start = from;
        l.l_len = 0;
        rc = rc || fcntl(fd, F_OFD_SETLK, &l);
        OUT("fdunlock rc=%d app=%d kept=%d", rc ? 1 : 0, locks_in(fd, from, 1LL << 40), locks_in(fd, 1LL << 40, INT64_MAX));
        return 3;
    }
    if (!strcmp(op, "exitfd")) {
        g_exit_fd = (int)client_parse_long(FARG(0));
        OUT("exitfd rc=%d", atexit(exit_fd) == 0 ? 0 : 1);
        return 2;
    }
    if (!strcmp(op, "ofdcycle")) {
        const char *path = FARG(0);
        int fd = path ? open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0600) : -1, other, rc, relock = 1;
        struct flock l = { .l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = 0, .l_len = 0 };
        rc = fd < 0 || fcntl(fd, F_OFD_SETLK, &l) != 0;
        l.l_type = F_UNLCK;
        rc = rc || fcntl(fd, F_OFD_SETLK, &l) != 0;
        if (!rc && (other = open(path, O_RDWR | O_CLOEXEC)) >= 0) {
            l.l_type = F_WRLCK;
            relock = fcntl(other, F_OFD_SETLK, &l) == 0 ? 0 : 1;
            close(other);
        }
        OUT("ofdcycle rc=%d relock=%d", rc, relock);
        return 2;
    }
    if (!strcmp(op, "waitfifo")) {
        char buf[16];
        const char *path = FARG(0);
        int fd = path ? open(path, O_RDONLY | O_CLOEXEC) : -1;
        while (fd >= 0 && read(fd, buf, sizeof buf) > 0)
            ;
        OUT("waitfifo rc=%d", fd >= 0 && close(fd) == 0 ? 0 : 1);
        return 2;
    }
    return 0;
#undef FARG
}
