#include "server.h"
#include "accounting.h"
#include "audit.h"
#include "call.h"
#include "policy.h"
#include "proc.h"
#include "record.h"
#include "remover.h"
#include "root.h"
#include "rpc.h"
#include "sandbox.h"
#include "service.h"
#include "version.h"
#include "zygote.h"

#include <dirent.h>
#include <fcntl.h>
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/pidfd.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#define LATENCY_SAMPLES 1024
#define ACCEPT_RETRY_MS 250         /* a listener parked for lack of descriptors */
#define CLASS_COUNT (CLASS_INTERNAL + 1)
#define PROTOCOL_VERSION 2
/* Any duration a client sends is capped here before it meets a clock: 2^40 ms is about
 * 34 years, far beyond every policy's limits, and wall_ms() + it cannot overflow. */
#define DURATION_MAX_MS (INT64_C(1) << 40)
/* A session that ended is remembered this long (at most ENDED_KEEP of them), so that a
 * late request learns it expired and a second close is answered rather than refused. */
#define ENDED_KEEP 1024
#define ENDED_KEEP_MS (10 * 60 * 1000)
#define LABELS_MAX 32

struct srv_conn;
struct srv_session;

/* A call in flight, as the server sees it: who asked (conn may go away first), under
 * which msgid, in which session. */
struct srv_call {
    struct call *call;
    struct srv_conn *conn;
    uint32_t msgid;
    struct srv_session *sess;
    bool counted;                   /* in srv->running: a process was started */
    uint64_t id;                    /* the per-call id of the logs */
    struct srv_call *next;          /* in the server's list */
};

struct close_waiter {
    struct srv_conn *conn;
    uint32_t msgid;
    struct close_waiter *next;
};

struct srv_session {
    struct session *s;
    struct server *srv;
    uid_t owner_uid;
    struct srv_conn *owner;         /* where session.expired goes; NULL once it left */
    ev_timer lease, fuse;
    int64_t ttl_ms;
    int64_t expires_at_ms, fuse_at_ms;  /* wall clock, for clients */
    char **labels;                  /* key, value, key, value, ..., NULL: the client's */
    unsigned ncalls;
    bool ending;
    bool isolated;                  /* false: adopted after a restart, built on its first call */
    const char *end_layer;          /* "fuse" / "ttl" when it expired, NULL when closed */
    unsigned calls_killed;
    struct close_waiter *waiters;
    /* strict: the zygote on its way; session.open is answered when it is ready */
    struct zygote *starting;
    ev_io zygote_ready;
    struct srv_conn *open_conn;     /* NULL once it went away */
    uint32_t open_msgid;
    struct srv_session *next;
};

struct srv_conn {
    struct rpc_conn *rpc;
    struct server *srv;
    uid_t uid;
    bool admin;                     /* may reload the policy: the spawner, or --admin-uid */
    unsigned running;               /* its calls counted in srv->running */
    struct srv_conn *next;
};

struct tool_latency {
    char *tool;
    int64_t samples[LATENCY_SAMPLES];
    size_t n, pos;
    struct tool_latency *next;
};

struct ended_session {
    char id[65];                    /* "" when the slot is free */
    uid_t owner_uid;
    const char *layer;              /* "fuse" / "ttl" when it expired, NULL when closed */
    int64_t at_ms;                  /* monotonic */
};

struct server {
    struct ev_loop *loop;
    const struct server_opts *opts;
    struct policy *policy;
    char *policy_path;
    char *state_dir;
    struct srv_session *sessions;
    unsigned nsessions;
    struct srv_session *removing;   /* ended; their roots on the way out (core/remover.c) */
    struct remover *remover;
    struct srv_call *calls;
    unsigned running;
    struct srv_conn *conns;
    int listen_fd;
    ev_io listen_watcher;
    ev_timer accept_retry;          /* the listener parked while descriptors are short */
    ev_signal sighup, sigterm, sigint, sigusr2;
    bool upgrading;                 /* SIGUSR2: drain, then exec the binary again */
    ev_timer upgrade_timer;         /* the exec, from the loop rather than a callback */
    ev_timer drain_timer;
    bool draining, stopping;
    const char *stop_reason;        /* for the shutdown record; NULL: the clients left */
    struct metrics metrics;         /* --metrics: counters, latency histograms */
    struct tool_latency *latencies;
    uint64_t call_seq;              /* a per-call id for the logs */
    /* accounting */
    ev_timer sampler;
    struct acct_sample last;        /* the accountant's last walk of /proc */
    unsigned last_standby, last_standby_fds;    /* held on purpose, at that walk */
    int64_t last_ms;
    int64_t last_cost_ms;           /* what that walk took */
    bool last_stale;                /* calls or sessions came or went since */
    struct zombie_watch zombies;
    struct zygote *prepared;        /* strict: the next session's world, made ahead */
    unsigned prepared_gen;          /* the policy generation it was made for */
    int fd_baseline;
    struct alarm alarms[ALARM_COUNT];
    ev_timer metrics_timer;
    int leaked[64];                 /* debug.leak: fds held on purpose, for alarm tests */
    int nleaked;
    struct proc zombie_holder;      /* debug.zombie: a child that never reaps its own */
    bool holding_zombie;
    struct zygote *spawner;         /* makes process-isolation calls' shims ahead of time */
    void (*on_reload)(void *ud);    /* told after a policy reload (`stockade mcp`) */
    void *on_reload_ud;
    struct ended_session ended[ENDED_KEEP];  /* a ring, the oldest overwritten first */
    size_t ended_next;
    int state_lock_fd;              /* the state dir is ours while it is held */
    /* a stdio server's: held for its life, named in its records (record_holder_take) */
    int holder_fd;
    char holder[RECORD_HOLDER_MAX];
    struct proc cleaner;            /* removes the roots of sessions that expired while no
                                     * server ran, off the loop */
    bool cleaning;
    uint64_t metrics_dropped;       /* metrics files that could not be written */
    /* Helpers (spawner, zygotes) that died and were replaced: freed once no call that
     * they started refers to them any more. */
    struct zygote **retired;
    size_t nretired, retired_cap;
};

/* ---- small helpers ------------------------------------------------------------------ */

/* A listening server owns its state dir: one at a time (the lock), and its sessions
 * outlive it (recovery). On stdio (`serve` for one orchestrator, `mcp`) the sessions are
 * the process's own and end with it, like `stockade run`'s: several may share a dir. */
static bool owns_state_dir(const struct server_opts *opts) { return opts->listen_path != NULL; }

/* After a long policy hook: timers armed next must count from the true time. */
static void refresh_loop_clock(void *loop)
{
    ev_now_update(loop);
}

static struct srv_session *session_find(struct server *srv, const char *id)
{
    for (struct srv_session *ss = srv->sessions; ss; ss = ss->next)
        if (strcmp(ss->s->id, id) == 0)
            return ss;
    return NULL;
}

static void send_notification_begin(struct srv_conn *conn, const char *method, uint32_t nfields)
{
    msgpack_packer *pk = &conn->rpc->pk;
    msgpack_pack_array(pk, 3);
    msgpack_pack_int(pk, 2);
    rpc_pack_str(pk, method);
    msgpack_pack_array(pk, 1);      /* the arguments: one, a map (protocol 2) */
    msgpack_pack_map(pk, nfields);
}

static msgpack_packer *result_begin(struct srv_conn *conn, uint32_t msgid, uint32_t nfields)
{
    msgpack_packer *pk = &conn->rpc->pk;
    msgpack_pack_array(pk, 4);
    msgpack_pack_int(pk, 1);
    msgpack_pack_uint32(pk, msgid);
    msgpack_pack_nil(pk);
    msgpack_pack_map(pk, nfields);
    return pk;
}

