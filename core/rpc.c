#include "rpc.h"

#include <errno.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define READ_CHUNK 65536
#define OUT_HIGH_WATER (4u << 20)
#define OUT_LOW_WATER (1u << 20)

static uint64_t be(const unsigned char *p, int n)
{
    uint64_t v = 0;
    for (int i = 0; i < n; i++)
        v = (v << 8) | p[i];
    return v;
}

enum rpc_scan rpc_scan(const unsigned char *d, size_t len, size_t max, size_t *pos_io,
                       uint64_t *pending_io)
{
    size_t pos = *pos_io;
    uint64_t pending = *pending_io;
    while (pending > 0) {
        if (pos >= max)
            return RPC_SCAN_TOO_BIG;
        if (pos >= len)
            break;
        unsigned char t = d[pos];
        size_t head = 1;        /* header bytes */
        uint64_t body = 0;      /* payload bytes after the header */
        uint64_t items = 0;     /* elements this container adds */
        int lenbytes = 0;
        if (t <= 0x7f || t >= 0xe0 || t == 0xc0 || t == 0xc2 || t == 0xc3) {
        } else if (t >= 0x80 && t <= 0x8f) {
            items = 2u * (t & 0x0f);
        } else if (t >= 0x90 && t <= 0x9f) {
            items = t & 0x0f;
        } else if (t >= 0xa0 && t <= 0xbf) {
            body = t & 0x1f;
        } else {
            switch (t) {
            case 0xc4: case 0xd9: lenbytes = 1; break;                /* bin8, str8 */
            case 0xc5: case 0xda: lenbytes = 2; break;                /* bin16, str16 */
            case 0xc6: case 0xdb: lenbytes = 4; break;                /* bin32, str32 */
            case 0xc7: lenbytes = 1; body = 1; break;                 /* ext8 (+type) */
            case 0xc8: lenbytes = 2; body = 1; break;
            case 0xc9: lenbytes = 4; body = 1; break;
            case 0xca: body = 4; break;
            case 0xcb: body = 8; break;
            case 0xcc: case 0xd0: body = 1; break;
            case 0xcd: case 0xd1: body = 2; break;
            case 0xce: case 0xd2: body = 4; break;
            case 0xcf: case 0xd3: body = 8; break;
            case 0xd4: body = 2; break;                               /* fixext 1..16 */
            case 0xd5: body = 3; break;
            case 0xd6: body = 5; break;
            case 0xd7: body = 9; break;
            case 0xd8: body = 17; break;
            case 0xdc: case 0xde: lenbytes = 2; break;                /* array16, map16 */
            case 0xdd: case 0xdf: lenbytes = 4; break;                /* array32, map32 */
            default: return RPC_SCAN_INVALID;                         /* 0xc1 */
            }
        }
        if (lenbytes) {
            if (pos + 1 + (size_t)lenbytes > len)
                break;
            uint64_t n = be(d + pos + 1, lenbytes);
            head += (size_t)lenbytes;
            if (t == 0xdc || t == 0xdd)
                items = n;
            else if (t == 0xde || t == 0xdf)
                items = 2 * n;
            else
                body += n;
        }
        /* Every element takes at least one byte: a count beyond the limit cannot fit. */
        if (items > max || body > max || pending - 1 + items > max)
            return RPC_SCAN_TOO_BIG;
        if (pos + head + body > max)
            return RPC_SCAN_TOO_BIG;
        if (pos + head + body > len)
            break;
        pos += head + (size_t)body;
        pending = pending - 1 + items;
    }
    *pos_io = pos;
    *pending_io = pending;
    return pending == 0 ? RPC_SCAN_COMPLETE : RPC_SCAN_NEED_MORE;
}

