#ifndef STOCKADE_SESSION_H
#define STOCKADE_SESSION_H
/* A session: its id, its disposable root and the service uid its tools run as. When the
 * supervisor is root, each session holds one uid of the configured range exclusively
 * (a lock file under /run/stockade/uids, held for the session's life, so concurrent
 * supervisors never share one, whatever their state dirs): RLIMIT_NPROC then caps the session's processes, and one
 * session's tools cannot signal another's. */
#include <stdbool.h>
#include <sys/types.h>

struct policy;
struct zygote;

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
    /* Its isolation (session_isolate), released by session_close: */
    struct zygote *zygote;      /* strict: the session's namespaces and mount tree */
    struct zygote *spawner;     /* process: the server's (borrowed), or NULL */
    int landlock_fd;            /* process: the ruleset its tools restrict themselves to;
                                 * -1 when it could not be built (each tool then tries) */
    bool net_closed;            /* the policy's network is "none" */
    dev_t workspace_dev;        /* the workspace as the session created (or reopened) it: */
    ino_t workspace_ino;        /*   a tool's cwd must still be that directory */
};

int uid_range_parse(const char *s, struct uid_range *out);

/* Create (or, with reuse, reopen) the session and its root. NULL and *err on failure.
 * id NULL: a random UUID v4. */
struct session *session_open(const char *state_dir, const char *id, bool reuse,
                             struct uid_range range, char **err);
/* Give the session what its policy's isolation needs: strict, its zygote (namespaces and
 * mount tree built); process, its Landlock ruleset, and `spawner` (the server's, borrowed;
 * NULL: each call forks its shim). False and *err when the zygote could not be built. */
bool session_isolate(struct session *s, const struct policy *p, struct zygote *spawner,
                     char **err);
/* End its isolation (the zygote first: its processes), remove the root (unless
 * keep_root) and release the uid; frees the session. Returns -1
 * when part of the root could not be removed (logged). */
int session_close(struct session *s);

#endif