static void bad_request(struct srv_conn *conn, uint32_t msgid, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void bad_request(struct srv_conn *conn, uint32_t msgid, const char *fmt, ...)
{
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    rpc_send_error(conn->rpc, msgid, "BAD_REQUEST", false, msg, NULL);
}

/* ---- params: typed readers ---------------------------------------------------------- */

/* A request's argument map, read key by key in the manner of OpenSMTPD's m_get_*: each
 * reader names its key, checks the type and extracts in one step. The first failure
 * answers BAD_REQUEST naming the key, and every later reader returns false at once;
 * params_end then refuses any key no reader asked for (protocol 2's strict params: a
 * typo such as `deadline` must not run the call without its deadline). Values a reader
 * allocates are the caller's, also when a later reader fails. */
#define PARAMS_MAX_KEYS 16
struct params {
    struct srv_conn *conn;
    uint32_t msgid;
    const msgpack_object *map;      /* NULL: no argument */
    const char *known[PARAMS_MAX_KEYS];
    size_t nknown;
    bool failed;
};

static void params_begin(struct params *p, struct srv_conn *conn, uint32_t msgid,
                         const msgpack_object *map)
{
    memset(p, 0, sizeof *p);
    p->conn = conn;
    p->msgid = msgid;
    p->map = map && map->type == MSGPACK_OBJECT_MAP ? map : NULL;
}

static bool param_fail(struct params *p, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static bool param_fail(struct params *p, const char *fmt, ...)
{
    if (!p->failed) {
        char msg[512];
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(msg, sizeof msg, fmt, ap);
        va_end(ap);
        rpc_send_error(p->conn->rpc, p->msgid, "BAD_REQUEST", false, msg, NULL);
        p->failed = true;
    }
    return false;
}

/* The value of `key` (nil counts as absent), and the key is now one the method knows. */
static const msgpack_object *param_get(struct params *p, const char *key)
{
    if (p->nknown < PARAMS_MAX_KEYS)
        p->known[p->nknown++] = key;
    const msgpack_object *o = rpc_map_get(p->map, key);
    return o && o->type != MSGPACK_OBJECT_NIL ? o : NULL;
}

/* The value of `key` when it has `type`; NULL when absent, or (with the answer sent)
 * when it has another type: "`key`: expected `what`". */
static const msgpack_object *param_typed(struct params *p, const char *key,
                                         msgpack_object_type type, const char *what)
{
    if (p->failed)
        return NULL;
    const msgpack_object *o = param_get(p, key);
    if (o && o->type != type) {
        param_fail(p, "%s: expected %s", key, what);
        return NULL;
    }
    return o;
}

static bool str_has_nul(const msgpack_object *o)
{
    return memchr(o->via.str.ptr, 0, o->via.str.size) != NULL;
}

/* An integer in [min, max]; *present false (and *out untouched) when absent. */
static bool param_int(struct params *p, const char *key, int64_t min, int64_t max, int64_t *out,
                      bool *present)
{
    *present = false;
    if (p->failed)
        return false;
    const msgpack_object *o = param_get(p, key);
    if (!o)
        return true;
    int64_t v;
    if (o->type == MSGPACK_OBJECT_POSITIVE_INTEGER)
        v = o->via.u64 > INT64_MAX ? INT64_MAX : (int64_t)o->via.u64;
    else if (o->type == MSGPACK_OBJECT_NEGATIVE_INTEGER)
        v = o->via.i64;
    else
        return param_fail(p, "%s: expected an integer", key);
    if (v < min || v > max || (o->type == MSGPACK_OBJECT_POSITIVE_INTEGER && o->via.u64 > INT64_MAX))
        return param_fail(p, "%s: expected an integer from %lld to %lld", key, (long long)min,
                          (long long)max);
    *out = v;
    *present = true;
    return true;
}

/* A duration in ms: positive, capped at DURATION_MAX_MS rather than refused. */
static bool param_ms(struct params *p, const char *key, int64_t *out, bool *present)
{
    if (!param_int(p, key, 1, INT64_MAX, out, present))
        return false;
    if (*present && *out > DURATION_MAX_MS)
        *out = DURATION_MAX_MS;
    return true;
}

/* A str without NUL bytes, copied; *out NULL when absent and not required. */
static bool param_str(struct params *p, const char *key, bool required, char **out)
{
    *out = NULL;
    if (p->failed)
        return false;
    const msgpack_object *o = param_get(p, key);
    if (!o)
        return required ? param_fail(p, "%s: required string", key) : true;
    if (o->type != MSGPACK_OBJECT_STR || str_has_nul(o))
        return param_fail(p, "%s: expected a string without NUL bytes", key);
    *out = rpc_obj_strdup(o);
    return true;
}

/* An array of str without NUL bytes, copied into a NULL-terminated vector (*n entries);
 * absent: *out NULL. */
static bool param_strv(struct params *p, const char *key, char ***out, size_t *n)
{
    *out = NULL;
    *n = 0;
    const msgpack_object *o = param_typed(p, key, MSGPACK_OBJECT_ARRAY, "an array of strings");
    if (!o)
        return !p->failed;
    for (uint32_t i = 0; i < o->via.array.size; i++) {
        const msgpack_object *e = &o->via.array.ptr[i];
        if (e->type != MSGPACK_OBJECT_STR || str_has_nul(e))
            return param_fail(p, "%s[%u]: expected a string without NUL bytes", key, i);
    }
    *out = xcalloc(o->via.array.size + 1, sizeof **out);
    for (uint32_t i = 0; i < o->via.array.size; i++)
        (*out)[i] = rpc_obj_strdup(&o->via.array.ptr[i]);
    *n = o->via.array.size;
    return true;
}

/* A map, borrowed from the message (valid while the request is handled); NULL absent. */
static bool param_map(struct params *p, const char *key, const msgpack_object **out)
{
    *out = param_typed(p, key, MSGPACK_OBJECT_MAP, "a map");
    return !p->failed;
}

/* A map of str to str without NUL bytes, at most `max` pairs, each at most `max_len`
 * bytes; copied as key, value, key, value, ..., NULL. Absent: *out NULL. */
static bool param_strmap(struct params *p, const char *key, uint32_t max, size_t max_len,
                         char ***out)
{
    const msgpack_object *m;
    *out = NULL;
    if (!param_map(p, key, &m))
        return false;
    if (!m)
        return true;
    if (m->via.map.size > max)
        return param_fail(p, "%s: at most %u entries", key, max);
    for (uint32_t i = 0; i < m->via.map.size; i++) {
        const msgpack_object_kv *kv = &m->via.map.ptr[i];
        if (kv->key.type != MSGPACK_OBJECT_STR || kv->val.type != MSGPACK_OBJECT_STR ||
            str_has_nul(&kv->key) || str_has_nul(&kv->val) || kv->key.via.str.size == 0)
            return param_fail(p, "%s: expected a map of strings to strings", key);
        if (kv->key.via.str.size > max_len || kv->val.via.str.size > max_len)
            return param_fail(p, "%s: keys and values of at most %zu bytes", key, max_len);
    }
    *out = xcalloc(2 * (size_t)m->via.map.size + 1, sizeof **out);
    for (uint32_t i = 0; i < m->via.map.size; i++) {
        (*out)[2 * i] = rpc_obj_strdup(&m->via.map.ptr[i].key);
        (*out)[2 * i + 1] = rpc_obj_strdup(&m->via.map.ptr[i].val);
    }
    return true;
}

/* Bytes: bin (or str, which some msgpack libraries send for byte strings), copied. */
static bool param_bin(struct params *p, const char *key, char **data, size_t *len)
{
    *data = NULL;
    *len = 0;
    if (p->failed)
        return false;
    const msgpack_object *o = param_get(p, key);
    if (!o)
        return true;
    if (o->type != MSGPACK_OBJECT_BIN && o->type != MSGPACK_OBJECT_STR)
        return param_fail(p, "%s: expected bin", key);
    size_t n = o->type == MSGPACK_OBJECT_BIN ? o->via.bin.size : o->via.str.size;
    *data = xmalloc(n ? n : 1);
    if (n)
        memcpy(*data, o->type == MSGPACK_OBJECT_BIN ? o->via.bin.ptr : o->via.str.ptr, n);
    *len = n;
    return true;
}

static bool param_bool(struct params *p, const char *key, bool *out)
{
    const msgpack_object *o = param_typed(p, key, MSGPACK_OBJECT_BOOLEAN, "a boolean");
    *out = o && o->via.boolean;
    return !p->failed;
}

/* Every key was read by a reader, once: true, or false with BAD_REQUEST sent. */
static bool params_end(struct params *p)
{
    if (p->failed || !p->map)
        return !p->failed;
    uint32_t seen = 0;
    for (uint32_t i = 0; i < p->map->via.map.size; i++) {
        const msgpack_object *k = &p->map->via.map.ptr[i].key;
        if (k->type != MSGPACK_OBJECT_STR)
            return param_fail(p, "params: every key must be a string");
        size_t j = 0;
        while (j < p->nknown && !(strlen(p->known[j]) == k->via.str.size &&
                                  memcmp(p->known[j], k->via.str.ptr, k->via.str.size) == 0))
            j++;
        int shown = (int)(k->via.str.size > 64 ? 64 : k->via.str.size);
        if (j == p->nknown) {
            char list[256] = "";
            size_t off = 0;
            for (size_t m = 0; m < p->nknown && off < sizeof list; m++)
                off += (size_t)snprintf(list + off, sizeof list - off, "%s%s", m ? ", " : "",
                                        p->known[m]);
            return param_fail(p, "%.*s: unknown parameter (this method takes: %s)", shown,
                              k->via.str.ptr, p->nknown ? list : "none");
        }
        if (seen & (1u << j))
            return param_fail(p, "%.*s: given twice", shown, k->via.str.ptr);
        seen |= 1u << j;
    }
    return true;
}

static void record_latency(struct server *srv, const char *tool, int64_t ms)
{
    struct tool_latency *t;
    for (t = srv->latencies; t; t = t->next)
        if (strcmp(t->tool, tool) == 0)
            break;
    if (!t) {
        t = xcalloc(1, sizeof *t);
        t->tool = xstrdup(tool);
        t->next = srv->latencies;
        srv->latencies = t;
    }
    t->samples[t->pos] = ms;
    t->pos = (t->pos + 1) % LATENCY_SAMPLES;
    if (t->n < LATENCY_SAMPLES)
        t->n++;
}

static int cmp_i64(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* ---- sessions ----------------------------------------------------------------------- */

static void session_finish(struct srv_session *ss);
static void session_touch(struct srv_session *ss);

static void ended_forget(struct server *srv, const char *id)
{
    for (size_t i = 0; i < ENDED_KEEP; i++)
        if (strcmp(srv->ended[i].id, id) == 0)
            srv->ended[i].id[0] = 0;
}

static void ended_remember(struct server *srv, const struct srv_session *ss)
{
    ended_forget(srv, ss->s->id);
    struct ended_session *e = &srv->ended[srv->ended_next];
    srv->ended_next = (srv->ended_next + 1) % ENDED_KEEP;
    snprintf(e->id, sizeof e->id, "%s", ss->s->id);
    e->owner_uid = ss->owner_uid;
    e->layer = ss->end_layer;
    e->at_ms = now_ms();
}

/* The session `id` that `uid` owned and that ended within ENDED_KEEP_MS, or NULL. */
static const struct ended_session *ended_find(const struct server *srv, const char *id, uid_t uid)
{
    int64_t now = now_ms();
    for (size_t i = 0; i < ENDED_KEEP; i++) {
        const struct ended_session *e = &srv->ended[i];
        if (e->id[0] && e->owner_uid == uid && now - e->at_ms <= ENDED_KEEP_MS &&
            strcmp(e->id, id) == 0)
            return e;
    }
    return NULL;
}

/* `"labels":{...}` for a log record (nothing when the session has none). */
static void labels_json(struct buf *f, char **labels)
{
    if (!labels)
        return;
    buf_append_lit(f, ",\"labels\":{");
    for (char **l = labels; *l; l += 2) {
        if (l != labels)
            buf_append_lit(f, ",");
        json_cstr(f, l[0]);
        buf_append_lit(f, ":");
        json_cstr(f, l[1]);
    }
    buf_append_lit(f, "}");
}

static void pairs_free(char **labels)
{
    for (char **l = labels; l && *l; l++)
        free(*l);
    free(labels);
}

static void labels_pack(msgpack_packer *pk, char **labels)
{
    size_t n = 0;
    for (char **l = labels; l && *l; l += 2)
        n++;
    msgpack_pack_map(pk, n);
    for (char **l = labels; l && *l; l += 2)
        rpc_pack_kv_str(pk, l[0], l[1]);
}

/* A session's record in the log: opened, closed or expired (with the layer). */
static void log_session(const struct srv_session *ss, const char *event)
{
    if (log_threshold < LOG_INFO)
        return;
    struct buf f = {0};
    buf_append_lit(&f, "\"event\":\"session\",\"session\":");
    json_cstr(&f, ss->s->id);
    buf_printf(&f, ",\"state\":\"%s\",\"uid\":%u", event, (unsigned)ss->owner_uid);
    if (ss->end_layer) {
        buf_append_lit(&f, ",\"layer\":");
        json_cstr(&f, ss->end_layer);
    }
    labels_json(&f, ss->labels);
    /* the line a human greps for */
    char msg[160];
    if (ss->end_layer)
        snprintf(msg, sizeof msg, "session %s expired (%s)", ss->s->id, ss->end_layer);
    else
        snprintf(msg, sizeof msg, "session %s %s", ss->s->id, event);
    buf_append_lit(&f, ",\"msg\":");
    json_cstr(&f, msg);
    log_json_line("info", f.data);
    buf_free(&f);
}

static void session_end(struct srv_session *ss, const char *layer)
{
    if (ss->ending)
        return;
    ss->ending = true;
    ss->end_layer = layer;
    ev_timer_stop(ss->srv->loop, &ss->lease);
    ev_timer_stop(ss->srv->loop, &ss->fuse);
    for (struct srv_call *sc = ss->srv->calls; sc; sc = sc->next) {
        if (sc->sess != ss)
            continue;
        ss->calls_killed++;
        /* Hard: the session's time is up (or it was closed); no grace for its tools. */
        if (layer)
            call_stop(sc->call, CLASS_SESSION_EXPIRED, layer, NULL, true);
        else
            call_stop(sc->call, CLASS_CANCELLED, NULL, "the session was closed", true);
    }
    if (ss->ncalls == 0)
        session_finish(ss);
}

/* The last call of an ending session is answered: remove its root, tell who asked. */
/* Its root is gone (or could not all go yet, and is being retried): tell who asked. */
static void on_root_removed(void *ud, bool removed)
{
    struct srv_session *ss = ud;
    struct server *srv = ss->srv;
    srv->last_stale = true;         /* its uid's lock goes with it */
    for (struct srv_session **pp = &srv->removing; *pp; pp = &(*pp)->next) {
        if (*pp == ss) {
            *pp = ss->next;
            break;
        }
    }
    while (ss->waiters) {
        struct close_waiter *w = ss->waiters;
        ss->waiters = w->next;
        if (w->conn) {
            msgpack_packer *pk = result_begin(w->conn, w->msgid, 2);
            rpc_pack_kv_bool(pk, "removed", removed);
            rpc_pack_kv_int(pk, "calls_killed", ss->calls_killed);
            rpc_conn_flush(w->conn->rpc);
        }
        free(w);
    }
    if (ss->end_layer)
        srv->metrics.sessions_expired++;
    else
        srv->metrics.sessions_closed++;
    pairs_free(ss->labels);
    free(ss);
}

static void prepared_refill(struct server *srv);
static bool errno_is_shortage(int e);

/* The last call of an ending session is answered: its processes end, its root goes off
 * the loop (a tool decides how big it is), and the close is answered once it is gone. */
static void session_finish(struct srv_session *ss)
{
    struct server *srv = ss->srv;
    if (ss->starting) {
        ev_io_stop(srv->loop, &ss->zygote_ready);
        zygote_stop(ss->starting);
        ss->starting = NULL;
        if (ss->open_conn)
            rpc_send_error(ss->open_conn->rpc, ss->open_msgid, "INTERNAL", false,
                           "the session ended before its sandbox was ready", NULL);
        prepared_refill(srv);       /* it may have taken the world made ahead */
    }
    for (struct srv_session **pp = &srv->sessions; *pp; pp = &(*pp)->next) {
        if (*pp == ss) {
            *pp = ss->next;
            break;
        }
    }
    srv->nsessions--;
    srv->last_stale = true;
    ended_remember(srv, ss);
    log_session(ss, ss->end_layer ? "expired" : "closed");
    if (ss->end_layer && ss->owner) {
        send_notification_begin(ss->owner, "session.expired", 2);
        rpc_pack_kv_str(&ss->owner->rpc->pk, "session_id", ss->s->id);
        rpc_pack_kv_str(&ss->owner->rpc->pk, "layer", ss->end_layer);
        rpc_conn_flush(ss->owner->rpc);
    }
    ss->next = srv->removing;
    srv->removing = ss;
    session_close_async(ss->s, srv->remover, on_root_removed, ss);
    ss->s = NULL;
}

static void on_lease(struct ev_loop *loop, ev_timer *w, int revents)
{
    (void)loop, (void)revents;
    struct srv_session *ss = w->data;
    /* A running call is activity: the lease only lapses on an idle session. */
    if (ss->ncalls > 0) {
        session_touch(ss);
        return;
    }
    session_end(ss, "ttl");
}

static void on_fuse(struct ev_loop *loop, ev_timer *w, int revents)
{
    (void)loop, (void)revents;
    session_end(w->data, "fuse");
}

/* The record's lease runs half a lease ahead of the real one: a session in use is
 * rewritten at most once per half lease, and a crash never finds the record of a session
 * still in its lease expired (it may outlive its lease by half of one instead). */
static void session_persist_lease(struct srv_session *ss)
{
    struct session_record *r = ss->s->record;
    if (!r || ss->expires_at_ms <= r->lease_at_ms)
        return;
    int64_t lease_at = ss->expires_at_ms + ss->ttl_ms / 2;
    if (lease_at > r->fuse_at_ms)
        lease_at = r->fuse_at_ms;
    /* A lease already at the fuse cannot grow: rewriting it (two fsyncs, on the loop)
     * would change nothing, and would on every call of the session's last lease. */
    if (lease_at <= r->lease_at_ms)
        return;
    int64_t before = r->lease_at_ms;
    r->lease_at_ms = lease_at;
    if (session_record_save(ss->s) < 0) {
        LOG_W("session %s: its record keeps the older lease: %s", ss->s->id, strerror(errno));
        r->lease_at_ms = before;
    }
}

static void session_touch(struct srv_session *ss)
{
    ev_timer_again(ss->srv->loop, &ss->lease);
    ss->expires_at_ms = wall_ms() + ss->ttl_ms;
    session_persist_lease(ss);
}

static void pack_session_info(msgpack_packer *pk, const struct srv_session *ss)
{
    rpc_pack_kv_str(pk, "session_id", ss->s->id);
    rpc_pack_kv_str(pk, "root", ss->s->root);
    rpc_pack_kv_int(pk, "expires_at_ms", ss->expires_at_ms);
    rpc_pack_kv_int(pk, "fuse_at_ms", ss->fuse_at_ms);
}

/* Reattach: the same uid may pick up its session on another connection. */
/* A strict session's zygote is ready (or failed): session.open is answered now. */
static void on_zygote_ready(struct ev_loop *loop, ev_io *w, int revents)
{
    (void)revents;
    struct srv_session *ss = w->data;
    ev_io_stop(loop, w);
    struct zygote *z = ss->starting;
    ss->starting = NULL;
    char *err = NULL;
    struct server *srv = ss->srv;
    bool ahead = z->made_ahead;
    if (zygote_start_finish(z, &err) == 0) {
        ss->s->zygote = z;
        if (ss->open_conn) {
            msgpack_packer *pk = result_begin(ss->open_conn, ss->open_msgid, 4);
            pack_session_info(pk, ss);
            rpc_conn_flush(ss->open_conn->rpc);
        }
        ss->open_conn = NULL;
    } else {
        int e = errno;
        struct zygote *own = NULL;
        char *why = NULL;
        /* a world made ahead that died (killed, OOM) before it took the session: the
         * session builds its own, once */
        if (ahead && session_isolate_begin(ss->s, srv->policy, srv->spawner, NULL, &own,
                                           &why) && own) {
            LOG_W("session %s: the world made ahead failed (%s); it builds its own",
                  ss->s->id, err);
            free(err);
            ss->starting = own;
            ev_io_init(&ss->zygote_ready, on_zygote_ready, zygote_start_fd(own), EV_READ);
            ev_io_start(loop, &ss->zygote_ready);
            prepared_refill(srv);
            return;
        }
        if (why) {
            free(err);
            err = why;
            e = errno;
        }
        LOG_W("session.open: %s", err);
        /* short of namespaces, memory or processes: retryable, and said so */
        bool shortage = errno_is_shortage(e);
        if (ss->open_conn)
            rpc_send_error(ss->open_conn->rpc, ss->open_msgid,
                           shortage ? "OVERLOADED" : "INTERNAL", shortage, err, NULL);
        free(err);
        ss->open_conn = NULL;
        session_end(ss, NULL);
    }
    /* the next session's world (if this one took it), once this one has its answer: the
     * fork is the loop's time */
    prepared_refill(srv);
}

static void session_reattach(struct srv_conn *conn, uint32_t msgid, struct srv_session *ss)
{
    if (ss->owner_uid != conn->uid || ss->ending || ss->starting) {
        bad_request(conn, msgid, "session %s is in use", ss->s->id);
        return;
    }
    ss->owner = conn;
    session_touch(ss);
    msgpack_packer *pk = result_begin(conn, msgid, 4);
    pack_session_info(pk, ss);
    rpc_conn_flush(conn->rpc);
}

/* Strict: the next session's world made ahead of it (one; zygote.h, zygote_bind), so
 * that session.open attaches only the session's root and tmp: a new network namespace
 * and some thirty mount operations are off its path. Remade once taken, and for a new
 * policy. */
static void prepared_refill(struct server *srv)
{
    if (srv->prepared && srv->prepared_gen != srv->policy->generation) {
        zygote_stop(srv->prepared);
        srv->prepared = NULL;
    }
    if (srv->prepared || srv->draining || strcmp(srv->policy->isolation, "strict") != 0 ||
        !zygote_prepare_enabled())
        return;
    char *err = NULL;
    struct zygote_config zc = {
        .state_dir = srv->state_dir, .mounts = srv->policy->mounts,
        .nmounts = srv->policy->nmounts,
        .loopback_up = strcmp(srv->policy->network, "loopback") == 0,
    };
    srv->prepared = zygote_start_begin(&zc, &err);
    if (!srv->prepared) {
        LOG_W("no session world made ahead (sessions build their own): %s", err);
        free(err);
        return;
    }
    srv->prepared_gen = srv->policy->generation;
}

/* An errno that says the server is short of something that comes back (descriptors,
 * memory, disk): the request may be repeated, and it is not the server's bug. */
static bool errno_is_shortage(int e)
{
    return e == EMFILE || e == ENFILE || e == ENOMEM || e == EAGAIN || e == ENOSPC ||
           e == EDQUOT || e == EFBIG;
}

/* A new session (id NULL: a random one) with its isolation, its lease (ttl_ms) and its
 * fuse (fuse_ms, at most the policy's); 0: the policy's. `labels` (key, value, ...,
 * NULL, or NULL) become the session's, or are freed. Answers either way. */
static void session_create(struct srv_conn *conn, uint32_t msgid, const char *id,
                           int64_t ttl_ms, int64_t fuse_ms, char **labels)
{
    struct server *srv = conn->srv;
    char *err = NULL;
    struct session *s = NULL;
    struct zygote *starting = NULL;
    if (srv->draining) {
        rpc_send_error(conn->rpc, msgid, "OVERLOADED", true, "the server is shutting down", NULL);
    } else if ((int64_t)srv->nsessions >= srv->policy->limits.sessions) {
        char msg[128];
        snprintf(msg, sizeof msg, "session limit reached (%u open)", srv->nsessions);
        rpc_send_error(conn->rpc, msgid, "OVERLOADED", true, msg, NULL);
    } else {
        const struct policy_timeouts *to = &srv->policy->timeouts;
        ttl_ms = ttl_ms > 0 ? ttl_ms : to->lease_ms;    /* at most DURATION_MAX_MS: no wrap */
        fuse_ms = fuse_ms > 0 && fuse_ms < to->fuse_ms ? fuse_ms : to->fuse_ms;
        int64_t now = wall_ms();
        struct session_record rec = {
            .owner = owns_state_dir(srv->opts) ? RECORD_SERVE : RECORD_STDIO,
            .pid = owns_state_dir(srv->opts) ? 0 : getpid(), .client_uid = conn->uid,
            .created_ms = now,
            .ttl_ms = ttl_ms, .lease_at_ms = now + ttl_ms + ttl_ms / 2,
            .fuse_at_ms = now + fuse_ms, .labels = labels,
        };
        if (rec.lease_at_ms > rec.fuse_at_ms)
            rec.lease_at_ms = rec.fuse_at_ms;
        snprintf(rec.holder, sizeof rec.holder, "%s", srv->holder);
        snprintf(rec.isolation, sizeof rec.isolation, "%s", srv->policy->isolation);
        snprintf(rec.policy_sha256, sizeof rec.policy_sha256, "%s", srv->policy->sha256);
        s = session_open_recorded(srv->state_dir, id, false, srv->opts->uids, &rec, &err);
        int saved = errno;
        if (srv->prepared && srv->prepared_gen != srv->policy->generation)
            prepared_refill(srv);       /* made for an older policy */
        if (s && !session_isolate_begin(s, srv->policy, srv->spawner, &srv->prepared,
                                        &starting, &err)) {
            saved = errno;
            session_close(s);
            s = NULL;
        }
        if (!s) {
            /* short of descriptors, memory or disk: retryable, and said so */
            if (errno_is_shortage(saved))
                rpc_send_error(conn->rpc, msgid, "OVERLOADED", true, err, NULL);
            else
                rpc_send_error(conn->rpc, msgid, saved == EEXIST ? "BAD_REQUEST" : "INTERNAL",
                               false, err, NULL);
            LOG_W("session.open: %s", err);
            free(err);
        }
    }
    if (!s) {
        pairs_free(labels);
        prepared_refill(srv);           /* if it was taken and could not be used */
        return;
    }
    ended_forget(srv, s->id);
    struct srv_session *ss = xcalloc(1, sizeof *ss);
    ss->s = s;
    ss->srv = srv;
    ss->owner = conn;
    ss->owner_uid = conn->uid;
    ss->labels = labels;
    ss->isolated = true;
    ss->ttl_ms = ttl_ms;
    ev_timer_init(&ss->lease, on_lease, 0, (double)ss->ttl_ms / 1000.0);
    ev_timer_init(&ss->fuse, on_fuse, (double)fuse_ms / 1000.0, 0);
    ss->lease.data = ss->fuse.data = ss;
    session_touch(ss);
    ev_timer_start(srv->loop, &ss->fuse);
    ss->fuse_at_ms = wall_ms() + fuse_ms;
    ss->next = srv->sessions;
    srv->sessions = ss;
    srv->nsessions++;
    srv->last_stale = true;
    log_session(ss, "opened");
    srv->metrics.sessions_opened++;
    if (starting) {
        /* its namespaces and mount tree take tens of milliseconds: answered when ready */
        ss->starting = starting;
        ss->open_conn = conn;
        ss->open_msgid = msgid;
        ev_io_init(&ss->zygote_ready, on_zygote_ready, zygote_start_fd(starting), EV_READ);
        ss->zygote_ready.data = ss;
        ev_io_start(srv->loop, &ss->zygote_ready);
        return;
    }
    msgpack_packer *pk = result_begin(conn, msgid, 4);
    pack_session_info(pk, ss);
    rpc_conn_flush(conn->rpc);
}

static void m_session_open(struct srv_conn *conn, uint32_t msgid, const msgpack_object *params)
{
    struct params p;
    params_begin(&p, conn, msgid, params);
    char *id = NULL, **labels = NULL;
    int64_t ttl = 0, fuse = 0;
    bool has_ttl, has_fuse;
    bool ok = param_str(&p, "session_id", false, &id) && param_ms(&p, "ttl_ms", &ttl, &has_ttl) &&
              param_ms(&p, "fuse_ms", &fuse, &has_fuse) &&
              param_strmap(&p, "labels", LABELS_MAX, 256, &labels) && params_end(&p);
    if (ok && id && !root_id_valid(id))
        ok = param_fail(&p, "session_id: expected a string matching [A-Za-z0-9][A-Za-z0-9_.-]{0,63}");
    struct srv_session *ss = ok && id ? session_find(conn->srv, id) : NULL;
    if (!ok || ss) {
        if (ss)
            session_reattach(conn, msgid, ss);
        pairs_free(labels);
    } else {
        session_create(conn, msgid, id, has_ttl ? ttl : 0, has_fuse ? fuse : 0, labels);
    }
    free(id);
}

/* ---- helpers that die: the spawner, a session's zygote ---------------------------------- */

static bool zygote_in_use(const struct server *srv, const struct zygote *z)
{
    for (const struct srv_call *sc = srv->calls; sc; sc = sc->next)
        if (sc->call && sc->call->zygote == z)
            return true;
    return false;
}

/* Keep a dead helper until the calls it started are answered (they refer to it), then
 * end it; with z NULL, only end those no call refers to any more. */
static void helpers_retire(struct server *srv, struct zygote *z)
{
    if (z) {
        srv->retired = xgrow(srv->retired, &srv->retired_cap, srv->nretired,
                             sizeof *srv->retired, 4);
        srv->retired[srv->nretired++] = z;
    }
    size_t kept = 0;
    for (size_t i = 0; i < srv->nretired; i++) {
        if (zygote_in_use(srv, srv->retired[i]))
            srv->retired[kept++] = srv->retired[i];
        else
            zygote_stop(srv->retired[i]);
    }
    srv->nretired = kept;
}

/* The spawner died (killed, OOM): start another, hand it to the sessions that borrowed
 * the old one. Until one starts, calls fork from the server. A world made ahead that
 * died is replaced too (a session.open would build its own meanwhile). */
static void spawner_check(struct server *srv)
{
    helpers_retire(srv, NULL);
    if (srv->prepared && !zygote_alive(srv->prepared)) {
        LOG_W("the session world made ahead died; another is made");
        zygote_stop(srv->prepared);
        srv->prepared = NULL;
        prepared_refill(srv);
    }
    if (!srv->spawner || zygote_alive(srv->spawner))
        return;
    struct zygote *old = srv->spawner;
    char *err = NULL;
    struct zygote_config plain = {.plain = true};
    struct zygote *fresh = zygote_start(&plain, &err);
    if (!fresh) {
        LOG_W("the spawner died and could not be started again (%s); calls fork from the "
              "server meanwhile", err);
        free(err);
        return;
    }
    LOG_W("the spawner died; a new one was started");
    for (struct srv_session *ss = srv->sessions; ss; ss = ss->next)
        if (ss->s->spawner == old)
            ss->s->spawner = fresh;
    srv->spawner = fresh;
    helpers_retire(srv, old);
}

/* A strict session whose zygote died gets a new one on its next call. */
static void session_zygote_check(struct srv_session *ss)
{
    if (!ss->isolated || !ss->s->zygote || zygote_alive(ss->s->zygote))
        return;
    LOG_W("session %s: its zygote died; a new one is built for its next call", ss->s->id);
    helpers_retire(ss->srv, session_zygote_take(ss->s));
    ss->isolated = false;
}

/* ---- recovery: the sessions a previous server left ----------------------------------- */

static void on_cleaner_exit(struct proc *p, int wstatus, void *ud)
{
    (void)p;
    struct server *srv = ud;
    srv->cleaning = false;
    if (!WIFEXITED(wstatus) || WEXITSTATUS(wstatus) != 0)
        LOG_W("recovery: some expired roots could not be removed yet; their records stay, "
              "the next start retries");
    else
        LOG_I("recovery: expired roots removed");
}

/* Remove the roots (then the records) of `ids` in a child process: how long it takes is
 * up to what the tools left in them, and the loop must not wait for it. The child holds
 * the service uids (uid_fds, closed here) until the files they own are gone. */
static void recovery_remove(struct server *srv, char **ids, int *uid_fds, size_t n)
{
    if (n == 0 || srv->cleaning) {
        /* (one at a time: an earlier one, stopped, leaves its records for the next start) */
        for (size_t i = 0; i < n; i++)
            close_quietly(&uid_fds[i]);
        return;
    }
    pid_t pid = fork();
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0);
        int failed = 0;
        for (size_t i = 0; i < n; i++) {
            if (root_remove(srv->state_dir, ids[i]) == 0)
                failed += record_remove(srv->state_dir, ids[i]) < 0;
            else
                failed++;
        }
        _exit(failed ? 1 : 0);
    }
    for (size_t i = 0; i < n; i++)
        close_quietly(&uid_fds[i]);
    int pidfd = pid > 0 ? pidfd_open(pid, 0) : -1;
    if (pid < 0 || pidfd < 0) {
        LOG_E("recovery: cannot remove expired roots now (%s); the next start retries",
              strerror(errno));
        if (pid > 0)
            proc_kill_reap(pid, -1);
        return;
    }
    proc_watch(&srv->cleaner, pid, pidfd, on_cleaner_exit, srv);
    srv->cleaning = true;
}

static void on_lease(struct ev_loop *loop, ev_timer *w, int revents);
static void on_fuse(struct ev_loop *loop, ev_timer *w, int revents);

/* A session taken back from its record: a fresh lease (the server's downtime is not the
 * client's idleness), the fuse where it was; isolation on its first call. */
static void session_adopted_add(struct server *srv, struct session *s,
                                const struct session_record *r, int64_t now)
{
    struct srv_session *ss = xcalloc(1, sizeof *ss);
    ss->s = s;
    ss->srv = srv;
    ss->owner_uid = r->client_uid;
    ss->labels = strv_dup(r->labels);
    ss->ttl_ms = r->ttl_ms > 0 ? r->ttl_ms : srv->policy->timeouts.lease_ms;
    int64_t fuse_ms = r->fuse_at_ms - now;
    ev_timer_init(&ss->lease, on_lease, 0, (double)ss->ttl_ms / 1000.0);
    ev_timer_init(&ss->fuse, on_fuse, (double)fuse_ms / 1000.0, 0);
    ss->lease.data = ss->fuse.data = ss;
    session_touch(ss);
    ev_timer_start(srv->loop, &ss->fuse);
    ss->fuse_at_ms = r->fuse_at_ms;
    ss->next = srv->sessions;
    srv->sessions = ss;
    srv->nsessions++;
    log_session(ss, "adopted");
}

/* Read every record of the state dir (which this server has locked). The rule, one for
 * every case (README, "Recovery"):
 * - a server's session whose lease and fuse have not run out is adopted;
 * - one that expired, or was being closed, is removed (root, then record), off the loop;
 * - a record whose root is gone is removed;
 * - a root with no record is left on disk and reported (`stockade sessions gc` removes
 *   it): it is not known whose it is;
 * - `stockade run`'s records are not the server's: left alone. */
static void server_recover(struct server *srv)
{
    char **ids = record_ids(srv->state_dir);
    char **roots = record_root_ids(srv->state_dir);
    if (!ids || !roots) {
        LOG_E("recovery: cannot list %s: %s", srv->state_dir, strerror(errno));
        strv_free(ids);
        strv_free(roots);
        return;
    }
    size_t n = 0;
    while (ids[n])
        n++;
    char **doomed = xcalloc(n + 1, sizeof *doomed);
    int *doomed_uids = xcalloc(n + 1, sizeof *doomed_uids);
    size_t ndoomed = 0;
    unsigned adopted = 0;
    int64_t now = wall_ms();
    for (size_t i = 0; i < n; i++) {
        struct session_record r;
        if (record_read(srv->state_dir, ids[i], &r) < 0) {
            LOG_W("recovery: record %s unreadable (%s): left as it is", ids[i], strerror(errno));
            continue;
        }
        bool has_root = false;
        for (char **p = roots; *p; p++)
            has_root |= strcmp(*p, r.id) == 0;
        char *err = NULL;
        struct session *s = NULL;
        if (r.owner != RECORD_SERVE) {
            /* stockade run's: not ours */
        } else if (!has_root) {
            LOG_W("recovery: session %s has a record and no root: record removed", r.id);
            if (record_remove(srv->state_dir, r.id) < 0)
                LOG_W("recovery: record %s: %s", r.id, strerror(errno));
        } else if (record_expired(srv->state_dir, &r, now)) {
            LOG_I("recovery: session %s %s while no server ran: removing it", r.id,
                  r.state == RECORD_CLOSING ? "was being closed" : "expired");
            doomed_uids[ndoomed] = r.service_uid && geteuid() == 0 ? session_uid_lock(r.uid) : -1;
            doomed[ndoomed++] = xstrdup(r.id);
        } else if ((s = session_adopt(srv->state_dir, &r, &err))) {
            session_adopted_add(srv, s, &r, now);
            adopted++;
        } else {
            LOG_E("recovery: session %s not adopted, left on disk with its record: %s", r.id,
                  err);
            free(err);
        }
        record_clear(&r);
    }
    for (char **p = roots; *p; p++) {
        bool recorded = false;
        for (size_t i = 0; i < n; i++)
            recorded |= strcmp(ids[i], *p) == 0;
        if (!recorded)
            LOG_W("recovery: root %s/sessions/%s has no record: left on disk "
                  "(`stockade sessions gc` removes it)", srv->state_dir, *p);
    }
    if (adopted || ndoomed)
        LOG_I("recovery: %u sessions adopted, %zu expired", adopted, ndoomed);
    recovery_remove(srv, doomed, doomed_uids, ndoomed);
    strv_free(doomed);
    free(doomed_uids);
    strv_free(ids);
    strv_free(roots);
}

/* The live session `id` of this connection's uid, touched; NULL (and an answer sent)
 * otherwise: SESSION_EXPIRED with its layer when it expired lately, else NO_SUCH_SESSION. */
static struct srv_session *session_lookup(struct srv_conn *conn, uint32_t msgid, const char *id)
{
    struct srv_session *ss = session_find(conn->srv, id);
    /* a strict session whose zygote is on its way is not open yet: its calls would
     * run without its namespaces */
    if (ss && ss->owner_uid == conn->uid && !ss->ending && !ss->starting) {
        session_touch(ss);
        return ss;
    }
    const char *layer = NULL;
    if (ss && ss->owner_uid == conn->uid)
        layer = ss->end_layer;              /* still ending: expired, or being closed */
    else if (!ss) {
        const struct ended_session *e = ended_find(conn->srv, id, conn->uid);
        layer = e ? e->layer : NULL;
    }
    char msg[160];
    if (layer) {
        snprintf(msg, sizeof msg, "session %.64s expired (%s)", id, layer);
        rpc_send_error(conn->rpc, msgid, "SESSION_EXPIRED", false, msg, layer);
    } else {
        snprintf(msg, sizeof msg, "no such session: %.64s", id);
        rpc_send_error(conn->rpc, msgid, "NO_SUCH_SESSION", false, msg, NULL);
    }
    return NULL;
}

/* Methods whose only parameter is the session: the session, or NULL with an answer sent. */
static struct srv_session *session_only_param(struct srv_conn *conn, uint32_t msgid,
                                              const msgpack_object *params, char **id)
{
    struct params p;
    params_begin(&p, conn, msgid, params);
    if (!param_str(&p, "session_id", true, id) || !params_end(&p)) {
        free(*id);
        *id = NULL;
        return NULL;
    }
    return session_find(conn->srv, *id);
}

static void m_session_renew(struct srv_conn *conn, uint32_t msgid, const msgpack_object *params)
{
    char *id = NULL;
    session_only_param(conn, msgid, params, &id);
    struct srv_session *ss = id ? session_lookup(conn, msgid, id) : NULL;
    free(id);
    if (!ss)
        return;
    msgpack_packer *pk = result_begin(conn, msgid, 1);
    rpc_pack_kv_int(pk, "expires_at_ms", ss->expires_at_ms);
    rpc_conn_flush(conn->rpc);
}

/* Idempotent: a session of this uid that already ended answers {removed: false,
 * calls_killed: 0}; one being closed answers with the first close. */
static void m_session_close(struct srv_conn *conn, uint32_t msgid, const msgpack_object *params)
{
    char *id = NULL;
    struct srv_session *ss = session_only_param(conn, msgid, params, &id);
    if (!id)
        return;
    if (ss && ss->owner_uid == conn->uid) {
        struct close_waiter *w = xcalloc(1, sizeof *w);
        w->conn = conn;
        w->msgid = msgid;
        w->next = ss->waiters;
        ss->waiters = w;
        session_end(ss, NULL);    /* answers now, or when its last call is reaped */
    } else if (!ss && ended_find(conn->srv, id, conn->uid)) {
        msgpack_packer *pk = result_begin(conn, msgid, 2);
        rpc_pack_kv_bool(pk, "removed", false);
        rpc_pack_kv_int(pk, "calls_killed", 0);
        rpc_conn_flush(conn->rpc);
    } else {
        char msg[160];
        snprintf(msg, sizeof msg, "no such session: %.64s", id);
        rpc_send_error(conn->rpc, msgid, "NO_SUCH_SESSION", false, msg, NULL);
    }
    free(id);
}

/* ---- calls -------------------------------------------------------------------------- */

static void pack_call_result(msgpack_packer *pk, const struct call_result *r)
{
    msgpack_pack_map(pk, 13);
    rpc_pack_kv_str(pk, "class", call_class_name(r->class));
    rpc_pack_kv_bool(pk, "retryable", r->retryable);
    rpc_pack_kv_str(pk, "message", r->message ? r->message : "");
    rpc_pack_kv_str(pk, "layer", r->layer);
    rpc_pack_key(pk, "exit_code");
    if (r->has_exit_code)
        msgpack_pack_int(pk, r->exit_code);
    else
        msgpack_pack_nil(pk);
    rpc_pack_key(pk, "signal");
    if (r->signal)
        msgpack_pack_int(pk, r->signal);
    else
        msgpack_pack_nil(pk);
    rpc_pack_key(pk, "stdout");
    msgpack_pack_bin_with_body(pk, r->out.data ? r->out.data : "", r->out.len);
    rpc_pack_key(pk, "stderr");
    msgpack_pack_bin_with_body(pk, r->err.data ? r->err.data : "", r->err.len);
    rpc_pack_key(pk, "truncated");
    msgpack_pack_map(pk, 2);
    rpc_pack_kv_int(pk, "stdout", r->truncated_out);
    rpc_pack_kv_int(pk, "stderr", r->truncated_err);
    rpc_pack_kv_int(pk, "redactions", r->redactions);
    rpc_pack_kv_int(pk, "duration_ms", r->duration_ms);
    rpc_pack_kv_int(pk, "cpu_ms", r->cpu_ms);
    rpc_pack_kv_int(pk, "max_rss_kb", r->max_rss_kb);
}

static void maybe_stop(struct server *srv);
static void alarm_message(const struct server *srv, enum alarm_kind k, char *out, size_t n);

/* One record per call: correlation ids, the decision and the outcome, sizes and times.
 * Never argv values, output bodies or stderr: the message is the core's own line (or
 * the policy's, redacted). */
static void log_call(const struct srv_call *sc, const struct call *c)
{
    if (log_threshold < LOG_INFO)
        return;
    const struct call_result *r = &c->result;
    struct buf f = {0};
    buf_append_lit(&f, "\"event\":\"call\",\"session\":");
    json_cstr(&f, sc->sess->s->id);
    buf_printf(&f, ",\"msgid\":%u,\"call_id\":%llu,\"tool\":", sc->msgid,
               (unsigned long long)sc->id);
    json_cstr(&f, c->req.tool);
    buf_printf(&f, ",\"decision\":\"%s\",\"class\":\"%s\",\"layer\":",
               sc->counted ? "run" : "refused", call_class_name(r->class));
    json_cstr(&f, r->layer);
    buf_append_lit(&f, ",\"message\":");
    json_cstr(&f, r->message);
    if (r->has_exit_code)
        buf_printf(&f, ",\"exit\":%d", r->exit_code);
    if (r->signal)
        buf_printf(&f, ",\"signal\":%d", r->signal);
    buf_printf(&f, ",\"duration_ms\":%lld,\"cpu_ms\":%lld,\"bytes_in\":%zu,"
                   "\"bytes_out\":%zu,\"bytes_err\":%zu,\"truncated\":%lld,"
                   "\"redactions\":%lld,\"generation\":%u",
               (long long)r->duration_ms, (long long)r->cpu_ms, c->req.stdin_len, r->out.len,
               r->err.len, (long long)(r->truncated_out + r->truncated_err),
               (long long)r->redactions, c->policy->generation);
    labels_json(&f, sc->sess->labels);
    log_json_line(r->class == CLASS_INTERNAL ? "error" : "info", f.data);
    buf_free(&f);
}

static void on_call_done(struct call *c, void *ud)
{
    struct srv_call *sc = ud;
    struct server *srv = sc->sess->srv;
    const struct call_result *r = &c->result;
    if (sc->conn) {
        msgpack_packer *pk = &sc->conn->rpc->pk;
        msgpack_pack_array(pk, 4);
        msgpack_pack_int(pk, 1);
        msgpack_pack_uint32(pk, sc->msgid);
        msgpack_pack_nil(pk);
        pack_call_result(pk, r);
        rpc_conn_flush(sc->conn->rpc);
    }
    srv->metrics.redactions += (uint64_t)r->redactions;
    srv->last_stale = true;
    log_call(sc, c);
    metrics_observe_call(&srv->metrics, sc->counted ? c->req.tool : NULL, r->class,
                         r->duration_ms);
    if (sc->counted)
        record_latency(srv, c->req.tool, r->duration_ms);
    for (struct srv_call **pp = &srv->calls; *pp; pp = &(*pp)->next) {
        if (*pp == sc) {
            *pp = sc->next;
            break;
        }
    }
    struct srv_session *ss = sc->sess;
    if (sc->counted)
        srv->running--;
    if (sc->counted && sc->conn)
        sc->conn->running--;
    ss->ncalls--;
    call_free(c);
    free(sc);
    if (ss->ending && ss->ncalls == 0)
        session_finish(ss);
    maybe_stop(srv);
}

static void on_call_output(struct call *c, enum call_stream s, const char *data, size_t len,
                           void *ud)
{
    struct srv_call *sc = ud;
    (void)c;
    if (!sc->conn)
        return;
    send_notification_begin(sc->conn, "call.output", 3);
    msgpack_packer *pk = &sc->conn->rpc->pk;
    rpc_pack_kv_int(pk, "msgid", sc->msgid);
    rpc_pack_kv_str(pk, "stream", s == CALL_STDOUT ? "stdout" : "stderr");
    rpc_pack_key(pk, "data");
    msgpack_pack_bin_with_body(pk, data, len);
    rpc_conn_flush(sc->conn->rpc);
}

/* The call's params into `req` (owned by the caller: call_request_free, also on false),
 * and the session it names; false with BAD_REQUEST sent when malformed. */
static bool parse_call(struct params *p, struct call_request *req, char **session_id)
{
    memset(req, 0, sizeof *req);
    int64_t timeout = 0, deadline = 0, depth = -1;
    bool has_timeout, has_deadline, has_depth;
    char **env_pairs = NULL;
    bool ok = param_str(p, "session_id", true, session_id) &&
              param_str(p, "tool", true, &req->tool) &&
              param_strv(p, "argv", &req->argv, &req->argc) &&
              param_map(p, "args", &req->args) &&
              param_strmap(p, "env", UINT32_MAX, SIZE_MAX, &env_pairs) &&
              param_bin(p, "stdin", &req->stdin_data, &req->stdin_len) &&
              param_ms(p, "timeout_ms", &timeout, &has_timeout) &&
              param_int(p, "deadline_ms", INT64_MIN, INT64_MAX, &deadline, &has_deadline) &&
              param_int(p, "depth", INT64_MIN, INT64_MAX, &depth, &has_depth) &&
              param_bool(p, "idempotent", &req->idempotent_hint) &&
              param_bool(p, "stream", &req->stream) && params_end(p);
    if (ok && !req->tool[0])
        ok = param_fail(p, "tool: required non-empty string");
    if (ok && req->args && req->argv)
        ok = param_fail(p, "argv and args: send one or the other");
    if (!ok) {
        pairs_free(env_pairs);
        return false;
    }
    if (!req->argv)
        req->argv = xcalloc(1, sizeof *req->argv);
    req->timeout_ms = has_timeout ? timeout : 0;
    /* A deadline already spent (0 or less) is refused as DEADLINE_EXCEEDED with the value
     * the caller sent; beyond DURATION_MAX_MS it could never run out. */
    req->has_deadline = has_deadline;
    req->deadline_ms = has_deadline && deadline > DURATION_MAX_MS ? DURATION_MAX_MS : deadline;
    req->depth = has_depth ? (depth > 0 ? depth : 0) : -1;
    if (env_pairs) {
        size_t n = 0;
        while (env_pairs[2 * n])
            n++;
        req->env = xcalloc(n + 1, sizeof *req->env);
        for (size_t i = 0; i < n; i++)
            req->env[i] = xasprintf("%s=%s", env_pairs[2 * i], env_pairs[2 * i + 1]);
        pairs_free(env_pairs);
    }
    return true;
}

static void m_call(struct srv_conn *conn, uint32_t msgid, const msgpack_object *params)
{
    struct server *srv = conn->srv;
    struct params p;
    params_begin(&p, conn, msgid, params);
    struct call_request req;
    char *id = NULL;
    bool ok = parse_call(&p, &req, &id);
    struct srv_session *ss = ok ? session_lookup(conn, msgid, id) : NULL;
    free(id);
    if (!ss) {
        call_request_free(&req);
        return;
    }
    /* On a socket no one client may hold every slot: a quarter (at least one) stays
     * for the others. */
    int64_t limit = srv->policy->limits.running;
    int64_t share = srv->opts->listen_path ? limit - (limit / 4 > 1 ? limit / 4 : 1) : limit;
    if (share < 1)
        share = 1;
    if (srv->draining || (int64_t)srv->running >= limit || (int64_t)conn->running >= share) {
        char msg[128];
        if (srv->draining)
            snprintf(msg, sizeof msg, "the server is shutting down");
        else if ((int64_t)srv->running >= limit)
            snprintf(msg, sizeof msg, "running-call limit reached (%u running)", srv->running);
        else
            snprintf(msg, sizeof msg, "this connection's share of running calls reached "
                     "(%u of %lld)", conn->running, (long long)limit);
        rpc_send_error(conn->rpc, msgid, "OVERLOADED", true, msg, NULL);
        call_request_free(&req);
        return;
    }
    spawner_check(srv);
    session_zygote_check(ss);
    if (!ss->isolated) {
        /* adopted after a restart, or its zygote died: its zygote or ruleset is built
         * now; the call waits for a zygote on its way, the loop does not */
        char *err = NULL;
        if (!session_isolate_async(ss->s, srv->policy, srv->spawner, &err)) {
            bool shortage = errno_is_shortage(errno);
            rpc_send_error(conn->rpc, msgid, shortage ? "OVERLOADED" : "INTERNAL", shortage,
                           err, NULL);
            LOG_W("session %s: isolation: %s", ss->s->id, err);
            free(err);
            call_request_free(&req);
            return;
        }
        ss->isolated = true;
    }
    struct srv_call *sc = xcalloc(1, sizeof *sc);
    sc->conn = conn;
    sc->msgid = msgid;
    sc->id = ++srv->call_seq;
    sc->sess = ss;
    sc->next = srv->calls;
    srv->calls = sc;
    ss->ncalls++;
    sc->call = call_start(srv->loop, srv->policy, ss->s, &req, on_call_done, on_call_output, sc);
    if (sc->call->state == CALL_RUNNING || sc->call->state == CALL_STARTING) {
        sc->counted = true;
        srv->running++;
        conn->running++;
        /* only a stream adds to what the client has not read: a plain call's output
         * waits in its (capped) result */
        if (conn->rpc->under_pressure && sc->call->req.stream)
            call_pause_output(sc->call, true);
    }
}

static void m_cancel(struct srv_conn *conn, uint32_t msgid, const msgpack_object *params)
{
    struct params p;
    params_begin(&p, conn, msgid, params);
    int64_t target = 0;
    bool has;
    if (!param_int(&p, "msgid", 0, UINT32_MAX, &target, &has) || !params_end(&p))
        return;
    if (!has) {
        bad_request(conn, msgid, "msgid: required unsigned integer");
        return;
    }
    bool found = false;
    for (struct srv_call *sc = conn->srv->calls; sc; sc = sc->next) {
        if (sc->conn == conn && sc->msgid == (uint32_t)target &&
            (sc->call->state == CALL_RUNNING || sc->call->state == CALL_TERMINATING ||
             sc->call->state == CALL_STARTING)) {
            call_stop(sc->call, CLASS_CANCELLED, NULL, NULL, false);
            found = true;
        }
    }
    msgpack_packer *pk = result_begin(conn, msgid, 1);
    rpc_pack_kv_bool(pk, "cancelled", found);
    rpc_conn_flush(conn->rpc);
}

/* ---- facts -------------------------------------------------------------------------- */

static void m_hello(struct srv_conn *conn, uint32_t msgid, const msgpack_object *params)
{
    struct server *srv = conn->srv;
    struct params p;
    params_begin(&p, conn, msgid, params);
    char *client = NULL;
    bool ok = param_str(&p, "client", false, &client) && params_end(&p);
    free(client);
    if (!ok)
        return;
    msgpack_packer *pk = result_begin(conn, msgid, 5);
    rpc_pack_kv_int(pk, "protocol", PROTOCOL_VERSION);
    rpc_pack_kv_str(pk, "version", STOCKADE_VERSION);
    rpc_pack_key(pk, "policy");
    msgpack_pack_map(pk, 3);
    rpc_pack_kv_str(pk, "name", srv->policy->name);
    rpc_pack_kv_str(pk, "sha256", srv->policy->sha256);
    rpc_pack_kv_int(pk, "generation", srv->policy->generation);
    rpc_pack_key(pk, "isolation");
    msgpack_pack_map(pk, 2);
    rpc_pack_kv_str(pk, "level", srv->policy->isolation);
    rpc_pack_key(pk, "layers");
    const char *layers[LAYER_COUNT + 2];
    size_t nlayers = sandbox_active_layers(srv->policy->isolation, layers);
    msgpack_pack_array(pk, nlayers);
    for (size_t i = 0; i < nlayers; i++)
        rpc_pack_str(pk, layers[i]);
    rpc_pack_key(pk, "limits");
    msgpack_pack_map(pk, 3);
    rpc_pack_kv_int(pk, "max_sessions", srv->policy->limits.sessions);
    rpc_pack_kv_int(pk, "max_running", srv->policy->limits.running);
    rpc_pack_kv_int(pk, "max_message", (int64_t)srv->opts->max_message);
    rpc_conn_flush(conn->rpc);
}

/* What the server holds on purpose beside the calls' trees: the spawner and the zygotes
 * with their spare shims (processes, and the descriptors it holds for them) and the
 * sessions' Landlock rulesets. Alarms and the soak measure growth beyond it. */
static unsigned standby_count(struct server *srv, int wait_ms, unsigned *fds)
{
    unsigned procs = zygote_standby(srv->spawner, wait_ms, fds) +
                     zygote_standby(srv->prepared, wait_ms, fds);
    for (struct srv_session *ss = srv->sessions; ss; ss = ss->next) {
        procs += zygote_standby(ss->s->zygote, wait_ms, fds);
        procs += zygote_runners_standby(ss->s->runners, fds);
        if (fds && ss->s->landlock_fd >= 0)
            (*fds)++;
    }
    return procs;
}

/* One walk of /proc (our descriptors, our process tree, our memory) and what is held on
 * purpose at that moment. Its cost grows with what the calls run (a fork bomb's tree),
 * so it is taken by the sampler, and by `stats` only as acct_resample_due says (on a
 * change or every ACCT_RESAMPLE_MS, never sooner than ten times the last walk's cost):
 * however many `stats` a client pipelines, /proc is walked that often at most. */
#define ZOMBIE_GRACE_SAMPLES 3          /* the sampler runs every second */

static void sample_take(struct server *srv)
{
    int64_t started = now_ms();
    standby_count(srv, 0, NULL);        /* take the spares that arrived, then count */
    acct_sample_take(&srv->last);
    srv->last_standby_fds = 0;
    srv->last_standby = standby_count(srv, -1, &srv->last_standby_fds);
    srv->last_ms = now_ms();
    srv->last_cost_ms = srv->last_ms - started;
    srv->last_stale = false;
}

static void m_stats(struct srv_conn *conn, uint32_t msgid, const msgpack_object *params)
{
    struct server *srv = conn->srv;
    struct params p;
    params_begin(&p, conn, msgid, params);
    if (!params_end(&p))
        return;
    if (acct_resample_due(srv->last_stale, now_ms() - srv->last_ms, srv->last_cost_ms))
        sample_take(srv);
    const struct acct_sample *now = &srv->last;
    msgpack_packer *pk = result_begin(conn, msgid, 19);
    rpc_pack_kv_int(pk, "sessions", srv->nsessions);
    /* the labels of the open sessions that have some, by session id */
    unsigned nlabelled = 0;
    for (struct srv_session *ss = srv->sessions; ss; ss = ss->next)
        nlabelled += ss->labels != NULL;
    rpc_pack_key(pk, "session_labels");
    msgpack_pack_map(pk, nlabelled);
    for (struct srv_session *ss = srv->sessions; ss; ss = ss->next) {
        if (!ss->labels)
            continue;
        rpc_pack_key(pk, ss->s->id);
        labels_pack(pk, ss->labels);
    }
    rpc_pack_kv_int(pk, "running", srv->running);
    rpc_pack_key(pk, "calls");
    msgpack_pack_map(pk, CLASS_COUNT);
    for (int i = 0; i < CLASS_COUNT; i++)
        rpc_pack_kv_int(pk, call_class_name((enum call_class)i), (int64_t)srv->metrics.calls[i]);
    rpc_pack_kv_int(pk, "processes", now->processes);
    rpc_pack_kv_int(pk, "standby", srv->last_standby);
    rpc_pack_kv_int(pk, "standby_fds", srv->last_standby_fds);
    rpc_pack_kv_int(pk, "zombies", now->zombies);
    rpc_pack_kv_int(pk, "fds", now->fds);
    rpc_pack_kv_int(pk, "rss_kb", now->rss_kb);
    rpc_pack_key(pk, "alarms");
    unsigned nraised = 0;
    for (int k = 0; k < ALARM_COUNT; k++)
        nraised += srv->alarms[k].raised;
    msgpack_pack_array(pk, nraised);
    for (int k = 0; k < ALARM_COUNT; k++) {
        if (!srv->alarms[k].raised)
            continue;
        char msg[256];
        alarm_message(srv, (enum alarm_kind)k, msg, sizeof msg);
        msgpack_pack_map(pk, 4);
        rpc_pack_kv_str(pk, "kind", alarm_kind_name((enum alarm_kind)k));
        rpc_pack_kv_int(pk, "value", srv->alarms[k].value);
        rpc_pack_kv_int(pk, "threshold", srv->alarms[k].threshold);
        rpc_pack_kv_str(pk, "message", msg);
    }
    rpc_pack_key(pk, "latency_ms");
    unsigned ntools = 0;
    for (struct tool_latency *t = srv->latencies; t; t = t->next)
        ntools++;
    msgpack_pack_map(pk, ntools);
    for (struct tool_latency *t = srv->latencies; t; t = t->next) {
        int64_t sorted[LATENCY_SAMPLES];
        memcpy(sorted, t->samples, t->n * sizeof *sorted);
        qsort(sorted, t->n, sizeof *sorted, cmp_i64);
        rpc_pack_key(pk, t->tool);
        msgpack_pack_map(pk, 3);
        rpc_pack_kv_int(pk, "p50", sorted[(t->n - 1) * 50 / 100]);
        rpc_pack_kv_int(pk, "p95", sorted[(t->n - 1) * 95 / 100]);
        rpc_pack_kv_int(pk, "p99", sorted[(t->n - 1) * 99 / 100]);
    }
    rpc_pack_kv_int(pk, "redactions", (int64_t)srv->metrics.redactions);
    rpc_pack_kv_int(pk, "policy_generation", srv->policy->generation);
    uint64_t total = 0;
    for (int i = 0; i < CLASS_COUNT; i++)
        total += srv->metrics.calls[i];
    rpc_pack_key(pk, "timeout_rate");
    msgpack_pack_double(pk, total ? (double)srv->metrics.calls[CLASS_TOOL_TIMEOUT] / (double)total : 0);
    rpc_pack_key(pk, "fds_by_kind");
    msgpack_pack_map(pk, 4);
    rpc_pack_kv_int(pk, "pipe", now->fd_pipe);
    rpc_pack_kv_int(pk, "pidfd", now->fd_pidfd);
    rpc_pack_kv_int(pk, "socket", now->fd_socket);
    rpc_pack_kv_int(pk, "other", now->fd_other);
    rpc_pack_kv_int(pk, "fd_baseline", srv->fd_baseline);
    /* lines the log or metrics file could not take (full disk, file size limit) */
    rpc_pack_kv_int(pk, "log_dropped", (int64_t)log_dropped);
    rpc_pack_kv_int(pk, "metrics_dropped", (int64_t)srv->metrics_dropped);
    rpc_conn_flush(conn->rpc);
}

static int isolation_rank(const char *level)
{
    return strcmp(level, "strict") == 0 ? 2 : strcmp(level, "process") == 0 ? 1 : 0;
}

/* Re-read the policy file the server started with; load and check completely, then
 * swap; running calls keep their generation. A policy that would lower the isolation
 * level, or that this host cannot isolate, is refused: lowering takes a restart. */
static struct policy *reload_checked(struct server *srv, char **err)
{
    struct policy *p = policy_load(srv->policy_path, err);
    if (!p)
        return NULL;
    char *why = NULL;
    if (!sandbox_level_allowed(p->isolation, &why)) {
        *err = xasprintf("the new policy asks for isolation=%s, which this host cannot give: %s",
                         p->isolation, why);
        free(why);
        policy_unref(p);
        return NULL;
    }
    if (!sandbox_network_allowed(p->isolation, p->network, &why)) {
        *err = xasprintf("policy %s: %s", srv->policy_path, why);
        free(why);
        policy_unref(p);
        return NULL;
    }
    if (isolation_rank(p->isolation) < isolation_rank(srv->policy->isolation)) {
        *err = xasprintf("the new policy would lower isolation from %s to %s: that takes a "
                         "restart", srv->policy->isolation, p->isolation);
        policy_unref(p);
        return NULL;
    }
    struct policy *old = srv->policy;
    srv->policy = p;
    policy_unref(old);
    LOG_I("policy %s loaded: generation %u", srv->policy_path, p->generation);
    prepared_refill(srv);
    if (srv->on_reload)
        srv->on_reload(srv->on_reload_ud);
    return p;
}

/* reload_checked with its audit record (who asked: "SIGHUP" or "rpc uid N") and counters. */
static struct policy *reload(struct server *srv, const char *who, char **err)
{
    char old_sha[sizeof srv->policy->sha256];
    memcpy(old_sha, srv->policy->sha256, sizeof old_sha);   /* the old policy may go */
    struct policy *p = reload_checked(srv, err);
    audit_reload(who, srv->policy_path, old_sha, p, p ? NULL : *err);
    if (p) {
        srv->metrics.reloads_ok++;
        srv->metrics.last_reload_ms = wall_ms();
    } else {
        srv->metrics.reloads_failed++;
    }
    return p;
}

/* No parameters: the policy is the operator's file, never one a client names. Only an
 * admin peer (the spawner on stdio, --admin-uid on a socket) may ask. */
static void m_policy_reload(struct srv_conn *conn, uint32_t msgid, const msgpack_object *params)
{
    struct server *srv = conn->srv;
    if (!conn->admin) {
        char msg[128];
        snprintf(msg, sizeof msg, "policy.reload: uid %u is not an admin peer (--admin-uid)",
                 (unsigned)conn->uid);
        rpc_send_error(conn->rpc, msgid, "POLICY_VIOLATION", false, msg, NULL);
        LOG_W("%s", msg);
        char who[32];
        snprintf(who, sizeof who, "rpc uid %u", (unsigned)conn->uid);
        audit_reload(who, srv->policy_path, srv->policy->sha256, NULL, msg);
        return;
    }
    struct params p;
    params_begin(&p, conn, msgid, params);
    if (!params_end(&p))
        return;
    char *err = NULL;
    char who[32];
    snprintf(who, sizeof who, "rpc uid %u", (unsigned)conn->uid);
    struct policy *pol = reload(srv, who, &err);
    if (!pol) {
        rpc_send_error(conn->rpc, msgid, "BAD_REQUEST", false, err, NULL);
        LOG_W("policy.reload refused, the old policy stays: %s", err);
        free(err);
        return;
    }
    msgpack_packer *pk = result_begin(conn, msgid, 2);
    rpc_pack_kv_int(pk, "generation", pol->generation);
    rpc_pack_kv_str(pk, "sha256", pol->sha256);
    rpc_conn_flush(conn->rpc);
}

/* ---- accounting: samples, alarms, metrics -------------------------------------------- */

static void alarm_message(const struct server *srv, enum alarm_kind k, char *out, size_t n)
{
    const struct alarm *a = &srv->alarms[k];
    switch (k) {
    case ALARM_ZOMBIES:
        snprintf(out, n, "%lld zombies left unreaped by the supervisor or a shim (threshold %lld)",
                 (long long)a->value, (long long)a->threshold);
        break;
    case ALARM_FDS:
        snprintf(out, n, "%lld open descriptors, %lld over the baseline of %d (threshold %lld)",
                 (long long)a->value, (long long)a->value - srv->fd_baseline, srv->fd_baseline,
                 (long long)a->threshold);
        break;
    case ALARM_RSS:
        snprintf(out, n, "supervisor RSS %lld KiB (threshold %lld KiB)", (long long)a->value,
                 (long long)a->threshold);
        break;
    default:
        snprintf(out, n, "%lld %s (threshold %lld)", (long long)a->value, alarm_kind_name(k),
                 (long long)a->threshold);
    }
}

static void alarm_announce(struct server *srv, enum alarm_kind k, bool raised)
{
    const struct alarm *a = &srv->alarms[k];
    char msg[256];
    alarm_message(srv, k, msg, sizeof msg);
    struct buf f = {0};
    buf_printf(&f, "\"event\":\"alarm\",\"kind\":\"%s\",\"state\":\"%s\",\"value\":%lld,"
                   "\"threshold\":%lld,\"msg\":", alarm_kind_name(k), raised ? "raised" : "cleared",
               (long long)a->value, (long long)a->threshold);
    json_cstr(&f, msg);
    log_json_line(raised ? "warn" : "info", f.data);
    buf_free(&f);
    for (struct srv_conn *conn = srv->conns; conn; conn = conn->next) {
        send_notification_begin(conn, "alarm", 5);
        msgpack_packer *pk = &conn->rpc->pk;
        rpc_pack_kv_str(pk, "kind", alarm_kind_name(k));
        rpc_pack_kv_int(pk, "value", a->value);
        rpc_pack_kv_int(pk, "threshold", a->threshold);
        rpc_pack_kv_str(pk, "message", msg);
        rpc_pack_kv_str(pk, "state", raised ? "raised" : "cleared");
        rpc_conn_flush(conn->rpc);
    }
}

/* Thresholds from the policy, or derived from its other limits. */
static void alarm_thresholds(struct server *srv)
{
    const struct policy_limits *l = &srv->policy->limits;
    srv->alarms[ALARM_ZOMBIES].threshold = l->alarm_zombies >= 0 ? l->alarm_zombies : 0;
    /* a running call holds about five descriptors: pipes, pidfd, status */
    int64_t fd_growth = l->alarm_fds >= 0 ? l->alarm_fds : 8 * l->running + 64;
    srv->alarms[ALARM_FDS].threshold = srv->fd_baseline + fd_growth;
    srv->alarms[ALARM_RSS].threshold = (l->alarm_rss >= 0 ? l->alarm_rss : 256LL << 20) / 1024;
    srv->alarms[ALARM_PROCESSES].threshold =
        l->alarm_processes >= 0 ? l->alarm_processes : l->running * (l->processes + 1);
    srv->alarms[ALARM_SESSIONS].threshold =
        l->alarm_sessions >= 0 ? l->alarm_sessions : l->sessions * 9 / 10;
}

static void on_sample(struct ev_loop *loop, ev_timer *w, int revents)
{
    (void)loop, (void)revents;
    struct server *srv = w->data;
    spawner_check(srv);
    for (struct srv_session *ss = srv->sessions; ss; ss = ss->next)
        session_zygote_check(ss);
    sample_take(srv);
    alarm_thresholds(srv);
    /* what is held on purpose is not growth; a zombie is a leak once the same one has
     * outlived its grace (ZOMBIE_GRACE_SAMPLES samples in a row) */
    int64_t values[ALARM_COUNT] = {
        [ALARM_ZOMBIES] = zombie_watch_update(&srv->zombies, &srv->last, ZOMBIE_GRACE_SAMPLES),
        [ALARM_FDS] = (int64_t)srv->last.fds - srv->last_standby_fds,
        [ALARM_RSS] = srv->last.rss_kb,
        [ALARM_PROCESSES] = (int64_t)srv->last.processes - srv->last_standby,
        [ALARM_SESSIONS] = srv->nsessions,
    };
    for (int k = 0; k < ALARM_COUNT; k++) {
        int change = alarm_update(&srv->alarms[k], values[k], 1);
        if (change)
            alarm_announce(srv, (enum alarm_kind)k, change > 0);
    }
}

/* Prometheus text exposition (core/accounting.c), replaced whole each time: node_exporter's
 * textfile collector must never read half a file. */
static void write_metrics(struct server *srv)
{
    struct metrics_gauges g = {.sessions = srv->nsessions, .running = srv->running,
                               .sample = &srv->last,
                               .policy_generation = srv->policy->generation};
    for (int k = 0; k < ALARM_COUNT; k++)
        g.alarm_raised[k] = srv->alarms[k].raised;
    struct buf b = {0};
    metrics_render(&b, &srv->metrics, &g);
    if (metrics_file_replace(srv->opts->metrics_path, b.data, b.len) < 0) {
        srv->metrics_dropped++;
        LOG_W("metrics %s: %s", srv->opts->metrics_path, strerror(errno));
    }
    buf_free(&b);
}

static void on_metrics(struct ev_loop *loop, ev_timer *w, int revents)
{
    (void)loop, (void)revents;
    write_metrics(w->data);
}

/* debug.leak {count} / debug.unleak: hold descriptors on purpose (only with
 * --debug-hooks), so tests can prove the fds alarm fires and clears. */
static void m_debug_leak(struct srv_conn *conn, uint32_t msgid, const msgpack_object *params)
{
    struct server *srv = conn->srv;
    if (!srv->opts->debug_hooks) {
        bad_request(conn, msgid, "unknown method 'debug.leak'");
        return;
    }
    int64_t n = 1;
    bool has;
    struct params p;
    params_begin(&p, conn, msgid, params);
    if (!param_int(&p, "count", 0, INT32_MAX, &n, &has) || !params_end(&p))
        return;
    while (n-- > 0 && srv->nleaked < (int)ARRAY_LEN(srv->leaked))
        srv->leaked[srv->nleaked++] = open("/dev/null", O_RDONLY | O_CLOEXEC);
    srv->last_stale = true;
    msgpack_packer *pk = result_begin(conn, msgid, 1);
    rpc_pack_kv_int(pk, "leaked", srv->nleaked);
    rpc_conn_flush(conn->rpc);
}

static void on_holder_exit(struct proc *p, int wstatus, void *ud)
{
    (void)p, (void)wstatus;
    struct server *srv = ud;
    srv->holding_zombie = false;
}

/* debug.zombie: a registered child that forks a grandchild which exits at once, and
 * never reaps it — a zombie the supervisor's side owns, as a leak would leave one. */
static void m_debug_zombie(struct srv_conn *conn, uint32_t msgid, const msgpack_object *params)
{
    struct server *srv = conn->srv;
    struct params p;
    params_begin(&p, conn, msgid, params);
    if (!srv->opts->debug_hooks) {
        bad_request(conn, msgid, "unknown method 'debug.zombie'");
        return;
    }
    if (!params_end(&p))
        return;
    if (!srv->holding_zombie) {
        pid_t pid = fork();
        if (pid == 0) {
            prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0);
            signal(SIGCHLD, SIG_DFL);
            if (fork() == 0)
                _exit(0);
            for (;;)
                pause();
        }
        int pidfd = pid > 0 ? pidfd_open(pid, 0) : -1;
        if (pidfd >= 0) {
            proc_watch(&srv->zombie_holder, pid, pidfd, on_holder_exit, srv);
            srv->holding_zombie = true;
        }
    }
    srv->last_stale = true;
    msgpack_packer *pk = result_begin(conn, msgid, 1);
    rpc_pack_kv_bool(pk, "holding", srv->holding_zombie);
    rpc_conn_flush(conn->rpc);
}

