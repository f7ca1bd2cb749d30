#include "spawn.h"
#include "proc.h"
#include "root.h"
#include "sandbox.h"
#include "util.h"

#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <string.h>
#include <sys/pidfd.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

/* Inside a one-call shim: fds 0,1,2 are the tool's stdio ends, 3 the report pipe. A
 * runner keeps its request socket there, and gets each call's report pipe where recvmsg
 * put it. */
#define SHIM_STATUS_FD 3
static int shim_status_fd = SHIM_STATUS_FD;
/* A runner's /dev/null: it holds 0,1,2 between calls, so that no descriptor received for
 * a call lands there. -1 in a one-call shim. */
static int runner_devnull = -1;

/* Signals the shim takes from sigtimedwait rather than handlers. */
static void shim_sigset(sigset_t *set)
{
    sigemptyset(set);
    sigaddset(set, SIGCHLD);
    sigaddset(set, SIGTERM);
    sigaddset(set, SIGUSR1);
    sigaddset(set, SIGINT);
    sigaddset(set, SIGHUP);
}

static void reset_signal_dispositions(void)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = SIG_DFL;
    for (int sig = 1; sig < NSIG; sig++)
        sigaction(sig, &sa, NULL);     /* fails harmlessly for KILL, STOP, RT internals */
}

/* The limits the shim inherited, read while it waits for its call (spawn_shim_prepare). */
static const int limited[] = {RLIMIT_CORE, RLIMIT_CPU, RLIMIT_AS, RLIMIT_FSIZE, RLIMIT_NOFILE,
                              RLIMIT_NPROC};
static struct rlimit inherited[RLIM_NLIMITS];

/* Lower a limit; a policy value above the inherited hard limit means the hard limit (it
 * cannot be raised once the uid has changed). */
static int set_limit(int resource, int64_t soft, int64_t hard)
{
    struct rlimit rl = {(rlim_t)soft, (rlim_t)hard};
    const struct rlimit cur = inherited[resource];
    if (cur.rlim_max != RLIM_INFINITY) {
        if (rl.rlim_max > cur.rlim_max)
            rl.rlim_max = cur.rlim_max;
        if (rl.rlim_cur > rl.rlim_max)
            rl.rlim_cur = rl.rlim_max;
    }
    return setrlimit(resource, &rl);
}

/* The tool's process borrows the shim's memory until it execs (CLONE_VM|CLONE_VFORK, as
 * posix_spawn does): copying an address space costs more than the exec itself on a VM,
 * and the shim has nothing to do until the exec is done. The child only makes syscalls
 * (and, should a step fail, writes its errno where the shim reads it); everything it
 * reads was prepared before (caps probed, seccomp compiled). Under ASan
 * (SAN=1), whose runtime keeps per-thread state the child would share, a plain fork. */
#if defined(__SANITIZE_ADDRESS__)
#define TOOL_SHARES_MEMORY 0
#else
#define TOOL_SHARES_MEMORY 1
#endif

/* What the tool's side is given, and how it says it could not exec: in memory it shares
 * with the shim (read once clone returns, which waits for the exec or the exit, as
 * posix_spawn does), or on a pipe where it has a copy (fork). */
struct tool_start {
    const struct spawn_req *req;
    int cwd_fd;
    int errpipe;                /* fork: the write end; -1 with shared memory */
    volatile int err;           /* shared memory: errno of the failed step, 0 if none */
};

static _Noreturn void tool_fail(struct tool_start *ts, int err)
{
    /* 0 would read as "it exec'd", and the failure as the tool's own exit 127 */
    if (err == 0)
        err = EIO;
    if (ts->errpipe < 0) {
        ts->err = err;
    } else {
        ssize_t n = write(ts->errpipe, &err, sizeof err);
        (void)n;
    }
    _exit(127);
}

/* The tool's side of the fork, in the shim's child: lock down, then exec. cwd_fd: the
 * workspace, opened pinned by the shim (shim_open_cwd). */