bool rpc_peek_msgid(const unsigned char *d, size_t len, uint32_t *msgid)
{
    size_t p;
    if (len >= 1 && d[0] == 0x94)
        p = 1;
    else if (len >= 3 && d[0] == 0xdc && d[1] == 0 && d[2] == 4)
        p = 3;
    else
        return false;
    if (len < p + 2 || d[p] != 0x00)
        return false;
    p++;
    unsigned char t = d[p];
    if (t <= 0x7f) {
        *msgid = t;
        return true;
    }
    int n = t == 0xcc ? 1 : t == 0xcd ? 2 : t == 0xce ? 4 : 0;
    if (!n || len < p + 1 + (size_t)n)
        return false;
    *msgid = (uint32_t)be(d + p + 1, n);
    return true;
}

/* ---- the connection ---------------------------------------------------------------- */

static size_t input_held;       /* sum of every connection's input buffer capacity */

size_t rpc_input_held(void) { return input_held; }

static int pack_into_out(void *data, const char *buf, size_t len)
{
    struct rpc_conn *c = data;
    buf_append(&c->out, buf, len);
    return 0;
}

size_t rpc_conn_queued(const struct rpc_conn *c) { return c->out.len - c->out_off; }

static void input_release(struct rpc_conn *c)
{
    input_held -= c->in.cap;
    buf_free(&c->in);
}

static void conn_free(struct rpc_conn *c)
{
    ev_io_stop(c->loop, &c->rw);
    ev_io_stop(c->loop, &c->ww);
    ev_timer_stop(c->loop, &c->linger);
    ev_timer_stop(c->loop, &c->backlog);
    ev_timer_stop(c->loop, &c->stall);
    if (c->wfd != c->rfd)
        close_quietly(&c->wfd);
    close_quietly(&c->rfd);
    input_release(c);
    buf_free(&c->out);
    c->closed = true;
    if (c->busy) {
        c->free_pending = true;     /* dispatch is still on the stack: it frees */
        return;
    }
    free(c);
}

/* dispatch() runs handlers that may close the connection: `c` outlives them. */
static void conn_hold(struct rpc_conn *c) { c->busy++; }

static bool conn_release(struct rpc_conn *c)
{
    if (--c->busy == 0 && c->free_pending) {
        free(c);
        return false;
    }
    return true;
}

/* Read from the peer only when what it sent so far has been served and it takes what
 * it is sent: a client that does not read gets no new requests served either. */
static void update_reading(struct rpc_conn *c)
{
    bool want = !c->closed && !c->under_pressure && !ev_is_active(&c->backlog);
    if (want && !ev_is_active(&c->rw))
        ev_io_start(c->loop, &c->rw);
    else if (!want && ev_is_active(&c->rw))
        ev_io_stop(c->loop, &c->rw);
}

static void set_pressure(struct rpc_conn *c)
{
    size_t q = rpc_conn_queued(c);
    bool high = c->under_pressure ? q > OUT_LOW_WATER : q > OUT_HIGH_WATER;
    if (high == c->under_pressure)
        return;
    c->under_pressure = high;
    if (!c->closed) {
        update_reading(c);
        /* requests read before the pressure are served once it is off */
        if (!high && c->in.len > 0 && !ev_is_active(&c->backlog)) {
            ev_timer_set(&c->backlog, 0, 0);
            ev_timer_start(c->loop, &c->backlog);
        }
    }
    if (c->h->on_pressure)
        c->h->on_pressure(c, high);
}

