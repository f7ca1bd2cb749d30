/* The policy loader and the budgeted entry into Lua: good policies load, bad ones fail
 * with the file:line and the field named, hostile hooks cost one refused call. */
#include "check.h"
#include "policy.h"
#include "util.h"

#include <lua.h>
#include <malloc.h>
#include <msgpack.h>
#include <stdlib.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

static char dir[] = "/tmp/stockade-test-policy-XXXXXX";

static char *write_policy(const char *name, const char *text)
{
    char *path = xasprintf("%s/%s", dir, name);
    FILE *f = fopen(path, "w");
    if (f) {
        fputs(text, f);
        fclose(f);
    }
    return path;
}

static char *load_error(const char *name, const char *text)
{
    char *path = write_policy(name, text);
    char *err = NULL;
    struct policy *p = policy_load(path, &err);
    if (p) {
        policy_unref(p);
        err = xstrdup("(loaded)");
    }
    free(path);
    return err;
}

#define HEAD "local stockade = require 'stockade'\nreturn stockade.policy {\n"

static void test_good_policy(void)
{
    char *path = write_policy("good.lua", HEAD
        "  name = 'good',\n"
        "  timeouts = { call = '5s', grace = '250ms' },\n"
        "  limits = { output = '64KiB', processes = 10 },\n"
        "  tools = {\n"
        "    echo = stockade.tool { path = '/bin/echo', owner = 't', timeout = '2s' },\n"
        "    cat = stockade.tool { path = '/bin/cat', owner = 't', idempotent = true },\n"
        "  },\n"
        "}\n");
    char *err = NULL;
    struct policy *p = policy_load(path, &err);
    CHECK(p != NULL);
    if (!p) {
        fprintf(stderr, "load failed: %s\n", err);
        free(err);
        free(path);
        return;
    }
    CHECK_STR(p->name, "good");
    CHECK(p->timeouts.call_ms == 5000);
    CHECK(p->timeouts.grace_ms == 250);
    CHECK(p->timeouts.call_max_ms == 600000);     /* a default */
    CHECK(p->limits.output == 65536);
    CHECK(p->limits.processes == 10);
    CHECK(p->ntools == 2);
    const struct tool_def *echo = policy_tool(p, "echo");
    CHECK(echo && echo->timeout_ms == 2000 && strcmp(echo->path, "/bin/echo") == 0);
    const struct tool_def *cat = policy_tool(p, "cat");
    CHECK(cat && cat->idempotent_declared && cat->idempotent);
    CHECK(policy_tool(p, "rm") == NULL);
    CHECK(p->generation > 0);
    policy_unref(p);
    free(path);
}

/* CHECK that haystack contains needle, printing the text when it does not. */
#define CHECK_CONTAINS(haystack, needle)                                                   \
    do {                                                                                   \
        const char *check_h = (haystack), *check_n = (needle);                             \
        if (check_h && strstr(check_h, check_n)) {                                         \
            check_passed++;                                                                \
        } else {                                                                           \
            check_failed++;                                                                \
            fprintf(stderr, "%s:%d: CHECK_CONTAINS failed: \"%s\" not in \"%s\"\n",        \
                    __FILE__, __LINE__, check_n, check_h ? check_h : "(null)");            \
        }                                                                                  \
    } while (0)

/* Each bad policy fails with FILE:LINE: first (one form, syntax errors included), the
 * line being the field's own, and the text says what is wrong and how to fix it. */
