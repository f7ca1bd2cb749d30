#include "policy.h"
#include "lua_embed.h"
#include "util.h"

#include <errno.h>
#include <fcntl.h>
#include <lauxlib.h>
#include <lua.h>
#include <lualib.h>
#include <nettle/sha2.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define POLICY_FILE_MAX (1 << 20)
#define HOOK_WALL_MS 1000       /* a hook may also not run longer than this */
#define HOOK_COUNT_STEP 1000

static unsigned next_generation = 1;

/* Registry keys are addresses of statics. */
static char key_stockade_module;
static char key_policy_env_base;

static struct policy *policy_of(lua_State *L)
{
    return *(struct policy **)lua_getextraspace(L);
}

/* ---- budget: memory and instructions ----------------------------------------------- */

static void *policy_alloc(void *ud, void *ptr, size_t osize, size_t nsize)
{
    struct policy *p = ud;
    size_t old = ptr ? osize : 0;
    if (nsize == 0) {
        free(ptr);
        p->mem_used -= old;
        return NULL;
    }
    if (nsize > old && p->mem_used - old + nsize > p->mem_limit) {
        p->out_of_memory = true;
        return NULL;        /* Lua raises LUA_ERRMEM */
    }
    void *q = realloc(ptr, nsize);
    if (q)
        p->mem_used = p->mem_used - old + nsize;
    return q;
}

static void count_hook(lua_State *L, lua_Debug *ar)
{
    struct policy *p = policy_of(L);
    if (ar->event == LUA_HOOKLINE) {
        /* While the policy file runs: remember its line, for errors raised where the
         * stack no longer shows it (`return stockade.policy{}` is a tail call). */
        if (lua_getinfo(L, "S", ar) && strcmp(ar->what, "main") == 0)
            p->load_line = ar->currentline;
        return;
    }
    p->instr_used += HOOK_COUNT_STEP;
    if (!p->over_budget &&
        (p->instr_used > p->instr_limit || now_ms() > p->hook_deadline_ms)) {
        p->over_budget = true;
        /* Fire on every instruction from now on, so a pcall in the policy cannot swallow
         * the abort: the next instruction outside it raises again. */
        lua_sethook(L, count_hook, LUA_MASKCOUNT, 1);
    }
    if (p->over_budget)
        luaL_error(L, "instruction budget exceeded");
}

static int message_handler(lua_State *L)
{
    const char *msg = lua_tostring(L, 1);
    if (!msg)
        msg = lua_pushfstring(L, "(error object is a %s value)", luaL_typename(L, 1));
    luaL_traceback(L, L, msg, 1);
    return 1;
}

/* First line of a Lua error (the traceback follows on the next lines). */
static char *first_line(const char *msg)
{
    if (!msg)
        return xstrdup("unknown error");
    size_t n = strcspn(msg, "\n");
    char *s = xmalloc(n + 1);
    memcpy(s, msg, n);
    s[n] = 0;
    return s;
}

enum policy_rc policy_pcall(struct policy *p, int nargs, int nres, const char *hook, char **err)
{
    lua_State *L = p->L;
    int fn = lua_gettop(L) - nargs;
    lua_pushcfunction(L, message_handler);
    lua_insert(L, fn);
    p->instr_used = 0;
    p->over_budget = false;
    p->out_of_memory = false;
    p->hook_deadline_ms = now_ms() + HOOK_WALL_MS;
    lua_sethook(L, count_hook, LUA_MASKCOUNT | (p->loading ? LUA_MASKLINE : 0),
                HOOK_COUNT_STEP);
    int rc = lua_pcall(L, nargs, nres, fn);
    /* The shared tail: always disarm the hook and drop the handler. */
    lua_sethook(L, NULL, 0, 0);
    lua_remove(L, fn);

