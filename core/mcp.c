/* jansson and core/util.h both declare a json_string(): jansson's (a constructor) is
 * never called here, so its declaration is moved aside; json_string() below is always
 * util.h's writer, which makes any bytes valid UTF-8. */
#define json_string jansson_json_string_unused
#include <jansson.h>
#undef json_string

#include "mcp.h"
#include "call.h"
#include "util.h"
#include "policy.h"
#include "rpc.h"
#include "server.h"

#include <errno.h>
#include <lauxlib.h>
#include <lua.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>

#define MCP_VERSION "0.1.0"
#define READ_CHUNK 65536
#define OUT_HIGH_WATER (8u << 20)
#define OUT_LOW_WATER (1u << 20)
#define LINGER_S 5.0
/* Our own server's answers: trusted, but a result carries two capped streams. */
#define SERVER_MAX_MESSAGE (1u << 30)

/* Newest first; an unknown version requested gets the newest. */
static const char *const protocol_versions[] = {"2025-11-25", "2025-06-18", "2025-03-26",
                                                "2024-11-05"};

/* ---- decoding ------------------------------------------------------------------------ */

static void invalid(struct mcp_msg *m, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void invalid(struct mcp_msg *m, int code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(m->error, sizeof m->error, fmt, ap);
    va_end(ap);
    m->kind = MCP_MSG_INVALID;
    m->code = code;
}

/* Deepest nesting of arrays and objects, scanning no further than the limit: the parser
 * recurses per level, so a deep message is refused before it runs. */
static bool depth_within(const char *s, size_t len, int max)
{
    int depth = 0;
    bool in_str = false, esc = false;
    for (size_t i = 0; i < len; i++) {
        char c = s[i];
        if (in_str) {
            if (esc)
                esc = false;
            else if (c == '\\')
                esc = true;
            else if (c == '"')
                in_str = false;
        } else if (c == '"') {
            in_str = true;
        } else if (c == '[' || c == '{') {
            if (++depth > max)
                return false;
        } else if (c == ']' || c == '}') {
            depth--;
        }
    }
    return true;
}

void mcp_decode(const char *line, size_t len, struct mcp_msg *m)
{
    memset(m, 0, sizeof *m);
    if (!depth_within(line, len, MCP_MAX_DEPTH)) {
        invalid(m, MCP_INVALID_REQUEST, "invalid request: nested deeper than %d levels",
                MCP_MAX_DEPTH);
        return;
    }
    json_error_t jerr;
    m->root = json_loadb(line, len, JSON_REJECT_DUPLICATES | JSON_DECODE_ANY, &jerr);
    if (!m->root) {
        invalid(m, MCP_PARSE_ERROR, "parse error at column %d: %.100s", jerr.column, jerr.text);
        return;
    }
    if (json_is_array(m->root)) {
        invalid(m, MCP_INVALID_REQUEST, "invalid request: batches are not supported");
        return;
    }
    if (!json_is_object(m->root)) {
        invalid(m, MCP_INVALID_REQUEST, "invalid request: expected a JSON-RPC 2.0 object");
        return;
    }
    json_t *id = json_object_get(m->root, "id");
    if (id && (json_is_string(id) || json_is_integer(id)))
        m->id = id;
    json_t *v = json_object_get(m->root, "jsonrpc");
    if (!json_is_string(v) || strcmp(json_string_value(v), "2.0") != 0) {
        invalid(m, MCP_INVALID_REQUEST, "invalid request: \"jsonrpc\" must be \"2.0\"");
        return;
    }
    if (id && !m->id) {
        invalid(m, MCP_INVALID_REQUEST, "invalid request: \"id\" must be a string or an integer");
        return;
    }
    json_t *method = json_object_get(m->root, "method");
    m->params = json_object_get(m->root, "params");
    if (method) {
        if (!json_is_string(method) || json_string_length(method) == 0) {
            invalid(m, MCP_INVALID_REQUEST, "invalid request: \"method\" must be a string");
            return;
        }
        m->method = json_string_value(method);
        m->kind = m->id ? MCP_MSG_REQUEST : MCP_MSG_NOTIFICATION;
        return;
    }
    if (m->id && (json_object_get(m->root, "result") || json_object_get(m->root, "error"))) {
        m->kind = MCP_MSG_RESPONSE;
        return;
    }
    invalid(m, MCP_INVALID_REQUEST, "invalid request: no \"method\"");
}

void mcp_msg_free(struct mcp_msg *m)
{
    json_decref(m->root);
    memset(m, 0, sizeof *m);
}

/* ---- the connection ------------------------------------------------------------------ */

enum pending_kind { PENDING_OPEN, PENDING_CALL };

/* A request sent to the server, by its msgid. */
struct pending {
    enum pending_kind kind;
    uint32_t msgid;
    json_t *id;                 /* the client's request id (a reference) */
    json_t *progress_token;     /* or NULL */
    int64_t streamed;           /* bytes of progress sent: the progress value */
    bool cancelled;             /* the client gave up: no answer goes out */
    /* what the call asks, kept to send it once more in a fresh session */
    char *tool;
    bool structured;            /* args is the tool's structured args, else its argv */
    json_t *args;               /* or NULL */
    unsigned session_seq;       /* the session it was sent in */
    bool resent;
    bool held;                  /* waits for its session's open to be answered */
    struct pending *next;
};

struct mcp {
    struct ev_loop *loop;
    struct server *srv;
    struct mcp_opts opts;
    /* the client: JSON lines */
    int in_fd, out_fd;
    ev_io in_w, out_w;
    ev_timer linger;
    ev_timer closer;            /* ends the server connection from the loop, not from
                                 * inside one of its own callbacks */
    const char *close_why;
    struct buf in;              /* a partial line */
    bool skipping;              /* the rest of an oversize line is being dropped */
    bool in_closed, out_dead, paused;
    struct buf out;
    size_t out_off;
    /* the server: MessagePack-RPC over a socketpair */
    struct rpc_conn *rpc;
    uint32_t next_msgid;
    struct pending *pending;
    /* the MCP session */
    const char *protocol;       /* one of protocol_versions, once initialized */
    bool ready;                 /* notifications/initialized came: we may notify */
    char nonce[17];
    unsigned session_seq;
    char *session_id;           /* NULL: none open (yet, or any more) */
    bool opening;               /* its session.open is not answered yet */
    char *session_error;        /* why the last session.open failed, and its class */
    const char *session_error_class;
    bool session_error_retryable;
    bool fused;                 /* the session's fuse ran out: no more calls */
    char *tools;                /* the tools/list array, for the current policy */
};

static void input_close(struct mcp *m, const char *why);
static void call_send(struct mcp *m, struct pending *p);

static void out_pressure(struct mcp *m)
{
    size_t q = m->out.len - m->out_off;
    bool high = m->paused ? q > OUT_LOW_WATER : q > OUT_HIGH_WATER;
    if (high == m->paused)
        return;
    m->paused = high;
    /* A client that does not read gets nothing new read for it: neither its requests nor
     * its calls' output (the server then pauses the streams, as for a slow msgpack peer). */
    if (!m->in_closed) {
        if (high)
            ev_io_stop(m->loop, &m->in_w);
        else
            ev_io_start(m->loop, &m->in_w);
    }
    if (m->rpc && !m->rpc->closed) {
        if (high)
            ev_io_stop(m->loop, &m->rpc->rw);
        else if (!m->rpc->under_pressure)
            ev_io_start(m->loop, &m->rpc->rw);
    }
}

static void out_write(struct mcp *m)
{
    while (m->out_off < m->out.len) {
        ssize_t n = write(m->out_fd, m->out.data + m->out_off, m->out.len - m->out_off);
        if (n < 0 && (errno == EAGAIN || errno == EINTR))
            break;
        if (n <= 0) {
            /* The client is gone: nothing more can be said to it. */
            m->out_dead = true;
            m->out.len = m->out_off = 0;
            ev_io_stop(m->loop, &m->out_w);
            ev_timer_stop(m->loop, &m->linger);
            input_close(m, "the client stopped reading (write failed)");
            return;
        }
        m->out_off += (size_t)n;
    }
    if (m->out_off == m->out.len) {
        m->out.len = m->out_off = 0;
        ev_io_stop(m->loop, &m->out_w);
        ev_timer_stop(m->loop, &m->linger);
    } else {
        if (m->out_off > (1u << 20)) {
            memmove(m->out.data, m->out.data + m->out_off, m->out.len - m->out_off);
            m->out.len -= m->out_off;
            m->out_off = 0;
        }
        ev_io_start(m->loop, &m->out_w);
    }
    out_pressure(m);
}

static void on_out_writable(struct ev_loop *loop, ev_io *w, int revents)
{
    (void)loop, (void)revents;
    out_write(w->data);
}

static void on_linger(struct ev_loop *loop, ev_timer *w, int revents)
{
    (void)loop, (void)revents;
    struct mcp *m = w->data;
    LOG_W("mcp: %zu bytes the client never read were dropped", m->out.len - m->out_off);
    m->out.len = m->out_off = 0;
    ev_io_stop(m->loop, &m->out_w);
}

/* A message is written straight into the output queue: line_begin() gives the queue,
 * send_line() ends the line and tries to write it. */
static struct buf *line_begin(struct mcp *m)
{
    return &m->out;
}

static void send_line(struct mcp *m, struct buf *b)
{
    if (m->out_dead) {
        b->len = m->out_off = 0;    /* nobody reads: the message is dropped */
        return;
    }
    buf_append_lit(b, "\n");
    out_write(m);
}

static void json_id(struct buf *b, const json_t *id)
{
    if (json_is_integer(id))
        buf_printf(b, "%lld", (long long)json_integer_value(id));
    else if (json_is_string(id))
        json_string(b, json_string_value(id), json_string_length(id));
    else
        buf_append_lit(b, "null");
}

static void send_error(struct mcp *m, const json_t *id, int code, const char *message)
{
    struct buf *b = line_begin(m);
    buf_append_lit(b, "{\"jsonrpc\":\"2.0\",\"id\":");
    json_id(b, id);
    buf_printf(b, ",\"error\":{\"code\":%d,\"message\":", code);
    json_cstr(b, message);
    buf_append_lit(b, "}}");
    send_line(m, b);
}

/* {"jsonrpc":"2.0","id":ID,"result": ... the caller writes the result, then result_end. */
static struct buf *result_begin(struct mcp *m, const json_t *id)
{
    struct buf *b = line_begin(m);
    buf_append_lit(b, "{\"jsonrpc\":\"2.0\",\"id\":");
    json_id(b, id);
    buf_append_lit(b, ",\"result\":");
    return b;
}

static void result_end(struct mcp *m, struct buf *b)
{
    buf_append_lit(b, "}");
    send_line(m, b);
}

/* ---- the tool registry as MCP tools ----------------------------------------------------- */

/* Keys whose value is a list in JSON Schema: an empty Lua table there is [], elsewhere {}. */
static bool key_is_list(const char *key)
{
    static const char *const lists[] = {"required", "enum", "allOf", "anyOf", "oneOf",
                                        "prefixItems", "examples", "type"};
    for (size_t i = 0; key && i < ARRAY_LEN(lists); i++)
        if (strcmp(key, lists[i]) == 0)
            return true;
    return false;
}

struct lua_key {
    const char *s;
    size_t len;
};

static int lua_key_cmp(const void *a, const void *b)
{
    const struct lua_key *x = a, *y = b;
    int c = memcmp(x->s, y->s, x->len < y->len ? x->len : y->len);
    return c ? c : (x->len > y->len) - (x->len < y->len);
}

/* A plain Lua value (a policy_describe copy) as JSON; depth bounded like the copy. */
static void lua_json(lua_State *L, int idx, const char *key, int depth, struct buf *b)
{
    idx = lua_absindex(L, idx);
    switch (lua_type(L, idx)) {
    case LUA_TBOOLEAN:
        buf_printf(b, "%s", lua_toboolean(L, idx) ? "true" : "false");
        return;
    case LUA_TNUMBER:
        if (lua_isinteger(L, idx)) {
            buf_printf(b, "%lld", (long long)lua_tointeger(L, idx));
        } else {
            double d = lua_tonumber(L, idx);
            if (isfinite(d))
                buf_printf(b, "%.17g", d);
            else
                buf_append_lit(b, "null");
        }
        return;
    case LUA_TSTRING: {
        size_t n;
        const char *s = lua_tolstring(L, idx, &n);
        json_string(b, s, n);
        return;
    }
    case LUA_TTABLE:
        break;
    default:
        buf_append_lit(b, "null");
        return;
    }
    if (depth > 24 || !lua_checkstack(L, 4)) {
        buf_append_lit(b, "null");
        return;
    }
    size_t n = lua_rawlen(L, idx), count = 0;
    lua_pushnil(L);
    while (lua_next(L, idx)) {
        count++;
        lua_pop(L, 1);
    }
    if ((n > 0 && count == n) || (count == 0 && key_is_list(key))) {
        buf_append_lit(b, "[");
        for (size_t i = 1; i <= n; i++) {
            if (i > 1)
                buf_append_lit(b, ",");
            lua_rawgeti(L, idx, (lua_Integer)i);
            lua_json(L, -1, NULL, depth + 1, b);
            lua_pop(L, 1);
        }
        buf_append_lit(b, "]");
        return;
    }
    /* keys in sorted order: a table's traversal order differs between two loads of the
     * same policy, and the text is compared to tell whether the registry changed */
    struct lua_key *keys = xcalloc(count ? count : 1, sizeof *keys);
    size_t nkeys = 0;
    lua_pushnil(L);
    while (lua_next(L, idx)) {
        if (lua_type(L, -2) == LUA_TSTRING) {
            keys[nkeys].s = lua_tolstring(L, -2, &keys[nkeys].len);    /* held by the table */
            nkeys++;
        }
        lua_pop(L, 1);
    }
    qsort(keys, nkeys, sizeof *keys, lua_key_cmp);
    buf_append_lit(b, "{");
    for (size_t i = 0; i < nkeys; i++) {
        if (i > 0)
            buf_append_lit(b, ",");
        json_string(b, keys[i].s, keys[i].len);
        buf_append_lit(b, ":");
        lua_pushlstring(L, keys[i].s, keys[i].len);
        lua_rawget(L, idx);
        lua_json(L, -1, keys[i].s, depth + 1, b);
        lua_pop(L, 1);
    }
    buf_append_lit(b, "}");
    free(keys);
}

static const char output_schema[] =
    "{\"type\":\"object\",\"properties\":{"
    "\"class\":{\"type\":\"string\",\"enum\":[\"OK\",\"TOOL_ERROR\",\"TOOL_TIMEOUT\","
    "\"DEADLINE_EXCEEDED\",\"SESSION_EXPIRED\",\"POLICY_VIOLATION\",\"RESOURCE_LIMIT\","
    "\"OUTPUT_REJECTED\",\"CANCELLED\",\"OVERLOADED\",\"BAD_REQUEST\",\"NO_SUCH_SESSION\","
    "\"INTERNAL\"]},"
    "\"retryable\":{\"type\":\"boolean\"},"
    "\"message\":{\"type\":\"string\"},"
    "\"layer\":{\"type\":[\"string\",\"null\"]},"
    "\"exit_code\":{\"type\":[\"integer\",\"null\"]},"
    "\"signal\":{\"type\":[\"integer\",\"null\"]},"
    "\"truncated\":{\"type\":\"object\",\"properties\":{\"stdout\":{\"type\":\"integer\"},"
    "\"stderr\":{\"type\":\"integer\"}},\"required\":[\"stdout\",\"stderr\"]},"
    "\"redactions\":{\"type\":\"integer\"},"
    "\"duration_ms\":{\"type\":\"integer\"}},"
    "\"required\":[\"class\",\"retryable\",\"message\",\"layer\",\"exit_code\",\"signal\","
    "\"truncated\",\"redactions\",\"duration_ms\"]}";

static const char argv_schema[] =
    "{\"type\":\"object\",\"properties\":{\"argv\":{\"type\":\"array\",\"items\":"
    "{\"type\":\"string\"},\"description\":\"arguments after the tool's program\"}},"
    "\"additionalProperties\":false}";

/* One MCP tool per policy tool, in the registry's (name) order. A tool with an argv hook
 * takes its schema's structured args; any other takes {argv: [string]}. */
static char *tools_build(struct policy *p)
{
    lua_State *L = luaL_newstate();
    if (!L)
        return NULL;
    policy_describe(p, L);
    lua_getfield(L, -1, "tools");
    int tools = lua_gettop(L);
    struct buf b = {0};
    buf_append_lit(&b, "[");
    for (size_t i = 0; i < p->ntools; i++) {
        const struct tool_def *t = &p->tools[i];
        if (i > 0)
            buf_append_lit(&b, ",");
        buf_append_lit(&b, "{\"name\":");
        json_cstr(&b, t->name);
        lua_getfield(L, tools, t->name);
        if (!lua_istable(L, -1)) {     /* not described (a name the copy skips) */
            lua_pop(L, 1);
            lua_newtable(L);
        }
        int tt = lua_gettop(L);
        buf_append_lit(&b, ",\"description\":");
        lua_getfield(L, tt, "description");
        if (lua_type(L, -1) == LUA_TSTRING) {
            lua_json(L, -1, NULL, 0, &b);
        } else {
            char *d = xasprintf("Runs %s under the stockade policy '%s'.", t->path, p->name);
            json_cstr(&b, d);
            free(d);
        }
        lua_pop(L, 1);
        buf_append_lit(&b, ",\"inputSchema\":");
        lua_getfield(L, tt, "schema");
        if (!t->has_argv) {
            buf_append(&b, argv_schema, sizeof argv_schema - 1);
        } else if (lua_istable(L, -1)) {
            /* MCP wants an object schema, and structured args are always a map (a schema
             * of another type refuses every call anyway) */
            lua_pushstring(L, "object");
            lua_setfield(L, -2, "type");
            lua_json(L, -1, NULL, 0, &b);
        } else {
            buf_append_lit(&b, "{\"type\":\"object\"}");
        }
        lua_pop(L, 1);
        buf_append_lit(&b, ",\"outputSchema\":");
        buf_append(&b, output_schema, sizeof output_schema - 1);
        buf_printf(&b, ",\"annotations\":{\"openWorldHint\":%s",
                   strcmp(p->network, "none") != 0 ? "true" : "false");
        if (t->idempotent_declared && !t->idempotent_fn)
            buf_printf(&b, ",\"idempotentHint\":%s", t->idempotent ? "true" : "false");
        buf_append_lit(&b, "}}");
        lua_settop(L, tools);
    }
    buf_append_lit(&b, "]");
    lua_close(L);
    return b.data;
}

static void on_policy_reload(void *ud)
{
    struct mcp *m = ud;
    char *tools = tools_build(server_policy(m->srv));
    if (!tools)
        return;
    bool changed = !m->tools || strcmp(tools, m->tools) != 0;
    free(m->tools);
    m->tools = tools;
    if (changed && m->ready) {
        struct buf *b = line_begin(m);
        buf_append_lit(b, "{\"jsonrpc\":\"2.0\",\"method\":\"notifications/tools/list_changed\"}");
        send_line(m, b);
    }
}

/* ---- the server's side -------------------------------------------------------------------- */

static struct pending *pending_add(struct mcp *m, enum pending_kind kind, json_t *id)
{
    struct pending *p = xcalloc(1, sizeof *p);
    p->kind = kind;
    p->msgid = ++m->next_msgid;
    p->id = id ? json_incref(id) : NULL;
    p->next = m->pending;
    m->pending = p;
    return p;
}

static struct pending *pending_take(struct mcp *m, uint32_t msgid)
{
    for (struct pending **pp = &m->pending; *pp; pp = &(*pp)->next) {
        if ((*pp)->msgid == msgid) {
            struct pending *p = *pp;
            *pp = p->next;
            return p;
        }
    }
    return NULL;
}

static void pending_free(struct pending *p)
{
    json_decref(p->id);
    json_decref(p->progress_token);
    json_decref(p->args);
    free(p->tool);
    free(p);
}

/* [0, msgid, method, {map with nfields}]: the caller packs the fields, then flushes. */
static msgpack_packer *request_begin(struct mcp *m, uint32_t msgid, const char *method,
                                     uint32_t nfields)
{
    msgpack_packer *pk = &m->rpc->pk;
    msgpack_pack_array(pk, 4);
    msgpack_pack_int(pk, 0);
    msgpack_pack_uint32(pk, msgid);
    rpc_pack_str(pk, method);
    msgpack_pack_map(pk, nfields);
    return pk;
}

/* The session is opened on first use. Calls wait for the open's answer: a strict
 * session is answered once its zygote is up, and a call that overtook it would find no
 * session (requests are handled concurrently, not in order). */
static void session_ensure(struct mcp *m)
{
    if (m->session_id)
        return;
    m->opening = true;
    m->session_id = xasprintf("mcp-%s-%u", m->nonce, ++m->session_seq);
    struct pending *p = pending_add(m, PENDING_OPEN, NULL);
    msgpack_packer *pk = request_begin(m, p->msgid, "session.open",
                                       m->opts.session_ttl_ms > 0 ? 2 : 1);
    rpc_pack_kv_str(pk, "session_id", m->session_id);
    if (m->opts.session_ttl_ms > 0)
        rpc_pack_kv_int(pk, "ttl_ms", m->opts.session_ttl_ms);
    rpc_conn_flush(m->rpc);
}

/* What a call came to, from a result map, an error map, or decided here. */
struct outcome {
    const char *class;
    bool retryable;
    const char *message, *layer, *out;
    size_t message_len, layer_len, out_len;
    bool has_exit_code;
    int64_t exit_code, signal, truncated_out, truncated_err, redactions, duration_ms;
};

static bool obj_bytes(const msgpack_object *o, const char **p, size_t *n)
{
    if (o && o->type == MSGPACK_OBJECT_STR) {
        *p = o->via.str.ptr;
        *n = o->via.str.size;
        return true;
    }
    if (o && o->type == MSGPACK_OBJECT_BIN) {
        *p = o->via.bin.ptr;
        *n = o->via.bin.size;
        return true;
    }
    return false;
}

static bool obj_int(const msgpack_object *o, int64_t *v)
{
    if (o && o->type == MSGPACK_OBJECT_POSITIVE_INTEGER && o->via.u64 <= INT64_MAX) {
        *v = (int64_t)o->via.u64;
        return true;
    }
    if (o && o->type == MSGPACK_OBJECT_NEGATIVE_INTEGER) {
        *v = o->via.i64;
        return true;
    }
    return false;
}

static void outcome_from_map(struct outcome *o, const msgpack_object *map)
{
    static const char class_internal[] = "INTERNAL";
    memset(o, 0, sizeof *o);
    char classbuf[32];
    const char *p;
    size_t n;
    o->class = class_internal;
    if (obj_bytes(rpc_map_get(map, "class"), &p, &n) && n < sizeof classbuf) {
        /* the class is one of the server's static names: find it to keep a C string */
        memcpy(classbuf, p, n);
        classbuf[n] = 0;
        for (int c = CLASS_OK; c <= CLASS_INTERNAL; c++)
            if (strcmp(classbuf, call_class_name((enum call_class)c)) == 0)
                o->class = call_class_name((enum call_class)c);
    }
    const msgpack_object *r = rpc_map_get(map, "retryable");
    o->retryable = r && r->type == MSGPACK_OBJECT_BOOLEAN && r->via.boolean;
    obj_bytes(rpc_map_get(map, "message"), &o->message, &o->message_len);
    obj_bytes(rpc_map_get(map, "layer"), &o->layer, &o->layer_len);
    obj_bytes(rpc_map_get(map, "stdout"), &o->out, &o->out_len);
    o->has_exit_code = obj_int(rpc_map_get(map, "exit_code"), &o->exit_code);
    obj_int(rpc_map_get(map, "signal"), &o->signal);
    const msgpack_object *t = rpc_map_get(map, "truncated");
    if (t && t->type == MSGPACK_OBJECT_MAP) {
        obj_int(rpc_map_get(t, "stdout"), &o->truncated_out);
        obj_int(rpc_map_get(t, "stderr"), &o->truncated_err);
    }
    obj_int(rpc_map_get(map, "redactions"), &o->redactions);
    obj_int(rpc_map_get(map, "duration_ms"), &o->duration_ms);
}

/* The one line a model reads for a call that did not succeed: the server's message (its
 * own words, or the policy's, never the tool's stderr) and what to do about it. */
static void model_line(struct buf *t, const struct outcome *o)
{
    const char *msg = o->message ? o->message : "";
    size_t len = o->message_len;
    const char *nl = memchr(msg, '\n', len);
    if (nl)
        len = (size_t)(nl - msg);
    buf_append(t, msg, len);
    if (strcmp(o->class, "POLICY_VIOLATION") == 0)
        buf_printf(t, " [%s: refused by policy; do not retry this call]", o->class);
    else if (o->retryable)
        buf_printf(t, " [%s: may succeed if retried]", o->class);
    else
        buf_printf(t, " [%s]", o->class);
}

static void answer_outcome(struct mcp *m, const json_t *id, const struct outcome *o)
{
    bool ok = strcmp(o->class, "OK") == 0;
    struct buf *b = result_begin(m, id);
    buf_append_lit(b, "{\"content\":[");
    if (!ok) {
        struct buf line = {0};
        model_line(&line, o);
        buf_append_lit(b, "{\"type\":\"text\",\"text\":");
        json_string(b, line.data, line.len);
        buf_append_lit(b, "}");
        buf_free(&line);
    }
    if (ok || o->out_len > 0) {
        buf_append(b, ok ? "" : ",", ok ? 0 : 1);
        buf_append_lit(b, "{\"type\":\"text\",\"text\":");
        json_string(b, o->out ? o->out : "", o->out_len);
        buf_append_lit(b, "}");
    }
    buf_append_lit(b, "],\"structuredContent\":{\"class\":");
    json_cstr(b, o->class);
    buf_printf(b, ",\"retryable\":%s,\"message\":", o->retryable ? "true" : "false");
    json_string(b, o->message ? o->message : "", o->message_len);
    buf_append_lit(b, ",\"layer\":");
    if (o->layer)
        json_string(b, o->layer, o->layer_len);
    else
        buf_append_lit(b, "null");
    if (o->has_exit_code)
        buf_printf(b, ",\"exit_code\":%lld", (long long)o->exit_code);
    else
        buf_append_lit(b, ",\"exit_code\":null");
    if (o->signal)
        buf_printf(b, ",\"signal\":%lld", (long long)o->signal);
    else
        buf_append_lit(b, ",\"signal\":null");
    buf_printf(b, ",\"truncated\":{\"stdout\":%lld,\"stderr\":%lld},\"redactions\":%lld,"
                  "\"duration_ms\":%lld},\"isError\":%s}",
               (long long)o->truncated_out, (long long)o->truncated_err,
               (long long)o->redactions, (long long)o->duration_ms, ok ? "false" : "true");
    result_end(m, b);
}

/* A tool result decided here, without the server (bad arguments, a spent fuse). */
static void answer_local(struct mcp *m, const json_t *id, const char *class, const char *layer,
                         const char *message)
{
    struct outcome o = {.class = class, .message = message, .message_len = strlen(message),
                        .layer = layer, .layer_len = layer ? strlen(layer) : 0};
    answer_outcome(m, id, &o);
}

static void answer_fused(struct mcp *m, const json_t *id)
{
    answer_local(m, id, "SESSION_EXPIRED", "fuse",
                 "the session's total time budget (fuse) ran out: no more calls on this "
                 "connection");
}

/* The open is answered: the calls that waited for it go, or learn why it failed. */
static void release_held(struct mcp *m)
{
    for (struct pending **pp = &m->pending; *pp;) {
        struct pending *p = *pp;
        if (p->kind != PENDING_CALL || !p->held) {
            pp = &p->next;
            continue;
        }
        p->held = false;
        if (m->session_id && !p->cancelled) {
            call_send(m, p);
            pp = &p->next;
            continue;
        }
        *pp = p->next;
        if (!p->cancelled) {
            struct outcome o = {
                .class = m->session_error_class ? m->session_error_class : "INTERNAL",
                .retryable = m->session_error_retryable,
                .message = m->session_error ? m->session_error : "could not open a session",
            };
            o.message_len = strlen(o.message);
            answer_outcome(m, p->id, &o);
        }
        pending_free(p);
    }
}

static void on_server_response(struct mcp *m, uint32_t msgid, const msgpack_object *err,
                               const msgpack_object *result)
{
    struct pending *p = pending_take(m, msgid);
    if (!p)
        return;     /* a cancel's answer: nothing to tell */
    bool failed = err->type != MSGPACK_OBJECT_NIL;
    if (p->kind == PENDING_OPEN) {
        free(m->session_error);
        m->session_error = NULL;
        if (failed) {
            struct outcome o = {.class = "INTERNAL"};
            if (err->type == MSGPACK_OBJECT_MAP)
                outcome_from_map(&o, err);
            m->session_error = xasprintf("could not open a session: %.*s",
                                         (int)(o.message_len > 300 ? 300 : o.message_len),
                                         o.message ? o.message : "");
            m->session_error_class = o.class;
            m->session_error_retryable = o.retryable;
            LOG_W("mcp: %s", m->session_error);
            free(m->session_id);
            m->session_id = NULL;   /* the next call tries again */
        }
        pending_free(p);
        m->opening = false;
        release_held(m);
        return;
    }
    if (!p->cancelled) {
        struct outcome o;
        const msgpack_object *map = failed ? err : result;
        if (map->type == MSGPACK_OBJECT_MAP) {
            outcome_from_map(&o, map);
            /* protocol 2 answers a session that lapsed lately SESSION_EXPIRED (ttl) */
            bool lapsed = failed && strcmp(o.class, "SESSION_EXPIRED") == 0 && o.layer &&
                          o.layer_len == 3 && memcmp(o.layer, "ttl", 3) == 0;
            bool no_session = strcmp(o.class, "NO_SUCH_SESSION") == 0 || lapsed;
            if (no_session && !m->session_error && !m->fused && !p->resent && m->rpc) {
                /* The session ended between the call's leaving and its arrival (a lapsed
                 * lease whose notice crossed it): once more, in a fresh session. */
                if (m->session_id && p->session_seq == m->session_seq) {
                    free(m->session_id);
                    m->session_id = NULL;
                }
                p->resent = true;
                p->msgid = ++m->next_msgid;
                p->next = m->pending;
                m->pending = p;
                call_send(m, p);
                return;
            }
            if (no_session && m->fused) {
                answer_fused(m, p->id);
                pending_free(p);
                return;
            }
            if (no_session && m->session_error) {
                /* the call behind a failed session.open: say why it failed */
                o.class = m->session_error_class;
                o.retryable = m->session_error_retryable;
                o.message = m->session_error;
                o.message_len = strlen(m->session_error);
            }
            answer_outcome(m, p->id, &o);
        } else {
            send_error(m, p->id, MCP_INTERNAL_ERROR, "the server's answer was malformed");
        }
    }
    pending_free(p);
}

static void on_server_notification(struct mcp *m, const msgpack_object *method,
                                   const msgpack_object *args)
{
    /* version 2 sends [map]; version 1 a bare map */
    if (args->type == MSGPACK_OBJECT_ARRAY && args->via.array.size == 1)
        args = &args->via.array.ptr[0];
    if (args->type != MSGPACK_OBJECT_MAP)
        return;
    const char *name = method->via.str.ptr;
    size_t len = method->via.str.size;
    if (len == 11 && memcmp(name, "call.output", 11) == 0) {
        int64_t msgid;
        const char *stream, *data;
        size_t slen, dlen;
        if (!obj_int(rpc_map_get(args, "msgid"), &msgid) ||
            !obj_bytes(rpc_map_get(args, "stream"), &stream, &slen) ||
            !obj_bytes(rpc_map_get(args, "data"), &data, &dlen))
            return;
        /* stdout only: what a model reads is never a tool's stderr */
        if (slen != 6 || memcmp(stream, "stdout", 6) != 0 || dlen == 0)
            return;
        for (struct pending *p = m->pending; p; p = p->next) {
            if (p->msgid != (uint32_t)msgid || !p->progress_token || p->cancelled)
                continue;
            p->streamed += (int64_t)dlen;
            struct buf *b = line_begin(m);
            buf_append_lit(b, "{\"jsonrpc\":\"2.0\",\"method\":\"notifications/progress\","
                              "\"params\":{\"progressToken\":");
            json_id(b, p->progress_token);
            buf_printf(b, ",\"progress\":%lld,\"message\":", (long long)p->streamed);
            json_string(b, data, dlen);
            buf_append_lit(b, "}}");
            send_line(m, b);
        }
    } else if (len == 15 && memcmp(name, "session.expired", 15) == 0) {
        const char *id, *layer;
        size_t idlen, llen;
        if (!m->session_id || !obj_bytes(rpc_map_get(args, "session_id"), &id, &idlen) ||
            idlen != strlen(m->session_id) || memcmp(id, m->session_id, idlen) != 0)
            return;
        /* The lease lapsed: the next call opens a fresh session. The fuse is the whole
         * connection's budget: it does not start over. */
        m->fused = obj_bytes(rpc_map_get(args, "layer"), &layer, &llen) && llen == 4 &&
                   memcmp(layer, "fuse", 4) == 0;
        free(m->session_id);
        m->session_id = NULL;
    }
}

static void on_server_message(struct rpc_conn *rpc, const msgpack_object *msg)
{
    struct mcp *m = rpc->ud;
    if (msg->type != MSGPACK_OBJECT_ARRAY || msg->via.array.size < 3)
        return;
    const msgpack_object *a = msg->via.array.ptr;
    if (a[0].type != MSGPACK_OBJECT_POSITIVE_INTEGER)
        return;
    if (a[0].via.u64 == 1 && msg->via.array.size == 4 &&
        a[1].type == MSGPACK_OBJECT_POSITIVE_INTEGER && a[1].via.u64 <= UINT32_MAX)
        on_server_response(m, (uint32_t)a[1].via.u64, &a[2], &a[3]);
    else if (a[0].via.u64 == 2 && a[1].type == MSGPACK_OBJECT_STR)
        on_server_notification(m, &a[1], &a[2]);
}

static void on_server_close(struct rpc_conn *rpc, const char *why)
{
    struct mcp *m = rpc->ud;
    m->rpc = NULL;
    /* Whoever still waits hears why; then nothing more is read from the client. */
    while (m->pending) {
        struct pending *p = m->pending;
        m->pending = p->next;
        if (p->kind == PENDING_CALL && !p->cancelled)
            send_error(m, p->id, MCP_INTERNAL_ERROR, "the server is stopping");
        pending_free(p);
    }
    input_close(m, why);
}

static const struct rpc_handlers server_handlers = {on_server_message, on_server_close, NULL};

/* ---- methods ---------------------------------------------------------------------------- */

static void m_initialize(struct mcp *m, const struct mcp_msg *msg)
{
    json_t *v = json_is_object(msg->params) ? json_object_get(msg->params, "protocolVersion")
                                            : NULL;
    if (!json_is_string(v)) {
        send_error(m, msg->id, MCP_INVALID_PARAMS, "initialize: protocolVersion: expected a string");
        return;
    }
    if (m->protocol) {
        send_error(m, msg->id, MCP_INVALID_REQUEST, "initialize: already initialized");
        return;
    }
    m->protocol = protocol_versions[0];
    for (size_t i = 0; i < ARRAY_LEN(protocol_versions); i++)
        if (strcmp(json_string_value(v), protocol_versions[i]) == 0)
            m->protocol = protocol_versions[i];
    struct policy *p = server_policy(m->srv);
    struct buf *b = result_begin(m, msg->id);
    buf_append_lit(b, "{\"protocolVersion\":");
    json_cstr(b, m->protocol);
    buf_append_lit(b, ",\"capabilities\":{\"tools\":{\"listChanged\":true}},"
                      "\"serverInfo\":{\"name\":\"stockade\",\"title\":\"stockade\","
                      "\"version\":\"" MCP_VERSION "\"},\"instructions\":");
    char *text = xasprintf(
        "Every tool runs under the stockade policy '%s' (isolation %s): checked, time-limited, "
        "its output redacted and capped. A result with isError says why in one line; "
        "POLICY_VIOLATION is final: change the request instead of retrying it.",
        p->name, p->isolation);
    json_cstr(b, text);
    free(text);
    buf_append_lit(b, "}");
    result_end(m, b);
}

static void m_tools_list(struct mcp *m, const struct mcp_msg *msg)
{
    if (msg->params && !json_is_object(msg->params)) {
        send_error(m, msg->id, MCP_INVALID_PARAMS, "tools/list: params: expected an object");
        return;
    }
    if (msg->params && json_object_get(msg->params, "cursor")) {
        send_error(m, msg->id, MCP_INVALID_PARAMS, "tools/list: invalid cursor");
        return;
    }
    if (!m->tools)
        m->tools = tools_build(server_policy(m->srv));
    struct buf *b = result_begin(m, msg->id);
    buf_append_lit(b, "{\"tools\":");
    if (m->tools)
        buf_append(b, m->tools, strlen(m->tools));
    else
        buf_append_lit(b, "[]");
    buf_append_lit(b, "}");
    result_end(m, b);
}

/* JSON -> msgpack, for structured args (depth already bounded by the decoder). */
void mcp_pack_json(msgpack_packer *pk, const json_t *v)
{
    switch (json_typeof(v)) {
    case JSON_OBJECT: {
        msgpack_pack_map(pk, (uint32_t)json_object_size(v));
        const char *k;
        json_t *e;
        json_object_foreach((json_t *)v, k, e) {
            rpc_pack_str(pk, k);
            mcp_pack_json(pk, e);
        }
        return;
    }
    case JSON_ARRAY: {
        msgpack_pack_array(pk, (uint32_t)json_array_size(v));
        size_t i;
        json_t *e;
        json_array_foreach(v, i, e)
            mcp_pack_json(pk, e);
        return;
    }
    case JSON_STRING:
        msgpack_pack_str_with_body(pk, json_string_value(v), json_string_length(v));
        return;
    case JSON_INTEGER: msgpack_pack_int64(pk, json_integer_value(v)); return;
    case JSON_REAL: msgpack_pack_double(pk, json_real_value(v)); return;
    case JSON_TRUE: msgpack_pack_true(pk); return;
    case JSON_FALSE: msgpack_pack_false(pk); return;
    default: msgpack_pack_nil(pk); return;
    }
}

/* {argv: [string]} for a tool without an argv hook; false and *why when it is not. */
static bool argv_arguments(const json_t *args, const json_t **argv, const char **why)
{
    *argv = json_object_get(args, "argv");
    if (json_object_size(args) > (*argv ? 1u : 0u)) {
        *why = "arguments: this tool takes only {\"argv\": [string]}";
        return false;
    }
    if (*argv && !json_is_array(*argv)) {
        *why = "arguments: argv must be an array of strings";
        return false;
    }
    size_t i;
    json_t *e;
    json_array_foreach(*argv, i, e) {
        if (!json_is_string(e)) {
            *why = "arguments: argv must be an array of strings";
            return false;
        }
    }
    return true;
}

static bool request_id_in_use(const struct mcp *m, const json_t *id)
{
    for (const struct pending *p = m->pending; p; p = p->next)
        if (p->kind == PENDING_CALL && !p->cancelled && json_equal(p->id, (json_t *)id))
            return true;
    return false;
}

/* The server's `call` for p, in the connection's session (opened if need be). */
static void call_send(struct mcp *m, struct pending *p)
{
    session_ensure(m);
    p->session_seq = m->session_seq;
    p->held = m->opening;
    if (p->held)
        return;
    bool has_args = p->structured || p->args;
    msgpack_packer *pk = request_begin(m, p->msgid, "call",
                                       2 + (has_args ? 1 : 0) + (p->progress_token ? 1 : 0));
    rpc_pack_kv_str(pk, "session_id", m->session_id);
    rpc_pack_kv_str(pk, "tool", p->tool);
    /* A tool with an argv hook gets its args (validated and turned into argv by the
     * policy); without one, argv as given. */
    if (p->structured) {
        rpc_pack_key(pk, "args");
        if (p->args)
            mcp_pack_json(pk, p->args);
        else
            msgpack_pack_map(pk, 0);    /* none given: the schema still decides */
    } else if (p->args) {
        rpc_pack_key(pk, "argv");
        mcp_pack_json(pk, p->args);
    }
    if (p->progress_token)
        rpc_pack_kv_bool(pk, "stream", true);
    rpc_conn_flush(m->rpc);
}

static void m_tools_call(struct mcp *m, const struct mcp_msg *msg)
{
    const json_t *params = msg->params;
    const json_t *name = json_is_object(params) ? json_object_get(params, "name") : NULL;
    if (!json_is_string(name)) {
        send_error(m, msg->id, MCP_INVALID_PARAMS, "tools/call: name: expected a string");
        return;
    }
    const json_t *args = json_object_get(params, "arguments");
    if (args && !json_is_object(args) && !json_is_null(args)) {
        send_error(m, msg->id, MCP_INVALID_PARAMS, "tools/call: arguments: expected an object");
        return;
    }
    const json_t *meta = json_object_get(params, "_meta");
    const json_t *token = json_is_object(meta) ? json_object_get(meta, "progressToken") : NULL;
    if (token && !json_is_string(token) && !json_is_integer(token)) {
        send_error(m, msg->id, MCP_INVALID_PARAMS,
                   "tools/call: _meta.progressToken: expected a string or an integer");
        return;
    }
    if (request_id_in_use(m, msg->id)) {
        send_error(m, msg->id, MCP_INVALID_REQUEST, "tools/call: this request id is in flight");
        return;
    }
    const struct tool_def *tool = policy_tool(server_policy(m->srv), json_string_value(name));
    if (!tool || strlen(json_string_value(name)) != json_string_length(name)) {
        char err[160];
        snprintf(err, sizeof err, "unknown tool: %.64s", json_string_value(name));
        send_error(m, msg->id, MCP_INVALID_PARAMS, err);
        return;
    }
    const json_t *argv = NULL;
    const char *why = NULL;
    if (!tool->has_argv && json_is_object(args) && !argv_arguments(args, &argv, &why)) {
        answer_local(m, msg->id, "BAD_REQUEST", NULL, why);
        return;
    }
    if (m->fused) {
        answer_fused(m, msg->id);
        return;
    }
    if (!m->rpc) {
        send_error(m, msg->id, MCP_INTERNAL_ERROR, "the server is stopping");
        return;
    }
    struct pending *p = pending_add(m, PENDING_CALL, msg->id);
    if (token)
        p->progress_token = json_incref((json_t *)token);
    p->tool = xstrdup(tool->name);
    p->structured = tool->has_argv;
    const json_t *sent = p->structured ? (json_is_object(args) ? args : NULL) : argv;
    p->args = sent ? json_incref((json_t *)sent) : NULL;
    call_send(m, p);
}

static void n_cancelled(struct mcp *m, const struct mcp_msg *msg)
{
    const json_t *req = json_is_object(msg->params) ? json_object_get(msg->params, "requestId")
                                                    : NULL;
    if (!req || !m->rpc)
        return;
    for (struct pending *p = m->pending; p; p = p->next) {
        if (p->kind != PENDING_CALL || p->cancelled || !json_equal(p->id, (json_t *)req))
            continue;
        /* No answer goes out for it (the client stopped waiting); the server still ends
         * it, CANCELLED, and kills its process tree. */
        p->cancelled = true;
        uint32_t msgid = ++m->next_msgid;
        msgpack_packer *pk = request_begin(m, msgid, "cancel", 1);
        rpc_pack_kv_int(pk, "msgid", p->msgid);
        rpc_conn_flush(m->rpc);
    }
}

static void dispatch(struct mcp *m, const struct mcp_msg *msg)
{
    switch (msg->kind) {
    case MCP_MSG_INVALID:
        send_error(m, msg->id, msg->code, msg->error);
        return;
    case MCP_MSG_RESPONSE:
        return;     /* we never ask the client anything */
    case MCP_MSG_NOTIFICATION:
        if (strcmp(msg->method, "notifications/cancelled") == 0)
            n_cancelled(m, msg);
        else if (strcmp(msg->method, "notifications/initialized") == 0)
            m->ready = m->protocol != NULL;
        /* the rest need nothing from us */
        return;
    case MCP_MSG_REQUEST:
        break;
    }
    if (strcmp(msg->method, "ping") == 0) {
        struct buf *b = result_begin(m, msg->id);
        buf_append_lit(b, "{}");
        result_end(m, b);
    } else if (strcmp(msg->method, "initialize") == 0) {
        m_initialize(m, msg);
    } else if (!m->protocol) {
        send_error(m, msg->id, MCP_INVALID_REQUEST, "not initialized: send initialize first");
    } else if (strcmp(msg->method, "tools/list") == 0) {
        m_tools_list(m, msg);
    } else if (strcmp(msg->method, "tools/call") == 0) {
        m_tools_call(m, msg);
    } else {
        char err[160];
        snprintf(err, sizeof err, "method not found: %.64s", msg->method);
        send_error(m, msg->id, MCP_METHOD_NOT_FOUND, err);
    }
}

/* ---- input ------------------------------------------------------------------------------ */

static void handle_line(struct mcp *m, const char *line, size_t len)
{
    while (len > 0 && (line[len - 1] == '\r' || line[len - 1] == ' ' || line[len - 1] == '\t'))
        len--;
    if (len == 0)
        return;
    struct mcp_msg msg;
    mcp_decode(line, len, &msg);
    dispatch(m, &msg);
    mcp_msg_free(&msg);
}

static void oversize(struct mcp *m)
{
    char err[128];
    snprintf(err, sizeof err, "invalid request: message larger than %zu bytes", m->opts.max_message);
    LOG_W("mcp: %s", err);
    send_error(m, NULL, MCP_INVALID_REQUEST, err);
}

void mcp_feed(struct mcp *m, const void *data, size_t len)
{
    const char *p = data, *end = p + len;
    while (p < end && !m->in_closed) {
        const char *nl = memchr(p, '\n', (size_t)(end - p));
        size_t seg = (size_t)((nl ? nl : end) - p);
        if (m->skipping) {
            /* the rest of an oversize line: dropped up to its newline */
            m->skipping = !nl;
        } else if (m->in.len + seg > m->opts.max_message) {
            m->in.len = 0;
            m->skipping = !nl;
            oversize(m);
        } else if (!nl) {
            buf_append(&m->in, p, seg);
        } else if (m->in.len == 0) {
            handle_line(m, p, seg);     /* the common case: the whole line in this read */
        } else {
            buf_append(&m->in, p, seg);
            handle_line(m, m->in.data, m->in.len);
            m->in.len = 0;
        }
        p += seg + (nl ? 1 : 0);
    }
}

static void on_input(struct ev_loop *loop, ev_io *w, int revents)
{
    (void)loop, (void)revents;
    struct mcp *m = w->data;
    char chunk[READ_CHUNK];
    ssize_t n = read(m->in_fd, chunk, sizeof chunk);
    if (n < 0 && (errno == EAGAIN || errno == EINTR))
        return;
    if (n <= 0) {
        /* a last line without its newline still counts */
        if (!m->skipping && m->in.len > 0) {
            handle_line(m, m->in.data, m->in.len);
            m->in.len = 0;
        }
        input_close(m, n == 0 ? "end of input" : "read failed");
        return;
    }
    mcp_feed(m, chunk, (size_t)n);
}

/* The client is gone (or the server is): read nothing more, end the server connection
 * (its calls end CANCELLED; on stdio the server then stops, closing the session), and
 * give what is queued for the client a bounded time to leave. */
static void input_close(struct mcp *m, const char *why)
{
    if (!m->in_closed) {
        m->in_closed = true;
        ev_io_stop(m->loop, &m->in_w);
        LOG_I("mcp: %s", why);
    }
    if (m->rpc && !ev_is_active(&m->closer)) {
        m->close_why = why;
        ev_timer_start(m->loop, &m->closer);
    }
    if (!m->out_dead && m->out.len > m->out_off && !ev_is_active(&m->linger)) {
        ev_timer_set(&m->linger, LINGER_S, 0);
        ev_timer_start(m->loop, &m->linger);
    }
}

static void on_closer(struct ev_loop *loop, ev_timer *w, int revents)
{
    (void)loop, (void)revents;
    struct mcp *m = w->data;
    if (m->rpc)
        rpc_conn_close(m->rpc, m->close_why, 1000);
}

/* ---- life ------------------------------------------------------------------------------- */

struct mcp *mcp_new(struct server *srv, int in_fd, int out_fd, const struct mcp_opts *opts)
{
    int sp[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sp) < 0)
        die_errno("socketpair");
    struct mcp *m = xcalloc(1, sizeof *m);
    m->loop = server_loop(srv);
    m->srv = srv;
    m->opts = *opts;
    if (m->opts.max_message == 0)
        m->opts.max_message = MCP_MAX_MESSAGE_DEFAULT;
    m->in_fd = in_fd;
    m->out_fd = out_fd;
    /* The nonce keeps the session ids of two front ends on one state dir apart: a
     * fixed one would repeat them, so there is no weaker fallback. */
    unsigned char rnd[8];
    if (getrandom(rnd, sizeof rnd, 0) != (ssize_t)sizeof rnd)
        die_errno("getrandom");
    for (size_t i = 0; i < sizeof rnd; i++)
        snprintf(m->nonce + 2 * i, 3, "%02x", rnd[i]);
    server_attach(srv, sp[0], sp[0], geteuid());
    m->rpc = rpc_conn_new(m->loop, sp[1], sp[1], SERVER_MAX_MESSAGE, &server_handlers, m);
    server_on_reload(srv, on_policy_reload, m);
    fd_set_nonblock(in_fd);
    fd_set_nonblock(out_fd);
    ev_io_init(&m->in_w, on_input, in_fd, EV_READ);
    ev_io_init(&m->out_w, on_out_writable, out_fd, EV_WRITE);
    ev_timer_init(&m->linger, on_linger, LINGER_S, 0);
    ev_timer_init(&m->closer, on_closer, 0, 0);
    m->in_w.data = m->out_w.data = m->linger.data = m->closer.data = m;
    ev_io_start(m->loop, &m->in_w);
    return m;
}

void mcp_free(struct mcp *m)
{
    server_on_reload(m->srv, NULL, NULL);
    m->out_dead = true;         /* nothing more is written from here */
    if (m->rpc)
        rpc_conn_close(m->rpc, "the MCP connection ended", 0);
    ev_io_stop(m->loop, &m->in_w);
    ev_io_stop(m->loop, &m->out_w);
    ev_timer_stop(m->loop, &m->linger);
    ev_timer_stop(m->loop, &m->closer);
    while (m->pending) {
        struct pending *p = m->pending;
        m->pending = p->next;
        pending_free(p);
    }
    buf_free(&m->in);
    buf_free(&m->out);
    free(m->session_id);
    free(m->session_error);
    free(m->tools);
    free(m);
}

int mcp_run(const struct server_opts *sopts, const struct mcp_opts *opts)
{
    struct server *srv = server_new(sopts);
    /* stdin/stdout are the protocol: keep them out of every child (CLOEXEC). */
    fd_set_cloexec(0);
    fd_set_cloexec(1);
    struct mcp *m = mcp_new(srv, 0, 1, opts);
    server_start(srv);
    ev_run(server_loop(srv), 0);
    mcp_free(m);
    server_free(srv);
    return 0;
}