static void m_debug_unleak(struct srv_conn *conn, uint32_t msgid, const msgpack_object *params)
{
    struct server *srv = conn->srv;
    struct params p;
    params_begin(&p, conn, msgid, params);
    if (!srv->opts->debug_hooks) {
        bad_request(conn, msgid, "unknown method 'debug.unleak'");
        return;
    }
    if (!params_end(&p))
        return;
    while (srv->nleaked > 0)
        close_quietly(&srv->leaked[--srv->nleaked]);
    if (srv->holding_zombie)
        proc_signal(&srv->zombie_holder, SIGKILL);  /* its zombie is reparented, reaped */
    srv->last_stale = true;
    msgpack_packer *pk = result_begin(conn, msgid, 1);
    rpc_pack_kv_int(pk, "leaked", 0);
    rpc_conn_flush(conn->rpc);
}

/* ---- dispatch ----------------------------------------------------------------------- */

static const struct {
    const char *name;
    void (*fn)(struct srv_conn *, uint32_t, const msgpack_object *);
} methods[] = {
    {"hello", m_hello},
    {"session.open", m_session_open},
    {"session.renew", m_session_renew},
    {"session.close", m_session_close},
    {"call", m_call},
    {"cancel", m_cancel},
    {"stats", m_stats},
    {"policy.reload", m_policy_reload},
    {"debug.leak", m_debug_leak},
    {"debug.unleak", m_debug_unleak},
    {"debug.zombie", m_debug_zombie},
};