    if (rc == LUA_OK)
        return POLICY_OK;
    enum policy_rc out = p->out_of_memory || rc == LUA_ERRMEM ? POLICY_NOMEM
                         : p->over_budget                     ? POLICY_TIMEOUT
                                                              : POLICY_ERR;
    char *msg = out == POLICY_NOMEM     ? xstrdup("memory cap exceeded")
                : out == POLICY_TIMEOUT ? xstrdup("instruction budget exceeded")
                                        : first_line(lua_tostring(L, -1));
    lua_pop(L, 1);
    if (out != POLICY_ERR || log_threshold >= LOG_DEBUG)
        LOG_W("policy %s: hook %s: %s", p->path, hook, msg);
    if (err)
        *err = msg;
    else
        free(msg);
    /* A bomb leaves garbage behind: give the memory back before the next hook. */
    if (out == POLICY_NOMEM)
        lua_gc(L, LUA_GCCOLLECT);
    return out;
}

/* ---- the C side of the stockade module ------------------------------------------------ */

static int l_core_duration(lua_State *L)
{
    const char *s = luaL_checkstring(L, 1);
    int64_t ms;
    if (parse_duration_ms(s, &ms) < 0) {
        lua_pushnil(L);
        lua_pushfstring(L, "bad duration '%s' (expected a number and ms, s, m or h)", s);
        return 2;
    }
    lua_pushinteger(L, ms);
    return 1;
}

static int l_core_size(lua_State *L)
{
    const char *s = luaL_checkstring(L, 1);
    int64_t n;
    if (parse_size(s, &n) < 0) {
        lua_pushnil(L);
        lua_pushfstring(L, "bad size '%s' (expected a number and B, KiB, MiB or GiB)", s);
        return 2;
    }
    lua_pushinteger(L, n);
    return 1;
}

/* "file:line" of the function `level` frames up, for load errors. */
static int l_core_where(lua_State *L)
{
    lua_Debug ar;
    int level = (int)luaL_optinteger(L, 1, 1);
    if (lua_getstack(L, level, &ar) && lua_getinfo(L, "Sl", &ar) && ar.currentline > 0) {
        lua_pushfstring(L, "%s:%d", ar.short_src, ar.currentline);
        return 1;
    }
    struct policy *p = policy_of(L);
    if (p->loading && p->load_line > 0) {
        lua_pushfstring(L, "%s:%d", p->path, p->load_line);
        return 1;
    }
    return 0;
}

/* print() in a policy goes to the log, never to stdout (the protocol's channel). */
static int l_policy_print(lua_State *L)
{
    luaL_Buffer b;
    luaL_buffinit(L, &b);
    int n = lua_gettop(L);
    for (int i = 1; i <= n; i++) {
        if (i > 1)
            luaL_addchar(&b, '\t');
        luaL_tolstring(L, i, NULL);
        luaL_addvalue(&b);
    }
    luaL_pushresult(&b);
    LOG_I("policy: %s", lua_tostring(L, -1));
    return 0;
}

static int l_policy_require(lua_State *L)
{
    const char *name = luaL_checkstring(L, 1);
    if (strcmp(name, "stockade") == 0) {
        lua_rawgetp(L, LUA_REGISTRYINDEX, &key_stockade_module);
        return 1;
    }
    return luaL_error(L, "module '%s' not found (policies may require only \"stockade\")", name);
}

static int l_strict_index(lua_State *L)
{
    return luaL_error(L, "undeclared global '%s'", luaL_checkstring(L, 2));
}

static int l_strict_newindex(lua_State *L)
{
    return luaL_error(L, "assignment to undeclared global '%s' (use local)",
                      luaL_checkstring(L, 2));
}

/* The functions of the base library a policy may use. Not: load, loadfile, dofile,
 * collectgarbage, and of course no io, os, debug or package. */
static const char *const safe_base[] = {
    "assert", "error", "ipairs", "next", "pairs", "pcall", "rawequal", "rawget", "rawlen",
    "rawset", "select", "setmetatable", "getmetatable", "tonumber", "tostring", "type",
    "xpcall", "_VERSION", NULL,
};
static const char *const safe_libs[] = {"string", "table", "math", "utf8", NULL};

