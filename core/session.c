#include "session.h"
#include "policy.h"
#include "record.h"
#include "remover.h"
#include "root.h"
#include "sandbox.h"
#include "zygote.h"
#include "util.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

int uid_range_parse(const char *s, struct uid_range *out)
{
    unsigned long a, b;
    char tail;
    if (sscanf(s, "%lu-%lu%c", &a, &b, &tail) != 2 || a == 0 || b < a || b > 0xfffffffeUL)
        return -1;
    out->first = (uid_t)a;
    out->count = (unsigned)(b - a + 1);
    return 0;
}

/* A random id, or NULL with errno: an id another session could guess or repeat is no
 * id, so there is no weaker fallback. */
static char *uuid_v4(void)
{
    unsigned char r[16];
    ssize_t n;
    do
        n = getrandom(r, sizeof r, 0);
    while (n < 0 && errno == EINTR);
    if (n != (ssize_t)sizeof r) {
        if (n >= 0)
            errno = EIO;
        return NULL;
    }
    r[6] = (r[6] & 0x0f) | 0x40;
    r[8] = (r[8] & 0x3f) | 0x80;
    return xasprintf("%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x",
                     r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7], r[8], r[9], r[10], r[11],
                     r[12], r[13], r[14], r[15]);
}

/* Take the first free uid of the range: a flock on UID_LOCK_DIR/UID, released when the
 * fd closes (so a crashed supervisor frees its uids by dying). Start at a random offset
 * so that concurrent supervisors rarely contend. */
/* One lock directory for the whole host, whatever the state dir: two supervisors with
 * different state dirs must not hand out the same uid either. */
#define UID_LOCK_DIR "/run/stockade/uids"

/* The uids that own a root in STATE_DIR/sessions other than `id`'s: a kept root keeps its
 * uid for as long as it exists, whether or not a session holds its lock (a later session
 * drawing that uid would own the kept files). malloc'd; *n entries. */
static uid_t *kept_root_uids(const char *state_dir, const char *id, size_t *n)
{
    *n = 0;
    char *path = xasprintf("%s/sessions", state_dir);
    DIR *d = opendir(path);
    free(path);
    uid_t *uids = NULL;
    size_t cap = 0;
    struct dirent *de;
    while (d && (de = readdir(d))) {
        struct stat st;
        if (de->d_name[0] == '.' || !strcmp(de->d_name, id) ||
            fstatat(dirfd(d), de->d_name, &st, AT_SYMLINK_NOFOLLOW) < 0 || !S_ISDIR(st.st_mode))
            continue;
        if (*n == cap) {
            cap = cap ? 2 * cap : 16;
            uids = xrealloc(uids, cap * sizeof *uids);
        }
        uids[(*n)++] = st.st_uid;
    }
    if (d)
        closedir(d);
    return uids;
}

/* A kept root elsewhere (another supervisor's state dir) is recorded next to its uid's
 * lock: UID_LOCK_DIR/UID.kept holds the root's path, and the uid stays reserved while that
 * root exists and is still the uid's (`self`: the root this session reopens). */