/* Is a request of this connection with this msgid still waiting for its answer? Only
 * calls and closes outlive their dispatch. */
static bool msgid_in_flight(const struct srv_conn *conn, uint32_t msgid)
{
    for (const struct srv_call *sc = conn->srv->calls; sc; sc = sc->next)
        if (sc->conn == conn && sc->msgid == msgid)
            return true;
    for (const struct srv_session *ss = conn->srv->sessions; ss; ss = ss->next)
        for (const struct close_waiter *w = ss->waiters; w; w = w->next)
            if (w->conn == conn && w->msgid == msgid)
                return true;
    return false;
}

/* [0, msgid, method, params]: params an array of the method's arguments (protocol 2:
 * [] or [{...}]) or a bare map (protocol 1). Every request that carries a msgid is
 * answered, a malformed msgid echoed as it came. */
static void on_message(struct rpc_conn *rpc, const msgpack_object *msg)
{
    struct srv_conn *conn = rpc->ud;
    const msgpack_object *a = msg->type == MSGPACK_OBJECT_ARRAY ? msg->via.array.ptr : NULL;
    uint32_t n = a ? msg->via.array.size : 0;
    bool is_request = n >= 1 && a[0].type == MSGPACK_OBJECT_POSITIVE_INTEGER && a[0].via.u64 == 0;
    if (!is_request || n < 2) {
        LOG_W("ignored a message that is not a request");
        return;
    }
    if (a[1].type != MSGPACK_OBJECT_POSITIVE_INTEGER || a[1].via.u64 > UINT32_MAX) {
        rpc_send_error_echo(rpc, &a[1], "BAD_REQUEST", false,
                            "msgid: expected an unsigned 32-bit integer", NULL);
        return;
    }
    uint32_t msgid = (uint32_t)a[1].via.u64;
    if (n != 4 || a[2].type != MSGPACK_OBJECT_STR) {
        bad_request(conn, msgid, "expected [0, msgid, method, params]");
        return;
    }
    const msgpack_object *params = &a[3];
    if (params->type == MSGPACK_OBJECT_ARRAY) {
        uint32_t nargs = params->via.array.size;
        params = nargs == 1 ? &params->via.array.ptr[0] : NULL;
        if (nargs > 1 || (params && params->type != MSGPACK_OBJECT_MAP &&
                          params->type != MSGPACK_OBJECT_NIL)) {
            bad_request(conn, msgid, "params: expected [] or [{...}] (one argument, a map)");
            return;
        }
    } else if (params->type != MSGPACK_OBJECT_MAP && params->type != MSGPACK_OBJECT_NIL) {
        bad_request(conn, msgid, "params: expected [] or [{...}] (one argument, a map)");
        return;
    }
    if (msgid_in_flight(conn, msgid)) {
        bad_request(conn, msgid, "msgid %u is already in flight on this connection", msgid);
        return;
    }
    const msgpack_object *method = &a[2];
    for (size_t i = 0; i < ARRAY_LEN(methods); i++) {
        size_t len = strlen(methods[i].name);
        if (method->via.str.size == len && memcmp(method->via.str.ptr, methods[i].name, len) == 0) {
            methods[i].fn(conn, msgid, params);
            return;
        }
    }
    bad_request(conn, msgid, "unknown method '%.*s'",
                (int)(method->via.str.size > 64 ? 64 : method->via.str.size), method->via.str.ptr);
}