/* Build the template of a policy environment once per state (at key_policy_env_base). */
static void build_env_base(lua_State *L)
{
    lua_newtable(L);
    for (const char *const *n = safe_base; *n; n++) {
        lua_getglobal(L, *n);
        lua_setfield(L, -2, *n);
    }
    for (const char *const *n = safe_libs; *n; n++) {
        lua_newtable(L);            /* a copy, so a policy cannot patch the shared one */
        lua_getglobal(L, *n);
        lua_pushnil(L);
        while (lua_next(L, -2)) {
            lua_pushvalue(L, -2);
            lua_insert(L, -2);
            lua_settable(L, -5);
        }
        lua_pop(L, 1);
        lua_setfield(L, -2, *n);
    }
    lua_pushcfunction(L, l_policy_print);
    lua_setfield(L, -2, "print");
    lua_pushcfunction(L, l_policy_require);
    lua_setfield(L, -2, "require");
    lua_rawsetp(L, LUA_REGISTRYINDEX, &key_policy_env_base);
}

/* Push a fresh environment: a copy of the base, then locked (unknown globals are errors). */
static void push_env(lua_State *L, bool strict)
{
    lua_newtable(L);
    lua_rawgetp(L, LUA_REGISTRYINDEX, &key_policy_env_base);
    lua_pushnil(L);
    while (lua_next(L, -2)) {
        lua_pushvalue(L, -2);
        lua_insert(L, -2);
        lua_settable(L, -5);
    }
    lua_pop(L, 1);
    lua_pushvalue(L, -1);
    lua_setfield(L, -2, "_G");
    if (strict) {
        lua_newtable(L);
        lua_pushcfunction(L, l_strict_index);
        lua_setfield(L, -2, "__index");
        lua_pushcfunction(L, l_strict_newindex);
        lua_setfield(L, -2, "__newindex");
        lua_setmetatable(L, -2);
    }
}

static int open_state(lua_State *L)
{
    static const luaL_Reg libs[] = {
        {LUA_GNAME, luaopen_base}, {LUA_STRLIBNAME, luaopen_string},
        {LUA_TABLIBNAME, luaopen_table}, {LUA_MATHLIBNAME, luaopen_math},
        {LUA_UTF8LIBNAME, luaopen_utf8}, {NULL, NULL},
    };
    for (const luaL_Reg *l = libs; l->func; l++) {
        luaL_requiref(L, l->name, l->func, 1);
        lua_pop(L, 1);
    }
    /* string.dump makes binary chunks; the string metatable reaches the real table. */
    lua_getglobal(L, "string");
    lua_pushnil(L);
    lua_setfield(L, -2, "dump");
    lua_pop(L, 1);
    build_env_base(L);

    const struct lua_embedded *m = NULL;
    for (const struct lua_embedded *e = lua_embedded; e->name; e++)
        if (strcmp(e->name, "stockade") == 0)
            m = e;
    if (!m)
        return luaL_error(L, "the stockade module is not built in");
    char chunkname[128];
    snprintf(chunkname, sizeof chunkname, "=%s", m->file);
    if (luaL_loadbufferx(L, m->src, m->len, chunkname, "t") != LUA_OK)
        return lua_error(L);
    push_env(L, false);
    lua_setupvalue(L, -2, 1);
    static const luaL_Reg core_fns[] = {
        {"duration", l_core_duration}, {"size", l_core_size}, {"where", l_core_where},
        {NULL, NULL},
    };
    luaL_newlib(L, core_fns);
    lua_call(L, 1, 1);
    lua_rawsetp(L, LUA_REGISTRYINDEX, &key_stockade_module);
    return 0;
}

/* ---- reading the normalized policy table ------------------------------------------- */

static int64_t get_int(lua_State *L, int t, const char *section, const char *key)
{
    lua_getfield(L, t, section);
    lua_getfield(L, -1, key);
    int64_t v = lua_isinteger(L, -1) ? lua_tointeger(L, -1) : 0;
    lua_pop(L, 2);
    return v;
}

static char *get_str(lua_State *L, int t, const char *key, const char *dflt)
{
    lua_getfield(L, t, key);
    const char *s = lua_type(L, -1) == LUA_TSTRING ? lua_tostring(L, -1) : dflt;
    char *out = s ? xstrdup(s) : NULL;
    lua_pop(L, 1);
    return out;
}

