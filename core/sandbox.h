#ifndef STOCKADE_SANDBOX_H
#define STOCKADE_SANDBOX_H
/* Everything Linux-specific about walls: what the host can give (probe, for `doctor` and
 * `hello`) and the Landlock and seccomp layers a tool gets before exec. A macOS backend
 * would implement the same interface. (The namespaces and mount tree of a session are
 * built by its zygote: zygote.h.) */
#include <stdbool.h>
#include <stddef.h>
#include <sys/types.h>

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
/* Probe once, without a process: Landlock, seccomp, root. The namespace layers read as
 * unavailable ("not probed") until sandbox_caps_namespaces. */
const struct sandbox_caps *sandbox_caps(void);
/* The same with the namespaces probed, once (a short-lived child tries them all; one per
 * namespace only if that fails, to tell which): for strict and doctor. */
const struct sandbox_caps *sandbox_caps_namespaces(void);
/* The names of the layers really active for calls at `level` (for hello and doctor);
 * fills out[] and returns how many. */
size_t sandbox_active_layers(const char *level, const char **out);
/* Can the host give `level` ("strict" or "process")? False and *why (malloc'd) if not. */
bool sandbox_level_allowed(const char *level, char **why);
/* Can `level` give `network` honestly? False and *why (malloc'd) if not: "loopback" under
 * process would be the host's whole network. Checked wherever a policy is taken to run
 * calls (run, serve, reload). */
bool sandbox_network_allowed(const char *level, const char *network, char **why);

/* What the walls allow a tool to write: its session root and the policy's rw mounts. */
struct sandbox_fs {
    const char *session_root;
    const char *const *rw_paths;    /* NULL-terminated, may be NULL */
    /* Where every session runs as one uid (a supervisor that is not root), file modes
     * cannot keep sessions apart: reads are then handled too, and allowed everywhere but
     * beneath private_dir (the state dir), where only the session root is. NULL: reads
     * stay as the mount tree and file modes make them. */
    const char *private_dir;
};

/* Which walls of a tool's network and host-sharing to close (spawn_req.walls) */
#define SANDBOX_NET_CLOSED 1u   /* no TCP (Landlock), no AF_INET* sockets (seccomp) */
#define SANDBOX_HOST_SHARED 2u  /* process isolation: the tool shares the host's IPC and
                                 * file system: no SysV IPC or POSIX queues, no xattr
                                 * writes, and with SANDBOX_NET_CLOSED no AF_UNIX
                                 * socket() (a host daemon's pathname socket) either */

/* In the tool's process, after the uid change and before exec. 0, or -1 with errno.
 * A layer the kernel lacks is skipped (the caps say so), never faked. */
int sandbox_apply_landlock(const struct sandbox_fs *fs, bool net_closed);
/* The same in two steps: the ruleset (an fd, built once per session by the supervisor),
 * then, in the tool's process, restricting to it. -1 with errno (ENOSYS: no Landlock). */
int sandbox_landlock_ruleset(const struct sandbox_fs *fs, bool net_closed);
int sandbox_landlock_restrict(int ruleset);
/* The seccomp filter of a tool with `walls` (spawn_req.walls: SANDBOX_NET_CLOSED,
 * SANDBOX_HOST_SHARED), one filter: what no tool may do and what those walls close. In
 * the tool's process before exec: attached, unless its runner has it already (below). */
int sandbox_apply_seccomp(unsigned walls);
/* In a runner, before the first call it starts: the same filter attached to itself (and
 * so inherited by each tool it starts, which then attaches nothing). Once: a runner
 * serves tools of one set of walls only (-1 with EBUSY for others). */
int sandbox_seccomp_attach_self(unsigned walls);
/* Compile the filters once, up front (the supervisor calls this at start). */
int sandbox_seccomp_prepare(void);
/* Only the one a tool with `walls` (SANDBOX_*) needs: a one-shot run's. */
int sandbox_seccomp_prepare_walls(unsigned walls);

/* A host path the policy mounts into its sessions' worlds. */
struct sandbox_mount {
    const char *src;        /* host path */
    const char *dest;       /* relative to the session root */
    bool ro;
};

#endif
