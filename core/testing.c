/* `stockade test FILE...` and the `stockade.testing` module: LuaUnit files assert a
 * policy's decisions through the same C paths the server uses (call_decide, the
 * streaming redaction, classify, the output check) without starting any process. */
#include "call.h"
#include "cli.h"
#include "policy.h"
#include "lua_embed.h"
#include "root.h"

#include <errno.h>
#include <fcntl.h>
#include <lauxlib.h>
#include <lua-cjson.h>
#include <lua.h>
#include <lualib.h>
#include <msgpack.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define HANDLE_MT "stockade.testing.policy"

struct handle {
    struct policy *policy;
    char *tmp;          /* a throwaway session root, for path helpers */
    char *root;
};

static struct handle *check_handle(lua_State *L)
{
    struct handle *h = luaL_checkudata(L, 1, HANDLE_MT);
    if (!h->policy)
        luaL_error(L, "policy handle is closed");
    return h;
}

static const struct tool_def *check_tool(lua_State *L, struct handle *h, int idx)
{
    const char *name = luaL_checkstring(L, idx);
    const struct tool_def *t = policy_tool(h->policy, name);
    if (!t)
        luaL_error(L, "no tool '%s' in %s", name, h->policy->path);
    return t;
}

static bool is_sequence(lua_State *L, int idx)
{
    size_t n = lua_rawlen(L, idx), count = 0;
    lua_pushnil(L);
    while (lua_next(L, idx)) {
        count++;
        lua_pop(L, 1);
    }
    return count == n;
}

/* A Lua value as msgpack, so test args take the server's path (msgpack -> policy). */
static void pack_lua(lua_State *L, int idx, msgpack_packer *pk, int depth)
{
    idx = lua_absindex(L, idx);
    if (depth > 32)
        luaL_error(L, "args nested too deep");
    switch (lua_type(L, idx)) {
    case LUA_TNIL: msgpack_pack_nil(pk); break;
    case LUA_TBOOLEAN:
        if (lua_toboolean(L, idx))
            msgpack_pack_true(pk);
        else
            msgpack_pack_false(pk);
        break;
    case LUA_TNUMBER:
        if (lua_isinteger(L, idx))
            msgpack_pack_int64(pk, lua_tointeger(L, idx));
        else
            msgpack_pack_double(pk, lua_tonumber(L, idx));
        break;
    case LUA_TSTRING: {
        size_t n;
        const char *s = lua_tolstring(L, idx, &n);
        msgpack_pack_str_with_body(pk, s, n);
        break;
    }
    case LUA_TTABLE:
        if (is_sequence(L, idx) && lua_rawlen(L, idx) > 0) {
            size_t n = lua_rawlen(L, idx);
            msgpack_pack_array(pk, n);
            for (size_t i = 1; i <= n; i++) {
                lua_rawgeti(L, idx, (lua_Integer)i);
                pack_lua(L, -1, pk, depth + 1);
                lua_pop(L, 1);
            }
        } else {
            size_t n = 0;
            lua_pushnil(L);
            while (lua_next(L, idx)) {
                n++;
                lua_pop(L, 1);
            }
            msgpack_pack_map(pk, n);
            lua_pushnil(L);
            while (lua_next(L, idx)) {
                lua_pushvalue(L, -2);
                pack_lua(L, -1, pk, depth + 1);
                lua_pop(L, 1);
                pack_lua(L, -1, pk, depth + 1);
                lua_pop(L, 1);
            }
        }
        break;
    default:
        luaL_error(L, "args: cannot send a %s", luaL_typename(L, idx));
    }
}

/* p:decide(tool, argv_or_args [, {depth=, env={NAME=value}}]) -> {class, message, argv,
 * idempotent}. A list is argv; a table with keys is structured args. */