static _Noreturn void tool_exec(struct tool_start *ts)
{
    const struct spawn_req *req = ts->req;
    int cwd_fd = ts->cwd_fd;
    if (setpgid(0, 0) < 0)
        tool_fail(ts, errno);
    /* Everything but 0,1,2 (and, forked, the CLOEXEC error pipe) is closed at exec. */
    if (close_range(3, ~0U, CLOSE_RANGE_CLOEXEC) < 0)
        tool_fail(ts, errno);
    /* by the fd the shim pinned: a path would be resolved as root, through whatever the
     * tool of an earlier call left there */
    if (fchdir(cwd_fd) < 0)
        tool_fail(ts, errno);

    if (req->drop_user) {
        /* raw syscalls: the C library's wrappers may signal "other threads" of a process
         * whose memory this one shares */
        if (syscall(SYS_setgroups, 0, NULL) < 0 ||
            syscall(SYS_setresgid, req->gid, req->gid, req->gid) < 0 ||
            syscall(SYS_setresuid, req->uid, req->uid, req->uid) < 0)
            tool_fail(ts, errno);
        if (getuid() == 0 || geteuid() == 0)
            tool_fail(ts, EPERM);
    }
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0)
        tool_fail(ts, errno);
    if (req->landlock) {
        struct sandbox_fs fs = {req->session_root, req->rw_paths, NULL};
        if ((req->landlock_fd >= 0 ? sandbox_landlock_restrict(req->landlock_fd)
                                   : sandbox_apply_landlock(&fs, req->walls &
                                                                  SANDBOX_NET_CLOSED)) < 0)
            tool_fail(ts, errno);
    }
    /* after Landlock: the filter refuses nothing Landlock needs, but keep walls in the
     * order they narrow */
    if (req->seccomp && sandbox_apply_seccomp(req->walls) < 0)
        tool_fail(ts, errno);
    /* After the uid change, which clears it: the tool dies with its shim. */
    if (prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0) < 0)
        tool_fail(ts, errno);
    /* Limits last: setting up the walls above may allocate, and RLIMIT_AS would refuse
     * an allocator that reserves much address space (ASan). Only lowering: allowed
     * after the uid change. */
    const struct spawn_limits *l = &req->limits;
    if (set_limit(RLIMIT_CORE, 0, 0) < 0 ||
        (l->cpu_s > 0 && set_limit(RLIMIT_CPU, l->cpu_s, l->cpu_s + 1) < 0) ||
        (l->address_space > 0 &&
         set_limit(RLIMIT_AS, l->address_space, l->address_space) < 0) ||
        (l->file_size > 0 && set_limit(RLIMIT_FSIZE, l->file_size, l->file_size) < 0) ||
        (l->open_files > 0 && set_limit(RLIMIT_NOFILE, l->open_files, l->open_files) < 0) ||
        (req->drop_user && l->processes > 0 &&
         set_limit(RLIMIT_NPROC, l->processes, l->processes) < 0))
        tool_fail(ts, errno);

    /* Signals stay blocked until the last moment: a handler must not run on the
     * borrowed stack. */
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    execve(req->path, req->argv, req->envp);
    tool_fail(ts, errno);
}

static int tool_child(void *arg)
{
    struct tool_start *ts = arg;
    close(shim_status_fd);
    tool_exec(ts);
}

/* Start the tool: its pid once it has exec'd or failed to (*exec_err: 0, or the errno of
 * the step that failed), or -1 with errno when it could not be started at all. */
static pid_t tool_spawn(const struct spawn_req *req, int cwd_fd, int *exec_err)
{
#if TOOL_SHARES_MEMORY
    static char stack[64 * 1024] __attribute__((aligned(16)));
    struct tool_start ts = {req, cwd_fd, -1, 0};
    pid_t pid = clone(tool_child, stack + sizeof stack, CLONE_VM | CLONE_VFORK | SIGCHLD, &ts);
    *exec_err = ts.err;
    return pid;
#else
    int errpipe[2];
    if (pipe2(errpipe, O_CLOEXEC) < 0)
        return -1;
    struct tool_start ts = {req, cwd_fd, errpipe[1], 0};
    pid_t pid = fork();
    if (pid == 0)
        tool_child(&ts);
    int e = errno;
    close(errpipe[1]);
    int err = 0;
    ssize_t n = 0;
    while (pid > 0 && (n = read(errpipe[0], &err, sizeof err)) < 0 && errno == EINTR)
        ;
    close(errpipe[0]);
    *exec_err = n == (ssize_t)sizeof err ? err : 0;
    errno = e;
    return pid;
#endif
}