static void test_load_errors(void)
{
    static const struct {
        const char *file, *text;
        const char *want[3];
    } cases[] = {
        {"typo.lua", HEAD "  timeouts = { cal = '5s' },\n}\n",
         {"typo.lua:3: ", "unknown field timeouts.cal (did you mean timeouts.call?)"}},
        {"dur.lua", HEAD "  timeouts = { call = '5 seconds' },\n}\n",
         {"dur.lua:3: ", "timeouts.call"}},
        {"bare.lua", HEAD "  timeouts = { call = 30 },\n}\n",
         {"bare.lua:3: ", "timeouts.call", "got number 30"}},
        {"type.lua", HEAD "  limits = {\n    processes = 'many' },\n}\n",
         {"type.lua:4: ", "limits.processes: expected a non-negative integer, got string \"many\""}},
        {"rel.lua", HEAD "  tools = { x = stockade.tool { path = 'bin/x' } },\n}\n",
         {"rel.lua:3: ", "tool x: path", "absolute"}},
        {"unknownkey.lua", HEAD "  tools = {\n    x = stockade.tool {\n      path = '/bin/x',\n"
                           "      acept = function() end },\n  },\n}\n",
         {"unknownkey.lua:6: ", "tool x: unknown field acept (did you mean accept?)"}},
        {"timout.lua", HEAD "  tools = {\n    y = stockade.tool { path = '/bin/x',\n"
                       "      timout = '5s' },\n  },\n}\n",
         {"timout.lua:5: ", "tool y: unknown field timout (did you mean timeout?)"}},
        {"syntax.lua", "return stockade.policy {\n", {"syntax.lua:"}},
        {"global.lua", "x = 1\nreturn nil\n", {"global.lua:1: ", "undeclared global 'x'"}},
        {"os.lua", "os.execute('touch /tmp/pwned')\n", {"os.lua:1: ", "undeclared global 'os'"}},
        {"io.lua", "local f = io.open('/etc/passwd')\n", {"io.lua:1: ", "undeclared global 'io'"}},
        {"req.lua", "local x = require 'os'\n", {"req.lua:1: ", "not found"}},
        {"load.lua", "local f = load('return 1')\n", {"load.lua:1: ", "undeclared global 'load'"}},
        /* nil: string.dump is gone everywhere */
        {"dump.lua", "local d = string.dump\nassert(d == nil)\nreturn ('x').dump\n",
         {"dump.lua:", "must return"}},
        {"notpolicy.lua", "return { tools = {} }\n", {"notpolicy.lua:", "must return stockade.policy"}},
        {"loop.lua", "while true do end\n", {"loop.lua:1: ", "budget"}},
        {"nottool.lua", HEAD "  tools = { x = { path = '/bin/x' } },\n}\n",
         {"nottool.lua:3: ", "stockade.tool"}},
        {"pattern.lua", HEAD "  redact = {\n    { pattern = 'ok%d+', window = 8 },\n"
                        "    { pattern = 'ACME[%-TKN', prefix = 'ACME', window = 64 },\n  },\n}\n",
         {"pattern.lua:5: ", "redact[2]: malformed pattern (missing ']')"}},
        {"allow.lua", HEAD "  name = 'x',\n  network = { allow = { 'pypi.internal:443' } },\n}\n",
         {"allow.lua:4: ", "not implemented"}},
        {"gc.lua", "setmetatable({}, { __gc = function() end })\n", {"gc.lua:1: ", "__gc"}},
    };
    for (size_t i = 0; i < ARRAY_LEN(cases); i++) {
        char *e = load_error(cases[i].file, cases[i].text);
        for (size_t k = 0; k < ARRAY_LEN(cases[i].want) && cases[i].want[k]; k++)
            CHECK_CONTAINS(e, cases[i].want[k]);
        /* FILE:LINE: first: the path of the file, then a line number */
        char *start = xasprintf("%s/%s:", dir, cases[i].file);
        bool located = e && strncmp(e, start, strlen(start)) == 0 &&
                       e[strlen(start)] >= '1' && e[strlen(start)] <= '9';
        CHECK(located);
        if (!located)
            fprintf(stderr, "  not FILE:LINE: %s\n", e ? e : "(null)");
        free(start);
        free(e);
    }
    char *missing = NULL;
    CHECK(policy_load("/nonexistent/policy.lua", &missing) == NULL && missing &&
          strstr(missing, "/nonexistent/policy.lua"));
    free(missing);
}

