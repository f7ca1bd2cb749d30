#ifndef STOCKADE_SESSION_H
#define STOCKADE_SESSION_H
/* A session: its id, its disposable root and the service uid its tools run as. When the
 * supervisor is root, each session holds one uid of the configured range exclusively
 * (a lock file under /run/stockade/uids, held for the session's life, so concurrent
 * supervisors never share one, whatever their state dirs): RLIMIT_NPROC then caps the session's processes, and one
 * session's tools cannot signal another's. */
#include <stdbool.h>
#include <sys/types.h>

struct uid_range {
    uid_t first;
    unsigned count;
};
#define UID_RANGE_DEFAULT ((struct uid_range){210000, 10000})

struct session {
    char *id;
    char *root;                 /* STATE_DIR/sessions/ID: the AGENT_ROOT */
    char *state_dir;
    bool drop_user;             /* tools run as uid:gid below, not as the supervisor */
    uid_t uid;
    gid_t gid;
    int uid_lock_fd;            /* holds the uid while the session lives */
    bool keep_root;             /* `stockade run --session ID`: left for the next run */
    struct zygote *zygote;      /* strict isolation: the session's namespaces */
    struct zygote *spawner;     /* process isolation: the server's (borrowed), or NULL */
    int landlock_fd;            /* process isolation: the ruleset its tools get, built at
                                 * its first call; -1 until then */
    bool net_closed;            /* the policy's network is "none" */
};

int uid_range_parse(const char *s, struct uid_range *out);

/* Create (or, with reuse, reopen) the session and its root. NULL and *err on failure.
 * id NULL: a random UUID v4. */
struct session *session_open(const char *state_dir, const char *id, bool reuse,
                             struct uid_range range, char **err);
/* Remove the root (unless keep_root) and release the uid; frees the session. Returns -1
 * when part of the root could not be removed (logged). */
int session_close(struct session *s);

#endif