static void on_writable(struct ev_loop *loop, ev_io *w, int revents)
{
    (void)loop, (void)revents;
    struct rpc_conn *c = w->data;
    bool progress = false;
    while (c->out_off < c->out.len) {
        ssize_t n = write(c->wfd, c->out.data + c->out_off, c->out.len - c->out_off);
        if (n < 0 && (errno == EAGAIN || errno == EINTR))
            break;
        if (n <= 0) {
            /* The peer is gone: nothing more can be said to it. */
            c->out_off = c->out.len;
            if (!c->closed) {
                c->closed = true;
                ev_io_stop(c->loop, &c->rw);
                c->h->on_close(c, "write failed");
            }
            conn_free(c);
            return;
        }
        c->out_off += (size_t)n;
        progress = true;
    }
    if (c->out_off == c->out.len) {
        c->out.len = c->out_off = 0;
        ev_io_stop(c->loop, &c->ww);
        ev_timer_stop(c->loop, &c->stall);
        if (c->closed) {
            conn_free(c);
            return;
        }
    } else {
        if (progress && ev_is_active(&c->stall))
            ev_timer_again(c->loop, &c->stall);
        if (c->out_off > (1u << 20)) {
            memmove(c->out.data, c->out.data + c->out_off, c->out.len - c->out_off);
            c->out.len -= c->out_off;
            c->out_off = 0;
        }
    }
    set_pressure(c);
}

void rpc_conn_flush(struct rpc_conn *c)
{
    /* Nothing was waiting for the peer: write now rather than after a trip through the
     * loop for a writable event (one more epoll_wait and two epoll_ctl per answer). What
     * does not go out, and a failed write, take the usual way: on_writable. */
    if (rpc_conn_queued(c) > 0 && !ev_is_active(&c->ww) && !c->closed) {
        ssize_t n = write(c->wfd, c->out.data + c->out_off, rpc_conn_queued(c));
        if (n > 0) {
            c->out_off += (size_t)n;
            if (c->out_off == c->out.len)
                c->out.len = c->out_off = 0;
        }
    }
    if (rpc_conn_queued(c) > 0 && !ev_is_active(&c->ww)) {
        ev_io_start(c->loop, &c->ww);
        if (c->slow_reader_ms > 0 && !c->closed) {
            ev_timer_set(&c->stall, 0, (double)c->slow_reader_ms / 1000.0);
            ev_timer_again(c->loop, &c->stall);
        }
    }
    set_pressure(c);
}

static void conn_fail(struct rpc_conn *c, const char *why)
{
    LOG_W("connection closed: %s", why);
    rpc_conn_close(c, why, 1000);   /* the error answer, if any, still goes out */
}

/* A client whose output has not moved for slow_reader_ms: it holds what we queued for
 * it (and, through back-pressure, its calls' output) for nothing. */
static void on_stall(struct ev_loop *loop, ev_timer *w, int revents)
{
    (void)loop, (void)revents;
    struct rpc_conn *c = w->data;
    ev_timer_stop(c->loop, w);
    char why[128];
    snprintf(why, sizeof why, "the client read nothing of %zu queued bytes for %lld ms",
             rpc_conn_queued(c), (long long)c->slow_reader_ms);
    LOG_W("connection closed: %s", why);
    rpc_conn_close(c, why, 0);
}

/* Dispatch the complete messages in the input buffer: at most RPC_DISPATCH_MAX of them,
 * or RPC_DISPATCH_SLICE_MS of work, per turn; the rest waits for the next turn (the
 * backlog timer, at the lowest priority), so that a pipelined flood on one connection is
 * served a slice at a time after everyone else's events. */
