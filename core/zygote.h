#ifndef STOCKADE_ZYGOTE_H
#define STOCKADE_ZYGOTE_H
/* The warm per-session zygote: it builds a session's namespaces and mount tree once and
 * makes each call's shim ahead of time (a spare), so that a call is a message to a
 * process that is already there. With `plain`, no namespaces: the server's spawner for
 * process isolation. The zygote is the supervisor's child, kept with proc_keep and ended
 * with proc_kill_async (proc.h). */
#include <stdbool.h>
#include <stddef.h>
#include <sys/types.h>

#include "sandbox.h"
#include "spawn.h"

struct zygote_config {
    bool plain;             /* no namespaces, no world: only the spares (process isolation) */
    const char *state_dir;
    const char *session_root;   /* NULL: a world made ahead of its session (zygote_bind) */
    const struct sandbox_mount *mounts;
    size_t nmounts;
    bool loopback_up;       /* network "loopback": lo is up; "none": lo down too */
};

/* A shim made ahead of time, waiting for its call on `sock`. */
struct zyg_spare {
    pid_t pid;
    int pidfd;
    int sock;
};

#define ZYG_POOL 4

struct zygote {
    pid_t pid;
    int pidfd;
    int sock;               /* SOCK_SEQPACKET to the zygote */
    bool broken;
    bool plain;             /* the server's spawner: never waited for (EWOULDBLOCK) */
    struct zyg_spare pool[ZYG_POOL];    /* delivered, ready */
    int npool;
    int asked;              /* spares we asked for, not yet taken off the socket */
    int coming;             /* spares the shims of ones handed out will ask for */
    int want;               /* how many to keep ahead: ready + asked + coming */
    bool starting;          /* forked, its ready message not read yet */
    bool unbound;           /* made ahead: its world waits for a session (zygote_bind) */
    bool made_ahead;        /* made ahead, and given its session */
    bool one_shot;          /* zygote_one_shot: one spare, and no successor for it */
    int waiting;            /* calls waiting for a spare (or for the start) */
};

/* Start a session's zygote: its namespaces and mount tree are ready when this returns.
 * NULL and *err on failure. */
struct zygote *zygote_start(const struct zygote_config *cfg, char **err);
/* The same in two halves, for a caller with a loop: building the world takes tens of
 * milliseconds, the loop need not wait. zygote_start_begin returns the zygote on its way
 * (NULL and *err if it could not even be forked); zygote_start_fd(z) turns readable when
 * it is ready or has failed; then zygote_start_finish: 0, or -1 and *err with z freed. A
 * zygote on its way is given to nothing else; zygote_stop ends it. */
struct zygote *zygote_start_begin(const struct zygote_config *cfg, char **err);
int zygote_start_fd(const struct zygote *z);
int zygote_start_finish(struct zygote *z, char **err);
/* Worlds made ahead (as root: the session's root is handed over as a detached mount,
 * which takes CAP_SYS_ADMIN; off with STOCKADE_PREPARED=0). zygote_start_begin with
 * session_root NULL starts one: it builds everything but the session's part and waits.
 * zygote_bind gives it a session: its root and tmp, and the mounts of the policy it was
 * made for (taken now, as their sources are now), are attached, then the zygote is
 * starting as any other (zygote_start_fd, zygote_start_finish). -1 and *err (the zygote
 * left as it was, to be stopped) if it died or the root could not be taken. */
bool zygote_prepare_enabled(void);
int zygote_bind(struct zygote *z, const char *session_root, const struct sandbox_mount *mounts,
                size_t nmounts, char **err);
/* A zygote on its way may also be given to a session as it is (an adopted session's, or
 * one whose zygote died): its calls wait for it as for a spare (below). */
/* Start a call inside it: like spawn_start, but the shim is a spare the zygote made
 * ahead of time (in a session's world, pid 1 of a fresh pid namespace); the request and
 * the call's pipes go to it directly, and the zygote is asked for the next one.
 * A session's zygote with no spare ready (or still building its world) is never waited
 * for: -1 with EINPROGRESS, a spare asked for; the caller waits for zygote_wait_fd(z) to
 * turn readable and calls again. */
int zygote_spawn(struct zygote *z, const struct spawn_req *req, struct spawn_child *out);
int zygote_wait_fd(const struct zygote *z);
/* A call that waits for zygote_wait_fd counts itself in (and out when it stops waiting):
 * a spare that another call takes meanwhile is then asked for again, for it. */
void zygote_wait_begin(struct zygote *z);
void zygote_wait_end(struct zygote *z);
/* Runners (spawn.h): a session keeps the spares its calls ran on, each ready for its
 * next call, so that a call creates one process (the tool's). The pool grows to the
 * session's calls in flight (at most RUNNERS_MAX kept idle); a runner is drawn from the
 * session's zygote (strict), or from the server's spawner (process). Off with
 * STOCKADE_RUNNERS=0 (every call then has a shim of its own). */
#define RUNNERS_MAX 32
struct runner_pool {
    struct zyg_spare idle[RUNNERS_MAX];
    int nidle;
    int busy;               /* runners out on calls */
};
struct zyg_runner {
    struct zyg_spare sp;    /* pid, the pool's pidfd, its request socket; pid -1: none */
    bool successor_asked;   /* a fresh spare of the spawner's: it asks for its successor */
};
bool zygote_runners_enabled(void);
/* Start a call on one of the session's runners (*pool made on first use), or a new one
 * from z: like zygote_spawn; out->pidfd is the call's own copy. *runner holds it while
 * the call runs. */
int zygote_run(struct zygote *z, struct runner_pool **pool, const struct spawn_req *req,
               struct spawn_child *out, struct zyg_runner *runner);
/* The call on it is over: `reported` (its tree reaped), back to the pool; otherwise (or
 * the pool full) ended. Idempotent. */
void zygote_runner_done(struct runner_pool *pool, struct zyg_runner *r, bool reported);
/* Idle runners (processes), and their descriptors added to *fds. */
unsigned zygote_runners_standby(const struct runner_pool *pool, unsigned *fds);
/* End the idle runners (none may be busy) and free the pool. */
void zygote_runners_free(struct runner_pool *pool);

/* A plain zygote for a process with one call to make (`stockade run`): it keeps one
 * spare, not ZYG_POOL, and the spare's shim asks for no successor. The spare is asked
 * for now, while the zygote may still be starting: it is made while the caller does
 * other work (zygote_standby with wait_ms then waits for it). */
void zygote_one_shot(struct zygote *z);

/* A spare handed out ended without a report: its ask for a successor may never come. */
void zygote_spare_lost(struct zygote *z);
/* Processes it keeps ready: itself and its spares (delivered or on their way); 0 for
 * NULL. Adds the descriptors the supervisor holds for them to *fds (if fds). wait_ms:
 * how long to wait for spares on their way (0: take what has arrived; < 0: count only). */
unsigned zygote_standby(struct zygote *z, int wait_ms, unsigned *fds);
/* False once it has died (killed, OOM) or stopped answering: its spares are gone with it
 * and it makes no more; the owner replaces it. Marks it broken. */
bool zygote_alive(struct zygote *z);
/* Kill it (its calls die with it) and release everything; it is reaped later, from the
 * loop (proc_kill_async): this does not wait for it to die. */
void zygote_stop(struct zygote *z);

#endif