static void shim_report_write(const struct shim_report *r)
{
    ssize_t n;
    do
        n = write(shim_status_fd, r, sizeof *r);
    while (n < 0 && errno == EINTR);
}

/* Reap every exited child; note the tool's status, and add each child's CPU time and
 * peak RSS to the report (per call: a runner's RUSAGE_CHILDREN counts all its calls).
 * Returns false once no child is left. */
static bool shim_reap(pid_t tool, bool *tool_done, int *tool_status, struct shim_report *rep)
{
    for (;;) {
        int st;
        struct rusage ru;
        pid_t pid = wait4(-1, &st, WNOHANG, &ru);
        if (pid == 0)
            return true;
        if (pid < 0)
            return errno == EINTR ? true : false;
        rep->cpu_us += (int64_t)ru.ru_utime.tv_sec * 1000000 + ru.ru_utime.tv_usec +
                       (int64_t)ru.ru_stime.tv_sec * 1000000 + ru.ru_stime.tv_usec;
        if (ru.ru_maxrss > rep->max_rss_kb)
            rep->max_rss_kb = ru.ru_maxrss;
        if (pid == tool) {
            *tool_done = true;
            *tool_status = st;
        }
    }
}

static void shim_noop(int sig) { (void)sig; }

/* The session root, by its path: an entry of the supervisor's sessions dir, which no tool
 * writes. */