static void shutdown_begin(struct server *srv, bool hard);

static void on_conn_close(struct rpc_conn *rpc, const char *why)
{
    struct srv_conn *conn = rpc->ud;
    struct server *srv = conn->srv;
    LOG_I("client disconnected: %s", why);
    /* Nobody is left to answer: its calls end now; its sessions live on until their
     * lease lapses (the same uid may reattach), but lose their notification target. */
    for (struct srv_call *sc = srv->calls; sc; sc = sc->next) {
        if (sc->conn == conn) {
            sc->conn = NULL;
            call_stop(sc->call, CLASS_CANCELLED, NULL, "the client went away", true);
        }
    }
    struct srv_session *lists[] = {srv->sessions, srv->removing};
    for (size_t i = 0; i < ARRAY_LEN(lists); i++) {
        for (struct srv_session *ss = lists[i]; ss; ss = ss->next) {
            if (ss->owner == conn)
                ss->owner = NULL;
            if (ss->open_conn == conn)
                ss->open_conn = NULL;
            for (struct close_waiter *w = ss->waiters; w; w = w->next)
                if (w->conn == conn)
                    w->conn = NULL;
        }
    }
    for (struct srv_conn **pp = &srv->conns; *pp; pp = &(*pp)->next) {
        if (*pp == conn) {
            *pp = conn->next;
            break;
        }
    }
    free(conn);
    /* On stdio the orchestrator owns the server: when it goes, everything goes. */
    if (!srv->opts->listen_path && srv->opts->listen_fd <= 2)
        shutdown_begin(srv, true);
}

