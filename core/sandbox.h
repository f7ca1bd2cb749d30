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
int sandbox_apply_seccomp(bool net_closed);
/* Compile the filters once, up front (the supervisor calls this at start). */
int sandbox_seccomp_prepare(void);

/* ---- the warm zygote ---------------------------------------------------------------- */

struct sandbox_mount {
    const char *src;        /* host path */
    const char *dest;       /* relative to the session root */
    bool ro;
};

struct zygote_config {
    const char *state_dir;
    const char *session_root;
    const struct sandbox_mount *mounts;
    size_t nmounts;
    bool loopback_up;       /* network "loopback": lo is up; "none": lo down too */
};

struct zygote {
    pid_t pid;
    int pidfd;
    int sock;               /* SOCK_SEQPACKET to the zygote */
    bool broken;
};

/* Start a session's zygote: its namespaces and mount tree are ready when this returns.
 * NULL and *err on failure. */
struct zygote *zygote_start(const struct zygote_config *cfg, char **err);
/* Start a call inside it: like spawn_start, but the shim is pid 1 of a fresh pid
 * namespace, and its pidfd comes back over the socket. */
int zygote_spawn(struct zygote *z, const struct spawn_req *req, struct spawn_child *out);
/* Kill it (its calls die with it) and release everything. */
void zygote_stop(struct zygote *z);

#endif