static int l_decide(lua_State *L)
{
    struct handle *h = check_handle(L);
    const char *tool = luaL_checkstring(L, 2);
    luaL_checktype(L, 3, LUA_TTABLE);
    struct call_request req = {.tool = xstrdup(tool), .depth = -1};
    msgpack_sbuffer sb;
    msgpack_sbuffer_init(&sb);
    msgpack_unpacked u;
    msgpack_unpacked_init(&u);
    bool structured = !is_sequence(L, 3);
    if (structured) {
        msgpack_packer pk;
        msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
        pack_lua(L, 3, &pk, 0);
        size_t off = 0;
        if (msgpack_unpack_next(&u, sb.data, sb.size, &off) == MSGPACK_UNPACK_SUCCESS)
            req.args = &u.data;
        req.argv = xcalloc(1, sizeof *req.argv);
    } else {
        size_t n = lua_rawlen(L, 3);
        req.argv = xcalloc(n + 1, sizeof *req.argv);
        for (size_t i = 0; i < n; i++) {
            lua_rawgeti(L, 3, (lua_Integer)i + 1);
            const char *a = lua_tostring(L, -1);
            req.argv[i] = xstrdup(a ? a : "");
            lua_pop(L, 1);
        }
        req.argc = n;
    }
    if (lua_istable(L, 4)) {
        if (lua_getfield(L, 4, "depth") == LUA_TNUMBER)
            req.depth = lua_tointeger(L, -1);
        lua_pop(L, 1);
        if (lua_getfield(L, 4, "env") == LUA_TTABLE) {
            size_t n = 0, i = 0;
            lua_pushnil(L);
            while (lua_next(L, -2)) {
                n++;
                lua_pop(L, 1);
            }
            req.env = xcalloc(n + 1, sizeof *req.env);
            lua_pushnil(L);
            while (lua_next(L, -2) && i < n) {
                req.env[i++] = xasprintf("%s=%s", lua_tostring(L, -2), lua_tostring(L, -1));
                lua_pop(L, 1);
            }
        }
        lua_pop(L, 1);
    }
    struct call_decision d;
    bool ok = call_decide(h->policy, "test-session", h->root, &req, &d);
    msgpack_unpacked_destroy(&u);
    msgpack_sbuffer_destroy(&sb);
    lua_createtable(L, 0, 4);
    lua_pushstring(L, call_class_name(ok ? CLASS_OK : d.class));
    lua_setfield(L, -2, "class");
    if (d.message) {
        lua_pushstring(L, d.message);
        lua_setfield(L, -2, "message");
    }
    lua_pushboolean(L, d.idempotent);
    lua_setfield(L, -2, "idempotent");
    /* a hook that failed (and fell back to its default): what it raised */
    if (policy_last_error(h->policy)) {
        lua_pushstring(L, policy_last_error(h->policy));
        lua_setfield(L, -2, "error");
    }
    if (ok) {
        lua_createtable(L, (int)req.argc, 0);
        for (size_t i = 0; i < req.argc; i++) {
            lua_pushstring(L, req.argv[i]);
            lua_rawseti(L, -2, (lua_Integer)i + 1);
        }
        lua_setfield(L, -2, "argv");
    }
    free(d.message);
    call_request_free(&req);
    return 1;
}

static void append_sink(void *ud, const char *data, size_t n)
{
    buf_append(ud, data, n);
}

/* p:redact(tool, text [, {chunk = N, stream = "stdout"}]) -> text, count [, error]. The
 * error is the first a redact hook raised (its chunk was withheld). With chunk,
 * the text goes through the streaming path in pieces of N bytes, as a tool's output
 * would. */