static int shim_open_root(const struct spawn_req *req)
{
    if (!req->session_root || !*req->session_root) {
        errno = EXDEV;
        return -1;
    }
    return open(req->session_root, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
}

/* The tool's cwd, opened beneath the session root (no symlink, no "..") and checked to be
 * the directory the session created: an earlier call's tool may have replaced it by a
 * symlink to anywhere root can reach. -1 with errno (ESTALE: another directory). */
static int shim_open_cwd(const struct spawn_req *req, int rootfd)
{
    size_t n = strlen(req->session_root);
    if (strncmp(req->cwd, req->session_root, n) != 0 || (req->cwd[n] != '/' && req->cwd[n])) {
        errno = EXDEV;
        return -1;
    }
    int fd = root_open_beneath(rootfd, req->cwd + n + (req->cwd[n] == '/'),
                               O_RDONLY | O_DIRECTORY, 0);
    struct stat st;
    if (fd >= 0 && req->cwd_ino &&
        (fstat(fd, &st) < 0 || st.st_dev != req->cwd_dev || st.st_ino != req->cwd_ino)) {
        close(fd);
        errno = ESTALE;
        return -1;
    }
    return fd;
}

/* limits.disk and limits.inodes: the session root's usage, walked (bounded by the caps)
 * at most every DISK_WATCH_MIN_MS and never more than 1/20 of the time. */
#define DISK_WATCH_MIN_MS 250

static int disk_check(const struct spawn_req *req, int rootfd, int64_t *next_ms)
{
    const struct spawn_limits *l = &req->limits;
    int64_t t0 = now_ms();
    struct root_usage u;
    int rc = root_usage_at(rootfd, l->disk, l->inodes, &u);
    int64_t took = now_ms() - t0;
    *next_ms = now_ms() + (took * 20 > DISK_WATCH_MIN_MS ? took * 20 : DISK_WATCH_MIN_MS);
    if (rc < 0 && errno == E2BIG)
        return SHIM_KILLED_INODES;
    if (l->disk > 0 && u.bytes > l->disk)
        return SHIM_KILLED_DISK;
    if (l->inodes > 0 && u.inodes > l->inodes)
        return SHIM_KILLED_INODES;
    return 0;
}

/* A shim is a fork of the supervisor: its command line and environment (the supervisor's
 * flags, paths) would show in the tool's /proc, where the shim is pid 1 under strict. */
static void shim_scrub_cmdline(void)
{
    char buf[1024];
    int fd = open("/proc/self/stat", O_RDONLY | O_CLOEXEC);
    ssize_t n = fd >= 0 ? read(fd, buf, sizeof buf - 1) : -1;
    if (fd >= 0)
        close(fd);
    if (n <= 0)
        return;
    buf[n] = 0;
    /* fields 48-51 (arg_start, arg_end, env_start, env_end) count from after "(comm)" */
    char *p = strrchr(buf, ')');
    unsigned long v[4];
    int field = 2;
    for (; p && *p && field < 48; p++)
        if (*p == ' ')
            field++;
    if (!p || sscanf(p, "%lu %lu %lu %lu", &v[0], &v[1], &v[2], &v[3]) != 4)
        return;
    static const char name[] = "stockade-shim";
    for (int i = 0; i < 4; i += 2) {
        if (v[i + 1] <= v[i])
            continue;
        memset((void *)v[i], 0, v[i + 1] - v[i]);
        if (i == 0 && v[1] - v[0] > sizeof name)
            memcpy((void *)v[0], name, sizeof name);
    }
}

/* Shared memory no process maps, or maps without it showing as theirs alone: memfds held
 * open (written with write(), they are in no RSS) and the SysV segments of the call's IPC
 * namespace. Deduplicated by inode; capped in work like the rest of the watch. */
static int64_t shared_kb(const pid_t *pids, size_t n, bool pid1)
{
    enum { MAX_FILES = 1024, MAX_FDS = 4096 };
    static struct {
        dev_t dev;
        ino_t ino;
    } seen[MAX_FILES];
    size_t nseen = 0, fds = 0;
    int64_t bytes = 0;
    for (size_t i = 0; i < n && fds < MAX_FDS; i++) {
        char dir[64];
        snprintf(dir, sizeof dir, "/proc/%d/fd", (int)pids[i]);
        DIR *d = opendir(dir);
        struct dirent *de;
        while (d && (de = readdir(d)) && fds < MAX_FDS) {
            if (de->d_name[0] == '.')
                continue;
            fds++;
            char link[sizeof dir + sizeof de->d_name + 1], target[64];
            snprintf(link, sizeof link, "%s/%s", dir, de->d_name);
            ssize_t k = readlink(link, target, sizeof target - 1);
            if (k < 7 || memcmp(target, "/memfd:", 7) != 0)
                continue;
            struct stat st;
            if (stat(link, &st) < 0)
                continue;
            bool dup = false;
            for (size_t j = 0; j < nseen && !dup; j++)
                dup = seen[j].dev == st.st_dev && seen[j].ino == st.st_ino;
            if (dup)
                continue;
            if (nseen < MAX_FILES) {
                seen[nseen].dev = st.st_dev;
                seen[nseen++].ino = st.st_ino;
            }
            bytes += (int64_t)st.st_blocks * 512;
        }
        if (d)
            closedir(d);
    }
    /* pid 1 of the session's world: its IPC namespace is the session's; its segments
     * outlive a call, and count for every call of the session */
    FILE *f = pid1 ? fopen("/proc/sysvipc/shm", "re") : NULL;
    char line[512];
    if (f && fgets(line, sizeof line, f)) {
        while (fgets(line, sizeof line, f)) {
            long long rss = 0;
            /* key shmid perms size cpid lpid nattch uid gid cuid cgid atime dtime ctime rss */
            if (sscanf(line, "%*d %*d %*o %*u %*d %*d %*u %*u %*u %*u %*u %*u %*u %*u %lld",
                       &rss) == 1)
                bytes += rss;
        }
    }
    if (f)
        fclose(f);
    return bytes / 1024;
}

/* Memory of the call's processes together: everyone in the pid namespace when we are its
 * init, else the tree below us (through the children lists, not a scan of every process
 * on the host). Each process's resident pages (shared mappings included: statm cannot
 * tell a shared anonymous mapping from a file page, and leaving shmem out would let a
 * tree hold any amount of it), plus shared memory no process need map: memfds and SysV
 * segments (shared_kb, which costs a walk of every fd: refreshed only when
 * `refresh_shared`, else *shared reused). What is both mapped and held counts twice:
 * over, never under. */
static int64_t tree_rss_kb(bool pid1, bool refresh_shared, int64_t *shared,
                           size_t *count)
{
    enum { MAX_PIDS = 4096 };
    static pid_t pids[MAX_PIDS];
    size_t n = 0;
    if (pid1) {
        DIR *d = opendir("/proc");
        struct dirent *de;
        while (d && (de = readdir(d)) && n < MAX_PIDS)
            if (de->d_name[0] >= '2' && de->d_name[0] <= '9')
                pids[n++] = (pid_t)atoi(de->d_name);
            else if (de->d_name[0] == '1' && de->d_name[1])
                pids[n++] = (pid_t)atoi(de->d_name);
        if (d)
            closedir(d);
    } else {
        n = proc_descendants(getpid(), pids, MAX_PIDS);
    }
    *count = n;
    int64_t total = 0;
    long page_kb = sysconf(_SC_PAGESIZE) / 1024;
    for (size_t i = 0; i < n; i++) {
        char path[64], buf[128];
        snprintf(path, sizeof path, "/proc/%d/statm", (int)pids[i]);
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        ssize_t r = fd >= 0 ? read(fd, buf, sizeof buf - 1) : -1;
        if (fd >= 0)
            close(fd);
        if (r <= 0)
            continue;
        buf[r] = 0;
        long size = 0, resident = 0;
        if (sscanf(buf, "%ld %ld", &size, &resident) == 2)
            total += resident * page_kb;
    }
    if (refresh_shared)
        *shared = shared_kb(pids, n, pid1);
    return total + *shared;
}

/* Signal every process of the call's tree. As pid 1 of the call's own pid namespace,
 * that is everyone else in it; otherwise the walk below the shim. */
static int shim_signal_tree(bool pid1, int sig)
{
    if (pid1) {
        int rc = kill(-1, sig);
        if (sig == SIGTERM)
            kill(-1, SIGCONT);
        return rc == 0 ? 1 : 0;
    }
    return proc_signal_descendants(getpid(), sig, false);
}

static bool shim_prepared;

/* Process isolation as root: the tool's /proc lists only its own uid's processes (a
 * procfs with hidepid=2 in a mount namespace of the shim's own, a slave of the host's so
 * that host mounts still show): the host's and other sessions' processes and command
 * lines are not the tool's to read. Best effort: where no mount namespace can be made
 * (doctor reports mountns), /proc stays the host's. Under strict the world has its own. */
static void shim_private_proc(void)
{
    if (getpid() == 1 || geteuid() != 0 || unshare(CLONE_NEWNS) < 0)
        return;
    /* never mount anything that could propagate back to the host */
    if (mount(NULL, "/", NULL, MS_REC | MS_SLAVE, NULL) < 0)
        return;
    mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "hidepid=2");
}