static void dispatch(struct rpc_conn *c)
{
    size_t start = 0;
    unsigned served = 0;
    ev_tstamp until = ev_time() + RPC_DISPATCH_SLICE_MS / 1000.0;
    bool more = false;
    while (!c->closed && start < c->in.len) {
        if (c->under_pressure)
            break;              /* set_pressure resumes us */
        if (served >= RPC_DISPATCH_MAX || (served > 0 && ev_time() >= until)) {
            more = true;
            break;
        }
        const unsigned char *d = (const unsigned char *)c->in.data + start;
        size_t avail = c->in.len - start;
        enum rpc_scan s = rpc_scan(d, avail, c->max_message, &c->scan_pos, &c->scan_pending);
        if (s == RPC_SCAN_NEED_MORE)
            break;
        if (s == RPC_SCAN_TOO_BIG || s == RPC_SCAN_INVALID) {
            uint32_t msgid;
            char why[160];
            if (s == RPC_SCAN_TOO_BIG)
                snprintf(why, sizeof why, "message larger than max_message (%zu bytes)",
                         c->max_message);
            else
                snprintf(why, sizeof why, "bytes that are not msgpack at offset %zu",
                         c->scan_pos);
            if (rpc_peek_msgid(d, avail, &msgid))
                rpc_send_error(c, msgid, "BAD_REQUEST", false, why, NULL);
            /* The stream cannot be resynchronised: drop this peer, answer everyone else. */
            c->in.len = 0;
            conn_fail(c, why);
            return;
        }
        size_t len = c->scan_pos;
        msgpack_unpacked u;
        msgpack_unpacked_init(&u);
        size_t off = 0;
        msgpack_unpack_return r = msgpack_unpack_next(&u, (const char *)d, len, &off);
        c->scan_pos = 0;
        c->scan_pending = 1;
        start += len;
        served++;
        if (r == MSGPACK_UNPACK_SUCCESS || r == MSGPACK_UNPACK_EXTRA_BYTES) {
            /* what came before (other messages, other events) took time: whatever the
             * handler arms is measured from now */
            ev_now_update(c->loop);
            c->h->on_message(c, &u.data);
        } else {
            /* well-framed but refused by msgpack-c (e.g. nested too deep): answer it */
            uint32_t msgid;
            if (rpc_peek_msgid(d, len, &msgid))
                rpc_send_error(c, msgid, "BAD_REQUEST", false,
                               "message could not be decoded (nested too deep?)", NULL);
            LOG_W("dropped an undecodable message of %zu bytes", len);
        }
        msgpack_unpacked_destroy(&u);
    }
    if (c->closed)
        return;
    if (start > 0) {
        memmove(c->in.data, c->in.data + start, c->in.len - start);
        c->in.len -= start;
    }
    /* A big message's room is given back once it is served. */
    if (c->in.len == 0 && c->in.cap > 4 * READ_CHUNK)
        input_release(c);
    if (more && !ev_is_active(&c->backlog)) {
        ev_timer_set(&c->backlog, 0, 0);
        ev_timer_start(c->loop, &c->backlog);
    }
    update_reading(c);
}

static void on_backlog(struct ev_loop *loop, ev_timer *w, int revents)
{
    (void)loop, (void)revents;
    struct rpc_conn *c = w->data;
    conn_hold(c);
    dispatch(c);
    conn_release(c);
}

static void on_readable(struct ev_loop *loop, ev_io *w, int revents)
{
    (void)loop, (void)revents;
    struct rpc_conn *c = w->data;
    /* Never buffer more than one message's worth plus one read. */
    if (c->in.len >= c->max_message + READ_CHUNK) {
        conn_fail(c, "a message larger than max_message");
        return;
    }
    size_t need = c->in.len + READ_CHUNK + 1;
    if (c->in.cap < need) {
        /* Memory for unfinished messages is bounded across all connections. */
        size_t budget = RPC_INPUT_BUDGET_MESSAGES * (c->max_message + READ_CHUNK);
        if (input_held - c->in.cap + need > budget && c->in.len > 0) {
            char why[160];
            snprintf(why, sizeof why, "input memory budget spent (%zu bytes held for "
                     "unfinished messages); a message of %zu bytes so far dropped",
                     input_held, c->in.len);
            conn_fail(c, why);
            return;
        }
        /* grow geometrically (a big message costs few reallocations) within the budget */
        size_t cap = c->in.cap * 2;
        if (cap > c->max_message + READ_CHUNK + 1)
            cap = c->max_message + READ_CHUNK + 1;
        if (cap < need || input_held - c->in.cap + cap > budget)
            cap = need;
        input_held += cap - c->in.cap;
        c->in.cap = cap;
        c->in.data = xrealloc(c->in.data, c->in.cap);
    }
    ssize_t n = read(c->rfd, c->in.data + c->in.len, READ_CHUNK);
    if (n < 0 && (errno == EAGAIN || errno == EINTR))
        return;
    if (n <= 0) {
        const char *why = n == 0 ? (c->in.len ? "end of stream inside a message" : "end of stream")
                                 : "read failed";
        rpc_conn_close(c, why, 1000);
        return;
    }
    c->in.len += (size_t)n;
    conn_hold(c);
    dispatch(c);
    conn_release(c);
}