static struct policy *hostile(void)
{
    char *path = write_policy("hostile.lua", HEAD
        "  limits = { lua_memory = '8MiB', lua_instructions = 1000000 },\n"
        "  tools = {\n"
        "    ok = stockade.tool { path = '/bin/true', accept = function(c)\n"
        "      return c.argv[1] ~= 'no', 'said no' end },\n"
        "    loop = stockade.tool { path = '/bin/true', accept = function() while true do end end },\n"
        "    swallow = stockade.tool { path = '/bin/true', accept = function()\n"
        "      while true do pcall(function() while true do end end) end end },\n"
        "    bomb = stockade.tool { path = '/bin/true', accept = function()\n"
        "      local t = {} for i = 1, 1e9 do t[i] = string.rep('x', 1024) .. i end end },\n"
        "    err = stockade.tool { path = '/bin/true', accept = function() error('boom') end },\n"
        "    errobj = stockade.tool { path = '/bin/true', accept = function()\n"
        "      error(setmetatable({}, { __tostring = function() error('again') end })) end },\n"
        "    gw = stockade.tool { path = '/bin/true', accept = function() leaked = 1 return true end },\n"
        "    wrong = stockade.tool { path = '/bin/true', accept = function() return 'yes' end },\n"
        "    mutate = stockade.tool { path = '/bin/true', accept = function(c)\n"
        "      c.argv[1] = 'changed' string.rep = nil return true end },\n"
        "    idem = stockade.tool { path = '/bin/true', idempotent = function(c)\n"
        "      return c.argv[1] == 'read' end },\n"
        "  },\n"
        "}\n");
    char *err = NULL;
    struct policy *p = policy_load(path, &err);
    if (!p)
        fprintf(stderr, "hostile.lua: %s\n", err);
    free(err);
    free(path);
    return p;
}

static bool accept1(struct policy *p, const char *tool, const char *arg, char **reason)
{
    char *argv[] = {(char *)arg, NULL};
    struct policy_call_view v = {tool, argv, arg ? 1 : 0, "sid", "/root/x", 3};
    return policy_accept(p, policy_tool(p, tool), &v, reason);
}

static void test_hostile_hooks(void)
{
    struct policy *p = hostile();
    CHECK(p != NULL);
    if (!p)
        return;
    lua_State *L = p->L;
    int top = lua_gettop(L);
    char *reason = NULL;

    CHECK(accept1(p, "ok", "yes", &reason) && reason == NULL);
    CHECK(!accept1(p, "ok", "no", &reason) && reason && strstr(reason, "said no"));
    free(reason);

    const char *refused[] = {"loop", "swallow", "bomb", "err", "errobj", "gw", "wrong"};
    for (size_t i = 0; i < ARRAY_LEN(refused); i++) {
        reason = NULL;
        bool ok = accept1(p, refused[i], "x", &reason);
        CHECK(!ok && reason != NULL);
        if (ok)
            fprintf(stderr, "hook %s was accepted\n", refused[i]);
        free(reason);
        CHECK(lua_gettop(L) == top);
        /* and the state still works after each */
        reason = NULL;
        CHECK(accept1(p, "ok", "yes", &reason));
        free(reason);
    }
    CHECK(p->mem_used < p->mem_limit);

    /* a hook gets copies: mutating them changes nothing for the caller or the next hook */
    reason = NULL;
    CHECK(accept1(p, "mutate", "orig", &reason));
    free(reason);
    reason = NULL;
    CHECK(accept1(p, "ok", "yes", &reason));    /* string.rep was the env's copy */
    free(reason);

    char *rd[] = {"read", NULL}, *wr[] = {"write", NULL};
    struct policy_call_view vr = {"idem", rd, 1, "s", "/r", 1}, vw = {"idem", wr, 1, "s", "/r", 1};
    CHECK(policy_idempotent(p, policy_tool(p, "idem"), &vr, false));
    CHECK(!policy_idempotent(p, policy_tool(p, "idem"), &vw, true));
    /* undeclared: the request's hint */
    CHECK(policy_idempotent(p, policy_tool(p, "ok"), &vr, true));
    CHECK(!policy_idempotent(p, policy_tool(p, "ok"), &vr, false));
    CHECK(lua_gettop(L) == top);
    policy_unref(p);
}

static void test_refcount(void)
{
    struct policy *p = hostile();
    CHECK(p && p->refcount == 1);
    if (!p)
        return;
    policy_ref(p);
    policy_unref(p);
    CHECK(p->refcount == 1);
    policy_unref(p);
}