void spawn_shim_prepare(bool dispositions_default)
{
    if (dispositions_default) {
        /* a zygote's child: everything is SIG_DFL but the zygote's SIGCHLD, which must
         * not stay ignored (children would reap themselves) */
        struct sigaction dfl;
        memset(&dfl, 0, sizeof dfl);
        dfl.sa_handler = SIG_DFL;
        sigaction(SIGCHLD, &dfl, NULL);
    } else {
        reset_signal_dispositions();
    }
    sigset_t set;
    shim_sigset(&set);
    sigprocmask(SIG_SETMASK, &set, NULL);
    if (getpid() == 1) {
        /* init of a pid namespace only receives signals it has a handler for; they stay
         * blocked and are taken with sigtimedwait */
        struct sigaction sa;
        memset(&sa, 0, sizeof sa);
        sa.sa_handler = shim_noop;
        for (int sig = 1; sig < NSIG; sig++)
            if (sigismember(&set, sig))
                sigaction(sig, &sa, NULL);
    }
    for (size_t i = 0; i < ARRAY_LEN(limited); i++)
        if (getrlimit(limited[i], &inherited[limited[i]]) < 0)
            inherited[limited[i]] = (struct rlimit){RLIM_INFINITY, RLIM_INFINITY};
    shim_private_proc();
    shim_scrub_cmdline();
    shim_prepared = true;
}

/* A spare's shim asks its zygote for its successor once its tool runs, or once its call
 * is over without one (else the pool would shrink by each call refused early). */
static void shim_ask_successor(bool has_ready_fd)
{
    if (!has_ready_fd)
        return;
    ssize_t w = write(SHIM_READY_FD, "s", 1);
    (void)w;
    close(SHIM_READY_FD);
}