void rpc_conn_feed(struct rpc_conn *c, const void *data, size_t n)
{
    const char *p = data;
    conn_hold(c);
    while (n > 0 && !c->closed) {
        size_t chunk = n < READ_CHUNK ? n : READ_CHUNK;
        size_t cap0 = c->in.cap;
        buf_append(&c->in, p, chunk);
        input_held += c->in.cap - cap0;
        p += chunk;
        n -= chunk;
        dispatch(c);
        /* the harness has no loop turns: serve the backlog now */
        while (!c->closed && ev_is_active(&c->backlog)) {
            ev_timer_stop(c->loop, &c->backlog);
            dispatch(c);
        }
    }
    conn_release(c);
}

static void on_linger(struct ev_loop *loop, ev_timer *w, int revents)
{
    (void)loop, (void)revents;
    struct rpc_conn *c = w->data;
    LOG_W("connection closed with %zu bytes unsent: the peer stopped reading",
          rpc_conn_queued(c));
    conn_free(c);
}

struct rpc_conn *rpc_conn_new(struct ev_loop *loop, int rfd, int wfd, size_t max_message,
                              const struct rpc_handlers *h, void *ud)
{
    struct rpc_conn *c = xcalloc(1, sizeof *c);
    c->loop = loop;
    c->rfd = rfd;
    c->wfd = wfd;
    c->max_message = max_message;
    c->scan_pending = 1;
    c->h = h;
    c->ud = ud;
    c->peer_uid = (uid_t)-1;
    c->slow_reader_ms = RPC_SLOW_READER_MS_DEFAULT;
    fd_set_nonblock(rfd);
    fd_set_nonblock(wfd);
    msgpack_packer_init(&c->pk, c, pack_into_out);
    ev_io_init(&c->rw, on_readable, rfd, EV_READ);
    ev_io_init(&c->ww, on_writable, wfd, EV_WRITE);
    ev_timer_init(&c->linger, on_linger, 0, 0);
    ev_timer_init(&c->backlog, on_backlog, 0, 0);
    /* A backlog turn comes after every other event of its loop turn: a connection that
     * pipelines expensive requests (hooks that run to their budget) never takes the
     * turn after its last one while another connection's event is waiting. */
    ev_set_priority(&c->backlog, EV_MINPRI);
    ev_timer_init(&c->stall, on_stall, 0, 0);
    c->rw.data = c->ww.data = c->linger.data = c->backlog.data = c->stall.data = c;
    ev_io_start(loop, &c->rw);
    return c;
}

void rpc_conn_close(struct rpc_conn *c, const char *why, int flush_ms)
{
    if (c->closed)
        return;
    c->closed = true;
    ev_io_stop(c->loop, &c->rw);
    ev_timer_stop(c->loop, &c->backlog);
    ev_timer_stop(c->loop, &c->stall);
    c->h->on_close(c, why);
    if (rpc_conn_queued(c) == 0 || flush_ms <= 0) {
        conn_free(c);
        return;
    }
    /* Queued answers get a bounded chance to leave (on_writable frees when drained). */
    ev_timer_set(&c->linger, flush_ms / 1000.0, 0);
    ev_timer_start(c->loop, &c->linger);
    if (!ev_is_active(&c->ww))
        ev_io_start(c->loop, &c->ww);
}

/* ---- packing ---------------------------------------------------------------------- */

void rpc_pack_str(msgpack_packer *pk, const char *s)
{
    size_t n = strlen(s);
    msgpack_pack_str(pk, n);
    msgpack_pack_str_body(pk, s, n);
}

