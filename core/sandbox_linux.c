/* The Linux walls: probe, Landlock, seccomp (libseccomp). The zygote that builds a
 * session's namespaces and mount tree is zygote.c. */
#include "sandbox.h"
#include "util.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/landlock.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sched.h>
#include <seccomp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <termios.h>
#include <unistd.h>

/* Newer than Debian 12's headers. */
#ifndef LANDLOCK_ACCESS_FS_TRUNCATE
#define LANDLOCK_ACCESS_FS_TRUNCATE (1ULL << 14)
#endif
#ifndef LANDLOCK_ACCESS_FS_IOCTL_DEV
#define LANDLOCK_ACCESS_FS_IOCTL_DEV (1ULL << 15)
#endif
#define LL_ACCESS_NET_BIND_TCP (1ULL << 0)
#define LL_ACCESS_NET_CONNECT_TCP (1ULL << 1)

#define LL_SCOPE_ABSTRACT_UNIX_SOCKET (1ULL << 0)
#define LL_SCOPE_SIGNAL (1ULL << 1)

struct ll_ruleset_attr {            /* landlock_ruleset_attr, ABI 6 layout */
    __u64 handled_access_fs;
    __u64 handled_access_net;       /* ABI 4+ */
    __u64 scoped;                   /* ABI 6+ */
};

static const char *const layer_names[LAYER_COUNT] = {
    [LAYER_USERNS] = "userns", [LAYER_MOUNTNS] = "mountns", [LAYER_PIDNS] = "pidns",
    [LAYER_NETNS] = "netns", [LAYER_IPCNS] = "ipcns", [LAYER_UTSNS] = "utsns",
    [LAYER_LANDLOCK] = "landlock", [LAYER_SECCOMP] = "seccomp", [LAYER_RLIMITS] = "rlimits",
    [LAYER_UID] = "uid", [LAYER_CGROUP] = "cgroup",
};

const char *sandbox_layer_name(enum sandbox_layer l) { return layer_names[l]; }

/* ---- probing -------------------------------------------------------------------- */

/* Try unshare(flags) in a throwaway child: the only honest test. */
static int try_unshare(int flags)
{
    pid_t pid = fork();
    if (pid < 0)
        return errno;
    if (pid == 0)
        _exit(unshare(flags) == 0 ? 0 : (errno & 0x7f));
    int st;
    if (waitpid(pid, &st, 0) < 0)
        return errno;
    return WIFEXITED(st) ? WEXITSTATUS(st) : EINVAL;
}

static struct sandbox_caps caps;
static bool probed, ns_probed;

static void ns_probe(enum sandbox_layer l, int flag, bool root)
{
    /* As root no user namespace is needed; without root, the others need one. */
    int flags = flag | (root || l == LAYER_USERNS ? 0 : CLONE_NEWUSER);
    int err = try_unshare(flags);
    caps.available[l] = err == 0;
    if (err == 0)
        return;
    const char *fix = err == EPERM && !root
        ? "unprivileged user namespaces are restricted: check sysctls "
          "kernel.unprivileged_userns_clone=1, user.max_user_namespaces>0 and "
          "kernel.apparmor_restrict_unprivileged_userns=0, or run as root"
        : err == EPERM ? "the container lacks CAP_SYS_ADMIN: run with it, or use isolation=process"
        : err == ENOSPC ? "user.max_user_namespaces is exhausted or 0: raise it"
        : "not supported by this kernel";
    snprintf(caps.reason[l], sizeof caps.reason[l], "unshare: %s; %s", strerror(err), fix);
}

