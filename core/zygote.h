#ifndef STOCKADE_ZYGOTE_H
#define STOCKADE_ZYGOTE_H
/* The warm per-session zygote: it builds a session's namespaces and mount tree once and
 * makes each call's shim ahead of time (a spare), so that a call is a message to a
 * process that is already there. With `plain`, no namespaces: the server's spawner for
 * process isolation. The zygote is the supervisor's child, kept with proc_keep and ended
 * with proc_kill_reap (proc.h). */
#include <stdbool.h>
#include <stddef.h>
#include <sys/types.h>

#include "sandbox.h"
#include "spawn.h"

struct zygote_config {
    bool plain;             /* no namespaces, no world: only the spares (process isolation) */
    const char *state_dir;
    const char *session_root;
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
};

/* Start a session's zygote: its namespaces and mount tree are ready when this returns.
 * NULL and *err on failure. */
struct zygote *zygote_start(const struct zygote_config *cfg, char **err);
/* Start a call inside it: like spawn_start, but the shim is a spare the zygote made
 * ahead of time (in a session's world, pid 1 of a fresh pid namespace); the request and
 * the call's pipes go to it directly, and the zygote is asked for the next one. */
int zygote_spawn(struct zygote *z, const struct spawn_req *req, struct spawn_child *out);
/* A spare handed out ended without a report: its ask for a successor may never come. */
void zygote_spare_lost(struct zygote *z);
/* Processes it keeps ready: itself and its spares (delivered or on their way); 0 for
 * NULL. Adds the descriptors the supervisor holds for them to *fds (if fds). wait_ms:
 * how long to wait for spares on their way (0: take what has arrived; < 0: count only). */
unsigned zygote_standby(struct zygote *z, int wait_ms, unsigned *fds);
/* False once it has died (killed, OOM) or stopped answering: its spares are gone with it
 * and it makes no more; the owner replaces it. Marks it broken. */
bool zygote_alive(struct zygote *z);
/* Kill it (its calls die with it) and release everything. */
void zygote_stop(struct zygote *z);

#endif