static bool kept_elsewhere(uid_t u, const char *self)
{
    char *marker = xasprintf("%s/%u.kept", UID_LOCK_DIR, (unsigned)u);
    int fd = open(marker, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    free(marker);
    if (fd < 0)
        return false;
    char path[4096];
    ssize_t n = read(fd, path, sizeof path - 1);
    close(fd);
    if (n <= 0)
        return false;
    path[n] = 0;
    struct stat st;
    return strcmp(path, self) != 0 && lstat(path, &st) == 0 && S_ISDIR(st.st_mode) &&
           st.st_uid == u;
}

static void kept_record(uid_t u, const char *root)
{
    char *marker = xasprintf("%s/%u.kept", UID_LOCK_DIR, (unsigned)u);
    int fd = open(marker, O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0 || write(fd, root, strlen(root)) != (ssize_t)strlen(root))
        LOG_W("uid %u: could not record its kept root %s: %s", (unsigned)u, root,
              strerror(errno));
    if (fd >= 0)
        close(fd);
    free(marker);
}

static int uid_lock_dir_make(void)
{
    if ((mkdir("/run/stockade", 0700) < 0 && errno != EEXIST) ||
        (mkdir(UID_LOCK_DIR, 0700) < 0 && errno != EEXIST))
        return -1;
    return 0;
}

/* Exactly uid u: its lock fd, or -1 (errno EBUSY when another session holds it). */
static int uid_take_exact(uid_t u)
{
    if (uid_lock_dir_make() < 0)
        return -1;
    char *path = xasprintf("%s/%u", UID_LOCK_DIR, (unsigned)u);
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
    free(path);
    if (fd >= 0 && flock(fd, LOCK_EX | LOCK_NB) < 0) {
        int saved = errno;
        close_quietly(&fd);
        errno = saved == EWOULDBLOCK ? EBUSY : saved;
    }
    return fd;
}

static int uid_take(struct uid_range range, uid_t prefer, const uid_t *kept, size_t nkept,
                    const char *self, uid_t *uid)
{
    char *dir = xstrdup(UID_LOCK_DIR);
    if (uid_lock_dir_make() < 0) {
        free(dir);
        return -1;
    }
    unsigned start = 0;
    if (getrandom(&start, sizeof start, 0) != sizeof start)
        start = (unsigned)getpid();
    /* A kept root is owned by the uid it had: take that one first, so its files stay
     * writable for the tool. */
    if (prefer >= range.first && prefer - range.first < range.count)
        start = prefer - range.first;
    int fd = -1;
    errno = 0;
    for (unsigned i = 0; i < range.count; i++) {
        uid_t u = range.first + (start + i) % range.count;
        bool reserved = false;
        for (size_t k = 0; k < nkept && !reserved; k++)
            reserved = kept[k] == u;
        if (reserved || kept_elsewhere(u, self))
            continue;
        char *path = xasprintf("%s/%u", dir, (unsigned)u);
        fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
        free(path);
        if (fd < 0)
            break;
        if (flock(fd, LOCK_EX | LOCK_NB) == 0) {
            *uid = u;
            break;
        }
        close_quietly(&fd);
    }
    free(dir);
    if (fd < 0 && (errno == 0 || errno == EWOULDBLOCK))
        errno = EAGAIN;
    return fd;
}

struct session *session_open(const char *state_dir, const char *id, bool reuse,
                             struct uid_range range, char **err)
{
    return session_open_recorded(state_dir, id, reuse, range, NULL, err);
}

/* What the tool's cwd must be, call after call (spawn.h): the workspace as the session
 * created (or reopened) it. False and *err when it cannot be opened beneath the root. */
static bool session_workspace_pin(struct session *s, char **err)
{
    int rootfd = open(s->root, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    int ws = rootfd >= 0 ? root_open_beneath(rootfd, "workspace", O_RDONLY | O_DIRECTORY, 0) : -1;
    struct stat st;
    bool pinned = ws >= 0 && fstat(ws, &st) == 0;
    if (pinned) {
        s->workspace_dev = st.st_dev;
        s->workspace_ino = st.st_ino;
    }
    int e = errno;
    close_quietly(&ws);
    close_quietly(&rootfd);
    if (!pinned) {
        *err = xasprintf("session root for %s: workspace: %s", s->id, strerror(e));
        errno = e;
    }
    return pinned;
}

/* Write the new session's record before its root exists: false and *err otherwise. */
static bool session_record_create(struct session *s, bool reuse,
                                  const struct session_record *rec, char **err)
{
    struct session_record *r = xcalloc(1, sizeof *r);
    *r = *rec;
    r->labels = strv_dup(rec->labels);
    snprintf(r->id, sizeof r->id, "%s", s->id);
    r->uid = s->uid;
    r->service_uid = s->drop_user;
    r->state = RECORD_OPEN;
    if (reuse) {
        struct session_record old;
        if (record_read(s->state_dir, s->id, &old) == 0) {
            bool theirs = old.owner != rec->owner;
            record_clear(&old);
            if (theirs) {
                *err = xasprintf("session %s belongs to a server", s->id);
                record_clear(r);
                free(r);
                errno = EBUSY;
                return false;
            }
        }
    }
    if (record_write(s->state_dir, r, !reuse) < 0) {
        int saved = errno;
        *err = saved == EEXIST ? xasprintf("session %s already exists", s->id)
                               : xasprintf("session record for %s in %s: %s", s->id,
                                           s->state_dir, strerror(saved));
        record_clear(r);
        free(r);
        errno = saved;
        return false;
    }
    s->record = r;
    return true;
}

struct session *session_open_recorded(const char *state_dir, const char *id, bool reuse,
                                      struct uid_range range, const struct session_record *rec,
                                      char **err)
{
    bool record_ours = false;
    struct session *s = xcalloc(1, sizeof *s);
    s->uid_lock_fd = -1;
    s->landlock_fd = -1;
    s->id = id ? xstrdup(id) : uuid_v4();
    s->state_dir = xstrdup(state_dir);
    if (!s->id) {
        *err = xasprintf("no session id: getrandom: %s", strerror(errno));
        goto fail;
    }
    if (!root_id_valid(s->id)) {
        *err = xasprintf("bad session id (expected [A-Za-z0-9][A-Za-z0-9_.-]{0,63})");
        goto fail;
    }
    if (mkdir(state_dir, 0711) < 0 && errno != EEXIST) {
        *err = xasprintf("state dir %s: %s", state_dir, strerror(errno));
        goto fail;
    }
    s->drop_user = geteuid() == 0;
    if (s->drop_user) {
        errno = 0;
        struct stat st;
        char *existing = xasprintf("%s/sessions/%s", state_dir, s->id);
        uid_t prefer = reuse && lstat(existing, &st) == 0 ? st.st_uid : 0;
        size_t nkept;
        uid_t *kept = kept_root_uids(state_dir, s->id, &nkept);
        s->uid_lock_fd = uid_take(range, prefer, kept, nkept, existing, &s->uid);
        free(kept);
        free(existing);
        if (s->uid_lock_fd < 0) {
            /* out of descriptors is not out of uids: say which, the caller maps errno */
            if (errno == EMFILE || errno == ENFILE || errno == ENOMEM)
                *err = xasprintf("cannot take a service uid now: %s", strerror(errno));
            else
                *err = xasprintf("no free service uid in %u-%u: %s", (unsigned)range.first,
                                 (unsigned)(range.first + range.count - 1), strerror(errno));
            goto fail;
        }
        s->gid = (gid_t)s->uid;
    } else {
        s->uid = getuid();
        s->gid = getgid();
    }
    if (rec) {
        if (!session_record_create(s, reuse, rec, err))
            goto fail;
        record_ours = !reuse;
    }
    s->root = root_create(state_dir, s->id, s->uid, s->gid, reuse);
    if (!s->root) {
        *err = errno == EEXIST ? xasprintf("session %s already exists", s->id)
                               : xasprintf("session root for %s in %s: %s", s->id, state_dir,
                                           strerror(errno));
        goto fail;
    }
    if (!session_workspace_pin(s, err))
        goto fail;
    return s;
fail:;
    int saved = errno;
    /* a record this call wrote goes; an existing root (someone else's) stays */
    if (record_ours &&
        (rec->unsynced ? record_remove_unsynced : record_remove)(state_dir, s->id) < 0)
        LOG_W("session %s: its record stays: %s", s->id, strerror(errno));
    if (s->record) {
        record_clear(s->record);
        free(s->record);
        s->record = NULL;
    }
    s->keep_root = true;
    session_close(s);
    errno = saved;
    return NULL;
}

struct session *session_adopt(const char *state_dir, const struct session_record *rec,
                              char **err)
{
    struct session *s = xcalloc(1, sizeof *s);
    s->uid_lock_fd = -1;
    s->landlock_fd = -1;
    s->id = xstrdup(rec->id);
    s->state_dir = xstrdup(state_dir);
    s->keep_root = true;        /* until adopted: a failure here removes nothing */
    s->drop_user = rec->service_uid && geteuid() == 0;
    if (s->drop_user) {
        s->uid_lock_fd = uid_take_exact(rec->uid);
        if (s->uid_lock_fd < 0) {
            *err = xasprintf("session %s: its uid %u: %s", rec->id, (unsigned)rec->uid,
                             errno == EBUSY ? "held by another session" : strerror(errno));
            goto fail;
        }
        s->uid = rec->uid;
        s->gid = (gid_t)rec->uid;
    } else {
        s->uid = getuid();
        s->gid = getgid();
    }
    char *path = xasprintf("%s/sessions/%s", state_dir, rec->id);
    struct stat st;
    if (lstat(path, &st) < 0 || !S_ISDIR(st.st_mode)) {
        *err = xasprintf("session %s: no root at %s", rec->id, path);
        free(path);
        errno = ENOENT;
        goto fail;
    }
    free(path);
    /* reuse: the dirs are checked (recreated if a tool removed one), never followed */
    s->root = root_create(state_dir, s->id, s->uid, s->gid, true);
    if (!s->root) {
        *err = xasprintf("session %s: its root: %s", rec->id, strerror(errno));
        goto fail;
    }
    if (!session_workspace_pin(s, err))
        goto fail;
    s->record = xcalloc(1, sizeof *s->record);
    *s->record = *rec;
    s->record->labels = strv_dup(rec->labels);
    s->keep_root = false;
    return s;
fail:;
    int saved = errno;
    session_close(s);
    errno = saved;
    return NULL;
}

int session_uid_lock(uid_t u) { return uid_take_exact(u); }

int session_record_save(struct session *s)
{
    if (!s->record)
        return 0;
    return record_write(s->state_dir, s->record, false);
}

bool session_isolate(struct session *s, const struct policy *p, struct zygote *spawner,
                     char **err)
{
    struct zygote *starting;
    if (!session_isolate_begin(s, p, spawner, NULL, &starting, err))
        return false;
    if (starting) {
        struct pollfd pf = {zygote_start_fd(starting), POLLIN, 0};
        while (poll(&pf, 1, -1) < 0 && errno == EINTR)
            ;
        if (zygote_start_finish(starting, err) < 0)
            return false;
        s->zygote = starting;
    }
    return true;
}

bool session_isolate_async(struct session *s, const struct policy *p, struct zygote *spawner,
                           char **err)
{
    struct zygote *starting;
    if (!session_isolate_begin(s, p, spawner, NULL, &starting, err))
        return false;
    if (starting)
        s->zygote = starting;
    return true;
}

bool session_isolate_begin(struct session *s, const struct policy *p, struct zygote *spawner,
                           struct zygote **prepared, struct zygote **starting, char **err)
{
    *starting = NULL;
    s->net_closed = strcmp(p->network, "loopback") != 0;
    if (strcmp(p->isolation, "strict") == 0) {
        /* a world made ahead for this policy: only the session's part is left to attach */
        struct zygote *ahead = prepared ? *prepared : NULL;
        if (ahead) {
            *prepared = NULL;
            char *why = NULL;
            if (zygote_bind(ahead, s->root, p->mounts, p->nmounts, &why) == 0) {
                *starting = ahead;
                return true;
            }
            LOG_W("session %s: the world made ahead is not used: %s", s->id, why);
            free(why);
            zygote_stop(ahead);
        }
        struct zygote_config zc = {
            .state_dir = s->state_dir, .session_root = s->root, .mounts = p->mounts,
            .nmounts = p->nmounts, .loopback_up = !s->net_closed,
        };
        *starting = zygote_start_begin(&zc, err);
        return *starting != NULL;
    }
    /* Built once, here: each tool only restricts itself to it. (In a zygote's world the
     * tool builds its own: the paths there are the world's.) */
    if (sandbox_caps()->landlock_abi > 0) {
        /* one uid for every session without root: the walls keep their files apart */
        struct sandbox_fs fs = {s->root, NULL, s->drop_user ? NULL : s->state_dir};
        s->landlock_fd = sandbox_landlock_ruleset(&fs, s->net_closed);
        /* not a tool's own ruleset instead: that one would not keep sessions apart */
        if (s->landlock_fd < 0) {
            *err = xasprintf("session %s: its Landlock ruleset: %s", s->id, strerror(errno));
            return false;
        }
    }
    s->spawner = spawner;
    return true;
}

struct zygote *session_zygote_take(struct session *s)
{
    struct zygote *z = s->zygote;
    s->zygote = NULL;
    return z;
}

static void session_isolation_end(struct session *s)
{
    zygote_runners_free(s->runners);
    s->runners = NULL;
    zygote_stop(s->zygote);
    s->zygote = NULL;
    s->spawner = NULL;
    close_quietly(&s->landlock_fd);
}

int session_close(struct session *s)
{
    int rc = 0;
    if (!s)
        return 0;
    /* its processes first: nothing may still be writing while the root goes */
    session_isolation_end(s);
    /* while it holds the uid's lock: no other session can have drawn the uid */
    if (s->root && s->keep_root && s->drop_user && s->uid_lock_fd >= 0)
        kept_record(s->uid, s->root);
    bool removing = s->root && !s->keep_root;
    if (removing && s->record && s->record->owner == RECORD_SERVE) {
        /* a crash from here on leaves a record that says "remove me" (another owner's is
         * over when its process is: record_expired) */
        s->record->state = RECORD_CLOSING;
        if (session_record_save(s) < 0)
            LOG_W("session %s: record: %s", s->id, strerror(errno));
    }
    if (removing && root_remove(s->state_dir, s->id) < 0) {
        LOG_E("session %s: could not remove all of %s: %s", s->id, s->root, strerror(errno));
        rc = -1;
    }
    /* the record goes only with the root: a root is never left without one */
    if (removing && rc == 0 && s->record &&
        (s->record->unsynced ? record_remove_unsynced : record_remove)(s->state_dir, s->id) < 0)
        LOG_W("session %s: record: %s", s->id, strerror(errno));
    if (s->record) {
        record_clear(s->record);
        free(s->record);
    }
    close_quietly(&s->uid_lock_fd);
    free(s->id);
    free(s->root);
    free(s->state_dir);
    free(s);
    return rc;
}

void session_close_async(struct session *s, struct remover *r,
                         void (*done)(void *ud, bool removed), void *ud)
{
    /* its processes first: nothing may still be writing while the root goes */
    session_isolation_end(s);
    /* while it holds the uid's lock: no other session can have drawn the uid */
    if (s->root && s->keep_root && s->drop_user && s->uid_lock_fd >= 0)
        kept_record(s->uid, s->root);
    bool removing = s->root && !s->keep_root;
    /* the job marks the record closing, removes the root, then the record: until it
     * starts, a crash leaves the session as it was (adopted at the next start) */
    remover_submit(r, s->state_dir, removing ? s->id : NULL, removing ? s->record : NULL,
                   s->uid_lock_fd, done, ud);
    s->uid_lock_fd = -1;                /* the job's now */
    if (s->record && !removing) {
        record_clear(s->record);
        free(s->record);
    }
    free(s->id);
    free(s->root);
    free(s->state_dir);
    free(s);
}