static int l_redact(lua_State *L)
{
    struct handle *h = check_handle(L);
    const struct tool_def *t = check_tool(L, h, 2);
    size_t len;
    const char *text = luaL_checklstring(L, 3, &len);
    size_t chunk = len ? len : 1;
    const char *stream = "stdout";
    if (lua_istable(L, 4)) {
        if (lua_getfield(L, 4, "chunk") == LUA_TNUMBER && lua_tointeger(L, -1) > 0)
            chunk = (size_t)lua_tointeger(L, -1);
        if (lua_getfield(L, 4, "stream") == LUA_TSTRING)
            stream = lua_tostring(L, -1);
        lua_pop(L, 2);
    }
    struct buf out = {0};
    struct redact_stream rs = {0};
    int64_t count = 0;
    char *error = NULL;
    if (t->redact_active) {
        for (size_t off = 0; off <= len; off += chunk) {
            size_t n = len - off < chunk ? len - off : chunk;
            bool eof = off + n >= len;
            policy_redact_feed(h->policy, t, stream, "test-session", &rs, text + off, n,
                               REDACT_MORE, &count, append_sink, &out);
            if (!error && policy_last_error(h->policy))
                error = xstrdup(policy_last_error(h->policy));
            if (eof)
                break;
        }
        policy_redact_feed(h->policy, t, stream, "test-session", &rs, NULL, 0, REDACT_EOF,
                           &count, append_sink, &out);
        if (!error && policy_last_error(h->policy))
            error = xstrdup(policy_last_error(h->policy));
    } else {
        buf_append(&out, text, len);
    }
    lua_pushlstring(L, out.data ? out.data : "", out.len);
    lua_pushinteger(L, count);
    buf_free(&out);
    redact_stream_free(&rs);
    if (!error)
        return 2;
    lua_pushstring(L, error);
    free(error);
    return 3;
}

/* p:classify(tool, {exit_code=, signal=, layer=, stdout_tail=, stderr_tail=,
 * duration_ms=}) -> class, retryable, message; nil when the default stands (no opinion);
 * nil and the error when the hook failed (the default stands too, but a test sees why). */
static int l_classify(lua_State *L)
{
    struct handle *h = check_handle(L);
    const struct tool_def *t = check_tool(L, h, 2);
    luaL_checktype(L, 3, LUA_TTABLE);
    struct policy_classify_input in = {0};
    if (lua_getfield(L, 3, "exit_code") == LUA_TNUMBER) {
        in.has_exit_code = true;
        in.exit_code = (int)lua_tointeger(L, -1);
    }
    if (lua_getfield(L, 3, "signal") == LUA_TNUMBER)
        in.signal = (int)lua_tointeger(L, -1);
    if (lua_getfield(L, 3, "layer") == LUA_TSTRING)
        in.layer = lua_tostring(L, -1);
    lua_getfield(L, 3, "stdout_tail");
    in.stdout_tail = lua_tolstring(L, -1, &in.stdout_tail_len);
    lua_getfield(L, 3, "stderr_tail");
    in.stderr_tail = lua_tolstring(L, -1, &in.stderr_tail_len);
    if (lua_getfield(L, 3, "duration_ms") == LUA_TNUMBER)
        in.duration_ms = lua_tointeger(L, -1);
    if (!in.stdout_tail)
        in.stdout_tail = "";
    if (!in.stderr_tail)
        in.stderr_tail = "";
    char *class = NULL, *message = NULL;
    bool retryable = false;
    if (!policy_classify(h->policy, t, &in, &class, &retryable, &message)) {
        lua_pushnil(L);
        if (!policy_last_error(h->policy))
            return 1;
        lua_pushstring(L, policy_last_error(h->policy));
        return 2;
    }
    lua_pushstring(L, class);
    lua_pushboolean(L, retryable);
    if (message)
        lua_pushstring(L, message);
    else
        lua_pushnil(L);
    free(class);
    free(message);
    return 3;
}

/* p:check_output(tool, text) -> true | false, reason */
static int l_check_output(lua_State *L)
{
    struct handle *h = check_handle(L);
    const struct tool_def *t = check_tool(L, h, 2);
    size_t len;
    const char *text = luaL_checklstring(L, 3, &len);
    char *why = NULL;
    bool ok = policy_check_output(h->policy, t, text, len, &why);
    lua_pushboolean(L, ok);
    if (ok)
        return 1;
    lua_pushstring(L, why ? why : "rejected");
    free(why);
    return 2;
}

/* p:tools() -> sorted list of tool names */
static int l_tools(lua_State *L)
{
    struct handle *h = check_handle(L);
    lua_createtable(L, (int)h->policy->ntools, 0);
    for (size_t i = 0; i < h->policy->ntools; i++) {
        lua_pushstring(L, h->policy->tools[i].name);
        lua_rawseti(L, -2, (lua_Integer)i + 1);
    }
    return 1;
}