static void on_pressure(struct rpc_conn *rpc, bool high)
{
    struct srv_conn *conn = rpc->ud;
    for (struct srv_call *sc = conn->srv->calls; sc; sc = sc->next)
        if (sc->conn == conn && sc->call->req.stream)
            call_pause_output(sc->call, high);
}

static void on_error_sent(struct rpc_conn *rpc, const char *class)
{
    struct srv_conn *conn = rpc->ud;
    metrics_rpc_error(&conn->srv->metrics, class);
}

static const struct rpc_handlers handlers = {on_message, on_conn_close, on_pressure};

static struct srv_conn *conn_add(struct server *srv, int rfd, int wfd, uid_t uid, bool admin)
{
    struct srv_conn *conn = xcalloc(1, sizeof *conn);
    conn->srv = srv;
    conn->uid = uid;
    conn->admin = admin;
    conn->rpc = rpc_conn_new(srv->loop, rfd, wfd, srv->opts->max_message, &handlers, conn);
    conn->rpc->peer_uid = uid;
    conn->rpc->on_error_sent = on_error_sent;
    conn->rpc->slow_reader_ms = srv->opts->slow_reader_ms;
    conn->next = srv->conns;
    srv->conns = conn;
    return conn;
}

/* ---- the listening socket ------------------------------------------------------------ */