/* require under the memory cap: whichever of its allocations the cap refuses, the
 * plugin's text and path are freed. The cap is swept across a protected call of the
 * policy's require on a large plugin, so one step of the sweep lands on each allocation
 * require makes; the text (256 KiB) held across the one that raises is what leaked.
 * LeakSanitizer names it under `make SAN=1 check`; the plain build sees the heap grow
 * (mallinfo2). */
static size_t heap_in_use(void)
{
    struct mallinfo2 mi = mallinfo2();
    return mi.uordblks + mi.hblkhd;     /* large blocks are mmap'd: hblkhd */
}

static void test_require_under_memory_cap(void)
{
    char *plugins = xasprintf("%s/cap-plugins", dir);
    char *plugin_path = xasprintf("%s/probe.lua", plugins);
    CHECK(mkdir(plugins, 0700) == 0);
    FILE *f = fopen(plugin_path, "w");
    CHECK(f != NULL);
    if (!f)
        goto out;
    for (int i = 0; i < 4096; i++)      /* comments: text to hold, nothing for Lua to keep */
        fputs("-- a line of a large plugin, to make a leak of its text visible -------\n", f);
    fputs("return { loaded = true }\n", f);
    fclose(f);
    char *saved = getenv("STOCKADE_PLUGIN_PATH") ? xstrdup(getenv("STOCKADE_PLUGIN_PATH")) : NULL;
    setenv("STOCKADE_PLUGIN_PATH", plugins, 1);
    char *path = write_policy("cap.lua", HEAD
        "  tools = { req = stockade.tool { path = '/bin/true', accept = function()\n"
        "    return require('plugins.probe').loaded end } },\n"
        "}\n");
    char *err = NULL;
    struct policy *p = policy_load(path, &err);
    if (saved)
        setenv("STOCKADE_PLUGIN_PATH", saved, 1);
    else
        unsetenv("STOCKADE_PLUGIN_PATH");
    free(saved);
    free(path);
    CHECK(p != NULL);
    if (!p) {
        fprintf(stderr, "cap.lua: %s\n", err);
        free(err);
        goto out;
    }
    /* the policy's require: the _ENV of the tool's accept hook has it */
    lua_State *L = p->L;
    int top = lua_gettop(L);
    lua_rawgeti(L, LUA_REGISTRYINDEX, policy_tool(p, "req")->ref);
    lua_getfield(L, -1, "accept");
    const char *up = lua_getupvalue(L, -1, 1);
    CHECK(up && strcmp(up, "_ENV") == 0 && lua_getfield(L, -1, "require") == LUA_TFUNCTION);
    int require_at = lua_gettop(L);
    size_t cap = p->mem_limit;
    int refused = 0, loaded = 0;
    lua_gc(L, LUA_GCCOLLECT);
    size_t heap_before = heap_in_use();
    for (size_t room = 0; room < 64 * 1024 && loaded < 8; room += 8) {
        lua_pushvalue(L, require_at);
        lua_pushliteral(L, "plugins.probe");
        lua_gc(L, LUA_GCCOLLECT);
        p->mem_limit = p->mem_used + room;
        if (lua_pcall(L, 1, 1, 0) == LUA_OK)
            loaded++;
        else
            refused++;
        p->mem_limit = cap;
        lua_pop(L, 1);
    }
    lua_settop(L, top);
    lua_gc(L, LUA_GCCOLLECT);
    size_t heap_after = heap_in_use();
    /* the sweep went through require's allocations: refused first, then loaded */
    CHECK(refused > 0 && loaded == 8);
    /* one leak is the whole text (256 KiB); Lua's own memory is back after a collection */
    CHECK(heap_after < heap_before + (256u << 10));
    if (heap_after >= heap_before + (256u << 10))
        fprintf(stderr, "  the heap grew by %zu KiB over %d refused requires\n",
                (heap_after - heap_before) >> 10, refused);
    policy_unref(p);
out:
    free(plugin_path);
    free(plugins);
}