/* p:describe() -> a plain copy of the normalized policy table */
static int l_describe(lua_State *L)
{
    policy_describe(check_handle(L)->policy, L);
    return 1;
}

/* p:root() -> the throwaway session root its path helpers resolve against */
static int l_root(lua_State *L)
{
    lua_pushstring(L, check_handle(L)->root);
    return 1;
}

static int l_gc(lua_State *L)
{
    struct handle *h = luaL_checkudata(L, 1, HANDLE_MT);
    if (h->policy)
        policy_unref(h->policy);
    h->policy = NULL;
    if (h->tmp) {
        int fd = open("/tmp", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        root_remove_tree_at(fd, h->tmp + 5);
        close(fd);
    }
    free(h->tmp);
    free(h->root);
    h->tmp = h->root = NULL;
    return 0;
}

/* testing.load(path) -> a policy handle; errors with the loader's message. */
static int l_load(lua_State *L)
{
    const char *path = luaL_checkstring(L, 1);
    struct handle *h = lua_newuserdatauv(L, sizeof *h, 0);
    memset(h, 0, sizeof *h);
    luaL_setmetatable(L, HANDLE_MT);
    char *err = NULL;
    h->policy = policy_load(path, &err);
    if (!h->policy) {
        lua_pushstring(L, err);
        free(err);
        return lua_error(L);
    }
    char tmpl[] = "/tmp/stockade-test-XXXXXX";
    if (mkdtemp(tmpl)) {
        h->tmp = xstrdup(tmpl);
        h->root = root_create(tmpl, "test-session", getuid(), getgid(), false);
    }
    if (!h->root)
        h->root = xstrdup("/nonexistent/test-session");
    return 1;
}

#define RULES_MT "stockade.testing.rules"

/* The compiled rules live in a userdata, so that a Lua error cannot leak them. */
static int l_rules_gc(lua_State *L)
{
    struct redact_rules **box = luaL_checkudata(L, 1, RULES_MT);
    redact_rules_unref(*box);
    *box = NULL;
    return 0;
}

struct found_target {
    lua_State *L;
    int list, names;            /* stack slots: the result, the rules argument */
    lua_Integer n;
};

static void on_found(void *ud, size_t start, size_t end, unsigned rule)
{
    struct found_target *t = ud;
    lua_State *L = t->L;
    lua_createtable(L, 0, 3);
    lua_pushinteger(L, (lua_Integer)start + 1);
    lua_setfield(L, -2, "first");
    lua_pushinteger(L, (lua_Integer)end);
    lua_setfield(L, -2, "last");
    lua_rawgeti(L, t->names, (lua_Integer)rule + 1);
    lua_getfield(L, -1, "name");
    lua_setfield(L, -3, "name");
    lua_pop(L, 1);
    lua_rawseti(L, t->list, ++t->n);
}

/* testing.find_secrets(rules, text) -> { {first=, last=, name=}, ... }, or nil and a
 * message: what the regex redactors `rules` ({name, regex, open, replace} each, as
 * plugins.secrets lists them) redact in text, 1-based and inclusive. For the gates'
 * secret-literal check. */
static int l_find_secrets(lua_State *L)
{
    luaL_checktype(L, 1, LUA_TTABLE);
    size_t len;
    const char *text = luaL_checklstring(L, 2, &len);
    size_t n = lua_rawlen(L, 1);
    struct redact_rule_spec *specs = lua_newuserdatauv(L, (n ? n : 1) * sizeof *specs, 0);
    for (size_t i = 0; i < n; i++) {
        lua_rawgeti(L, 1, (lua_Integer)i + 1);
        static const char *const fields[] = {"name", "regex", "open", "replace"};
        const char **dst[] = {&specs[i].name, &specs[i].regex, &specs[i].open,
                              &specs[i].replace};
        for (int f = 0; f < 4; f++) {
            lua_getfield(L, -1, fields[f]);
            *dst[f] = lua_isstring(L, -1) ? lua_tostring(L, -1) : "";
            lua_pop(L, 1);      /* alive in the rule's table, alive in the argument */
        }
        lua_pop(L, 1);
    }
    struct redact_rules **box = lua_newuserdatauv(L, sizeof *box, 0);
    *box = NULL;
    luaL_setmetatable(L, RULES_MT);
    char *err = NULL;
    *box = redact_rules_compile(specs, n, 0, &err);
    if (!*box) {
        char msg[512];
        snprintf(msg, sizeof msg, "%s", err);
        free(err);
        lua_pushnil(L);
        lua_pushstring(L, msg);
        return 2;
    }
    lua_newtable(L);
    struct found_target t = {L, lua_gettop(L), 1, 0};
    redact_rules_find(*box, text, len, on_found, &t);
    return 1;
}

static int luaopen_stockade_testing(lua_State *L)
{
    static const luaL_Reg methods[] = {
        {"decide", l_decide}, {"redact", l_redact}, {"classify", l_classify},
        {"check_output", l_check_output}, {"tools", l_tools}, {"root", l_root},
        {"describe", l_describe},
        {NULL, NULL},
    };
    luaL_newmetatable(L, RULES_MT);
    lua_pushcfunction(L, l_rules_gc);
    lua_setfield(L, -2, "__gc");
    lua_pop(L, 1);
    luaL_newmetatable(L, HANDLE_MT);
    luaL_newlib(L, methods);
    lua_setfield(L, -2, "__index");
    lua_pushcfunction(L, l_gc);
    lua_setfield(L, -2, "__gc");
    lua_pushcfunction(L, l_gc);
    lua_setfield(L, -2, "__close");
    lua_pop(L, 1);
    static const luaL_Reg fns[] = {{"load", l_load}, {"find_secrets", l_find_secrets},
                                   {NULL, NULL}};
    luaL_newlib(L, fns);
    return 1;
}

/* The last of package.searchers: the shipped plugins ("plugins.X") and the schema module
 * ("stockade.schema") as built into the binary, found after every file on package.path
 * (so a file overrides them), as a policy finds them. */
static int l_embedded_searcher(lua_State *L)
{
    const char *name = luaL_checkstring(L, 1);
    const char *want = strcmp(name, "stockade.schema") == 0 ? "schema"
                       : strncmp(name, "plugins.", 8) == 0 ? name : NULL;
    for (const struct lua_embedded *e = lua_embedded; want && e->name; e++) {
        if (strcmp(e->name, want) != 0)
            continue;
        /* precompiled at build time (lua_embed.h), with its chunk name */
        if (luaL_loadbufferx(L, e->chunk, e->len, e->file, "b") != LUA_OK)
            return lua_error(L);
        lua_pushstring(L, e->file);
        return 2;
    }
    lua_pushfstring(L, "no built-in module '%s'", name);
    return 1;
}

/* os.exit(code) as LuaUnit files end (`os.exit(lu.LuaUnit.run())`) skips lua_close, so no
 * __gc would remove what testing.load made under /tmp: exit through a close instead. */
static const char exit_closes[] =
    "local exit = os.exit\n"
    "os.exit = function(code) return exit(code, true) end\n";

/* A full Lua state (the team's test code, not a policy: all libraries) with
 * stockade.testing preloaded and the built-in plugins findable. */
static lua_State *new_full_state(void)
{
    lua_State *L = luaL_newstate();
    if (!L)
        die("cannot create a Lua state");
    luaL_openlibs(L);
    luaL_getsubtable(L, LUA_REGISTRYINDEX, LUA_PRELOAD_TABLE);
    lua_pushcfunction(L, luaopen_stockade_testing);
    lua_setfield(L, -2, "stockade.testing");
    lua_pushcfunction(L, luaopen_cjson);        /* the linked one, whatever the system has */
    lua_setfield(L, -2, "cjson");
    lua_pop(L, 1);
    lua_getglobal(L, "package");
    lua_getfield(L, -1, "searchers");
    lua_pushcfunction(L, l_embedded_searcher);
    lua_rawseti(L, -2, (lua_Integer)lua_rawlen(L, -2) + 1);
    lua_pop(L, 2);
    if (luaL_dostring(L, exit_closes) != LUA_OK)
        die("%s", lua_tostring(L, -1));
    return L;
}

/* One test file in its own process: LuaUnit ends with os.exit, and a file's globals or
 * crash must not touch the next one. */
static int run_file(const char *file)
{
    fflush(stdout);
    pid_t pid = fork();
    if (pid < 0)
        die_errno("fork");
    if (pid == 0) {
        lua_State *L = new_full_state();
        lua_createtable(L, 1, 0);
        lua_pushstring(L, file);
        lua_rawseti(L, -2, 0);
        lua_setglobal(L, "arg");
        if (luaL_dofile(L, file) != LUA_OK) {
            fprintf(stderr, "%s\n", lua_tostring(L, -1));
            lua_close(L);
            _exit(1);
        }
        lua_close(L);
        _exit(0);
    }
    int st;
    while (waitpid(pid, &st, 0) < 0 && errno == EINTR)
        ;
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

static const char test_usage[] =
    "usage: stockade test FILE...\n"
    "Runs each LuaUnit FILE in its own process, in a full Lua 5.4 state with\n"
    "stockade.testing preloaded (POLICY.md, \"Testing a policy\"); luaunit and the shipped\n"
    "plugins (plugins.NAME) can be required. What testing.load makes under\n"
    "/tmp/stockade-test-* is removed when the file ends, os.exit included.\n"
    "Environment: STOCKADE_PLUGIN_PATH (where a policy's require \"plugins.X\" looks first).\n"
    "Exit status: 0 every file passed, 1 a file failed, 125 usage error.\n";

int cli_test(int argc, char **argv)
{
    if (argc >= 2 && (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0)) {
        fputs(test_usage, stdout);
        return 0;
    }
    int first = argc >= 2 && strcmp(argv[1], "--") == 0 ? 2 : 1;
    if (first == 1 && argc >= 2 && argv[1][0] == '-') {
        fprintf(stderr, "stockade test: unknown option '%s'\n", argv[1]);
        fputs(test_usage, stderr);
        return EXIT_USAGE;
    }
    if (argc <= first) {
        fputs(test_usage, stderr);
        return EXIT_USAGE;
    }
    int failed = 0;
    for (int i = first; i < argc; i++) {
        int rc = run_file(argv[i]);
        if (rc != 0) {
            fprintf(stderr, "stockade test: %s failed (status %d)\n", argv[i], rc);
            failed++;
        }
    }
    return failed ? 1 : 0;
}

/* `stockade check|diff|dry-run|budget ...`: the CI gates, written in Lua (lua/gates.lua)
 * over p:describe(), run in a full Lua state like a test. The module is called as
 * gates(command, args, self) and returns the exit status. */
int cli_gate(const char *command, int argc, char **argv)
{
    const struct lua_embedded *m = NULL;
    for (const struct lua_embedded *e = lua_embedded; e->name; e++)
        if (strcmp(e->name, "gates") == 0)
            m = e;
    if (!m)
        die("%s: the gates are not built in", command);
    lua_State *L = new_full_state();
    if (luaL_loadbufferx(L, m->chunk, m->len, m->file, "b") != LUA_OK)
        die("%s", lua_tostring(L, -1));
    lua_pushstring(L, command);
    lua_createtable(L, argc, 0);
    for (int i = 1; i < argc; i++) {
        lua_pushstring(L, argv[i]);
        lua_rawseti(L, -2, i);
    }
    char self[4096];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    self[n > 0 ? n : 0] = 0;
    lua_pushstring(L, self);
    int status = 125;
    if (lua_pcall(L, 3, 1, 0) != LUA_OK)
        fprintf(stderr, "stockade %s: %s\n", command, lua_tostring(L, -1));
    else
        status = lua_isinteger(L, -1) ? (int)lua_tointeger(L, -1) : 0;
    lua_close(L);
    return status;
}