static void on_accept(struct ev_loop *loop, ev_io *w, int revents)
{
    (void)loop, (void)revents;
    struct server *srv = w->data;
    int fd = accept4(srv->listen_fd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) {
        if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
            /* The connection stays in the backlog, so the listener stays readable: left
             * armed, the loop would spin on it. Parked, it is tried again in a while. */
            LOG_W("accept: %s; new clients wait until descriptors come back",
                  strerror(errno));
            ev_io_stop(srv->loop, &srv->listen_watcher);
            ev_timer_set(&srv->accept_retry, ACCEPT_RETRY_MS / 1000.0, 0);
            ev_timer_start(srv->loop, &srv->accept_retry);
        } else if (errno != EAGAIN && errno != EINTR) {
            LOG_W("accept: %s", strerror(errno));
        }
        return;
    }
    struct ucred cred;
    socklen_t len = sizeof cred;
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) < 0) {
        LOG_W("SO_PEERCRED: %s", strerror(errno));
        close(fd);
        return;
    }
    bool allowed = false;
    for (size_t i = 0; i < srv->opts->n_allow_uids; i++)
        allowed |= srv->opts->allow_uids[i] == cred.uid;
    if (!allowed) {
        LOG_W("refused a client with uid %u pid %d (not in --allow-uid)", (unsigned)cred.uid,
              (int)cred.pid);
        close(fd);
        return;
    }
    bool admin = false;
    for (size_t i = 0; i < srv->opts->n_admin_uids; i++)
        admin |= srv->opts->admin_uids[i] == cred.uid;
    conn_add(srv, fd, fd, cred.uid, admin);
}

/* A socket at `path` that a live server accepts on is in use: never take it over. A
 * stale one (connect refused: its server died) is replaced; anything else is not ours. */
static void refuse_live_socket(const struct sockaddr_un *addr, const char *path)
{
    struct stat st;
    if (lstat(path, &st) < 0)
        return;
    if (!S_ISSOCK(st.st_mode))
        die("--listen: %s exists and is not a socket", path);
    int probe = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (probe < 0)
        die_errno("socket");
    int rc = connect(probe, (const struct sockaddr *)addr, sizeof *addr);
    int err = errno;
    close(probe);
    if (rc == 0)
        die("--listen: %s: address in use (a server is listening there)", path);
    if (err != ECONNREFUSED)
        die("--listen: %s: cannot tell whether a server listens there: %s", path, strerror(err));
    unlink(path);
}

static void on_accept_retry(struct ev_loop *loop, ev_timer *w, int revents)
{
    (void)loop, (void)revents;
    struct server *srv = w->data;
    if (srv->listen_fd >= 0 && !srv->draining)
        ev_io_start(srv->loop, &srv->listen_watcher);
}

/* No new client from now on: the socket closed (a connection attempt is refused at
 * once, rather than left in a backlog nobody accepts from) and its path removed. */
static void listener_close(struct server *srv)
{
    ev_timer_stop(srv->loop, &srv->accept_retry);
    if (srv->listen_fd < 0)
        return;
    ev_io_stop(srv->loop, &srv->listen_watcher);
    close_quietly(&srv->listen_fd);
    if (srv->opts->listen_path)         /* systemd's socket (LISTEN_FDS) is not ours */
        unlink(srv->opts->listen_path);
}

static int listen_unix(const struct server_opts *opts)
{
    const char *path = opts->listen_path;
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    if (strlen(path) >= sizeof addr.sun_path)
        die("--listen: path too long: %s", path);
    strcpy(addr.sun_path, path);
    refuse_live_socket(&addr, path);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0)
        die_errno("socket");
    /* Born 0600; widened (mode, group) only once it is ours, before anyone can connect. */
    mode_t old = umask(0177);
    int rc = bind(fd, (struct sockaddr *)&addr, sizeof addr);
    umask(old);
    if (rc < 0 && errno == EADDRINUSE)
        die("--listen: %s: address in use", path);
    if (rc < 0)
        die_errno("bind %s", path);
    if (opts->socket_gid != (gid_t)-1 && chown(path, (uid_t)-1, opts->socket_gid) < 0)
        die_errno("--socket-group: chown %s", path);
    if (chmod(path, opts->socket_mode) < 0 || listen(fd, 64) < 0)
        die_errno("listen %s", path);
    return fd;
}

/* ---- signals, draining, stopping ------------------------------------------------------ */

static void upgrade_begin(struct server *srv);

static void maybe_stop(struct server *srv)
{
    if (!srv->draining || srv->calls || srv->stopping)
        return;
    if (srv->upgrading) {
        upgrade_begin(srv);
        return;
    }
    srv->stopping = true;
    ev_timer_stop(srv->loop, &srv->drain_timer);
    if (srv->holding_zombie)
        proc_signal(&srv->zombie_holder, SIGKILL);
    while (srv->sessions) {
        struct srv_session *ss = srv->sessions;
        ss->ending = true;
        ev_timer_stop(srv->loop, &ss->lease);
        ev_timer_stop(srv->loop, &ss->fuse);
        session_finish(ss);
    }
    while (srv->conns)
        rpc_conn_close(srv->conns->rpc, "server stopping", 1000);
    listener_close(srv);
    ev_signal_stop(srv->loop, &srv->sighup);
    ev_signal_stop(srv->loop, &srv->sigterm);
    ev_signal_stop(srv->loop, &srv->sigint);
    ev_signal_stop(srv->loop, &srv->sigusr2);
}

static void on_drain_timer(struct ev_loop *loop, ev_timer *w, int revents)
{
    (void)loop, (void)revents;
    struct server *srv = w->data;
    if (srv->calls)
        LOG_W("drain: %u calls still running; killing them", srv->running);
    for (struct srv_call *sc = srv->calls; sc; sc = sc->next)
        call_stop(sc->call, CLASS_CANCELLED, NULL, "the server is stopping", true);
}

static void shutdown_begin(struct server *srv, bool hard)
{
    if (!srv->draining) {
        srv->draining = true;
        service_stopping();
        audit_shutdown(srv->stop_reason ? srv->stop_reason : "the last client left",
                       srv->nsessions, srv->running);
        listener_close(srv);
        ev_timer_set(&srv->drain_timer, hard ? 0 : (double)srv->opts->drain_ms / 1000.0, 0);
        ev_timer_start(srv->loop, &srv->drain_timer);
    } else if (hard) {
        on_drain_timer(srv->loop, &srv->drain_timer, 0);
    }
    maybe_stop(srv);
}

/* ---- graceful upgrade: SIGUSR2 ----------------------------------------------------------
 * The listening socket stays open (connections wait in its backlog), running calls finish
 * within the drain timeout, the clients are disconnected, the sessions released with
 * their roots and records kept, and the binary at the same path is executed again with
 * the socket and the state dir's lock inherited; it adopts the sessions as a restart
 * would. If the exec fails, this server adopts them back and goes on serving. */

#define ENV_LISTEN_FD "STOCKADE_UPGRADE_LISTEN_FD"
#define ENV_LOCK_FD "STOCKADE_UPGRADE_LOCK_FD"
#define UPGRADE_FLUSH_MS 1000       /* the last answers' chance to leave, all clients */

/* A descriptor the previous image left us, named in the environment (which no tool
 * ever sees: theirs is built from nothing); -1 when none. */
static int inherited_fd(const char *var)
{
    const char *v = getenv(var);
    if (!v)
        return -1;
    char *end;
    long fd = strtol(v, &end, 10);
    unsetenv(var);
    if (*end || fd < 3 || fd > INT32_MAX || fcntl((int)fd, F_GETFD) < 0)
        return -1;
    fd_set_cloexec((int)fd);
    return (int)fd;
}

static void upgrade_abort(struct server *srv, const char *why)
{
    LOG_E("upgrade: %s; this server goes on", why);
    srv->upgrading = false;
    srv->draining = false;
    unsetenv(ENV_LISTEN_FD);
    unsetenv(ENV_LOCK_FD);
    if (srv->listen_fd >= 0)
        fd_set_cloexec(srv->listen_fd);
    if (srv->state_lock_fd >= 0)
        fd_set_cloexec(srv->state_lock_fd);
    if (!srv->spawner) {
        char *err = NULL;
        struct zygote_config plain = {.plain = true};
        srv->spawner = zygote_start(&plain, &err);
        if (!srv->spawner) {
            LOG_W("no spawner, calls fork from the server: %s", err);
            free(err);
        }
    }
    prepared_refill(srv);
    server_recover(srv);
    if (srv->listen_fd >= 0)
        ev_io_start(srv->loop, &srv->listen_watcher);
}

/* argv of this process, from /proc/self/cmdline (NULL-terminated, malloc'd). */
static char **own_argv(void)
{
    int fd = open("/proc/self/cmdline", O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return NULL;
    struct buf b = {0};
    char chunk[4096];
    ssize_t n;
    while ((n = read(fd, chunk, sizeof chunk)) > 0)
        buf_append(&b, chunk, (size_t)n);
    close(fd);
    size_t count = 0;
    for (size_t i = 0; i < b.len; i++)
        count += b.data[i] == 0;
    char **argv = xcalloc(count + 1, sizeof *argv);
    size_t k = 0;
    for (size_t i = 0; i < b.len && k < count; i += strlen(b.data + i) + 1)
        argv[k++] = xstrdup(b.data + i);
    buf_free(&b);
    return argv;
}

static void on_upgrade_timer(struct ev_loop *loop, ev_timer *w, int revents)
{
    (void)loop, (void)revents;
    struct server *srv = w->data;
    if (!srv->upgrading)
        return;                 /* a SIGTERM came first: the server is stopping instead */
    /* the binary now at the path this one was started from (a package update renames a
     * new file over it: /proc/self/exe then names the old one, "(deleted)") */
    char exe[4096];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n <= 0) {
        upgrade_abort(srv, "cannot read /proc/self/exe");
        return;
    }
    exe[n] = 0;
    char *deleted = strstr(exe, " (deleted)");
    if (deleted && deleted[10] == 0)
        *deleted = 0;
    char **argv = own_argv();
    if (!argv || !argv[0]) {
        strv_free(argv);
        upgrade_abort(srv, "cannot read /proc/self/cmdline");
        return;
    }
    char fdtext[16];
    snprintf(fdtext, sizeof fdtext, "%d", srv->listen_fd);
    setenv(ENV_LISTEN_FD, fdtext, 1);
    snprintf(fdtext, sizeof fdtext, "%d", srv->state_lock_fd);
    setenv(ENV_LOCK_FD, fdtext, 1);
    /* the two descriptors cross the exec; everything else is close-on-exec */
    int flags = fcntl(srv->listen_fd, F_GETFD);
    fcntl(srv->listen_fd, F_SETFD, flags & ~FD_CLOEXEC);
    flags = fcntl(srv->state_lock_fd, F_GETFD);
    fcntl(srv->state_lock_fd, F_SETFD, flags & ~FD_CLOEXEC);
    LOG_I("upgrade: executing %s", exe);
    execv(exe, argv);
    char *why = xasprintf("exec %s: %s", exe, strerror(errno));
    strv_free(argv);
    upgrade_abort(srv, why);
    free(why);
}