/* The call ends before its tool could start: the report says why. */
static void shim_fail(struct shim_report *rep, enum shim_outcome outcome, int err,
                      bool has_ready_fd)
{
    rep->outcome = outcome;
    rep->err = err;
    shim_report_write(rep);
    shim_ask_successor(has_ready_fd);
}

/* Let go of the tool's stdio ends 0..last (the shim writes nothing but its report). A
 * runner keeps them taken by /dev/null. */
static void shim_drop_stdio_to(int last)
{
    if (runner_devnull < 0) {
        close_range(0, (unsigned)last, 0);
        return;
    }
    for (int fd = 0; fd <= last; fd++)
        dup2(runner_devnull, fd);
}

static void shim_drop_stdio(void) { shim_drop_stdio_to(2); }

/* One call, in a shim or a runner whose stdio (0,1,2) are the tool's and whose report
 * goes to shim_status_fd: start the tool, watch its tree, end it, reap every process of
 * it, report. Returns with no child left. */
static void shim_call(const struct spawn_req *req, bool pid1, bool has_ready_fd)
{
    struct shim_report rep = {.magic = SHIM_REPORT_MAGIC};
    sigset_t set;
    shim_sigset(&set);

    int rootfd = shim_open_root(req);
    int cwd_fd = rootfd >= 0 ? shim_open_cwd(req, rootfd) : -1;
    if (cwd_fd < 0) {
        int e = errno;
        close_quietly(&rootfd);
        shim_drop_stdio();
        shim_fail(&rep, SHIM_CWD_REFUSED, e, has_ready_fd);
        return;
    }
    int err = 0;
    pid_t tool = tool_spawn(req, cwd_fd, &err);
    int spawn_errno = errno;
    close(cwd_fd);
    if (tool < 0) {
        close_quietly(&rootfd);
        shim_drop_stdio();
        shim_fail(&rep, SHIM_FORK_FAILED, spawn_errno, has_ready_fd);
        return;
    }
    /* stdin now: a tool that exits unread must break the supervisor's writes. Its stdout
     * and stderr are held until just after the report (below): the supervisor, woken by
     * the report, reads what they hold to the end without waiting for their EOF, one
     * wake-up rather than three. EOF still means the tree is done. */
    shim_drop_stdio_to(0);

    /* The tool runs (or could not be started): our zygote makes the next spare now, on
     * the CPU the tool is not using (earlier, it would compete with this call's start;
     * later, with its end). */
    shim_ask_successor(has_ready_fd);

    bool tool_done = false, killing = false;
    int tool_status = 0;
    int64_t next_watch = now_ms() + 50, next_disk = now_ms() + 100, shared = 0;
    unsigned watches = 0;
    bool disk_watch = req->limits.disk > 0 || req->limits.inodes > 0;
    if (err != 0) {
        rep.outcome = SHIM_EXEC_FAILED;
        rep.err = err;
        killing = true;
    } else {
        rep.outcome = SHIM_EXITED;
    }

    for (;;) {
        if (!shim_reap(tool, &tool_done, &tool_status, &rep))
            break;
        if (tool_done || killing) {
            /* The call is over: nothing it started may outlive it. */
            int live = shim_signal_tree(pid1, SIGKILL);
            if (tool_done && !killing)
                rep.swept += live;
            killing = true;
        }
        /* The tree's resident memory and its number of processes are watched here,
         * twenty times a second (no cgroup to do it for us on this kind of host; RLIMIT_AS
         * is address space, which JITs reserve far beyond use): a tree can overshoot
         * by what it allocates in one interval, never for long. By the clock, not per
         * wake-up: a tree whose children die fast must not starve the watch, and a tool
         * that is over in a few ms never pays for a walk. */
        bool tree_watch = req->limits.memory > 0 || req->limits.processes > 0;
        if (!killing && tree_watch && now_ms() >= next_watch) {
            next_watch = now_ms() + 50;
            size_t nprocs = 0;
            /* shared memory costs a look at every fd: every fourth watch */
            int64_t rss_kb = tree_rss_kb(pid1, watches++ % 4 == 0, &shared, &nprocs);
            if (req->limits.memory > 0 && rss_kb * 1024 > req->limits.memory)
                rep.killed_for = SHIM_KILLED_MEMORY;
            else if (req->limits.processes > 0 && (int64_t)nprocs > req->limits.processes)
                rep.killed_for = SHIM_KILLED_PROCESSES;
            if (rep.killed_for) {
                killing = true;
                continue;
            }
        }
        if (!killing && disk_watch && now_ms() >= next_disk) {
            int over = disk_check(req, rootfd, &next_disk);
            if (over) {
                rep.killed_for = over;
                killing = true;
                continue;
            }
        }
        struct timespec tick = {0, (killing ? 20 : 50) * 1000 * 1000};
        siginfo_t si;
        int sig = sigtimedwait(&set, &si, killing || tree_watch || disk_watch ? &tick : NULL);
        if (sig == SIGTERM || sig == SIGINT || sig == SIGHUP) {
            if (!killing)
                shim_signal_tree(pid1, SIGTERM);
        } else if (sig == SIGUSR1) {
            killing = true;
        }
    }

    close_quietly(&rootfd);
    rep.wstatus = tool_status;
    shim_report_write(&rep);
    shim_drop_stdio();
}

