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
struct runner_pool;
struct zygote;
struct session_record;

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
    struct runner_pool *runners; /* its calls' runners, made on first use (zygote.h) */
    int landlock_fd;            /* process: the ruleset its tools restrict themselves to;
                                 * -1 when it could not be built (each tool then tries) */
    bool net_closed;            /* the policy's network is "none" */
    dev_t workspace_dev;        /* the workspace as the session created (or reopened) it: */
    ino_t workspace_ino;        /*   a tool's cwd must still be that directory */
    /* Its durable record (core/record.h), or NULL when it has none: */
    struct session_record *record;
};

int uid_range_parse(const char *s, struct uid_range *out);

/* Create (or, with reuse, reopen) the session and its root. NULL and *err on failure.
 * id NULL: a random UUID v4. */
struct session *session_open(const char *state_dir, const char *id, bool reuse,
                             struct uid_range range, char **err);
/* The same, with a durable record (core/record.h): `rec` gives its owner, policy, lease
 * and labels; the id and uid are filled in here. The record is written before the root
 * is created (a record that exists already: EEXIST), and kept up to date by
 * session_record_save; session_close removes it once the root is gone. With reuse (a kept
 * root), a record of another owner is refused (EBUSY). */
struct session *session_open_recorded(const char *state_dir, const char *id, bool reuse,
                                      struct uid_range range, const struct session_record *rec,
                                      char **err);
/* Take back a session a previous server left (restart, crash, upgrade): its uid (the same
 * one: its files are owned by it) and its root, which must exist. Its isolation is not
 * built: session_isolate does that, on its first call. NULL and *err (errno EBUSY: the
 * uid is held by another session; ENOENT: no root). */
struct session *session_adopt(const char *state_dir, const struct session_record *rec,
                              char **err);
/* Hold exactly service uid u (its lock under /run/stockade/uids): the fd, or -1 (errno
 * EBUSY: another session holds it). For removing a root its owner left behind. */
int session_uid_lock(uid_t u);
/* Rewrite the record from s->record (after a renew, a new deadline). 0, or -1 (errno). */
int session_record_save(struct session *s);
/* Give the session what its policy's isolation needs: strict, its zygote (namespaces and
 * mount tree built); process, its Landlock ruleset, and `spawner` (the server's, borrowed;
 * NULL: each call forks its shim). False and *err when the zygote could not be built. */
bool session_isolate(struct session *s, const struct policy *p, struct zygote *spawner,
                     char **err);
/* Take its zygote away (a dead one, which the caller keeps until no call refers to it),
 * so that session_isolate builds it again. Returns it. */
struct zygote *session_zygote_take(struct session *s);
/* The same without waiting for a strict session's zygote: it is only started, in
 * *starting (the caller finishes it with zygote_start_finish once zygote_start_fd is
 * readable, and puts it in s->zygote); *starting NULL: the session is ready now.
 * *prepared (if given and not NULL): a world made ahead for this policy (zygote.h,
 * zygote_bind), taken (set to NULL) and used, or stopped if it cannot be. */
bool session_isolate_begin(struct session *s, const struct policy *p, struct zygote *spawner,
                           struct zygote **prepared, struct zygote **starting, char **err);
/* The same, with a strict session's zygote put in s->zygote while it starts: its calls
 * wait for it (zygote.h, EINPROGRESS) and the caller does not. */
bool session_isolate_async(struct session *s, const struct policy *p, struct zygote *spawner,
                           char **err);
/* End its isolation (the zygote first: its processes), remove the root (unless
 * keep_root) and release the uid; frees the session. Returns -1
 * when part of the root could not be removed (logged). */
int session_close(struct session *s);
/* The same, with the root removed off the loop by `r` (core/remover.h): the session's
 * processes end now, its uid stays reserved until its root is gone, and done(ud,
 * removed) runs on the loop after the first attempt. Frees s now. */
struct remover;
void session_close_async(struct session *s, struct remover *r,
                         void (*done)(void *ud, bool removed), void *ud);

#endif
