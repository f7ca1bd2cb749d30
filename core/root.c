#include "root.h"
#include "util.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <linux/openat2.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

static const char *const root_subdirs[] = {"workspace", "tmp", "cache", "home"};

char *root_state_dir(const char *flag)
{
    if (flag && *flag)
        return xstrdup(flag);
    const char *env = getenv("STOCKADE_STATE_DIR");
    if (env && *env)
        return xstrdup(env);
    if (geteuid() == 0)
        return xstrdup("/var/lib/stockade");
    const char *run = getenv("XDG_RUNTIME_DIR");
    if (run && *run)
        return xasprintf("%s/stockade", run);
    return NULL;
}

bool root_id_valid(const char *id)
{
    size_t n = id ? strlen(id) : 0;
    if (n < 1 || n > 64)
        return false;
    for (size_t i = 0; i < n; i++) {
        char c = id[i];
        bool alnum = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9');
        if (!alnum && (i == 0 || (c != '_' && c != '.' && c != '-')))
            return false;
    }
    return true;
}

/* mkdir -p for the (trusted, operator-given) state dir, then open it without following
 * a final symlink. */
static int open_dir_creating(int at, const char *path, mode_t mode)
{
    if (mkdirat(at, path, mode) < 0 && errno != EEXIST)
        return -1;
    return openat(at, path, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
}

static int mkdir_parents(const char *path, mode_t mode)
{
    char *p = xstrdup(path);
    for (char *s = p + 1; *s; s++) {
        if (*s != '/')
            continue;
        *s = 0;
        if (mkdir(p, mode) < 0 && errno != EEXIST) {
            free(p);
            return -1;
        }
        *s = '/';
    }
    free(p);
    return 0;
}

char *root_create(const char *state_dir, const char *id, uid_t uid, gid_t gid, bool reuse)
{
    if (!root_id_valid(id)) {
        errno = EINVAL;
        return NULL;
    }
    bool may_chown = geteuid() == 0;
    int state = -1, sessions = -1, session = -1;
    char *root = NULL;

    if (mkdir_parents(state_dir, 0711) < 0)
        goto out;
    state = open_dir_creating(AT_FDCWD, state_dir, 0711);
    if (state < 0)
        goto out;
    sessions = open_dir_creating(state, "sessions", 0711);
    if (sessions < 0)
        goto out;
    if (mkdirat(sessions, id, 0700) < 0) {
        if (errno != EEXIST || !reuse)
            goto out;
    }
    session = openat(sessions, id, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (session < 0)
        goto out;
    /* fchown on the opened fds, and AT_SYMLINK_NOFOLLOW for the children: a reused root
     * belongs to the tool uid, which may have replaced a subdir by a symlink. */
    if (may_chown && fchown(session, uid, gid) < 0)
        goto out;
    if (fchmod(session, 0700) < 0)
        goto out;
    for (size_t i = 0; i < ARRAY_LEN(root_subdirs); i++) {
        const char *sub = root_subdirs[i];
        if (mkdirat(session, sub, 0700) < 0 && errno != EEXIST)
            goto out;
        int fd = root_open_beneath(session, sub, O_RDONLY | O_DIRECTORY, 0);
        if (fd < 0)
            goto out;
        int rc = (may_chown ? fchown(fd, uid, gid) : 0) | fchmod(fd, 0700);
        close(fd);
        if (rc < 0)
            goto out;
    }
    root = xasprintf("%s/sessions/%s", state_dir, id);
out:
    close_quietly(&session);
    close_quietly(&sessions);
    close_quietly(&state);
    return root;
}

/* The fallback of root_open_beneath for kernels without openat2 (before 5.6): one
 * component at a time, each opened O_NOFOLLOW relative to the one before, ".." refused.
 * Stack only: it may run in a child that shares its parent's memory. */
int root_open_walk(int dirfd, const char *rel, int flags, mode_t mode)
{
    char path[PATH_MAX];
    size_t n = strlen(rel);
    if (n >= sizeof path) {
        errno = ENAMETOOLONG;
        return -1;
    }
    if (rel[0] == '/') {
        errno = EXDEV;
        return -1;
    }
    memcpy(path, rel, n + 1);
    int cur = openat(dirfd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    char *p = path;
    while (cur >= 0) {
        while (*p == '/')
            p++;
        char *end = strchr(p, '/');
        char *rest = end;
        while (rest && *rest == '/')
            rest++;
        bool last = !end || !*rest;
        if (end)
            *end = 0;
        if (!strcmp(p, "..")) {
            close(cur);
            errno = EXDEV;
            return -1;
        }
        int next;
        if (!*p || !strcmp(p, "."))
            next = last ? openat(cur, ".", (flags & ~(O_CREAT | O_EXCL)) | O_CLOEXEC)
                        : dup(cur);
        else if (last)
            next = openat(cur, p, flags | O_NOFOLLOW | O_CLOEXEC, mode);
        else
            next = openat(cur, p, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        int e = errno;
        struct stat st;
        /* a symlink on the way says ELOOP, as openat2 does, not ENOTDIR */
        if (next < 0 && e == ENOTDIR && fstatat(cur, p, &st, AT_SYMLINK_NOFOLLOW) == 0 &&
            S_ISLNK(st.st_mode))
            e = ELOOP;
        close(cur);
        errno = e;
        if (last || next < 0)
            return next;
        cur = next;
        p = rest;
    }
    return -1;
}

int root_open_beneath(int dirfd, const char *rel, int flags, mode_t mode)
{
    struct open_how how = {
        .flags = (uint64_t)(unsigned)(flags | O_CLOEXEC),
        .mode = flags & O_CREAT ? mode : 0,
        .resolve = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS,
    };
    if (!*rel)
        rel = ".";
    /* EAGAIN: a rename raced the lookup (the kernel will not vouch for it); bounded */
    for (int attempt = 0; attempt < 16; attempt++) {
        long fd = syscall(SYS_openat2, dirfd, rel, &how, sizeof how);
        if (fd >= 0)
            return (int)fd;
        if (errno == ENOSYS)
            return root_open_walk(dirfd, rel, flags, mode);
        if (errno != EAGAIN)
            return -1;
    }
    return -1;
}

int root_mkdirs_beneath(int dirfd, const char *rel, mode_t mode)
{
    char path[PATH_MAX];
    size_t n = strlen(rel);
    if (n >= sizeof path || rel[0] == '/') {
        errno = n >= sizeof path ? ENAMETOOLONG : EXDEV;
        return -1;
    }
    memcpy(path, rel, n + 1);
    int cur = root_open_beneath(dirfd, ".", O_RDONLY | O_DIRECTORY, 0);
    for (char *p = path, *end; cur >= 0 && *p; p = end) {
        end = strchr(p, '/');
        if (end)
            *end++ = 0;
        else
            end = p + strlen(p);
        if (!*p || !strcmp(p, "."))
            continue;
        /* mkdirat never follows a final symlink (EEXIST), and the open below refuses it */
        if (strcmp(p, "..") && mkdirat(cur, p, mode) < 0 && errno != EEXIST) {
            close_quietly(&cur);
            break;
        }
        int next = root_open_beneath(cur, p, O_RDONLY | O_DIRECTORY, 0);
        int e = errno;
        close(cur);
        errno = e;
        cur = next;
    }
    return cur;
}

int root_usage_at(int topfd, int64_t max_bytes, int64_t max_inodes, struct root_usage *out)
{
    struct stat top;
    *out = (struct root_usage){0, 0};
    if (fstat(topfd, &top) < 0)
        return -1;
    out->bytes = (int64_t)top.st_blocks * 512;
    out->inodes = 1;
    /* one open directory per level; deeper than the stack counts as over the caps, so
     * that depth cannot hide anything */
    DIR *stack[ROOT_USAGE_MAX_DEPTH];
    int depth = 0, rc = 0;
    int fd = openat(topfd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    DIR *d = fd >= 0 ? fdopendir(fd) : NULL;
    if (!d) {
        if (fd >= 0)
            close(fd);
        return -1;
    }
    stack[depth++] = d;
    while (depth > 0) {
        DIR *cur = stack[depth - 1];
        struct dirent *de = readdir(cur);
        if (!de) {
            closedir(cur);
            depth--;
            continue;
        }
        if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, ".."))
            continue;
        struct stat st;
        if (fstatat(dirfd(cur), de->d_name, &st, AT_SYMLINK_NOFOLLOW) < 0 ||
            st.st_dev != top.st_dev)
            continue;       /* gone meanwhile, or a mount point: not the root's */
        out->inodes++;
        out->bytes += (int64_t)st.st_blocks * 512;
        if ((max_bytes > 0 && out->bytes > max_bytes) ||
            (max_inodes > 0 && out->inodes > max_inodes))
            break;
        if (!S_ISDIR(st.st_mode))
            continue;
        if (depth == ROOT_USAGE_MAX_DEPTH) {
            errno = E2BIG;
            rc = -1;
            break;
        }
        /* not into a mount point, even a bind of the same file system (a policy mount
         * under strict): what is mounted there is not the session's */
        struct open_how how = {.flags = O_RDONLY | O_DIRECTORY | O_CLOEXEC,
                               .resolve = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS |
                                          RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV};
        int c = (int)syscall(SYS_openat2, dirfd(cur), de->d_name, &how, sizeof how);
        if (c < 0 && errno == ENOSYS)
            c = openat(dirfd(cur), de->d_name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        DIR *cd = c >= 0 ? fdopendir(c) : NULL;
        if (!cd) {
            if (c >= 0)
                close(c);
            continue;
        }
        stack[depth++] = cd;
    }
    int e = errno;
    while (depth > 0)
        closedir(stack[--depth]);
    errno = e;
    return rc;
}

/* Names of subdirectories the passes keep for the walk to descend into: at most this
 * many bytes of them over the whole walk, the levels above included (more subdirectories
 * than that cost one more pass per batch, not one per subdirectory). A level whose
 * ancestors hold the budget still gets REMOVE_BATCH_MIN: a tree wide at every level
 * costs passes, not depth × the budget in memory. */
#define REMOVE_BATCH_BYTES (1u << 20)
#define REMOVE_BATCH_MIN (8u << 10)
/* Directories that could not be removed are remembered so that a pass skips them; past
 * this many the walk gives up (the removal is retried later) rather than keep searching a
 * list that a hostile tree could make long. */
#define REMOVE_MAX_FAILED 4096

/* One level of the walk: the name to remove in the parent, the parent's identity so that
 * climbing back with ".." is checked rather than trusted, and the subdirectories the last
 * pass over this directory found (NUL-separated names, consumed from batch_pos). */
struct remove_frame {
    char *name;
    dev_t parent_dev;
    ino_t parent_ino;
    char *batch;
    size_t batch_len, batch_pos;
    uint64_t passes;
};

struct dir_id {
    dev_t dev;
    ino_t ino;
};

struct remove_walk {
    dev_t root_dev;
    struct dir_id *failed;      /* directories that could not be removed: not retried */
    size_t nfailed, failcap;
    size_t batch_held;          /* bytes of names held by every frame's batch */
    int errors;
    struct root_remove_stats *stats;
};

static bool id_in(const struct dir_id *ids, size_t n, dev_t dev, ino_t ino)
{
    for (size_t i = 0; i < n; i++)
        if (ids[i].dev == dev && ids[i].ino == ino)
            return true;
    return false;
}

static void note_failed(struct remove_walk *w, dev_t dev, ino_t ino)
{
    w->errors++;
    w->failed = xgrow(w->failed, &w->failcap, w->nfailed, sizeof *w->failed, 8);
    w->failed[w->nfailed++] = (struct dir_id){dev, ino};
}

/* A tool may leave a directory of its own without read, write or search permission for
 * its owner (chmod 555, 000). A supervisor without CAP_DAC_OVERRIDE removes the tree as
 * that owner, so it gives the owner's permissions back first; only on a directory it
 * owns, and only through a descriptor that pins it (never by path: the name may have
 * been swapped for a symlink). A root supervisor's tools have other uids: nothing to do. */
static void grant_owner_rwx(int fd)
{
    struct stat st;
    if (fstat(fd, &st) == 0 && S_ISDIR(st.st_mode) && st.st_uid == geteuid() &&
        (st.st_mode & 0700) != 0700)
        fchmod(fd, (st.st_mode & 07777) | 0700);
}

/* Open directory `name` of `at` for the walk: never through a symlink. One its owner
 * cannot read is pinned with O_PATH, checked (a directory, ours, on `dev`), given its
 * owner's permissions back through /proc/self/fd (fchmod refuses an O_PATH descriptor),
 * and opened again. -1 with errno otherwise. */
static int open_dir_to_remove(int at, const char *name, dev_t dev)
{
    const int flags = O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC;
    int fd = openat(at, name, flags);
    if (fd >= 0 || errno != EACCES || geteuid() == 0)
        return fd;
    int pin = openat(at, name, O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    struct stat st;
    if (pin < 0)
        return -1;
    if (fstat(pin, &st) == 0 && st.st_dev == dev && st.st_uid == geteuid()) {
        char link[64];
        snprintf(link, sizeof link, "/proc/self/fd/%d", pin);
        if (chmod(link, (st.st_mode & 07777) | 0700) == 0)
            fd = openat(pin, ".", flags);
    }
    int saved = errno;
    close(pin);
    errno = fd >= 0 ? 0 : saved ? saved : EACCES;
    return fd;
}

static void frame_drop_batch(struct remove_frame *f, struct remove_walk *w)
{
    w->batch_held -= f->batch_len;
    free(f->batch);
    f->batch = NULL;
    f->batch_len = f->batch_pos = 0;
}

/* One pass over `fd` (frame f): unlink every non-directory, remove empty directories in
 * place, and keep the names of the others (up to REMOVE_BATCH_BYTES) in f->batch. The
 * pass reads the directory from its start: what earlier passes removed is gone, so it
 * sees only what is left. */
static void remove_pass(int fd, struct remove_frame *f, struct remove_walk *w)
{
    frame_drop_batch(f, w);
    size_t cap = 0;
    size_t room = w->batch_held + REMOVE_BATCH_MIN < REMOVE_BATCH_BYTES
                      ? REMOVE_BATCH_BYTES - w->batch_held : REMOVE_BATCH_MIN;
    w->stats->passes++;
    grant_owner_rwx(fd);
    if (++f->passes > w->stats->max_dir_passes)
        w->stats->max_dir_passes = f->passes;
    /* its own open file description: the walk's fd keeps no offset of ours */
    int dfd = openat(fd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    DIR *d = dfd >= 0 ? fdopendir(dfd) : NULL;
    if (!d) {
        if (dfd >= 0)
            close(dfd);
        w->errors++;
        return;
    }
    struct dirent *de;
    while ((de = readdir(d))) {
        if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, ".."))
            continue;
        w->stats->entries_read++;
        struct stat st;
        if (fstatat(fd, de->d_name, &st, AT_SYMLINK_NOFOLLOW) < 0) {
            if (errno != ENOENT)
                w->errors++;
            continue;
        }
        if (!S_ISDIR(st.st_mode)) {
            if (unlinkat(fd, de->d_name, 0) < 0 && errno != ENOENT)
                w->errors++;
            continue;
        }
        if (st.st_dev != w->root_dev) {
            /* A mount point: never walk into another file system. */
            if (unlinkat(fd, de->d_name, AT_REMOVEDIR) < 0 && errno != ENOENT)
                note_failed(w, st.st_dev, st.st_ino);
            continue;
        }
        if (id_in(w->failed, w->nfailed, st.st_dev, st.st_ino))
            continue;
        /* An empty directory goes now, without a descent. */
        if (unlinkat(fd, de->d_name, AT_REMOVEDIR) == 0 || errno == ENOENT)
            continue;
        size_t n = strlen(de->d_name) + 1;
        if (f->batch_len + n > room)
            break;              /* the next pass takes the rest */
        if (f->batch_len + n > cap) {
            cap = cap ? cap * 2 : 4096;
            while (cap < f->batch_len + n)
                cap *= 2;
            f->batch = xrealloc(f->batch, cap);
        }
        memcpy(f->batch + f->batch_len, de->d_name, n);
        f->batch_len += n;
        w->batch_held += n;
        if (w->batch_held > w->stats->max_batch_held)
            w->stats->max_batch_held = w->batch_held;
    }
    closedir(d);
}

/* Open subdirectory `sub` of `cur` to walk into: never through a symlink (O_NOFOLLOW on
 * one component), never onto another file system. -1 when it is not to be walked (then
 * it has been dealt with: removed as what it turned into, or noted as failed). */
static int remove_descend(int cur, const char *sub, struct remove_walk *w)
{
    int child = open_dir_to_remove(cur, sub, w->root_dev);
    struct stat st;
    if (child >= 0 && fstat(child, &st) == 0 && st.st_dev == w->root_dev)
        return child;
    if (child >= 0) {
        /* mounted on since the pass saw it: leave it */
        if (unlinkat(cur, sub, AT_REMOVEDIR) < 0 && errno != ENOENT &&
            fstatat(cur, sub, &st, AT_SYMLINK_NOFOLLOW) == 0)
            note_failed(w, st.st_dev, st.st_ino);
        close(child);
        return -1;
    }
    if (errno == ENOENT)
        return -1;
    /* Raced into a non-directory, or unreadable: try it as a file. */
    if (unlinkat(cur, sub, 0) < 0 && errno != ENOENT) {
        if (fstatat(cur, sub, &st, AT_SYMLINK_NOFOLLOW) == 0)
            note_failed(w, st.st_dev, st.st_ino);
        else
            w->errors++;
    }
    return -1;
}

int root_remove_tree_at(int dirfd, const char *name)
{
    struct root_remove_stats stats;
    return root_remove_tree_counted(dirfd, name, &stats);
}

/* Iterative and linear: one open directory at a time (a hostile tool can nest directories
 * far deeper than we have descriptors or stack), and each directory read in a bounded
 * number of passes: a pass keeps the names of the subdirectories it found, the walk
 * descends into each in turn, and only when they are all done is the directory read
 * again (to find what the batch could not hold, and what failed). Rescanning after each
 * subdirectory instead costs the directory's whole size each time, n^2 for n
 * subdirectories (10,000 directories of one file took 4.8 s on ext4; 0.9 s now). */
int root_remove_tree_counted(int dirfd, const char *name, struct root_remove_stats *stats)
{
    *stats = (struct root_remove_stats){0};
    struct stat top;
    if (fstatat(dirfd, name, &top, AT_SYMLINK_NOFOLLOW) < 0)
        return errno == ENOENT ? 0 : -1;
    if (!S_ISDIR(top.st_mode))
        return unlinkat(dirfd, name, 0) < 0 && errno != ENOENT ? -1 : 0;

    struct stat base;
    if (fstat(dirfd, &base) < 0)
        return -1;
    int cur = open_dir_to_remove(dirfd, name, top.st_dev);
    if (cur < 0)
        return -1;

    struct remove_walk w = {.root_dev = top.st_dev, .stats = stats};
    struct remove_frame *stack = NULL;
    size_t depth = 0, cap = 0;
    stack = xgrow(stack, &cap, depth, sizeof *stack, 16);
    stack[depth++] = (struct remove_frame){.name = xstrdup(name), .parent_dev = base.st_dev,
                                           .parent_ino = base.st_ino};

    while (depth > 0 && w.nfailed <= REMOVE_MAX_FAILED) {
        struct remove_frame *f = &stack[depth - 1];
        if (f->batch_pos >= f->batch_len)
            remove_pass(cur, f, &w);
        if (f->batch_pos < f->batch_len) {
            char *sub = xstrdup(f->batch + f->batch_pos);
            f->batch_pos += strlen(sub) + 1;
            if (f->batch_pos >= f->batch_len) {
                /* the last of the batch: its room is not held during the descent */
                frame_drop_batch(f, &w);
            }
            struct stat here;
            int child = fstat(cur, &here) == 0 ? remove_descend(cur, sub, &w) : -1;
            if (child < 0) {
                free(sub);
                continue;
            }
            stack = xgrow(stack, &cap, depth, sizeof *stack, 16);
            stack[depth++] = (struct remove_frame){.name = sub, .parent_dev = here.st_dev,
                                                   .parent_ino = here.st_ino};
            close(cur);
            cur = child;
            continue;
        }
        /* `cur` holds nothing more we can remove: climb and remove it. */
        struct remove_frame done = stack[--depth];
        frame_drop_batch(&done, &w);
        struct stat self;
        fstat(cur, &self);
        int parent;
        if (depth == 0) {
            parent = dup(dirfd);
        } else {
            parent = openat(cur, "..", O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
            struct stat pst;
            if (parent >= 0 && (fstat(parent, &pst) < 0 || pst.st_dev != done.parent_dev ||
                                pst.st_ino != done.parent_ino)) {
                close(parent);
                parent = -1;
                errno = EXDEV;
            }
        }
        close(cur);
        cur = -1;
        if (parent < 0) {
            w.errors++;
            free(done.name);
            break;
        }
        if (unlinkat(parent, done.name, AT_REMOVEDIR) < 0 && errno != ENOENT)
            note_failed(&w, self.st_dev, self.st_ino);
        free(done.name);
        cur = parent;
    }
    close_quietly(&cur);
    while (depth > 0) {
        free(stack[--depth].name);
        free(stack[depth].batch);
    }
    free(stack);
    free(w.failed);
    if (w.errors) {
        errno = ENOTEMPTY;
        return -1;
    }
    return 0;
}

int root_remove(const char *state_dir, const char *id)
{
    if (!root_id_valid(id)) {
        errno = EINVAL;
        return -1;
    }
    char *sessions_path = xasprintf("%s/sessions", state_dir);
    int sessions = open(sessions_path, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    free(sessions_path);
    if (sessions < 0)
        return errno == ENOENT ? 0 : -1;
    int rc = root_remove_tree_at(sessions, id);
    int saved = errno;
    close(sessions);
    errno = saved;
    return rc;
}
