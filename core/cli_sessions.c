/* `stockade sessions list | show ID | rm ID | gc`: the operator's view of a state dir's
 * sessions, from their records (core/record.h), whether or not a server runs. Removing
 * takes the state dir's lock, so it never races a server: while one owns the dir, rm and
 * gc refuse and say so (the server's own recovery and expiry remove its sessions). */
#include "cli.h"
#include "record.h"
#include "root.h"
#include "session.h"
#include "util.h"

#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static const char sessions_usage[] =
    "usage: stockade sessions [--state-dir DIR] [--json] list\n"
    "       stockade sessions [--state-dir DIR] [--json] show ID\n"
    "       stockade sessions [--state-dir DIR] rm ID\n"
    "       stockade sessions [--state-dir DIR] [--json] gc\n"
    "The sessions of a state dir, from their records: list, show one, remove one, or\n"
    "remove every expired one (and every root without a record, and every record\n"
    "without a root). rm and gc refuse while a server owns the state dir.\n"
    "  --state-dir DIR   default: $STOCKADE_STATE_DIR, /var/lib/stockade as root, else\n"
    "                    $XDG_RUNTIME_DIR/stockade\n"
    "  --json            one JSON document on stdout\n";

/* One row of the listing: a record, a root, or both. */
struct entry {
    char *id;
    bool has_record, has_root;
    struct session_record rec;
};

static bool root_exists(const char *state_dir, const char *id)
{
    char *path = xasprintf("%s/sessions/%s", state_dir, id);
    struct stat st;
    bool yes = lstat(path, &st) == 0 && S_ISDIR(st.st_mode);
    free(path);
    return yes;
}

/* What the row is, in one word: open, closing, expired, kept, orphan (a root with no
 * record), no-root (a record with no root). */
static const char *entry_status(const char *state_dir, const struct entry *e, int64_t now)
{
    if (!e->has_record)
        return "orphan";
    if (!e->has_root)
        return "no-root";
    if (e->rec.kept)
        return "kept";
    if (e->rec.state == RECORD_CLOSING)
        return "closing";
    return record_expired(state_dir, &e->rec, now) ? "expired" : "open";
}

/* Every record and every root of the state dir, merged by id. False on error (printed). */
static bool entries_load(const char *state_dir, struct entry **out, size_t *count)
{
    char **ids = record_ids(state_dir), **roots = record_root_ids(state_dir);
    if (!ids || !roots) {
        fprintf(stderr, "stockade: sessions: cannot read %s: %s\n", state_dir, strerror(errno));
        strv_free(ids);
        strv_free(roots);
        return false;
    }
    size_t n = 0, cap = 0;
    struct entry *v = NULL;
    for (char **p = ids; *p; p++) {
        v = xgrow(v, &cap, n, sizeof *v, 16);
        struct entry *e = &v[n];
        memset(e, 0, sizeof *e);
        e->id = xstrdup(*p);
        e->has_record = record_read(state_dir, *p, &e->rec) == 0;
        if (!e->has_record)
            fprintf(stderr, "stockade: sessions: record %s unreadable: %s\n", *p, strerror(errno));
        e->has_root = root_exists(state_dir, *p);
        n++;
    }
    for (char **p = roots; *p; p++) {
        bool known = false;
        for (size_t i = 0; i < n && !known; i++)
            known = strcmp(v[i].id, *p) == 0;
        if (known)
            continue;
        v = xgrow(v, &cap, n, sizeof *v, 16);
        memset(&v[n], 0, sizeof v[n]);
        v[n].id = xstrdup(*p);
        v[n].has_root = true;
        n++;
    }
    strv_free(ids);
    strv_free(roots);
    *count = n;
    *out = v;
    return true;
}

static void entries_free(struct entry *v, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        free(v[i].id);
        record_clear(&v[i].rec);
    }
    free(v);
}