static _Noreturn void shim_main(const struct spawn_req *req, pid_t parent, bool has_ready_fd)
{
    bool pid1 = getpid() == 1;
    /* SIGUSR1 when the parent dies: the same "kill everything" path as a hard stop. */
    if (prctl(PR_SET_PDEATHSIG, SIGUSR1, 0, 0, 0) < 0 || (!pid1 && getppid() != parent))
        _exit(1);
    prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0);
    setsid();
    shim_call(req, pid1, has_ready_fd);
    _exit(0);
}

static pid_t runner_parent;

void spawn_runner_init(pid_t parent)
{
    if (!shim_prepared)
        spawn_shim_prepare(false);
    runner_parent = parent;
    /* during a call its fd 2 is the tool's stderr, which goes to the client: no line of
     * ours may land there */
    log_fd = -1;
    prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0);
    /* Its tools may share its uid (no root): they must not read its memory or its fds */
    prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
    setsid();
    runner_devnull = open("/dev/null", O_RDWR | O_CLOEXEC);
    if (runner_devnull < 0)
        _exit(1);
    shim_drop_stdio();
}

/* The parent the runner was made by is still there (a pid namespace's init cannot tell:
 * its SIGKILL on the parent's death, armed while idle, covers it). */
static bool runner_parent_alive(void)
{
    return getpid() == 1 || getppid() == runner_parent;
}

bool spawn_runner_call(const struct spawn_req *req, int in_fd, int out_fd, int err_fd,
                       int status_fd, bool ask_successor)
{
    /* A signal the supervisor sent for an earlier call (a stop racing its end) is that
     * call's: taken off before this one starts. The supervisor signals a runner only
     * about the call it last sent it. */
    sigset_t set;
    shim_sigset(&set);
    struct timespec zero = {0, 0};
    while (sigtimedwait(&set, NULL, &zero) > 0)
        ;
    /* During a call the parent's death ends the call's tree (SIGUSR1); while idle it ends
     * the runner (SIGKILL). */
    if (prctl(PR_SET_PDEATHSIG, SIGUSR1, 0, 0, 0) < 0 || !runner_parent_alive())
        return false;
    /* The tool's whole seccomp filter, on the runner itself at its first call: its tools
     * inherit it and attach nothing (the attach, BPF JIT included, was most of a call's
     * walls). The runner needs nothing the filter refuses. Should it fail, each tool
     * attaches its own (sandbox_apply_seccomp). */
    if (req->seccomp)
        sandbox_seccomp_attach_self(req->walls);
    if (dup2(in_fd, 0) < 0 || dup2(out_fd, 1) < 0 || dup2(err_fd, 2) < 0)
        return false;
    close(in_fd);
    close(out_fd);
    close(err_fd);
    shim_status_fd = status_fd;
    shim_call(req, getpid() == 1, ask_successor);
    close(status_fd);
    shim_status_fd = -1;
    return prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0) == 0 && runner_parent_alive();
}