void rpc_pack_key(msgpack_packer *pk, const char *k) { rpc_pack_str(pk, k); }

void rpc_pack_kv_str(msgpack_packer *pk, const char *k, const char *v)
{
    rpc_pack_str(pk, k);
    if (v)
        rpc_pack_str(pk, v);
    else
        msgpack_pack_nil(pk);
}

void rpc_pack_kv_int(msgpack_packer *pk, const char *k, int64_t v)
{
    rpc_pack_str(pk, k);
    msgpack_pack_int64(pk, v);
}

void rpc_pack_kv_bool(msgpack_packer *pk, const char *k, bool v)
{
    rpc_pack_str(pk, k);
    if (v)
        msgpack_pack_true(pk);
    else
        msgpack_pack_false(pk);
}

static void send_error_map(struct rpc_conn *c, const char *class, bool retryable,
                           const char *message, const char *layer)
{
    if (c->on_error_sent)
        c->on_error_sent(c, class);
    msgpack_packer *pk = &c->pk;
    msgpack_pack_map(pk, 4);
    rpc_pack_kv_str(pk, "class", class);
    rpc_pack_kv_bool(pk, "retryable", retryable);
    rpc_pack_kv_str(pk, "message", message);
    rpc_pack_kv_str(pk, "layer", layer);
    msgpack_pack_nil(pk);
    rpc_conn_flush(c);
}

void rpc_send_error(struct rpc_conn *c, uint32_t msgid, const char *class, bool retryable,
                    const char *message, const char *layer)
{
    if (c->closed)
        return;
    msgpack_pack_array(&c->pk, 4);
    msgpack_pack_int(&c->pk, 1);
    msgpack_pack_uint32(&c->pk, msgid);
    send_error_map(c, class, retryable, message, layer);
}

void rpc_send_error_echo(struct rpc_conn *c, const msgpack_object *msgid, const char *class,
                         bool retryable, const char *message, const char *layer)
{
    if (c->closed)
        return;
    msgpack_pack_array(&c->pk, 4);
    msgpack_pack_int(&c->pk, 1);
    msgpack_pack_object(&c->pk, *msgid);
    send_error_map(c, class, retryable, message, layer);
}

/* ---- reading ---------------------------------------------------------------------- */

const msgpack_object *rpc_map_get(const msgpack_object *map, const char *key)
{
    if (!map || map->type != MSGPACK_OBJECT_MAP)
        return NULL;
    size_t klen = strlen(key);
    for (uint32_t i = 0; i < map->via.map.size; i++) {
        const msgpack_object *k = &map->via.map.ptr[i].key;
        if (k->type == MSGPACK_OBJECT_STR && k->via.str.size == klen &&
            memcmp(k->via.str.ptr, key, klen) == 0)
            return &map->via.map.ptr[i].val;
    }
    return NULL;
}

char *rpc_obj_strdup(const msgpack_object *o)
{
    const char *p;
    size_t n;
    if (o->type == MSGPACK_OBJECT_STR) {
        p = o->via.str.ptr;
        n = o->via.str.size;
    } else if (o->type == MSGPACK_OBJECT_BIN) {
        p = o->via.bin.ptr;
        n = o->via.bin.size;
    } else {
        return NULL;
    }
    char *s = xmalloc(n + 1);
    if (n)
        memcpy(s, p, n);
    s[n] = 0;
    return s;
}

void rpc_conn_flush_until(struct rpc_conn *c, int64_t until_ms)
{
    while (rpc_conn_queued(c) > 0) {
        int64_t left = until_ms - now_ms();
        struct pollfd pf = {c->wfd, POLLOUT, 0};
        if (left <= 0 || poll(&pf, 1, (int)left) <= 0)
            return;
        ssize_t n = write(c->wfd, c->out.data + c->out_off, rpc_conn_queued(c));
        if (n < 0 && (errno == EAGAIN || errno == EINTR))
            continue;
        if (n <= 0)
            return;
        c->out_off += (size_t)n;
    }
}