/* A hook that keeps memory alive up to the cap (an upvalue it fills, swallowing each
 * refused allocation with pcall): every later entry into the state must cost its call
 * only, with a one-line reason, and never raise outside a protected call (a Lua panic
 * aborts the server). The core's own pushes (the call's view, argv's args, the output
 * for redact and classify, the results it reads back) all meet the full state. */
static struct policy *memory_keeper(void)
{
    char *path = write_policy("keeper.lua",
        "local stockade = require 'stockade'\n"
        "local keep, chain = {}, nil\n"
        "local function t(f)\n"
        "  f.path, f.owner, f.timeout = '/bin/true', 't', '5s'\n"
        "  f.schema = { type = 'object' }\n"
        "  return stockade.tool(f)\n"
        "end\n"
        "return stockade.policy {\n"
        "  limits = { lua_memory = '8MiB' },\n"
        "  tools = {\n"
        "    fill = t { accept = function()\n"
        "      pcall(function() while true do\n"
        "        keep[#keep + 1] = string.rep('x', 4096) .. #keep end end)\n"
        "      pcall(function() while true do keep[#keep + 1] = {} end end)\n"
        "      pcall(function() while true do chain = { chain } end end)\n"
        "      return true end },\n"
                "    ok = t { accept = function() return true end },\n"
        "    idem = t { idempotent = function() return true end },\n"
        "    args = t { argv = function(a) return { 'x' } end },\n"
        "    out = t { output = { format = 'json' } },\n"
        "    red = t { redact = function(text) return text end },\n"
        "    cls = t { classify = function(r) return 'TOOL_ERROR', false, 'said so' end },\n"
        "  },\n"
        "}\n");
    char *err = NULL;
    struct policy *p = policy_load(path, &err);
    if (!p)
        fprintf(stderr, "keeper.lua: %s\n", err);
    free(err);
    free(path);
    return p;
}

/* One line, naming the memory cap. */
static bool memory_reason(const char *reason)
{
    return reason && strstr(reason, "memory cap") && !strchr(reason, '\n');
}

static void test_hook_keeps_memory(void)
{
    struct policy *p = memory_keeper();
    CHECK(p != NULL);
    if (!p)
        return;
    lua_State *L = p->L;
    int top = lua_gettop(L);
    char *reason = NULL;

    /* The hook swallowed every refusal: it may pass, but the state is full after it. */
    accept1(p, "fill", "x", &reason);
    free(reason);
    CHECK(lua_gettop(L) == top);
    CHECK(p->mem_limit - p->mem_used < 4096);

    /* Each entry below needs more than the garbage the filler left: the core's own
     * pushes (64 KiB of argv, args, output) meet the cap, and the call is refused with
     * the cap named, in one line, instead of a panic. */
    size_t big_len = 64 << 10;
    char *big = xmalloc(big_len + 1);
    memset(big, 'a', big_len);
    big[big_len] = 0;
    for (int i = 0; i < 3; i++) {
        reason = NULL;
        bool ok = accept1(p, "ok", big, &reason);
        CHECK(!ok && memory_reason(reason));
        if (ok || !memory_reason(reason))
            fprintf(stderr, "  accept after fill: %s\n", reason ? reason : "(accepted)");
        free(reason);
        CHECK(lua_gettop(L) == top);
    }
    char *big_argv[] = {big, NULL};
    struct policy_call_view v = {"idem", big_argv, 1, "s", "/r", 1};
    CHECK(!policy_idempotent(p, policy_tool(p, "idem"), &v, true));

    msgpack_object_kv kv = {
        .key = {.type = MSGPACK_OBJECT_STR, .via.str = {.size = 1, .ptr = "s"}},
        .val = {.type = MSGPACK_OBJECT_STR, .via.str = {.size = (uint32_t)big_len, .ptr = big}},
    };
    msgpack_object args = {.type = MSGPACK_OBJECT_MAP, .via.map = {.size = 1, .ptr = &kv}};
    char **argv = NULL;
    size_t argc = 0;
    reason = NULL;
    v.tool = "args";
    CHECK(!policy_argv(p, policy_tool(p, "args"), &args, &v, &argv, &argc, &reason));
    CHECK(memory_reason(reason) && argv == NULL);
    free(reason);

    reason = NULL;
    big[0] = '"';
    big[big_len - 1] = '"';
    CHECK(!policy_check_output(p, policy_tool(p, "out"), big, big_len, &reason));
    CHECK(memory_reason(reason));
    free(reason);

    struct buf out = {0};
    size_t consumed = 0;
    int64_t count = 0;
    CHECK(policy_redact(p, policy_tool(p, "red"), "stdout", "s", big, big_len, REDACT_MORE,
                        &out, &consumed, &count) == POLICY_NOMEM);
    CHECK(out.len == 0);
    buf_free(&out);

    struct policy_classify_input in = {.has_exit_code = true, .exit_code = 1,
                                       .stdout_tail = "", .stderr_tail = big,
                                       .stderr_tail_len = big_len, .duration_ms = 5};
    char *class = NULL, *message = NULL;
    bool retryable = false;
    CHECK(!policy_classify(p, policy_tool(p, "cls"), &in, &class, &retryable, &message));
    CHECK(class == NULL && message == NULL);
    CHECK(lua_gettop(L) == top);
    CHECK(p->mem_used <= p->mem_limit);

    /* small entries may fit in what the collector gives back: either way, no panic */
    reason = NULL;
    if (!accept1(p, "ok", "x", &reason))
        CHECK(memory_reason(reason));
    free(reason);
    CHECK(lua_gettop(L) == top);
    free(big);
    policy_unref(p);
}