static void read_settings(struct policy *p, int t)
{
    lua_State *L = p->L;
    struct policy_timeouts *to = &p->timeouts;
    to->call_ms = get_int(L, t, "timeouts", "call");
    to->call_max_ms = get_int(L, t, "timeouts", "call_max");
    to->grace_ms = get_int(L, t, "timeouts", "grace");
    to->cpu_ms = get_int(L, t, "timeouts", "cpu");
    to->fuse_ms = get_int(L, t, "timeouts", "fuse");
    to->lease_ms = get_int(L, t, "timeouts", "lease");
    to->idle_shutdown_ms = get_int(L, t, "timeouts", "idle_shutdown");
    to->deadline_min_ms = get_int(L, t, "timeouts", "deadline_min");
    struct policy_limits *li = &p->limits;
    li->memory = get_int(L, t, "limits", "memory");
    li->processes = get_int(L, t, "limits", "processes");
    li->file_size = get_int(L, t, "limits", "file_size");
    li->open_files = get_int(L, t, "limits", "open_files");
    li->output = get_int(L, t, "limits", "output");
    li->stdin_bytes = get_int(L, t, "limits", "stdin");
    li->argv = get_int(L, t, "limits", "argv");
    li->argv_bytes = get_int(L, t, "limits", "argv_bytes");
    li->sessions = get_int(L, t, "limits", "sessions");
    li->running = get_int(L, t, "limits", "running");
    li->depth = get_int(L, t, "limits", "depth");
    li->lua_memory = get_int(L, t, "limits", "lua_memory");
    li->lua_instructions = get_int(L, t, "limits", "lua_instructions");
    p->name = get_str(L, t, "name", "unnamed");
    p->isolation = get_str(L, t, "isolation", "process");
    lua_getfield(L, t, "env");
    p->env_path = get_str(L, lua_gettop(L), "path", "/usr/bin:/bin");
    lua_pop(L, 1);
}

static int tool_cmp(const void *a, const void *b)
{
    return strcmp(((const struct tool_def *)a)->name, ((const struct tool_def *)b)->name);
}

static void read_tools(struct policy *p, int t)
{
    lua_State *L = p->L;
    lua_getfield(L, t, "tools");
    size_t n = 0;
    lua_pushnil(L);
    while (lua_next(L, -2)) {
        n++;
        lua_pop(L, 1);
    }
    p->tools = xcalloc(n, sizeof *p->tools);
    lua_pushnil(L);
    while (lua_next(L, -2)) {
        int tt = lua_gettop(L);
        struct tool_def *d = &p->tools[p->ntools++];
        d->name = xstrdup(lua_tostring(L, -2));
        d->path = get_str(L, tt, "path", "");
        d->owner = get_str(L, tt, "owner", NULL);
        d->where = get_str(L, tt, "at", "?");
        lua_getfield(L, tt, "timeout");
        d->timeout_ms = lua_isinteger(L, -1) ? lua_tointeger(L, -1) : 0;
        lua_getfield(L, tt, "accept");
        d->has_accept = lua_isfunction(L, -1);
        lua_getfield(L, tt, "idempotent");
        d->idempotent_declared = !lua_isnil(L, -1);
        d->idempotent_fn = lua_isfunction(L, -1);
        d->idempotent = lua_toboolean(L, -1);
        lua_pop(L, 3);
        d->ref = luaL_ref(L, LUA_REGISTRYINDEX);    /* pops the tool table */
    }
    lua_pop(L, 1);
    qsort(p->tools, p->ntools, sizeof *p->tools, tool_cmp);
}

static char *read_file(const char *path, size_t *len, char **err)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        *err = xasprintf("policy %s: %s", path, strerror(errno));
        return NULL;
    }
    struct stat st;
    if (fstat(fd, &st) < 0 || !S_ISREG(st.st_mode) || st.st_size > POLICY_FILE_MAX) {
        *err = xasprintf("policy %s: not a regular file of at most %d bytes", path,
                         POLICY_FILE_MAX);
        close(fd);
        return NULL;
    }
    char *buf = xmalloc((size_t)st.st_size + 1);
    size_t got = 0;
    while (got < (size_t)st.st_size) {
        ssize_t n = read(fd, buf + got, (size_t)st.st_size - got);
        if (n <= 0)
            break;
        got += (size_t)n;
    }
    close(fd);
    buf[got] = 0;
    *len = got;
    return buf;
}

