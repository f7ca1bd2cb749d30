#include "record.h"
#include "root.h"
#include "util.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#define RECORD_MAGIC "stockade-session-record 1"
#define RECORD_MAX 65536        /* labels included: a record is small */

static const char *const owner_names[] = {
    [RECORD_SERVE] = "serve", [RECORD_RUN] = "run", [RECORD_STDIO] = "stdio",
};

const char *record_owner_name(enum record_owner o) { return owner_names[o]; }
static const char *const state_names[] = {[RECORD_OPEN] = "open", [RECORD_CLOSING] = "closing"};

/* STATE_DIR/records, created 0700 when missing; an fd on it (never through a symlink). */
static int records_dir_open(const char *state_dir, bool create)
{
    int state = open(state_dir, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (state < 0)
        return -1;
    if (create && mkdirat(state, "records", 0700) < 0 && errno != EEXIST) {
        int saved = errno;
        close(state);
        errno = saved;
        return -1;
    }
    int fd = openat(state, "records", O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    int saved = errno;
    close(state);
    errno = saved;
    return fd;
}

/* A label's key or value in a record line: bytes other than [A-Za-z0-9._-] as %XX, so
 * that neither a space nor a newline of the client's can shape the record. */
static void label_encode(struct buf *b, const char *s)
{
    static const char hex[] = "0123456789ABCDEF";
    if (!*s)
        buf_append_lit(b, "%");     /* the empty string: a lone % */
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        bool plain = (*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') ||
                     (*p >= '0' && *p <= '9') || *p == '.' || *p == '_' || *p == '-';
        if (plain) {
            buf_append(b, p, 1);
        } else {
            char esc[3] = {'%', hex[*p >> 4], hex[*p & 15]};
            buf_append(b, esc, 3);
        }
    }
}

static int hex_value(char c)
{
    return c >= '0' && c <= '9' ? c - '0' : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
}

/* NULL when it is not one label_encode wrote. */
static char *label_decode(const char *s)
{
    if (strcmp(s, "%") == 0)
        return xstrdup("");
    char *out = xmalloc(strlen(s) + 1), *o = out;
    for (const char *p = s; *p; p++) {
        if (*p != '%') {
            *o++ = *p;
            continue;
        }
        int hi = hex_value(p[1]), lo = hi < 0 ? -1 : hex_value(p[2]);
        if (lo < 0 || (hi == 0 && lo == 0)) {
            free(out);
            return NULL;
        }
        *o++ = (char)(hi << 4 | lo);
        p += 2;
    }
    *o = 0;
    return out;
}

/* "KEY VALUE", both encoded: appended to r->labels. */
static bool label_parse(struct session_record *r, char *v)
{
    char *sp = strchr(v, ' ');
    if (!sp)
        return false;
    *sp = 0;
    char *key = label_decode(v), *value = label_decode(sp + 1);
    if (!key || !value) {
        free(key);
        free(value);
        return false;
    }
    size_t n = strv_len(r->labels);
    r->labels = xrealloc(r->labels, (n + 3) * sizeof *r->labels);
    r->labels[n] = key;
    r->labels[n + 1] = value;
    r->labels[n + 2] = NULL;
    return true;
}

static void record_format(struct buf *b, const struct session_record *r)
{
    buf_printf(b, RECORD_MAGIC "\nid %s\nowner %s\nstate %s\nkept %d\nservice_uid %d\n"
                  "uid %u\nclient_uid %u\npid %d\nholder %s\nisolation %s\npolicy_sha256 %s\n"
                  "created_ms %" PRId64
                  "\nttl_ms %" PRId64 "\nlease_at_ms %" PRId64 "\nfuse_at_ms %" PRId64 "\n",
               r->id, owner_names[r->owner], state_names[r->state], r->kept, r->service_uid,
               (unsigned)r->uid, (unsigned)r->client_uid, (int)r->pid,
               r->holder[0] ? r->holder : "-", r->isolation[0] ? r->isolation : "-",
               r->policy_sha256[0] ? r->policy_sha256 : "-", r->created_ms, r->ttl_ms,
               r->lease_at_ms, r->fuse_at_ms);
    for (char **l = r->labels; l && l[0] && l[1]; l += 2) {
        buf_append_lit(b, "label ");
        label_encode(b, l[0]);
        buf_append_lit(b, " ");
        label_encode(b, l[1]);
        buf_append_lit(b, "\n");
    }
    buf_append_lit(b, "end\n");     /* a record cut short is not a record */
}

int record_write(const char *state_dir, const struct session_record *r, bool create)
{
    if (!root_id_valid(r->id)) {
        errno = EINVAL;
        return -1;
    }
    int dir = records_dir_open(state_dir, true);
    if (dir < 0)
        return -1;
    struct buf b = {0};
    record_format(&b, r);
    char *records = xasprintf("%s/records", state_dir);
    char *tmp = xasprintf("%s/.%s.XXXXXX", records, r->id);
    char *final = xasprintf("%s/%s", records, r->id);
    int rc = -1, saved = 0;
    int fd = mkostemp(tmp, O_CLOEXEC);
    if (fd < 0) {
        saved = errno;
        goto out;
    }
    if (write_all(fd, b.data, b.len) < 0 || (!r->unsynced && fsync(fd) < 0)) {
        saved = errno;
        close(fd);
        unlink(tmp);
        goto out;
    }
    close(fd);
    /* create: never replace a record another session holds */
    rc = create ? renameat2(AT_FDCWD, tmp, AT_FDCWD, final, RENAME_NOREPLACE)
                : rename(tmp, final);
    saved = errno;
    if (rc < 0)
        unlink(tmp);
    else if (!r->unsynced && fsync(dir) < 0)
        rc = -1, saved = errno;
out:
    close(dir);
    buf_free(&b);
    free(records);
    free(tmp);
    free(final);
    errno = saved;
    return rc;
}

static bool parse_i64(const char *v, int64_t *out)
{
    char *end;
    errno = 0;
    long long x = strtoll(v, &end, 10);
    if (errno || end == v || *end)
        return false;
    *out = x;
    return true;
}

static bool copy_word(char *dst, size_t n, const char *v)
{
    size_t len = strlen(v);
    if (len == 0 || len >= n)
        return false;
    memcpy(dst, v, len + 1);
    if (strcmp(dst, "-") == 0)
        dst[0] = 0;
    return true;
}

#define HOLDER_PREFIX ".holder."

/* ".holder." and 32 hex digits: a name in the records dir that no id can take. */
static bool holder_name_valid(const char *name)
{
    size_t n = strlen(HOLDER_PREFIX);
    if (strncmp(name, HOLDER_PREFIX, n) != 0 || strlen(name) != n + 32)
        return false;
    for (const char *p = name + n; *p; p++)
        if (!((*p >= '0' && *p <= '9') || (*p >= 'a' && *p <= 'f')))
            return false;
    return true;
}

static bool record_parse_line(struct session_record *r, char *line)
{
    char *v = strchr(line, ' ');
    if (!v)
        return false;
    *v++ = 0;
    int64_t x;
    if (!strcmp(line, "id"))
        return copy_word(r->id, sizeof r->id, v) && root_id_valid(r->id);
    if (!strcmp(line, "owner")) {
        for (size_t i = 0; i < ARRAY_LEN(owner_names); i++)
            if (!strcmp(v, owner_names[i]))
                return r->owner = (enum record_owner)i, true;
        return false;
    }
    if (!strcmp(line, "state")) {
        for (size_t i = 0; i < ARRAY_LEN(state_names); i++)
            if (!strcmp(v, state_names[i]))
                return r->state = (enum record_state)i, true;
        return false;
    }
    if (!strcmp(line, "isolation"))
        return copy_word(r->isolation, sizeof r->isolation, v);
    if (!strcmp(line, "holder"))
        return copy_word(r->holder, sizeof r->holder, v) &&
               (!r->holder[0] || holder_name_valid(r->holder));
    if (!strcmp(line, "policy_sha256"))
        return copy_word(r->policy_sha256, sizeof r->policy_sha256, v);
    if (!strcmp(line, "label"))
        return label_parse(r, v);
    if (!parse_i64(v, &x))
        return false;
    if (!strcmp(line, "kept"))
        r->kept = x != 0;
    else if (!strcmp(line, "service_uid"))
        r->service_uid = x != 0;
    else if (!strcmp(line, "uid"))
        r->uid = (uid_t)x;
    else if (!strcmp(line, "client_uid"))
        r->client_uid = (uid_t)x;
    else if (!strcmp(line, "pid"))
        r->pid = (pid_t)x;
    else if (!strcmp(line, "created_ms"))
        r->created_ms = x;
    else if (!strcmp(line, "ttl_ms"))
        r->ttl_ms = x;
    else if (!strcmp(line, "lease_at_ms"))
        r->lease_at_ms = x;
    else if (!strcmp(line, "fuse_at_ms"))
        r->fuse_at_ms = x;
    /* an unknown key is a newer version's: ignored */
    return true;
}

int record_read(const char *state_dir, const char *id, struct session_record *r)
{
    memset(r, 0, sizeof *r);
    if (!root_id_valid(id)) {
        errno = EINVAL;
        return -1;
    }
    int dir = records_dir_open(state_dir, false);
    if (dir < 0)
        return -1;
    int fd = openat(dir, id, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    int saved = errno;
    close(dir);
    if (fd < 0) {
        errno = saved;
        return -1;
    }
    char *text = xmalloc(RECORD_MAX + 1);
    size_t len = 0;
    ssize_t n;
    while (len < RECORD_MAX && (n = read(fd, text + len, RECORD_MAX - len)) != 0) {
        if (n < 0) {
            if (errno == EINTR)
                continue;
            saved = errno;
            close(fd);
            free(text);
            errno = saved;
            return -1;
        }
        len += (size_t)n;
    }
    close(fd);
    text[len] = 0;
    bool ok = strncmp(text, RECORD_MAGIC "\n", sizeof RECORD_MAGIC) == 0, ended = false;
    char *save = NULL;
    for (char *line = ok ? strtok_r(text + sizeof RECORD_MAGIC, "\n", &save) : NULL;
         ok && line; line = strtok_r(NULL, "\n", &save)) {
        if (!strcmp(line, "end")) {
            ended = true;
            break;
        }
        ok = record_parse_line(r, line);
    }
    free(text);
    if (!ok || !ended || strcmp(r->id, id) != 0) {
        record_clear(r);
        errno = EINVAL;
        return -1;
    }
    return 0;
}

static int remove_record(const char *state_dir, const char *id, bool sync)
{
    if (!root_id_valid(id)) {
        errno = EINVAL;
        return -1;
    }
    int dir = records_dir_open(state_dir, false);
    if (dir < 0)
        return errno == ENOENT ? 0 : -1;
    int rc = unlinkat(dir, id, 0);
    if (rc < 0 && errno == ENOENT)
        rc = 0;
    if (rc == 0 && sync && fsync(dir) < 0)
        rc = -1;
    int saved = errno;
    close(dir);
    errno = saved;
    return rc;
}

int record_remove(const char *state_dir, const char *id)
{
    return remove_record(state_dir, id, true);
}

int record_remove_unsynced(const char *state_dir, const char *id)
{
    return remove_record(state_dir, id, false);
}

void record_clear(struct session_record *r)
{
    strv_free(r->labels);
    r->labels = NULL;
}

static int cmp_str(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* The valid ids among the entries of STATE_DIR/SUB (dot-files, temps, are not ids). */
static char **ids_in(const char *state_dir, const char *sub)
{
    char *path = xasprintf("%s/%s", state_dir, sub);
    int fd = open(path, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    free(path);
    size_t n = 0, cap = 0;
    char **ids = NULL;
    ids = xgrow(ids, &cap, n, sizeof *ids, 8);
    if (fd < 0) {
        if (errno != ENOENT) {
            free(ids);
            return NULL;
        }
        ids[0] = NULL;
        return ids;
    }
    DIR *d = fdopendir(fd);
    if (!d) {
        int saved = errno;
        close(fd);
        free(ids);
        errno = saved;
        return NULL;
    }
    struct dirent *de;
    while ((de = readdir(d))) {
        if (!root_id_valid(de->d_name))
            continue;
        ids = xgrow(ids, &cap, n + 1, sizeof *ids, 8);
        ids[n++] = xstrdup(de->d_name);
    }
    closedir(d);
    ids[n] = NULL;
    qsort(ids, n, sizeof *ids, cmp_str);
    return ids;
}

char **record_ids(const char *state_dir) { return ids_in(state_dir, "records"); }
char **record_root_ids(const char *state_dir) { return ids_in(state_dir, "sessions"); }

/* Try the holder's lock without waiting: 1 held by its process, 0 free or gone (with
 * *fd, when asked, the lock now ours: unlink the file before closing it), -1 with errno. */
static int holder_probe(int dir, const char *name, int *fd_out)
{
    int fd = openat(dir, name, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0)
        return errno == ENOENT ? 0 : -1;
    if (flock(fd, LOCK_EX | LOCK_NB) < 0) {
        int saved = errno;
        close(fd);
        errno = saved;
        return saved == EWOULDBLOCK ? 1 : -1;
    }
    if (fd_out)
        *fd_out = fd;
    else
        close(fd);
    return 0;
}

int record_process_alive(const char *state_dir, const struct session_record *r)
{
    if (r->holder[0]) {
        int dir = records_dir_open(state_dir, false);
        if (dir < 0)
            return -1;
        int alive = holder_probe(dir, r->holder, NULL);
        int saved = errno;
        close(dir);
        errno = saved;
        return alive;
    }
    /* an older version's record: only its pid to go by (EPERM: someone else's, alive) */
    if (r->pid <= 0)
        return -1;
    return kill(r->pid, 0) == 0 || errno != ESRCH;
}

bool record_expired(const char *state_dir, const struct session_record *r, int64_t now)
{
    if (r->kept)
        return false;
    if (r->owner != RECORD_SERVE)   /* over when its process is */
        return record_process_alive(state_dir, r) == 0;
    return r->state == RECORD_CLOSING || now >= r->lease_at_ms || now >= r->fuse_at_ms;
}

int record_holder_take(const char *state_dir, char name[RECORD_HOLDER_MAX])
{
    name[0] = 0;
    if (mkdir(state_dir, 0711) < 0 && errno != EEXIST)     /* taken before any record */
        return -1;
    int dir = records_dir_open(state_dir, true);
    if (dir < 0)
        return -1;
    /* a sweep may unlink a file between our create and our flock: then it is not the one
     * the name says, and we take another */
    for (int attempt = 0; attempt < 8; attempt++) {
        unsigned char rnd[16];
        if (getrandom(rnd, sizeof rnd, 0) != (ssize_t)sizeof rnd)
            break;
        size_t n = (size_t)snprintf(name, RECORD_HOLDER_MAX, HOLDER_PREFIX);
        for (size_t i = 0; i < sizeof rnd; i++)
            n += (size_t)snprintf(name + n, RECORD_HOLDER_MAX - n, "%02x", rnd[i]);
        int fd = openat(dir, name, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
        if (fd < 0) {
            if (errno == EEXIST)
                continue;
            break;
        }
        struct stat mine, named;
        if (flock(fd, LOCK_EX | LOCK_NB) == 0 && fstat(fd, &mine) == 0 &&
            fstatat(dir, name, &named, AT_SYMLINK_NOFOLLOW) == 0 &&
            mine.st_dev == named.st_dev && mine.st_ino == named.st_ino) {
            char pid[24];
            int len = snprintf(pid, sizeof pid, "%d\n", (int)getpid());
            if (write_all(fd, pid, (size_t)len) < 0)
                LOG_D("holder %s: pid: %s", name, strerror(errno));  /* informative only */
            close(dir);
            return fd;
        }
        close(fd);
    }
    int saved = errno ? errno : EAGAIN;
    close(dir);
    name[0] = 0;
    errno = saved;
    return -1;
}

void record_holder_drop(const char *state_dir, const char *name, int fd)
{
    if (fd < 0)
        return;
    int dir = records_dir_open(state_dir, false);
    /* unlinked while still locked: a sweep never sees it free under this name */
    if (dir >= 0 && unlinkat(dir, name, 0) < 0 && errno != ENOENT)
        LOG_W("holder %s/records/%s: %s", state_dir, name, strerror(errno));
    if (dir >= 0)
        close(dir);
    close(fd);
}

unsigned record_holders_sweep(const char *state_dir)
{
    int dir = records_dir_open(state_dir, false);
    if (dir < 0)
        return 0;
    int list = fcntl(dir, F_DUPFD_CLOEXEC, 0);     /* readdir's own, beside dir's openat */
    DIR *d = list >= 0 ? fdopendir(list) : NULL;
    if (!d) {
        close_quietly(&list);
        close(dir);
        return 0;
    }
    unsigned removed = 0;
    struct dirent *de;
    while ((de = readdir(d))) {
        int fd = -1;
        if (!holder_name_valid(de->d_name) || holder_probe(dir, de->d_name, &fd) != 0 || fd < 0)
            continue;
        removed += unlinkat(dir, de->d_name, 0) == 0;
        close(fd);
    }
    closedir(d);
    close(dir);
    return removed;
}

void record_json(struct buf *b, const struct session_record *r)
{
    buf_append_lit(b, "{\"session_id\":");
    json_cstr(b, r->id);
    buf_printf(b, ",\"owner\":\"%s\",\"state\":\"%s\",\"kept\":%s,\"uid\":%u,",
               owner_names[r->owner], state_names[r->state], r->kept ? "true" : "false",
               (unsigned)r->uid);
    if (r->owner == RECORD_SERVE)
        buf_printf(b, "\"client_uid\":%u,", (unsigned)r->client_uid);
    if (r->owner != RECORD_SERVE)
        buf_printf(b, "\"pid\":%d,", (int)r->pid);
    buf_append_lit(b, "\"isolation\":");
    json_cstr(b, r->isolation[0] ? r->isolation : NULL);
    buf_append_lit(b, ",\"policy_sha256\":");
    json_cstr(b, r->policy_sha256[0] ? r->policy_sha256 : NULL);
    buf_printf(b, ",\"created_ms\":%" PRId64 ",\"ttl_ms\":%" PRId64 ",\"lease_at_ms\":%" PRId64
                  ",\"fuse_at_ms\":%" PRId64 ",\"labels\":{",
               r->created_ms, r->ttl_ms, r->lease_at_ms, r->fuse_at_ms);
    for (char **l = r->labels; l && l[0] && l[1]; l += 2) {
        if (l != r->labels)
            buf_append_lit(b, ",");
        json_cstr(b, l[0]);
        buf_append_lit(b, ":");
        json_cstr(b, l[1]);
    }
    buf_append_lit(b, "}}");
}

static int lock_file_open(const char *state_dir)
{
    char *path = xasprintf("%s/lock", state_dir);
    int fd = open(path, O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0600);
    free(path);
    return fd;
}

static pid_t lock_file_pid(int fd)
{
    char text[32] = {0};
    ssize_t n = pread(fd, text, sizeof text - 1, 0);
    long pid = n > 0 ? strtol(text, NULL, 10) : 0;
    return pid > 0 ? (pid_t)pid : 0;
}

int record_lock_state_dir(const char *state_dir, char **err)
{
    if (mkdir(state_dir, 0711) < 0 && errno != EEXIST) {
        *err = xasprintf("state dir %s: %s", state_dir, strerror(errno));
        return -1;
    }
    int fd = lock_file_open(state_dir);
    if (fd < 0) {
        *err = xasprintf("state dir %s: lock: %s", state_dir, strerror(errno));
        return -1;
    }
    if (flock(fd, LOCK_EX | LOCK_NB) < 0) {
        int saved = errno;
        pid_t holder = lock_file_pid(fd);
        close(fd);
        if (saved == EWOULDBLOCK)
            *err = holder ? xasprintf("state dir %s is in use by another stockade (pid %d)",
                                      state_dir, (int)holder)
                          : xasprintf("state dir %s is in use by another stockade", state_dir);
        else
            *err = xasprintf("state dir %s: lock: %s", state_dir, strerror(saved));
        return -1;
    }
    char pid[32];
    int len = snprintf(pid, sizeof pid, "%d\n", (int)getpid());
    if (ftruncate(fd, 0) < 0 || pwrite(fd, pid, (size_t)len, 0) != len)
        LOG_W("state dir %s: could not write the lock's pid: %s", state_dir, strerror(errno));
    return fd;
}

pid_t record_state_dir_owner(const char *state_dir)
{
    int fd = lock_file_open(state_dir);
    if (fd < 0)
        return errno == ENOENT ? 0 : -1;
    pid_t owner = 0;
    if (flock(fd, LOCK_SH | LOCK_NB) < 0) {
        owner = errno == EWOULDBLOCK ? lock_file_pid(fd) : -1;
        if (owner == 0)
            owner = -1;         /* held, but no pid written yet */
    }
    close(fd);
    return owner;
}