static void entry_json(struct buf *b, const struct entry *e, const char *state_dir, int64_t now)
{
    buf_append_lit(b, "{\"session_id\":");
    json_cstr(b, e->id);
    buf_printf(b, ",\"status\":\"%s\",\"root\":", entry_status(state_dir, e, now));
    char *root = xasprintf("%s/sessions/%s", state_dir, e->id);
    json_cstr(b, e->has_root ? root : NULL);
    free(root);
    buf_append_lit(b, ",\"record\":");
    if (e->has_record)
        record_json(b, &e->rec);
    else
        buf_append_lit(b, "null");
    buf_append_lit(b, "}");
}

/* Seconds from now to a wall-clock deadline, for people ("-" when there is none). */
static void fmt_left(char *out, size_t n, int64_t at, int64_t now)
{
    if (at <= 0)
        snprintf(out, n, "-");
    else
        snprintf(out, n, "%+" PRId64 "s", (at - now) / 1000);
}

static int sessions_list(const char *state_dir, bool json)
{
    size_t n;
    struct entry *v;
    if (!entries_load(state_dir, &v, &n))
        return 1;
    int64_t now = wall_ms();
    pid_t owner = record_state_dir_owner(state_dir);
    if (json) {
        struct buf b = {0};
        buf_printf(&b, "{\"state_dir\":");
        json_cstr(&b, state_dir);
        if (owner > 0)
            buf_printf(&b, ",\"server_pid\":%d", (int)owner);
        else
            buf_append_lit(&b, ",\"server_pid\":null");
        buf_append_lit(&b, ",\"sessions\":[");
        for (size_t i = 0; i < n; i++) {
            if (i)
                buf_append_lit(&b, ",");
            entry_json(&b, &v[i], state_dir, now);
        }
        buf_append_lit(&b, "]}\n");
        write_all(1, b.data, b.len);
        buf_free(&b);
    } else {
        printf("%-40s %-8s %-6s %-9s %-9s %10s %10s\n", "SESSION", "STATUS", "OWNER", "UID",
               "ISOLATION", "LEASE", "FUSE");
        for (size_t i = 0; i < n; i++) {
            const struct entry *e = &v[i];
            char lease[32], fuse[32];
            fmt_left(lease, sizeof lease, e->has_record ? e->rec.lease_at_ms : 0, now);
            fmt_left(fuse, sizeof fuse, e->has_record ? e->rec.fuse_at_ms : 0, now);
            char uid[16] = "-";
            if (e->has_record)
                snprintf(uid, sizeof uid, "%u", (unsigned)e->rec.uid);
            printf("%-40s %-8s %-6s %-9s %-9s %10s %10s\n", e->id, entry_status(state_dir, e, now),
                   !e->has_record ? "-" : record_owner_name(e->rec.owner), uid,
                   e->has_record && e->rec.isolation[0] ? e->rec.isolation : "-", lease, fuse);
        }
    }
    entries_free(v, n);
    return 0;
}

static int sessions_show(const char *state_dir, const char *id, bool json)
{
    if (!root_id_valid(id)) {
        fprintf(stderr, "stockade: sessions show: bad id '%s'\n", id);
        return 125;
    }
    struct entry e = {.id = xstrdup(id)};
    e.has_record = record_read(state_dir, id, &e.rec) == 0;
    e.has_root = root_exists(state_dir, id);
    int rc = 0;
    int64_t now = wall_ms();
    if (!e.has_record && !e.has_root) {
        fprintf(stderr, "stockade: sessions show: no session %s in %s\n", id, state_dir);
        rc = 1;
    } else if (json) {
        struct buf b = {0};
        entry_json(&b, &e, state_dir, now);
        buf_append_lit(&b, "\n");
        write_all(1, b.data, b.len);
        buf_free(&b);
    } else {
        printf("session:   %s\nstatus:    %s\n", id, entry_status(state_dir, &e, now));
        if (e.has_root)
            printf("root:      %s/sessions/%s\n", state_dir, id);
        if (e.has_record) {
            const struct session_record *r = &e.rec;
            char lease[32], fuse[32];
            fmt_left(lease, sizeof lease, r->lease_at_ms, now);
            fmt_left(fuse, sizeof fuse, r->fuse_at_ms, now);
            printf("owner:     %s\nuid:       %u\nisolation: %s\npolicy:    %s\n"
                   "lease:     %s\nfuse:      %s\n",
                   record_owner_name(r->owner), (unsigned)r->uid,
                   r->isolation[0] ? r->isolation : "-",
                   r->policy_sha256[0] ? r->policy_sha256 : "-", lease, fuse);
            for (char **l = r->labels; l && l[0] && l[1]; l += 2)
                printf("label:     %s=%s\n", l[0], l[1]);
        }
    }
    free(e.id);
    record_clear(&e.rec);
    return rc;
}