struct policy *policy_load(const char *path, char **err)
{
    size_t len;
    char *text = read_file(path, &len, err);
    if (!text)
        return NULL;
    struct policy *p = xcalloc(1, sizeof *p);
    p->path = xstrdup(path);
    p->refcount = 1;
    p->mem_limit = 256u << 20;          /* until the policy says otherwise */
    p->instr_limit = 100000000;
    p->L = lua_newstate(policy_alloc, p);
    if (!p->L) {
        *err = xasprintf("policy %s: cannot create a Lua state", path);
        goto fail;
    }
    lua_State *L = p->L;
    *(struct policy **)lua_getextraspace(L) = p;

    lua_pushcfunction(L, open_state);
    if (policy_pcall(p, 0, 0, "open", err) != POLICY_OK)
        goto fail_msg;

    char *chunkname = xasprintf("@%s", path);
    int rc = luaL_loadbufferx(L, text, len, chunkname, "t");
    free(chunkname);
    if (rc != LUA_OK) {
        *err = xasprintf("policy %s", lua_tostring(L, -1));
        lua_pop(L, 1);
        goto fail;
    }
    push_env(L, true);
    lua_setupvalue(L, -2, 1);
    p->loading = true;
    rc = policy_pcall(p, 0, 1, "load", err);
    p->loading = false;
    if (rc != POLICY_OK)
        goto fail_msg;
    if (!lua_istable(L, -1)) {
        *err = xasprintf("policy %s: must return stockade.policy{...}, returned %s", path,
                         luaL_typename(L, -1));
        goto fail;
    }
    lua_getfield(L, -1, "timeouts");
    bool shaped = lua_istable(L, -1);
    lua_pop(L, 1);
    if (!shaped) {
        *err = xasprintf("policy %s: must return stockade.policy{...}", path);
        goto fail;
    }
    int t = lua_gettop(L);
    read_settings(p, t);
    read_tools(p, t);
    lua_pop(L, 1);
    p->mem_limit = p->limits.lua_memory > 0 ? (size_t)p->limits.lua_memory : p->mem_limit;
    if (p->mem_limit < p->mem_used + (1u << 20))
        p->mem_limit = p->mem_used + (1u << 20);
    p->instr_limit = p->limits.lua_instructions > 0 ? p->limits.lua_instructions : 10000000;
    p->generation = next_generation++;
    /* The policy's identity for hello and reload answers: sha256 of its text. */
    struct sha256_ctx sha;
    uint8_t digest[SHA256_DIGEST_SIZE];
    sha256_init(&sha);
    sha256_update(&sha, len, (const uint8_t *)text);
    sha256_digest(&sha, sizeof digest, digest);
    for (size_t i = 0; i < sizeof digest; i++)
        snprintf(p->sha256 + 2 * i, 3, "%02x", digest[i]);
    free(text);
    return p;

fail_msg:
    /* policy_pcall's message already names file:line; prefix the policy. */
    {
        char *m = *err;
        *err = strncmp(m, path, strlen(path)) == 0 ? m : xasprintf("policy %s: %s", path, m);
        if (*err != m)
            free(m);
    }
fail:
    free(text);
    policy_unref(p);
    return NULL;
}

struct policy *policy_ref(struct policy *p)
{
    p->refcount++;
    return p;
}

void policy_unref(struct policy *p)
{
    if (!p || --p->refcount > 0)
        return;
    if (p->L)
        lua_close(p->L);
    for (size_t i = 0; i < p->ntools; i++) {
        free(p->tools[i].name);
        free(p->tools[i].path);
        free(p->tools[i].owner);
        free(p->tools[i].where);
    }
    free(p->tools);
    free(p->path);
    free(p->name);
    free(p->isolation);
    free(p->env_path);
    free(p);
}