/* Nothing runs any more: let go of the clients and the sessions (roots and records
 * stay), end the helpers, and exec shortly. */
static void upgrade_begin(struct server *srv)
{
    ev_timer_stop(srv->loop, &srv->drain_timer);
    if (srv->holding_zombie)
        proc_signal(&srv->zombie_holder, SIGKILL);
    /* the loop will not turn for them again: what is queued goes now, within a bound */
    int64_t until = now_ms() + UPGRADE_FLUSH_MS;
    while (srv->conns) {
        rpc_conn_flush_until(srv->conns->rpc, until);
        rpc_conn_close(srv->conns->rpc, "server upgrading", 0);
    }
    while (srv->sessions) {
        struct srv_session *ss = srv->sessions;
        srv->sessions = ss->next;
        ev_timer_stop(srv->loop, &ss->lease);
        ev_timer_stop(srv->loop, &ss->fuse);
        if (ss->starting) {             /* its zygote, still building: its watcher goes too */
            ev_io_stop(srv->loop, &ss->zygote_ready);
            zygote_stop(ss->starting);
            ss->starting = NULL;
        }
        ss->s->keep_root = true;        /* and its record: the next image adopts it */
        session_close(ss->s);
        free(ss);
    }
    srv->nsessions = 0;
    zygote_stop(srv->spawner);
    srv->spawner = NULL;
    zygote_stop(srv->prepared);
    srv->prepared = NULL;
    while (srv->nretired > 0)
        zygote_stop(srv->retired[--srv->nretired]);
    if (srv->cleaning)
        proc_signal(&srv->cleaner, SIGKILL);    /* the next image starts it again */
    ev_timer_set(&srv->upgrade_timer, 0, 0);    /* exec outside the call's callbacks */
    ev_timer_start(srv->loop, &srv->upgrade_timer);
}

static void upgrade_request(struct server *srv)
{
    if (!srv->opts->listen_path || srv->listen_fd < 0) {
        LOG_W("SIGUSR2: an upgrade keeps the listening socket; without --listen there is "
              "none (stdio): ignored");
        return;
    }
    if (srv->draining) {
        LOG_W("SIGUSR2: already %s: ignored", srv->upgrading ? "upgrading" : "stopping");
        return;
    }
    LOG_I("SIGUSR2: upgrading: no new client, running calls finish (drain timeout %lld ms)",
          (long long)srv->opts->drain_ms);
    srv->upgrading = true;
    srv->draining = true;
    ev_io_stop(srv->loop, &srv->listen_watcher);   /* parked, not closed: clients queue */
    ev_timer_stop(srv->loop, &srv->accept_retry);
    ev_timer_set(&srv->drain_timer, (double)srv->opts->drain_ms / 1000.0, 0);
    ev_timer_start(srv->loop, &srv->drain_timer);
    maybe_stop(srv);
}

static void on_signal(struct ev_loop *loop, ev_signal *w, int revents)
{
    (void)loop, (void)revents;
    struct server *srv = w->data;
    if (w->signum == SIGUSR2) {
        upgrade_request(srv);
        return;
    }
    if (w->signum == SIGHUP) {
        char *err = NULL;
        if (!reload(srv, "SIGHUP", &err)) {
            LOG_E("SIGHUP: policy reload refused, the old policy stays: %s", err);
            free(err);
        }
        return;
    }
    LOG_I("signal %d: draining", w->signum);
    srv->stop_reason = w->signum == SIGTERM ? "SIGTERM" : "SIGINT";
    if (srv->upgrading) {
        /* a stop wins over an upgrade under way: the listener goes too */
        srv->upgrading = false;
        listener_close(srv);
    }
    shutdown_begin(srv, false);
}

struct server *server_new(const struct server_opts *opts)
{
    struct server *srv = xcalloc(1, sizeof *srv);
    srv->opts = opts;
    srv->listen_fd = -1;
    /* A size-capped log or metrics disk (RLIMIT_FSIZE) must cost lines, not the server:
     * a write past the limit then fails with EFBIG, counted like ENOSPC. (The tools'
     * shims set every signal back to its default.) */
    signal(SIGXFSZ, SIG_IGN);
    char *err = NULL;
    srv->policy = policy_load(opts->policy_path, &err);
    if (!srv->policy)
        die("%s", err);
    srv->policy_path = xstrdup(opts->policy_path);
    srv->metrics.last_reload_ms = wall_ms();
    if (sandbox_seccomp_prepare() < 0)
        die_errno("compiling the seccomp filter");
    char *why = NULL;
    if (!sandbox_level_allowed(srv->policy->isolation, &why))
        die("policy %s requires isolation=%s, which this host cannot give: %s",
            opts->policy_path, srv->policy->isolation, why);
    if (!sandbox_network_allowed(srv->policy->isolation, srv->policy->network, &why))
        die("policy %s: %s", opts->policy_path, why);
    srv->state_dir = xstrdup(opts->state_dir);
    if (mkdir(srv->state_dir, 0711) < 0 && errno != EEXIST)
        die_errno("state dir %s", srv->state_dir);
    /* one server per state dir: two would each take the other's sessions for orphans
     * (after an upgrade, the lock the previous image held is ours already) */
    srv->state_lock_fd = inherited_fd(ENV_LOCK_FD);
    if (srv->state_lock_fd < 0 && owns_state_dir(opts))
        srv->state_lock_fd = record_lock_state_dir(srv->state_dir, &err);
    if (srv->state_lock_fd < 0 && owns_state_dir(opts))
        die("%s", err);
    srv->listen_fd = inherited_fd(ENV_LISTEN_FD);   /* after an upgrade; else made later */

    /* Forked now, while we are small and before any client: it inherits the probed
     * caps and the compiled filter. Without it calls fork from here (slower, same walls). */
    struct zygote_config plain = {.plain = true};
    srv->spawner = zygote_start(&plain, &err);
    if (!srv->spawner) {
        LOG_W("no spawner, calls fork from the server: %s", err);
        free(err);
        err = NULL;
    }
    prepared_refill(srv);

    /* after the spawner's fork: it does not hold the lock on our behalf */
    srv->holder_fd = -1;
    if (!owns_state_dir(opts)) {
        srv->holder_fd = record_holder_take(srv->state_dir, srv->holder);
        if (srv->holder_fd < 0)     /* its records then say only its pid */
            LOG_W("state dir %s: no lock for this server's records: %s", srv->state_dir,
                  strerror(errno));
    }

    srv->loop = ev_loop_new(EVFLAG_AUTO);
    if (!srv->loop)
        die("cannot create the event loop");
    proc_init(srv->loop);
    /* after an upgrade (the same pid), the old image's helpers it killed before its exec:
     * those that died meanwhile sent their SIGCHLD to it, and would wait as zombies for
     * the next child of ours to exit */
    proc_reap();
    policy_set_clock_refresh(refresh_loop_clock, srv->loop);
    srv->remover = remover_new(srv->loop);
    ev_signal_init(&srv->sighup, on_signal, SIGHUP);
    ev_signal_init(&srv->sigterm, on_signal, SIGTERM);
    ev_signal_init(&srv->sigint, on_signal, SIGINT);
    ev_signal_init(&srv->sigusr2, on_signal, SIGUSR2);
    srv->sighup.data = srv->sigterm.data = srv->sigint.data = srv->sigusr2.data = srv;
    ev_signal_start(srv->loop, &srv->sigusr2);
    ev_timer_init(&srv->upgrade_timer, on_upgrade_timer, 0, 0);
    srv->upgrade_timer.data = srv;
    ev_signal_start(srv->loop, &srv->sighup);
    ev_signal_start(srv->loop, &srv->sigterm);
    ev_signal_start(srv->loop, &srv->sigint);
    ev_timer_init(&srv->drain_timer, on_drain_timer, 0, 0);
    srv->drain_timer.data = srv;
    ev_timer_init(&srv->accept_retry, on_accept_retry, 0, 0);
    srv->accept_retry.data = srv;
    if (owns_state_dir(opts))
        server_recover(srv);
    ev_timer_init(&srv->sampler, on_sample, 1.0, 1.0);
    srv->sampler.data = srv;
    ev_timer_init(&srv->metrics_timer, on_metrics, 0,
                  (double)(opts->metrics_interval_ms > 0 ? opts->metrics_interval_ms : 10000) / 1000.0);
    srv->metrics_timer.data = srv;
    return srv;
}

struct srv_conn *server_attach(struct server *srv, int rfd, int wfd, uid_t uid)
{
    return conn_add(srv, rfd, wfd, uid, true);
}

void server_feed(struct srv_conn *conn, const void *data, size_t len)
{
    rpc_conn_feed(conn->rpc, data, len);
}

struct ev_loop *server_loop(struct server *srv) { return srv->loop; }

void server_free(struct server *srv)
{
    /* Whatever is still running ends now; the loop turns until every tree is reaped. */
    if (!srv->stopping) {
        shutdown_begin(srv, true);
        ev_run(srv->loop, 0);
    }
    if (ev_is_active(&srv->sampler)) {
        ev_ref(srv->loop);
        ev_timer_stop(srv->loop, &srv->sampler);
    }
    if (ev_is_active(&srv->metrics_timer)) {
        ev_ref(srv->loop);
        ev_timer_stop(srv->loop, &srv->metrics_timer);
    }
    /* a file left behind would show a dead server's figures as current */
    if (srv->opts->metrics_path && unlink(srv->opts->metrics_path) < 0 && errno != ENOENT)
        LOG_W("metrics %s: %s", srv->opts->metrics_path, strerror(errno));
    metrics_free(&srv->metrics);
    while (srv->nleaked > 0)
        close_quietly(&srv->leaked[--srv->nleaked]);
    while (srv->latencies) {
        struct tool_latency *t = srv->latencies;
        srv->latencies = t->next;
        free(t->tool);
        free(t);
    }
    remover_free(srv->remover);     /* the loop has waited for every first attempt */
    while (srv->removing) {         /* answered nowhere: the connections are gone */
        struct srv_session *ss = srv->removing;
        srv->removing = ss->next;
        while (ss->waiters) {
            struct close_waiter *w = ss->waiters;
            ss->waiters = w->next;
            free(w);
        }
        pairs_free(ss->labels);
        free(ss);
    }
    zygote_stop(srv->spawner);
    zygote_stop(srv->prepared);
    while (srv->nretired > 0)
        zygote_stop(srv->retired[--srv->nretired]);
    free(srv->retired);
    if (srv->cleaning)
        proc_signal(&srv->cleaner, SIGKILL);    /* the next start finishes its work */
    record_holder_drop(srv->state_dir, srv->holder, srv->holder_fd);
    close_quietly(&srv->state_lock_fd);
    policy_unref(srv->policy);
    free(srv->policy_path);
    free(srv->state_dir);
    proc_shutdown();
    ev_loop_destroy(srv->loop);
    free(srv);
}

struct policy *server_policy(struct server *srv) { return srv->policy; }

void server_on_reload(struct server *srv, void (*fn)(void *ud), void *ud)
{
    srv->on_reload = fn;
    srv->on_reload_ud = ud;
}

void server_start(struct server *srv)
{
    /* The baseline the fds alarm measures growth from: everything start-up opened. */
    standby_count(srv, 100, NULL);
    sample_take(srv);
    srv->fd_baseline = srv->last.fds - (int)srv->last_standby_fds;
    alarm_thresholds(srv);
    ev_timer_start(srv->loop, &srv->sampler);
    ev_unref(srv->loop);        /* the sampler alone must not keep the server alive */
    if (srv->opts->metrics_path) {
        write_metrics(srv);
        ev_timer_again(srv->loop, &srv->metrics_timer);
        ev_unref(srv->loop);
    }
}

int server_run(const struct server_opts *opts)
{
    struct server *srv = server_new(opts);
    char *listen = NULL;
    if (opts->listen_fd > 2 || opts->listen_path) {
        /* an upgrade hands the socket over (server_new took it): clients that connected
         * meanwhile are in its backlog; systemd passes one (LISTEN_FDS) that outlives us */
        bool inherited = srv->listen_fd >= 0;
        if (!inherited)
            srv->listen_fd = opts->listen_fd > 2 ? opts->listen_fd : listen_unix(opts);
        ev_io_init(&srv->listen_watcher, on_accept, srv->listen_fd, EV_READ);
        srv->listen_watcher.data = srv;
        ev_io_start(srv->loop, &srv->listen_watcher);
        listen = opts->listen_fd > 2 ? service_socket_name(srv->listen_fd)
                                     : xasprintf("unix:%s", opts->listen_path);
        LOG_I("listening on %s%s", listen, inherited ? " (after an upgrade)" : "");
    } else {
        /* stdin/stdout are the protocol: keep them out of every child (CLOEXEC). */
        fd_set_cloexec(0);
        fd_set_cloexec(1);
        conn_add(srv, 0, 1, geteuid(), true);   /* the spawner: an admin peer */
        listen = xstrdup("stdio");
    }
    audit_startup(srv->policy, srv->policy_path, listen);
    free(listen);
    server_start(srv);
    service_ready();
    ev_run(srv->loop, 0);
    server_free(srv);
    return 0;
}