/* The state dir's lock, for rm and gc: -1 (and why, printed) while a server owns it. */
static int sessions_lock(const char *state_dir, const char *what)
{
    char *err = NULL;
    int fd = record_lock_state_dir(state_dir, &err);
    if (fd < 0) {
        fprintf(stderr, "stockade: sessions %s: refused: %s; its server removes its sessions "
                        "(session.close, expiry)\n", what, err);
        free(err);
    }
    return fd;
}

/* Remove one session: its root (holding its service uid meanwhile, so the uid is not
 * handed out while files it owns remain), then its record. */
static bool session_discard(const char *state_dir, const struct entry *e, char **err)
{
    /* a kept session's too while its run runs (only its holder can say: a pid can be
     * reused) */
    bool running = e->has_record && e->rec.owner != RECORD_SERVE &&
                   (e->rec.kept ? e->rec.holder[0] && record_process_alive(state_dir, &e->rec) == 1
                                : !record_expired(state_dir, &e->rec, 0));
    if (running) {
        *err = xasprintf("its `stockade %s` (pid %d) is still running",
                         record_owner_name(e->rec.owner), (int)e->rec.pid);
        return false;
    }
    int uid_fd = -1;
    if (e->has_record && e->has_root && e->rec.service_uid && geteuid() == 0) {
        uid_fd = session_uid_lock(e->rec.uid);
        if (uid_fd < 0) {
            *err = xasprintf("its uid %u is held by a live session (%s)", (unsigned)e->rec.uid,
                             strerror(errno));
            return false;
        }
    }
    bool ok = true;
    if (e->has_record) {
        /* a crash from here on leaves a record that says "remove me" */
        struct session_record r = e->rec;
        r.state = RECORD_CLOSING;
        if (e->has_root && record_write(state_dir, &r, false) < 0)
            LOG_W("session %s: record: %s", e->id, strerror(errno));
    }
    if (e->has_root && root_remove(state_dir, e->id) < 0) {
        *err = xasprintf("could not remove all of its root: %s", strerror(errno));
        ok = false;
    }
    if (ok && e->has_record && record_remove(state_dir, e->id) < 0) {
        *err = xasprintf("its record: %s", strerror(errno));
        ok = false;
    }
    close_quietly(&uid_fd);
    return ok;
}

static int sessions_rm(const char *state_dir, const char *id)
{
    if (!root_id_valid(id)) {
        fprintf(stderr, "stockade: sessions rm: bad id '%s'\n", id);
        return 125;
    }
    int lock = sessions_lock(state_dir, "rm");
    if (lock < 0)
        return 1;
    struct entry e = {.id = xstrdup(id)};
    e.has_record = record_read(state_dir, id, &e.rec) == 0;
    e.has_root = root_exists(state_dir, id);
    int rc = 0;
    char *err = NULL;
    if (!e.has_record && !e.has_root) {
        fprintf(stderr, "stockade: sessions rm: no session %s in %s\n", id, state_dir);
        rc = 1;
    } else if (!session_discard(state_dir, &e, &err)) {
        fprintf(stderr, "stockade: sessions rm: %s: %s\n", id, err);
        free(err);
        rc = 1;
    } else {
        printf("removed %s\n", id);
    }
    free(e.id);
    record_clear(&e.rec);
    close(lock);
    return rc;
}