const struct sandbox_caps *sandbox_caps(void)
{
    if (probed)
        return &caps;
    probed = true;
    caps.root = geteuid() == 0;
    /* the namespaces: sandbox_caps_namespaces, for what needs them (strict, doctor) */
    for (int l = LAYER_USERNS; l <= LAYER_UTSNS; l++)
        snprintf(caps.reason[l], sizeof caps.reason[l], "not probed");
    long abi = syscall(SYS_landlock_create_ruleset, NULL, 0, LANDLOCK_CREATE_RULESET_VERSION);
    caps.landlock_abi = abi > 0 ? (int)abi : 0;
    caps.available[LAYER_LANDLOCK] = abi > 0;
    if (abi <= 0)
        snprintf(caps.reason[LAYER_LANDLOCK], sizeof caps.reason[0],
                 "%s; boot with lsm=...,landlock (CONFIG_SECURITY_LANDLOCK)",
                 errno == EOPNOTSUPP ? "disabled at boot" : strerror(errno));
    caps.available[LAYER_SECCOMP] = prctl(PR_GET_SECCOMP, 0, 0, 0, 0) >= 0;
    if (!caps.available[LAYER_SECCOMP])
        snprintf(caps.reason[LAYER_SECCOMP], sizeof caps.reason[0], "%s", strerror(errno));
    caps.available[LAYER_RLIMITS] = true;
    caps.available[LAYER_UID] = caps.root;
    if (!caps.root)
        snprintf(caps.reason[LAYER_UID], sizeof caps.reason[0],
                 "not root: tools run as the supervisor's uid (mapped in a user namespace "
                 "under strict isolation); run as root for a per-session service uid");
    /* A cgroup v2 subtree delegated to us would have memory and pids controllers. */
    char ctl[256] = "";
    int fd = open("/sys/fs/cgroup/cgroup.controllers", O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        fd = open("/sys/fs/cgroup/unified/cgroup.controllers", O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
        ssize_t n = read(fd, ctl, sizeof ctl - 1);
        ctl[n > 0 ? n : 0] = 0;
        close(fd);
    }
    caps.available[LAYER_CGROUP] = false;
    snprintf(caps.reason[LAYER_CGROUP], sizeof caps.reason[0],
             "not implemented: stockade has no cgroup layer, so delegating a subtree would "
             "change nothing; a call's tree is held to limits.memory by the shim's "
             "resident-memory watch and to limits.processes by RLIMIT_NPROC under the "
             "session uid and the same watch (v2 controllers here: '%s')",
             ctl[0] ? strtok(ctl, "\n") : "none");
    return &caps;
}

const struct sandbox_caps *sandbox_caps_namespaces(void)
{
    sandbox_caps();
    if (ns_probed)
        return &caps;
    ns_probed = true;
    /* One child tries them all; only when that fails, one each, to say which and why. */
    static const int flags[] = {CLONE_NEWUSER, CLONE_NEWNS, CLONE_NEWPID, CLONE_NEWNET,
                                CLONE_NEWIPC, CLONE_NEWUTS};
    int all = 0;
    for (size_t i = 0; i < ARRAY_LEN(flags); i++)
        all |= flags[i];
    if (try_unshare(all) == 0) {
        for (int l = LAYER_USERNS; l <= LAYER_UTSNS; l++) {
            caps.available[l] = true;
            caps.reason[l][0] = 0;
        }
        return &caps;
    }
    for (int l = LAYER_USERNS; l <= LAYER_UTSNS; l++)
        ns_probe((enum sandbox_layer)l, flags[l - LAYER_USERNS], caps.root);
    return &caps;
}

size_t sandbox_active_layers(const char *level, const char **out)
{
    bool strict = strcmp(level, "strict") == 0;
    const struct sandbox_caps *c = strict ? sandbox_caps_namespaces() : sandbox_caps();
    size_t n = 0;
    for (int l = 0; l < LAYER_COUNT; l++) {
        bool ns = l <= LAYER_UTSNS;
        if (!c->available[l] || (ns && !strict) || (l == LAYER_USERNS && c->root))
            continue;
        out[n++] = layer_names[l];
    }
    out[n++] = "no_new_privs";
    out[n++] = "subreaper";
    return n;
}

bool sandbox_level_allowed(const char *level, char **why)
{
    if (strcmp(level, "strict") != 0)
        return true;
    const struct sandbox_caps *c = sandbox_caps_namespaces();
    static const enum sandbox_layer need[] = {LAYER_MOUNTNS, LAYER_PIDNS, LAYER_NETNS,
                                              LAYER_IPCNS, LAYER_UTSNS, LAYER_USERNS};
    for (size_t i = 0; i < ARRAY_LEN(need); i++) {
        if (need[i] == LAYER_USERNS && c->root)
            continue;       /* root makes the others without one */
        if (!c->available[need[i]]) {
            *why = xstrdup(c->reason[need[i]]);
            return false;
        }
    }
    return true;
}

bool sandbox_network_allowed(const char *level, const char *network, char **why)
{
    if (strcmp(level, "strict") != 0 && strcmp(network, "loopback") == 0) {
        *why = xstrdup("network = \"loopback\" needs isolation = \"strict\": without a "
                       "network namespace a tool would share the host's whole network");
        return false;
    }
    return true;
}

/* ---- Landlock ------------------------------------------------------------------- */

static int ll_add_path(int ruleset, const char *path, __u64 access)
{
    int fd = open(path, O_PATH | O_CLOEXEC);
    if (fd < 0)
        return errno == ENOENT ? 0 : -1;     /* nothing there: nothing to allow */
    struct landlock_path_beneath_attr pb = {.allowed_access = access, .parent_fd = fd};
    struct stat st;
    /* on a file only the file rights apply */
    if (fstat(fd, &st) == 0 && !S_ISDIR(st.st_mode))
        pb.allowed_access &= LANDLOCK_ACCESS_FS_WRITE_FILE | LANDLOCK_ACCESS_FS_TRUNCATE |
                             LANDLOCK_ACCESS_FS_READ_FILE | LANDLOCK_ACCESS_FS_EXECUTE |
                             LANDLOCK_ACCESS_FS_IOCTL_DEV;
    int rc = (int)syscall(SYS_landlock_add_rule, ruleset, LANDLOCK_RULE_PATH_BENEATH, &pb, 0);
    int e = errno;
    close(fd);
    errno = e;
    return rc;
}

/* A rule for `name` in `dir` itself, never through a symlink (one planted in a
 * world-writable dir on the way could point into the private dir). */
static int ll_add_at(int ruleset, int dir, const char *name, __u64 access)
{
    int fd = openat(dir, name, O_PATH | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0)
        return errno == ENOENT ? 0 : -1;
    struct stat st;
    int rc = 0;
    if (fstat(fd, &st) == 0 && !S_ISLNK(st.st_mode)) {
        struct landlock_path_beneath_attr pb = {.allowed_access = access, .parent_fd = fd};
        if (!S_ISDIR(st.st_mode))
            pb.allowed_access &= LANDLOCK_ACCESS_FS_READ_FILE;
        rc = (int)syscall(SYS_landlock_add_rule, ruleset, LANDLOCK_RULE_PATH_BENEATH, &pb, 0);
    }
    int e = errno;
    close(fd);
    errno = e;
    return rc;
}

/* Landlock only allows, so "everywhere but beneath private_dir" is a rule for every
 * sibling of each directory on the way down to it. (Those ancestors themselves cannot be
 * listed, and what appears in them later cannot be read: the price of one uid.) */
static int ll_allow_reads_outside(int ruleset, const char *private_dir, __u64 read)
{
    char *real = realpath(private_dir, NULL);
    if (!real)
        return -1;
    int dir = open("/", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    int rc = dir < 0 ? -1 : 0;
    for (char *c = real + 1, *next; rc == 0 && *c; c = next) {
        next = strchr(c, '/');
        if (next)
            *next++ = 0;
        else
            next = c + strlen(c);
        int dup_fd = dup(dir);
        DIR *d = dup_fd >= 0 ? fdopendir(dup_fd) : NULL;
        if (!d) {
            if (dup_fd >= 0)
                close(dup_fd);
            rc = -1;
            break;
        }
        struct dirent *de;
        while (rc == 0 && (de = readdir(d)))
            if (strcmp(de->d_name, ".") && strcmp(de->d_name, "..") && strcmp(de->d_name, c))
                rc = ll_add_at(ruleset, dir, de->d_name, read);
        closedir(d);
        int below = rc == 0 ? openat(dir, c, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC) : -1;
        close(dir);
        dir = below;
        if (rc == 0 && dir < 0)
            rc = -1;
    }
    int e = errno;
    if (dir >= 0)
        close(dir);
    free(real);
    errno = e;
    return rc;
}

int sandbox_landlock_ruleset(const struct sandbox_fs *fs, bool net_closed)
{
    int abi = sandbox_caps()->landlock_abi;
    if (abi <= 0) {
        errno = ENOSYS;
        return -1;
    }
    /* Reads stay as the mount tree and file modes make them; every way of writing,
     * creating, removing or renaming is handled, and allowed only beneath the roots. */
    __u64 write = LANDLOCK_ACCESS_FS_WRITE_FILE | LANDLOCK_ACCESS_FS_REMOVE_DIR |
                  LANDLOCK_ACCESS_FS_REMOVE_FILE | LANDLOCK_ACCESS_FS_MAKE_CHAR |
                  LANDLOCK_ACCESS_FS_MAKE_DIR | LANDLOCK_ACCESS_FS_MAKE_REG |
                  LANDLOCK_ACCESS_FS_MAKE_SOCK | LANDLOCK_ACCESS_FS_MAKE_FIFO |
                  LANDLOCK_ACCESS_FS_MAKE_BLOCK | LANDLOCK_ACCESS_FS_MAKE_SYM;
    if (abi >= 2)
        write |= LANDLOCK_ACCESS_FS_REFER;
    if (abi >= 3)
        write |= LANDLOCK_ACCESS_FS_TRUNCATE;
    __u64 read = fs->private_dir ? LANDLOCK_ACCESS_FS_READ_FILE | LANDLOCK_ACCESS_FS_READ_DIR : 0;
    struct ll_ruleset_attr attr = {.handled_access_fs = write | read};
    size_t attr_size = sizeof attr.handled_access_fs;
    if (abi >= 4) {
        if (net_closed)
            attr.handled_access_net = LL_ACCESS_NET_BIND_TCP | LL_ACCESS_NET_CONNECT_TCP;
        attr_size = 2 * sizeof(__u64);
    }
    /* Abstract unix sockets and signals stay inside the tool's own domain: no talking to
     * a host daemon's @socket, no signals to processes outside the call. */
    if (abi >= 6) {
        attr.scoped = LL_SCOPE_ABSTRACT_UNIX_SOCKET | LL_SCOPE_SIGNAL;
        attr_size = sizeof attr;
    }
    int rs = (int)syscall(SYS_landlock_create_ruleset, &attr, attr_size, 0);
    if (rs < 0)
        return -1;
    __u64 file_write = LANDLOCK_ACCESS_FS_WRITE_FILE | (abi >= 3 ? LANDLOCK_ACCESS_FS_TRUNCATE : 0);
    int rc = ll_add_path(rs, fs->session_root, write | read);
    for (const char *const *p = fs->rw_paths; rc == 0 && p && *p; p++)
        rc = ll_add_path(rs, *p, write | read);
    /* the character devices a tool legitimately writes to */
    static const char *const devs[] = {"/dev/null", "/dev/zero", "/dev/full", "/dev/tty", NULL};
    for (const char *const *d = devs; rc == 0 && *d; d++)
        rc = ll_add_path(rs, *d, file_write | (read & LANDLOCK_ACCESS_FS_READ_FILE));
    if (rc == 0 && fs->private_dir)
        rc = ll_allow_reads_outside(rs, fs->private_dir, read);
    if (rc == 0)
        return rs;
    int e = errno;
    close(rs);
    errno = e;
    return -1;
}

int sandbox_landlock_restrict(int ruleset)
{
    return (int)syscall(SYS_landlock_restrict_self, ruleset, 0);
}

int sandbox_apply_landlock(const struct sandbox_fs *fs, bool net_closed)
{
    if (sandbox_caps()->landlock_abi <= 0)
        return 0;
    int rs = sandbox_landlock_ruleset(fs, net_closed);
    if (rs < 0)
        return -1;
    int rc = sandbox_landlock_restrict(rs);
    int e = errno;
    close(rs);
    errno = e;
    return rc;
}

/* ---- seccomp -------------------------------------------------------------------- */

/* Refused with EPERM (a clean error for the tool), logged by the kernel's audit. */
static const char *const denied_syscalls[] = {
    "mount", "umount2", "pivot_root", "chroot", "ptrace", "process_vm_readv",
    "process_vm_writev", "bpf", "kexec_load", "kexec_file_load", "init_module",
    "finit_module", "delete_module", "keyctl", "add_key", "request_key", "perf_event_open",
    "userfaultfd", "unshare", "setns", "open_tree", "move_mount", "fsopen", "fsconfig",
    "fsmount", "fspick", "mount_setattr", "name_to_handle_at", "open_by_handle_at", "swapon",
    "swapoff", "reboot", "syslog", "acct", "quotactl", "iopl", "ioperm", "lookup_dcookie",
    "vhangup", "settimeofday", "clock_settime", "clock_adjtime", "adjtimex",
    "pidfd_getfd", "kcmp", "fanotify_init",
    /* io_uring makes sockets (and more) without the socket() syscall this filter sees */
    "io_uring_setup", "io_uring_enter", "io_uring_register",
};

/* What a tool with given walls (SANDBOX_*) may not do, as one filter: the base rules
 * (what no tool may do) and those of its walls (the socket families of a closed network,
 * what a tool sharing the host may not touch, or both). One filter, not the base and a
 * part stacked: the kernel runs every attached filter on each of the tool's syscalls. */
enum seccomp_part { SECCOMP_BASE, SECCOMP_NET_CLOSED, SECCOMP_HOST_SHARED,
                    SECCOMP_HOST_SHARED_NET_CLOSED, SECCOMP_PARTS };

/* Under process isolation the tool shares the host's IPC namespace and file system: what
 * lives there outlives the call and reaches other sessions (SysV segments, queues and
 * semaphores, POSIX message queues), or what Landlock does not see (extended attributes
 * on a world-writable host file). */
static const char *const host_shared_syscalls[] = {
    "shmget", "shmat", "shmctl", "shmdt", "msgget", "msgsnd", "msgrcv", "msgctl", "semget",
    "semop", "semtimedop", "semctl", "mq_open", "mq_unlink", "mq_timedsend",
    "mq_timedreceive", "mq_notify", "mq_getsetattr",
};
static const char *const xattr_writes[] = {
    "setxattr", "lsetxattr", "fsetxattr", "removexattr", "lremovexattr", "fremovexattr",
    "setxattrat", "removexattrat",
};

/* The rules of one part, added to ctx. */
static int seccomp_add_part(scmp_filter_ctx ctx, enum seccomp_part part)
{
    int rc = 0;
    for (size_t i = 0; part == SECCOMP_BASE && i < ARRAY_LEN(denied_syscalls) && rc == 0; i++) {
        int nr = seccomp_syscall_resolve_name(denied_syscalls[i]);
        if (nr != __NR_SCMP_ERROR)
            rc = seccomp_rule_add(ctx, SCMP_ACT_ERRNO(EPERM), nr, 0);
    }
    /* clone with a namespace flag; clone3 hides its flags in memory, so it answers
     * ENOSYS and the C library falls back to clone, which we can inspect */
    static const unsigned long ns_flags[] = {CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID,
                                             CLONE_NEWNET, CLONE_NEWIPC, CLONE_NEWUTS,
                                             CLONE_NEWCGROUP, CLONE_NEWTIME};
    for (size_t i = 0; part == SECCOMP_BASE && i < ARRAY_LEN(ns_flags) && rc == 0; i++)
        rc = seccomp_rule_add(ctx, SCMP_ACT_ERRNO(EPERM), SCMP_SYS(clone), 1,
                              SCMP_A0(SCMP_CMP_MASKED_EQ, ns_flags[i], ns_flags[i]));
    if (part == SECCOMP_BASE && rc == 0)
        rc = seccomp_rule_add(ctx, SCMP_ACT_ERRNO(ENOSYS), SCMP_SYS(clone3), 0);
    /* typing into the terminal of whoever runs us */
    if (part == SECCOMP_BASE && rc == 0)
        rc = seccomp_rule_add(ctx, SCMP_ACT_ERRNO(EPERM), SCMP_SYS(ioctl), 1,
                              SCMP_A1(SCMP_CMP_MASKED_EQ, 0xffffffffu, TIOCSTI));
    if (part == SECCOMP_BASE && rc == 0)
        rc = seccomp_rule_add(ctx, SCMP_ACT_ERRNO(EPERM), SCMP_SYS(ioctl), 1,
                              SCMP_A1(SCMP_CMP_MASKED_EQ, 0xffffffffu, TIOCLINUX));
    /* socket families: AF_UNIX always; AF_INET/AF_INET6 only with a network (the second
     * filter); nothing else. Every family above AF_INET6 in one comparison: a filter's
     * length is attach cost. */
    for (int fam = 0; fam <= AF_INET6 && rc == 0; fam++) {
        bool inet = fam == AF_INET || fam == AF_INET6;
        if (fam == AF_UNIX || part == SECCOMP_HOST_SHARED ||
            inet != (part == SECCOMP_NET_CLOSED || part == SECCOMP_HOST_SHARED_NET_CLOSED))
            continue;
        rc = seccomp_rule_add(ctx, SCMP_ACT_ERRNO(EAFNOSUPPORT), SCMP_SYS(socket), 1,
                              SCMP_A0(SCMP_CMP_EQ, (scmp_datum_t)fam));
    }
    if (part == SECCOMP_BASE && rc == 0)
        rc = seccomp_rule_add(ctx, SCMP_ACT_ERRNO(EAFNOSUPPORT), SCMP_SYS(socket), 1,
                              SCMP_A0(SCMP_CMP_GT, (scmp_datum_t)AF_INET6));
    bool host = part == SECCOMP_HOST_SHARED || part == SECCOMP_HOST_SHARED_NET_CLOSED;
    for (size_t i = 0; host && i < ARRAY_LEN(host_shared_syscalls) && rc == 0; i++) {
        int nr = seccomp_syscall_resolve_name(host_shared_syscalls[i]);
        if (nr != __NR_SCMP_ERROR)
            rc = seccomp_rule_add(ctx, SCMP_ACT_ERRNO(EPERM), nr, 0);
    }
    /* EOPNOTSUPP: what a file system without xattrs answers, which tools handle */
    for (size_t i = 0; host && i < ARRAY_LEN(xattr_writes) && rc == 0; i++) {
        int nr = seccomp_syscall_resolve_name(xattr_writes[i]);
        if (nr != __NR_SCMP_ERROR)
            rc = seccomp_rule_add(ctx, SCMP_ACT_ERRNO(EOPNOTSUPP), nr, 0);
    }
    /* a new AF_UNIX socket could connect to any pathname socket of the host (Landlock
     * scopes abstract ones only); socketpair, which reaches nobody, stays */
    if (part == SECCOMP_HOST_SHARED_NET_CLOSED && rc == 0)
        rc = seccomp_rule_add(ctx, SCMP_ACT_ERRNO(EAFNOSUPPORT), SCMP_SYS(socket), 1,
                              SCMP_A0(SCMP_CMP_EQ, (scmp_datum_t)AF_UNIX));
    return rc;
}

/* The part a tool with these walls gets besides the base; SECCOMP_PARTS: none. */
static enum seccomp_part walls_part(unsigned walls)
{
    bool net = walls & SANDBOX_NET_CLOSED;
    if (walls & SANDBOX_HOST_SHARED)
        return net ? SECCOMP_HOST_SHARED_NET_CLOSED : SECCOMP_HOST_SHARED;
    return net ? SECCOMP_NET_CLOSED : SECCOMP_PARTS;
}

/* The whole filter of a tool with these walls: the base and its walls' part. */
static int seccomp_build(unsigned walls, scmp_filter_ctx *out)
{
    scmp_filter_ctx ctx = seccomp_init(SCMP_ACT_ALLOW);
    if (!ctx)
        return -ENOMEM;
    seccomp_attr_set(ctx, SCMP_FLTATR_CTL_LOG, 1);
    /* A binary tree of syscall numbers, not a list: at attach the kernel runs the filter
     * once per syscall number to build its allow cache, so the depth of the lookup is
     * per-call cost (half the attach time here). */
    seccomp_attr_set(ctx, SCMP_FLTATR_CTL_OPTIMIZE, 2);
    enum seccomp_part part = walls_part(walls);
    int rc = seccomp_add_part(ctx, SECCOMP_BASE);
    if (rc == 0 && part != SECCOMP_PARTS)
        rc = seccomp_add_part(ctx, part);
    if (rc != 0) {
        seccomp_release(ctx);
        return rc;
    }
    *out = ctx;
    return 0;
}

/* The filters are compiled to BPF once, in the supervisor (and so inherited by every
 * zygote and shim it forks): a call only attaches one, or none when its runner has. */
#define WALLS_COMBINATIONS 4        /* SANDBOX_NET_CLOSED | SANDBOX_HOST_SHARED */
static struct sock_fprog compiled[WALLS_COMBINATIONS];     /* by walls */
/* The walls whose filter this process (a runner) attached to itself; -1: none. Read, never
 * written, by the tool's side of a clone that shares this memory. */
static int self_walls = -1;

static int seccomp_compile(unsigned walls, struct sock_fprog *out)
{
    scmp_filter_ctx ctx;
    int rc = seccomp_build(walls, &ctx);
    if (rc != 0)
        return rc;
    int fd = memfd_create("stockade-seccomp", MFD_CLOEXEC);
    if (fd < 0 || (rc = seccomp_export_bpf(ctx, fd)) != 0) {
        rc = rc ? rc : -errno;
        goto out;
    }
    off_t len = lseek(fd, 0, SEEK_END);
    if (len <= 0 || len % (off_t)sizeof(struct sock_filter) != 0) {
        rc = -EINVAL;
        goto out;
    }
    struct sock_filter *prog = xmalloc((size_t)len);
    if (pread(fd, prog, (size_t)len, 0) != len) {
        free(prog);
        rc = -EIO;
        goto out;
    }
    out->filter = prog;
    out->len = (unsigned short)(len / (off_t)sizeof(struct sock_filter));
out:
    if (fd >= 0)
        close(fd);
    seccomp_release(ctx);
    return rc;
}

int sandbox_seccomp_prepare_walls(unsigned walls)
{
    if (!sandbox_caps()->available[LAYER_SECCOMP] || walls >= WALLS_COMBINATIONS ||
        compiled[walls].filter)
        return 0;
    int rc = seccomp_compile(walls, &compiled[walls]);
    if (rc != 0) {
        errno = -rc;
        return -1;
    }
    return 0;
}

int sandbox_seccomp_prepare(void)
{
    for (unsigned walls = 0; walls < WALLS_COMBINATIONS; walls++)
        if (sandbox_seccomp_prepare_walls(walls) < 0)
            return -1;
    return 0;
}

/* A set of walls a filter was compiled for: anything else is refused before it is
 * compared with self_walls, whose -1 ("none attached") an (int) cast of ~0u would match. */
static bool walls_known(unsigned walls)
{
    if (walls < WALLS_COMBINATIONS)
        return true;
    errno = EINVAL;
    return false;
}

static int seccomp_attach(unsigned walls)
{
    if (!walls_known(walls))
        return -1;
    if (!compiled[walls].filter && sandbox_seccomp_prepare_walls(walls) < 0)
        return -1;
    /* the kernel logs what the filter refuses (SECCOMP_FILTER_FLAG_LOG) */
    return (int)syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_LOG,
                        &compiled[walls]);
}

int sandbox_seccomp_attach_self(unsigned walls)
{
    if (!walls_known(walls))
        return -1;
    if (!sandbox_caps()->available[LAYER_SECCOMP] || self_walls == (int)walls)
        return 0;
    /* A filter cannot be taken off: a runner serves tools of one set of walls only */
    if (self_walls >= 0) {
        errno = EBUSY;
        return -1;
    }
    /* without CAP_SYS_ADMIN the kernel wants no_new_privs first; a runner execs nothing */
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0 || seccomp_attach(walls) < 0)
        return -1;
    self_walls = (int)walls;
    return 0;
}

int sandbox_apply_seccomp(unsigned walls)
{
    if (!walls_known(walls))
        return -1;
    if (!sandbox_caps()->available[LAYER_SECCOMP] || self_walls == (int)walls)
        return 0;       /* inherited from the runner: the whole filter already */
    /* none yet (a shim of its own), or a runner's of other walls (never sent one by the
     * supervisor): the tool's own, stacked, refuses at least what it must */
    return seccomp_attach(walls);
}