const struct tool_def *policy_tool(const struct policy *p, const char *name)
{
    struct tool_def key = {.name = (char *)name};
    return bsearch(&key, p->tools, p->ntools, sizeof *p->tools, tool_cmp);
}

/* ---- hooks ---------------------------------------------------------------------- */

static void push_call_view(lua_State *L, const struct policy_call_view *v)
{
    lua_createtable(L, 0, 6);
    lua_pushstring(L, v->tool);
    lua_setfield(L, -2, "tool");
    lua_createtable(L, (int)v->argc, 0);
    for (size_t i = 0; i < v->argc; i++) {
        lua_pushstring(L, v->argv[i]);
        lua_rawseti(L, -2, (lua_Integer)i + 1);
    }
    lua_setfield(L, -2, "argv");
    lua_createtable(L, 0, 2);
    lua_pushstring(L, v->session_id ? v->session_id : "");
    lua_setfield(L, -2, "id");
    lua_pushstring(L, v->session_root ? v->session_root : "");
    lua_setfield(L, -2, "root");
    lua_setfield(L, -2, "session");
    lua_pushinteger(L, v->depth);
    lua_setfield(L, -2, "depth");
    lua_newtable(L);
    lua_setfield(L, -2, "env");
}

/* Push the tool's hook `name`; false (nothing pushed) when absent. */
static bool push_hook(lua_State *L, const struct tool_def *t, const char *name)
{
    lua_rawgeti(L, LUA_REGISTRYINDEX, t->ref);
    lua_getfield(L, -1, name);
    lua_remove(L, -2);
    if (lua_isfunction(L, -1))
        return true;
    lua_pop(L, 1);
    return false;
}

bool policy_accept(struct policy *p, const struct tool_def *t, const struct policy_call_view *v,
                   char **reason)
{
    lua_State *L = p->L;
    int top = lua_gettop(L);
    *reason = NULL;
    if (!t->has_accept || !push_hook(L, t, "accept"))
        return true;
    push_call_view(L, v);
    char *err = NULL;
    enum policy_rc rc = policy_pcall(p, 1, 2, "accept", &err);
    bool ok = false;
    if (rc != POLICY_OK) {
        *reason = xasprintf("refused: the policy's accept hook for %s failed (%s)", t->name,
                            rc == POLICY_ERR ? "error" : rc == POLICY_TIMEOUT
                                                             ? "instruction budget exceeded"
                                                             : "memory cap exceeded");
        free(err);
    } else {
        if (lua_type(L, -2) == LUA_TBOOLEAN && lua_toboolean(L, -2)) {
            ok = true;
        } else if (lua_type(L, -2) == LUA_TBOOLEAN || lua_isnil(L, -2)) {
            const char *why = lua_type(L, -1) == LUA_TSTRING ? lua_tostring(L, -1) : NULL;
            *reason = why ? xasprintf("refused by policy: %.200s", why)
                          : xasprintf("refused by policy (%s: accept)", t->name);
            /* A reason is one line for a model: cut at the first newline. */
            (*reason)[strcspn(*reason, "\r\n")] = 0;
        } else {
            *reason = xasprintf("refused: the accept hook for %s returned a %s, not a boolean",
                                t->name, luaL_typename(L, -2));
        }
        lua_pop(L, 2);
    }
    if (lua_gettop(L) != top)
        LOG_E("policy %s: Lua stack unbalanced after accept (%d != %d)", p->path,
              lua_gettop(L), top);
    lua_settop(L, top);
    return ok;
}

bool policy_idempotent(struct policy *p, const struct tool_def *t,
                       const struct policy_call_view *v, bool hint)
{
    if (!t->idempotent_declared)
        return hint;
    if (!t->idempotent_fn)
        return t->idempotent;
    lua_State *L = p->L;
    int top = lua_gettop(L);
    if (!push_hook(L, t, "idempotent"))
        return false;
    push_call_view(L, v);
    bool out = false;
    if (policy_pcall(p, 1, 1, "idempotent", NULL) == POLICY_OK) {
        out = lua_type(L, -1) == LUA_TBOOLEAN && lua_toboolean(L, -1);
        lua_pop(L, 1);
    }
    lua_settop(L, top);
    return out;
}
