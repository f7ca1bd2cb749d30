#ifndef STOCKADE_SANDBOX_H
#define STOCKADE_SANDBOX_H
/* Everything Linux-specific about walls: what the host can give (probe, for `doctor` and
 * `hello`), the Landlock and seccomp layers a tool gets before exec, and the warm
 * per-session zygote that builds a session's namespaces and mount tree once so that a
 * call is a fork inside it. A macOS backend would implement the same interface. */
#include <stdbool.h>
#include <stddef.h>
#include <sys/types.h>

#include "spawn.h"

enum sandbox_layer {
    LAYER_USERNS, LAYER_MOUNTNS, LAYER_PIDNS, LAYER_NETNS, LAYER_IPCNS, LAYER_UTSNS,
    LAYER_LANDLOCK, LAYER_SECCOMP, LAYER_RLIMITS, LAYER_UID, LAYER_CGROUP,
    LAYER_COUNT,
};

struct sandbox_caps {
    bool available[LAYER_COUNT];
    char reason[LAYER_COUNT][400];  /* why not, and the fix; empty when available */
    int landlock_abi;               /* 0: none */
    bool root;
};

const char *sandbox_layer_name(enum sandbox_layer l);
/* Probe once (forks short-lived children to try each namespace). */
const struct sandbox_caps *sandbox_caps(void);
/* The names of the layers really active for calls at `level` (for hello and doctor);
 * fills out[] and returns how many. */
size_t sandbox_active_layers(const char *level, const char **out);
/* Can the host give `level` ("strict" or "process")? NULL, or why not. */
const char *sandbox_level_unavailable(const char *level);

/* What the walls allow a tool to write: its session root and the policy's rw mounts. */
struct sandbox_fs {
    const char *session_root;
    const char *const *rw_paths;    /* NULL-terminated, may be NULL */
};

/* In the tool's process, after the uid change and before exec. 0, or -1 with errno.
 * A layer the kernel lacks is skipped (the caps say so), never faked. */
int sandbox_apply_landlock(const struct sandbox_fs *fs, bool net_closed);
/* The same in two steps: the ruleset (an fd, built once per session by the supervisor),
 * then, in the tool's process, restricting to it. -1 with errno (ENOSYS: no Landlock). */
int sandbox_landlock_ruleset(const struct sandbox_fs *fs, bool net_closed);
int sandbox_landlock_restrict(int ruleset);
int sandbox_apply_seccomp(bool net_closed);
/* In a spare shim, before its call: the part of the filter every tool gets, attached once
 * to the shim and so inherited by its tool (sandbox_apply_seccomp then adds only the
 * network part). */
int sandbox_seccomp_attach_base(void);
/* Compile the filters once, up front (the supervisor calls this at start). */
int sandbox_seccomp_prepare(void);

/* ---- the warm zygote ---------------------------------------------------------------- */

struct sandbox_mount {
    const char *src;        /* host path */
    const char *dest;       /* relative to the session root */
    bool ro;
};

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
/* Kill it (its calls die with it) and release everything. */
void zygote_stop(struct zygote *z);

#endif