/* What a policy file returns is read inside a protected call: a returned table whose
 * metamethods raise is a load error (FILE:LINE: the message), not a Lua panic that
 * aborts the loader, and with it a server on `policy.reload`. */
static void test_load_reads_protected(void)
{
    char *err = load_error("meta.lua",
        "local stockade = require 'stockade'\n"
        "local p = stockade.policy { tools = { t = stockade.tool { path = '/bin/true' } } }\n"
        "return setmetatable({ timeouts = p.timeouts },\n"
        "  { __index = function(_, k) error('no field ' .. k, 0) end })\n");
    CHECK(err && strstr(err, "meta.lua:") && strstr(err, "no field") && !strchr(err, '\n'));
    if (!(err && strstr(err, "no field")))
        fprintf(stderr, "  meta.lua: %s\n", err ? err : "(null)");
    free(err);
}

/* No entry into the state raises outside a protected call any more; if one ever does,
 * the abort that follows is named in the log, one line, not silent. */
static void test_panic_is_logged(void)
{
    struct policy *p = hostile();
    CHECK(p != NULL);
    if (!p)
        return;
    int fds[2];
    CHECK(pipe(fds) == 0);
    fflush(stderr);
    pid_t pid = fork();
    if (pid == 0) {
        close(fds[0]);
        log_fd = fds[1];
        signal(SIGABRT, SIG_DFL);
        lua_pushstring(p->L, "a raise nothing catches");
        lua_error(p->L);
        _exit(0);
    }
    close(fds[1]);
    char out[4096];
    size_t n = 0;
    ssize_t r;
    while (n < sizeof out - 1 && (r = read(fds[0], out + n, sizeof out - 1 - n)) > 0)
        n += (size_t)r;
    out[n] = 0;
    close(fds[0]);
    int status = 0;
    CHECK(waitpid(pid, &status, 0) == pid);
    CHECK(WIFSIGNALED(status) && WTERMSIG(status) == SIGABRT);
    CHECK(strstr(out, "outside a protected call") && strstr(out, "a raise nothing catches"));
    if (!strstr(out, "a raise nothing catches"))
        fprintf(stderr, "  the log said: %s\n", out);
    policy_unref(p);
}

int main(void)
{
    if (!mkdtemp(dir))
        return 2;
    log_threshold = LOG_ERROR;
    test_good_policy();
    test_load_errors();
    test_hostile_hooks();
    test_refcount();
    test_require_under_memory_cap();
    test_hook_keeps_memory();
    test_load_reads_protected();
    test_panic_is_logged();
    char *cmd = xasprintf("rm -rf '%s'", dir);
    if (system(cmd) != 0)
        fprintf(stderr, "could not remove %s\n", dir);
    free(cmd);
    return check_report("test_policy");
}
