#ifndef STOCKADE_SPAWN_H
#define STOCKADE_SPAWN_H
/* Process creation for one call: a per-call shim (forked by the supervisor here, or made
 * ahead of time by a zygote: zygote.h) starts and execs the tool. The shim is the call's
 * child subreaper: when the tool exits, when the
 * supervisor asks (SIGTERM: forward to the tree; SIGUSR1: kill the tree) or when the
 * supervisor dies (PR_SET_PDEATHSIG), it kills every descendant, reaps them, reports on
 * the status pipe and exits. So nothing a call started outlives its answer, daemonized
 * grandchildren included. */
#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

struct spawn_limits {           /* 0: leave the inherited limit */
    int64_t cpu_s;              /* RLIMIT_CPU soft; hard = soft + 1 */
    int64_t memory;             /* resident memory of the tree together (the shim watches) */
    int64_t address_space;      /* RLIMIT_AS of each process */
    int64_t file_size;          /* RLIMIT_FSIZE */
    int64_t open_files;         /* RLIMIT_NOFILE */
    int64_t processes;          /* RLIMIT_NPROC with a dedicated uid; the shim also counts */
    int64_t disk, inodes;       /* the session root's usage, watched by the shim */
};


struct spawn_req {
    const char *path;           /* absolute; never looked up in PATH */
    char *const *argv;          /* argv[0] included, NULL-terminated */
    char *const *envp;          /* built from nothing by the caller */
    const char *cwd;            /* beneath session_root: entered through a pinned fd */
    dev_t cwd_dev;              /* what cwd must be (the dir the session created); */
    ino_t cwd_ino;              /*   0: not checked */
    bool drop_user;             /* run the tool as uid:gid, supplementary groups dropped */
    uid_t uid;
    gid_t gid;
    struct spawn_limits limits;
    bool with_stdin;            /* a pipe for stdin; otherwise /dev/null */
    /* walls applied in the tool's process before exec (sandbox.h) */
    bool landlock;              /* writes only beneath session_root and rw_paths */
    bool seccomp;               /* the syscall filter */
    unsigned walls;             /* SANDBOX_NET_CLOSED | SANDBOX_HOST_SHARED (sandbox.h) */
    const char *session_root;
    const char *const *rw_paths;
    int landlock_fd;            /* the ruleset for the above, built already; -1: build it */
};

struct spawn_child {
    pid_t pid;                  /* the shim */
    int pidfd;
    int stdin_fd;               /* write end, or -1 */
    int stdout_fd, stderr_fd;   /* read ends, non-blocking */
    int status_fd;              /* read end of the shim's report */
};

enum shim_outcome {
    SHIM_EXITED = 1,            /* the tool ran; wstatus is its status */
    SHIM_EXEC_FAILED,           /* the tool could not be started; err is errno */
    SHIM_FORK_FAILED,
    SHIM_CWD_REFUSED,           /* the workspace is not the session's any more; err */
};

#define SHIM_REPORT_MAGIC 0x53544b44u
#define SHIM_KILLED_MEMORY 1        /* the tree together went over limits.memory */
#define SHIM_KILLED_DISK 2          /* the session root went over limits.disk */
#define SHIM_KILLED_INODES 3        /* ... over limits.inodes (or deeper than counted) */
#define SHIM_KILLED_PROCESSES 4     /* the tree had more than limits.processes processes */

struct shim_report {
    uint32_t magic;
    int32_t outcome;            /* enum shim_outcome */
    int32_t wstatus;
    int32_t err;
    int64_t cpu_us;             /* user + system of the whole tree */
    int64_t max_rss_kb;
    int32_t swept;              /* descendants still alive when the tool ended */
    int32_t killed_for;         /* SHIM_KILLED_MEMORY when the shim ended it itself */
};

/* The four pipes of a call: the tool's stdin (or /dev/null), stdout, stderr, and the
 * shim's report. [0] read ends, [1] write ends; in[0], out[1], err[1], status[1] go to
 * the child. */
struct spawn_pipes {
    int in[2], out[2], err[2], status[2];
};
int spawn_pipes_open(struct spawn_pipes *p, bool with_stdin);
void spawn_pipes_close(struct spawn_pipes *p);
/* The child has them: close its ends here, make ours non-blocking, fill *out. */
void spawn_pipes_finish(struct spawn_pipes *p, pid_t pid, int pidfd, struct spawn_child *out);

/* Start the shim and the tool. 0, or -1 with errno (nothing left open or running). */
int spawn_start(const struct spawn_req *req, struct spawn_child *out);

/* What a shim sets up before it knows its call (signals, the limits it inherited): a
 * spare calls this while it waits; spawn_shim_enter does it if not done.
 * dispositions_default: every signal but SIGCHLD is known to be SIG_DFL already. */
void spawn_shim_prepare(bool dispositions_default);

/* A spare shim's fd 4: a byte written there once its tool is started (or could not be)
 * asks its zygote for the next spare. */
#define SHIM_READY_FD 4
/* The shim's copy of spawn_req.landlock_fd. */
#define SHIM_RULESET_FD 5

/* In a freshly forked (or cloned) child: become the call's shim with these ends of the
 * tool's stdio and the report pipe (and, with has_ready_fd, SHIM_READY_FD kept open).
 * `parent` is checked against getppid() unless the shim is pid 1 of its own pid
 * namespace. Never returns. */
_Noreturn void spawn_shim_enter(const struct spawn_req *req, int in_fd, int out_fd, int err_fd,
                                int status_fd, pid_t parent, bool has_ready_fd);

/* A runner: a spare that, rather than ending with its call, serves the next ones (zygote.h
 * hands it each call). It is set up once as a shim is (signals, limits read, child
 * subreaper, own session), and not dumpable; 0,1,2 hold /dev/null between calls.
 * `parent`: as for spawn_shim_enter. */
void spawn_runner_init(pid_t parent);
/* One call on a runner, with these ends (all closed on return): the tool started, its
 * tree ended and reaped to the last process, the report written. ask_successor: write
 * SHIM_READY_FD once the tool runs (then closed). False when the runner must end (its
 * parent is gone). */
bool spawn_runner_call(const struct spawn_req *req, int in_fd, int out_fd, int err_fd,
                       int status_fd, bool ask_successor);

#endif