/* Everything nobody can use any more: expired or closing records with their roots,
 * records without roots, roots without records. Kept sessions stay. */
static int sessions_gc(const char *state_dir, bool json)
{
    int lock = sessions_lock(state_dir, "gc");
    if (lock < 0)
        return 1;
    size_t n;
    struct entry *v;
    if (!entries_load(state_dir, &v, &n)) {
        close(lock);
        return 1;
    }
    int64_t now = wall_ms();
    int rc = 0;
    struct buf b = {0};
    buf_append_lit(&b, "{\"removed\":[");
    unsigned removed = 0;
    for (size_t i = 0; i < n; i++) {
        struct entry *e = &v[i];
        const char *status = entry_status(state_dir, e, now);
        if (strcmp(status, "open") == 0 || strcmp(status, "kept") == 0)
            continue;
        char *err = NULL;
        if (!session_discard(state_dir, e, &err)) {
            fprintf(stderr, "stockade: sessions gc: %s: %s\n", e->id, err);
            free(err);
            rc = 1;
            continue;
        }
        if (json) {
            if (removed)
                buf_append_lit(&b, ",");
            buf_append_lit(&b, "{\"session_id\":");
            json_cstr(&b, e->id);
            buf_printf(&b, ",\"status\":\"%s\"}", status);
        } else {
            printf("removed %s (%s)\n", e->id, status);
        }
        removed++;
    }
    buf_append_lit(&b, "]}\n");
    record_holders_sweep(state_dir);    /* the locks crashed runs left */
    if (json)
        write_all(1, b.data, b.len);
    buf_free(&b);
    entries_free(v, n);
    close(lock);
    return rc;
}

int cli_sessions(int argc, char **argv)
{
    static const struct option opts[] = {
        {"state-dir", required_argument, 0, 'd'}, {"json", no_argument, 0, 'j'},
        {"help", no_argument, 0, 'h'}, {0, 0, 0, 0},
    };
    const char *state_flag = NULL;
    bool json = false;
    int opt;
    optind = 1;
    while ((opt = getopt_long(argc, argv, "d:jh", opts, NULL)) != -1) {
        switch (opt) {
        case 'd': state_flag = optarg; break;
        case 'j': json = true; break;
        case 'h': fputs(sessions_usage, stdout); return 0;
        default: fputs(sessions_usage, stderr); return 125;
        }
    }
    const char *cmd = optind < argc ? argv[optind] : NULL;
    const char *id = optind + 1 < argc ? argv[optind + 1] : NULL;
    bool wants_id = cmd && (!strcmp(cmd, "show") || !strcmp(cmd, "rm"));
    if (!cmd || (wants_id && !id) || optind + (wants_id ? 2 : 1) < argc) {
        fputs(sessions_usage, stderr);
        return 125;
    }
    char *state_dir = root_state_dir(state_flag);
    if (!state_dir) {
        fprintf(stderr, "stockade: sessions: no state dir: pass --state-dir, or set "
                        "STOCKADE_STATE_DIR or XDG_RUNTIME_DIR\n");
        return 125;
    }
    int rc;
    if (!strcmp(cmd, "list"))
        rc = sessions_list(state_dir, json);
    else if (!strcmp(cmd, "show"))
        rc = sessions_show(state_dir, id, json);
    else if (!strcmp(cmd, "rm"))
        rc = sessions_rm(state_dir, id);
    else if (!strcmp(cmd, "gc"))
        rc = sessions_gc(state_dir, json);
    else {
        fprintf(stderr, "stockade: sessions: unknown command '%s'\n", cmd);
        fputs(sessions_usage, stderr);
        rc = 125;
    }
    free(state_dir);
    return rc;
}