void spawn_shim_enter(const struct spawn_req *req, int in_fd, int out_fd, int err_fd,
                      int status_fd, pid_t parent, bool has_ready_fd)
{
    if (!shim_prepared)
        spawn_shim_prepare(false);
    log_fd = -1;        /* fd 2 becomes the tool's stderr, which goes to the client */
    /* Sources are all above the fds they go to (the supervisor keeps 0,1,2 open; a spare
     * 0 to SHIM_READY_FD), so these dup2 calls never clobber one another. */
    if (dup2(in_fd, 0) < 0 || dup2(out_fd, 1) < 0 || dup2(err_fd, 2) < 0 ||
        dup2(status_fd, SHIM_STATUS_FD) < 0)
        _exit(1);
    fcntl(SHIM_STATUS_FD, F_SETFD, FD_CLOEXEC);
    /* the ruleset last: whatever it lands on was copied above already */
    struct spawn_req r = *req;
    if (r.landlock_fd >= 0) {
        if (dup2(r.landlock_fd, SHIM_RULESET_FD) < 0)
            _exit(1);
        r.landlock_fd = SHIM_RULESET_FD;
        if (!has_ready_fd)
            close(SHIM_READY_FD);
        close_range(SHIM_RULESET_FD + 1, ~0U, 0);
    } else {
        close_range(has_ready_fd ? SHIM_READY_FD + 1 : SHIM_STATUS_FD + 1, ~0U, 0);
    }
    shim_main(&r, parent, has_ready_fd);
}

int spawn_pipes_open(struct spawn_pipes *p, bool with_stdin)
{
    *p = (struct spawn_pipes){{-1, -1}, {-1, -1}, {-1, -1}, {-1, -1}};
    if ((with_stdin ? pipe2(p->in, O_CLOEXEC)
                    : (p->in[0] = open("/dev/null", O_RDONLY | O_CLOEXEC))) < 0 ||
        pipe2(p->out, O_CLOEXEC) < 0 || pipe2(p->err, O_CLOEXEC) < 0 ||
        pipe2(p->status, O_CLOEXEC) < 0) {
        spawn_pipes_close(p);
        return -1;
    }
    return 0;
}

void spawn_pipes_close(struct spawn_pipes *p)
{
    int e = errno;
    int *fds[] = {&p->in[0], &p->in[1], &p->out[0], &p->out[1], &p->err[0], &p->err[1],
                  &p->status[0], &p->status[1]};
    for (size_t i = 0; i < ARRAY_LEN(fds); i++)
        close_quietly(fds[i]);
    errno = e;
}

void spawn_pipes_finish(struct spawn_pipes *p, pid_t pid, int pidfd, struct spawn_child *out)
{
    /* The child's ends stay only with the child, so EOF means its tree is done. */
    close_quietly(&p->in[0]);
    close_quietly(&p->out[1]);
    close_quietly(&p->err[1]);
    close_quietly(&p->status[1]);
    /* Non-blocking: the loop must never stall on a tool that does not read its stdin or
     * floods its output. */
    if (p->in[1] >= 0)
        fd_set_nonblock(p->in[1]);
    fd_set_nonblock(p->out[0]);
    fd_set_nonblock(p->err[0]);
    fd_set_nonblock(p->status[0]);
    *out = (struct spawn_child){pid, pidfd, p->in[1], p->out[0], p->err[0], p->status[0]};
    p->in[1] = p->out[0] = p->err[0] = p->status[0] = -1;
}

int spawn_start(const struct spawn_req *req, struct spawn_child *out)
{
    struct spawn_pipes p;
    if (spawn_pipes_open(&p, req->with_stdin) < 0)
        return -1;
    /* Block everything across fork so no inherited handler runs in the child before it
     * resets the dispositions. */
    sigset_t all, old;
    sigfillset(&all);
    sigprocmask(SIG_SETMASK, &all, &old);
    pid_t supervisor = getpid();
    pid_t pid = fork();
    if (pid == 0)
        spawn_shim_enter(req, p.in[0], p.out[1], p.err[1], p.status[1], supervisor, false);
    int fork_errno = errno;
    sigprocmask(SIG_SETMASK, &old, NULL);
    int pidfd = pid > 0 ? pidfd_open(pid, 0) : -1;
    if (pid < 0 || pidfd < 0) {
        int e = pid < 0 ? fork_errno : errno;
        if (pid > 0)
            proc_kill_async(pid, -1);
        spawn_pipes_close(&p);
        errno = e;
        return -1;
    }
    spawn_pipes_finish(&p, pid, pidfd, out);
    return 0;
}
