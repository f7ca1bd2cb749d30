#include "policy.h"
#include "lua_embed.h"
#include "lua_match.h"
#include "version.h"
#include "util.h"

#include <errno.h>
#include <fcntl.h>
#include <lauxlib.h>
#include <lua.h>
#include <lua-cjson.h>
#include <lualib.h>
#include <msgpack.h>
#include <nettle/sha2.h>
#include <fnmatch.h>
#include <libgen.h>
#include <linux/openat2.h>
#include <sys/syscall.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <unistd.h>

#define POLICY_FILE_MAX (1 << 20)
#define HOOK_WALL_MS 1000       /* a hook may also not run longer than this */
#define HOOK_COUNT_STEP 1000

static unsigned next_generation = 1;

/* Registry keys are addresses of statics. */
static char key_loaded;         /* module name -> value, for require */
static char key_policy_env_base;
static char key_engine;         /* lua/engine.lua */
static char key_policy_table;   /* the normalized table stockade.policy{} returned */
static char key_json;           /* lua-cjson */
static char key_errerr;         /* "error in error handling", kept interned */

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

static void count_hook(lua_State *L, lua_Debug *ar);

/* Charge steps to the running hook's budget: every HOOK_COUNT_STEP instructions (the
 * count hook), and the steps of C functions that run outside it (pattern matching: see
 * lua_match.c). Over budget or past the wall clock, abort. */
static void charge_steps(lua_State *L, int64_t steps)
{
    struct policy *p = policy_of(L);
    p->instr_used += steps;
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

static void count_hook(lua_State *L, lua_Debug *ar)
{
    if (ar->event == LUA_HOOKLINE) {
        /* While the policy file runs: remember its line, for errors raised where the
         * stack no longer shows it (`return stockade.policy{}` is a tail call). */
        if (lua_getinfo(L, "S", ar) && strcmp(ar->what, "main") == 0)
            policy_of(L)->load_line = ar->currentline;
        return;
    }
    charge_steps(L, HOOK_COUNT_STEP);
}

static policy_clock_fn clock_refresh;
static void *clock_refresh_ud;

void policy_set_clock_refresh(policy_clock_fn fn, void *ud)
{
    clock_refresh = fn;
    clock_refresh_ud = ud;
}

const char *policy_last_error(const struct policy *p)
{
    return p->last_error;
}

static int hook_where_protected(lua_State *L)
{
    const char *hook = lua_touserdata(L, 1);
    lua_rawgeti(L, LUA_REGISTRYINDEX, policy_of(L)->hook_tool->ref);
    if (lua_istable(L, -1) && lua_getfield(L, -1, hook) == LUA_TFUNCTION) {
        lua_Debug ar;
        if (lua_getinfo(L, ">S", &ar) && ar.linedefined > 0) {
            lua_pushfstring(L, "%s:%d", ar.short_src, ar.linedefined);
            return 1;
        }
    }
    return 0;
}

/* "file:line" where the running tool's hook `hook` is defined, or NULL. In a protected
 * call: the state may be at its cap, and the tool table is the policy's to change. */
static char *hook_where(struct policy *p, const char *hook)
{
    lua_State *L = p->L;
    if (!p->hook_tool)
        return NULL;
    lua_pushcfunction(L, hook_where_protected);
    lua_pushlightuserdata(L, (void *)hook);
    char *where = NULL;
    if (lua_pcall(L, 1, 1, 0) == LUA_OK && lua_type(L, -1) == LUA_TSTRING)
        where = xstrdup(lua_tostring(L, -1));
    lua_pop(L, 1);
    return where;
}

/* Every entry into the state is a protected call, so this should never run; if it does,
 * the state is unusable and Lua aborts when this returns: say why first, in one line. */
static int policy_panic(lua_State *L)
{
    struct policy *p = policy_of(L);
    const char *msg = lua_type(L, -1) == LUA_TSTRING ? lua_tostring(L, -1) : NULL;
    LOG_E("policy %s: Lua error outside a protected call, aborting: %.200s",
          p && p->path ? p->path : "?", msg ? msg : "(not a string)");
    return 0;
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
    /* The last hook met the cap (it may have swallowed the refusal): give back what is
     * garbage before this one starts, so that it is not refused for the other's litter.
     * A full collection cannot raise (finalizers are stripped) and is bounded by the cap. */
    if (p->out_of_memory)
        lua_gc(L, LUA_GCCOLLECT);
    p->instr_used = 0;
    p->over_budget = false;
    p->out_of_memory = false;
    free(p->last_error);
    p->last_error = NULL;
    int64_t started = now_ms();
    p->hook_deadline_ms = started + HOOK_WALL_MS;
    lua_sethook(L, count_hook, LUA_MASKCOUNT | (p->loading ? LUA_MASKLINE : 0),
                HOOK_COUNT_STEP);
    int rc = lua_pcall(L, nargs, nres, fn);
    /* The shared tail: always disarm the hook and drop the handler. */
    lua_sethook(L, NULL, 0, 0);
    lua_remove(L, fn);
    /* A hook may have held the loop for up to its wall budget: whoever caches the time
     * must not arm the next timer on a stale clock. */
    if (clock_refresh && now_ms() > started)
        clock_refresh(clock_refresh_ud);

    if (rc == LUA_OK) {
        p->hook_tool = NULL;
        return POLICY_OK;
    }
    enum policy_rc out = p->out_of_memory || rc == LUA_ERRMEM ? POLICY_NOMEM
                         : p->over_budget                     ? POLICY_TIMEOUT
                                                              : POLICY_ERR;
    char *msg = out == POLICY_NOMEM     ? xstrdup("memory cap exceeded")
                : out == POLICY_TIMEOUT ? xstrdup("instruction budget exceeded")
                                        : first_line(lua_type(L, -1) == LUA_TSTRING
                                                         ? lua_tostring(L, -1) : NULL);
    lua_pop(L, 1);
    /* Every failure is logged where an operator looks: the tool, the hook and where
     * the hook is defined, since the fallback the caller applies is silent. */
    if (p->hook_tool) {
        char *where = hook_where(p, hook);
        LOG_W("policy %s: tool %s: hook %s%s%s%s: %s", p->path,
              p->hook_tool ? p->hook_tool->name : "-", hook, where ? " (" : "",
              where ? where : "", where ? ")" : "", msg);
        free(where);
    }
    p->hook_tool = NULL;
    p->last_error = xstrdup(msg);
    if (err)
        *err = msg;
    else
        free(msg);
    /* A bomb leaves garbage behind: give the memory back before the next hook. */
    if (out == POLICY_NOMEM) {
        lua_gc(L, LUA_GCCOLLECT);
        p->out_of_memory = false;
    }
    return out;
}

/* Entering the state for a hook. The core's own pushes (the hook, the call's view, the
 * output handed to redact and classify) and its reads of the results allocate in the
 * policy's state, which may be at its memory cap: a hook can keep memory alive up to it,
 * swallowing the refusals with pcall. A refused allocation outside a protected call is a
 * Lua panic, which aborts the server; so all of it runs inside the protected call, and a
 * refusal there costs the call its hook, like the hook's own. */
struct hook_entry {
    /* Push the function and its arguments; return how many arguments. */
    int (*push)(lua_State *L, const void *ud);
    const void *ud;
    int nres;
    /* Results 1..nres whose bit is set are read back as strings: numbers among them are
     * converted here, where converting may raise, so that the caller's lua_tolstring
     * never allocates. */
    unsigned as_strings;
    /* Also the strings of the list at this result (0: none): argv's. */
    int list_of_strings;
};

static void convert_number(lua_State *L, int idx)
{
    if (lua_type(L, idx) == LUA_TNUMBER)
        lua_tolstring(L, idx, NULL);    /* converts in place */
}

static int enter_hook(lua_State *L)
{
    const struct hook_entry *e = lua_touserdata(L, 1);
    lua_pop(L, 1);
    int nargs = e->push(L, e->ud);
    lua_call(L, nargs, e->nres);
    int first = lua_gettop(L) - e->nres + 1;
    for (int i = 0; i < e->nres; i++)
        if (e->as_strings & (1u << i))
            convert_number(L, first + i);
    if (e->list_of_strings && lua_istable(L, first + e->list_of_strings - 1)) {
        int list = first + e->list_of_strings - 1;
        lua_Integer n = (lua_Integer)lua_rawlen(L, list);
        for (lua_Integer i = 1; i <= n; i++) {
            if (lua_rawgeti(L, list, i) == LUA_TNUMBER) {
                lua_tolstring(L, -1, NULL);
                lua_rawseti(L, list, i);
            } else {
                lua_pop(L, 1);
            }
        }
    }
    return e->nres;
}

/* The budgeted, protected entry: e->nres results on POLICY_OK, nothing otherwise. */
static enum policy_rc policy_enter(struct policy *p, const struct hook_entry *e,
                                   const char *hook, char **err)
{
    /* A light C function and a light userdata: neither allocates. */
    lua_pushcfunction(p->L, enter_hook);
    lua_pushlightuserdata(p->L, (void *)e);
    return policy_pcall(p, 1, e->nres, hook, err);
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
        /* the full path (short_src is cut at 60 bytes), so the loader can read it back */
        lua_pushfstring(L, "%s:%d", ar.source[0] == '@' ? ar.source + 1 : ar.short_src,
                        ar.currentline);
        return 1;
    }
    struct policy *p = policy_of(L);
    if (p->loading && p->load_line > 0) {
        lua_pushfstring(L, "%s:%d", p->path, p->load_line);
        return 1;
    }
    return 0;
}

static char *slurp(const char *path, size_t max, size_t *len, char **err);

/* The text of a policy or plugin file, for locating a field's own line in an error; nil
 * when it cannot be read. Only the stockade module has it, never a policy. */
static int l_core_source(lua_State *L)
{
    size_t len;
    char *err = NULL;
    char *text = slurp(luaL_checkstring(L, 1), POLICY_FILE_MAX, &len, &err);
    free(err);
    if (!text)
        return 0;
    lua_pushlstring(L, text, len);
    free(text);
    return 1;
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

static void push_env(lua_State *L, bool strict);

/* Run the plugin chunk on the top of the stack in the strict environment; its value. */
static int run_plugin(lua_State *L)
{
    push_env(L, true);
    lua_setupvalue(L, -2, 1);
    lua_call(L, 0, 1);
    if (lua_isnil(L, -1)) {
        lua_pop(L, 1);
        lua_pushboolean(L, 1);
    }
    /* Not cached: each require runs the plugin afresh, so no plugin can change a
     * table that the policy or another plugin reads later (secrets.default = {}). */
    return 1;
}

/* require: the stockade modules, and plugins: "plugins.X" is X.lua in the first plugin
 * directory that has it, else the copy of plugins/X.lua built into the binary (so a file
 * on the path overrides the shipped one). Nothing else: no C modules, no paths outside
 * those directories. */
static int l_policy_require(lua_State *L)
{
    const char *name = luaL_checkstring(L, 1);
    lua_settop(L, 1);
    lua_rawgetp(L, LUA_REGISTRYINDEX, &key_loaded);   /* at 2 */
    if (lua_getfield(L, -1, name) != LUA_TNIL)
        return 1;
    lua_pop(L, 1);
    struct policy *p = policy_of(L);
    const char *rel = strncmp(name, "plugins.", 8) == 0 ? name + 8 : NULL;
    bool ok = rel && *rel;
    for (const char *c = rel; ok && *c; c++)
        ok = (*c >= 'a' && *c <= 'z') || (*c >= 'A' && *c <= 'Z') || (*c >= '0' && *c <= '9') ||
             *c == '_' || (*c == '.' && c[1] && c[1] != '.' && c != rel);
    if (!ok)
        return luaL_error(L, "module '%s' not found (a policy may require \"stockade\", "
                             "\"stockade.schema\" and \"plugins.NAME\")", name);
    char relpath[256];
    snprintf(relpath, sizeof relpath, "%s.lua", rel);
    for (char *c = relpath; *c && strcmp(c, ".lua"); c++)
        if (*c == '.')
            *c = '/';
    for (size_t i = 0; i < p->nplugin_dirs; i++) {
        /* The names live on the Lua stack: a push may raise (the memory cap), so nothing
         * malloc'd is held across one; luaL_loadbufferx does not raise. */
        const char *path = lua_pushfstring(L, "%s/%s", p->plugin_dirs[i], relpath);
        const char *chunkname = lua_pushfstring(L, "@%s", path);
        size_t len;
        char *err = NULL;
        char *text = slurp(path, 1 << 20, &len, &err);
        if (!text) {
            free(err);
            lua_pop(L, 2);
            continue;
        }
        int rc = luaL_loadbufferx(L, text, len, chunkname, "t");
        free(text);
        if (rc != LUA_OK)
            return lua_error(L);
        return run_plugin(L);
    }
    for (const struct lua_embedded *e = lua_embedded; e->name; e++) {
        if (strcmp(e->name, name) == 0) {
            /* precompiled at build time (lua_embed.h), named "=plugins/X.lua (built in)" */
            if (luaL_loadbufferx(L, e->chunk, e->len, e->file, "b") != LUA_OK)
                return lua_error(L);
            return run_plugin(L);
        }
    }
    luaL_Buffer b;
    luaL_buffinit(L, &b);
    for (size_t i = 0; i < p->nplugin_dirs; i++) {
        luaL_addstring(&b, i ? ", " : "");
        luaL_addstring(&b, p->plugin_dirs[i]);
    }
    luaL_pushresult(&b);
    return luaL_error(L, "module '%s' not found: no %s in the plugin directories (%s; set "
                         "STOCKADE_PLUGIN_PATH, colon-separated, to change them) and no "
                         "built-in plugin of that name", name, relpath, lua_tostring(L, -1));
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
 * collectgarbage, and of course no io, os, debug or package; setmetatable is wrapped. */
static const char *const safe_base[] = {
    "assert", "error", "ipairs", "next", "pairs", "pcall", "rawequal", "rawget", "rawlen",
    "rawset", "select", "getmetatable", "tonumber", "tostring", "type",
    "xpcall", "_VERSION", NULL,
};

/* setmetatable without finalizers: a __gc runs when the collector decides, outside any
 * hook's budget, and at lua_close; one that loops would hang the server. (Lua marks an
 * object for finalization only if __gc is present when the metatable is set.) */
static int l_policy_setmetatable(lua_State *L)
{
    lua_settop(L, 2);
    if (lua_type(L, 2) == LUA_TTABLE) {
        lua_pushliteral(L, "__gc");
        if (lua_rawget(L, 2) != LUA_TNIL)
            return luaL_error(L, "setmetatable: __gc is not allowed in a policy (a "
                                 "finalizer runs outside every budget)");
        lua_pop(L, 1);
    }
    lua_pushvalue(L, lua_upvalueindex(1));
    lua_insert(L, 1);
    lua_call(L, 2, 1);
    return 1;
}

/* A copy of the library table at idx, pushed. */
static void push_lib_copy(lua_State *L, int idx)
{
    idx = lua_absindex(L, idx);
    lua_newtable(L);
    lua_pushnil(L);
    while (lua_next(L, idx)) {
        lua_pushvalue(L, -2);
        lua_insert(L, -2);
        lua_settable(L, -4);
    }
}
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
        lua_getglobal(L, *n);
        lua_setfield(L, -2, *n);    /* copied again for each environment (push_env) */
    }
    lua_getglobal(L, "setmetatable");
    lua_pushcclosure(L, l_policy_setmetatable, 1);
    lua_setfield(L, -2, "setmetatable");
    lua_pushcfunction(L, l_policy_print);
    lua_setfield(L, -2, "print");
    lua_pushcfunction(L, l_policy_require);
    lua_setfield(L, -2, "require");
    lua_rawsetp(L, LUA_REGISTRYINDEX, &key_policy_env_base);
}

/* Push a fresh environment: a copy of the base with its own copies of the libraries (a
 * plugin that patches string.gsub patches its own), then locked (unknown globals are
 * errors). */
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
    for (const char *const *n = safe_libs; *n; n++) {
        lua_getfield(L, -1, *n);
        push_lib_copy(L, -1);
        lua_setfield(L, -3, *n);
        lua_pop(L, 1);
    }
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

/* Load a module of lua/ (compiled in) with `nargs` arguments below it on the stack;
 * leaves its value. */
static void load_embedded(lua_State *L, const char *name, int nargs)
{
    const struct lua_embedded *m = NULL;
    for (const struct lua_embedded *e = lua_embedded; e->name; e++)
        if (strcmp(e->name, name) == 0)
            m = e;
    if (!m)
        luaL_error(L, "the %s module is not built in", name);
    /* precompiled at build time (lua_embed.h): loaded, not parsed */
    if (luaL_loadbufferx(L, m->chunk, m->len, m->file, "b") != LUA_OK)
        lua_error(L);
    push_env(L, false);
    lua_setupvalue(L, -2, 1);
    lua_insert(L, -1 - nargs);
    lua_call(L, nargs, 1);
}

static int l_schema_unavailable(lua_State *L)
{
    lua_pushboolean(L, 0);
    lua_pushstring(L, "JSON Schema validation is not built in");
    return 2;
}

static int l_core_log(lua_State *L);
static int l_core_path_resolve(lua_State *L);
static int l_core_paths_beneath(lua_State *L);

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
    /* Lua makes this message after a protected call whose error handler failed, outside
     * the call: interned for good here, making it never allocates (nor can be refused). */
    lua_pushliteral(L, "error in error handling");
    lua_rawsetp(L, LUA_REGISTRYINDEX, &key_errerr);
    /* string.dump makes binary chunks. */
    lua_getglobal(L, "string");
    lua_pushnil(L);
    lua_setfield(L, -2, "dump");
    lua_pop(L, 1);
    /* Matching charged to the hook's budget, in the real table (reached through every
     * string's metatable) before any copy is made. */
    lua_match_set_charge(charge_steps);
    lua_match_install(L);
    /* The string metatable is shared by the engine and every policy and plugin: locked,
     * so no one reaches the real string table through getmetatable(""). */
    lua_pushliteral(L, "");
    lua_getmetatable(L, -1);
    lua_pushboolean(L, 0);
    lua_setfield(L, -2, "__metatable");
    lua_pop(L, 2);
    build_env_base(L);
    lua_newtable(L);
    lua_rawsetp(L, LUA_REGISTRYINDEX, &key_loaded);

    /* lua-cjson, for the engine; policies get encode/decode/null only. */
    luaL_requiref(L, "cjson", luaopen_cjson, 0);
    lua_pushvalue(L, -1);
    lua_rawsetp(L, LUA_REGISTRYINDEX, &key_json);
    int cjson = lua_gettop(L);
    lua_createtable(L, 0, 3);
    int json = lua_gettop(L);
    lua_getfield(L, cjson, "encode");
    lua_setfield(L, json, "encode");
    lua_getfield(L, cjson, "decode");
    lua_setfield(L, json, "decode");
    lua_getfield(L, cjson, "null");
    lua_setfield(L, json, "null");

    bool have_schema = false;
    for (const struct lua_embedded *e = lua_embedded; e->name; e++)
        have_schema |= strcmp(e->name, "schema") == 0;
    if (have_schema) {
        load_embedded(L, "schema", 0);
    } else {
        /* built without lua/schema.lua: validation fails closed */
        lua_newtable(L);
        lua_pushcfunction(L, l_schema_unavailable);
        lua_setfield(L, -2, "validate");
        lua_pushcfunction(L, l_schema_unavailable);
        lua_setfield(L, -2, "check_schema");
    }
    int schema = lua_gettop(L);
    lua_getfield(L, cjson, "null");
    lua_setfield(L, schema, "null");

    static const luaL_Reg core_fns[] = {
        {"duration", l_core_duration}, {"size", l_core_size}, {"where", l_core_where},
        {"log", l_core_log}, {"path_resolve", l_core_path_resolve},
        {"paths_beneath", l_core_paths_beneath}, {"source", l_core_source},
        {"check_pattern", lua_match_check}, {NULL, NULL},
    };
    luaL_newlib(L, core_fns);
    lua_pushvalue(L, json);
    lua_setfield(L, -2, "json");
    lua_pushvalue(L, schema);
    lua_setfield(L, -2, "schema");
    load_embedded(L, "stockade", 1);
    /* what policies get is read-only all the way down (stockade.lua); the schema
     * module's raw table stays the engine's alone */
    lua_rawgetp(L, LUA_REGISTRYINDEX, &key_loaded);
    lua_pushvalue(L, -2);
    lua_setfield(L, -2, "stockade");
    lua_getfield(L, -2, "schema");
    lua_setfield(L, -2, "stockade.schema");
    lua_pop(L, 2);

    lua_pushvalue(L, schema);
    lua_createtable(L, 0, 1);
    lua_pushcfunction(L, lua_match_check);
    lua_setfield(L, -2, "check_pattern");
    load_embedded(L, "engine", 2);
    lua_rawsetp(L, LUA_REGISTRYINDEX, &key_engine);
    lua_settop(L, 0);
    return 0;
}

/* ---- reading the normalized policy table ------------------------------------------- */

/* t[section][key] as an integer; 0 when either is absent. Raw reads: the settings are
 * what the table holds, not what a metamethod answers. */
static int64_t get_int(lua_State *L, int t, const char *section, const char *key)
{
    lua_pushstring(L, section);
    if (lua_rawget(L, t) != LUA_TTABLE) {
        lua_pop(L, 1);
        return 0;
    }
    lua_pushstring(L, key);
    lua_rawget(L, -2);
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

/* A Lua list of strings (or nil) as a NULL-terminated C array. */
static char **read_strv(lua_State *L, int idx)
{
    size_t n = lua_istable(L, idx) ? lua_rawlen(L, idx) : 0;
    char **v = xcalloc(n + 1, sizeof *v);
    for (size_t i = 0; i < n; i++) {
        lua_rawgeti(L, idx, (lua_Integer)i + 1);
        const char *s = lua_tostring(L, -1);
        v[i] = xstrdup(s ? s : "");
        lua_pop(L, 1);
    }
    return v;
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
    li->address_space = get_int(L, t, "limits", "address_space");
    li->processes = get_int(L, t, "limits", "processes");
    li->file_size = get_int(L, t, "limits", "file_size");
    li->disk = get_int(L, t, "limits", "disk");
    li->inodes = get_int(L, t, "limits", "inodes");
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
    li->redact_hold = get_int(L, t, "limits", "redact_hold");
    /* alarms: 0 = unset, the server derives a default from the other limits */
    lua_getfield(L, t, "limits");
    lua_getfield(L, -1, "alarms");
    if (lua_istable(L, -1)) {
        int a = lua_gettop(L);
        static const char *const keys[] = {"zombies", "fds", "rss", "processes", "sessions"};
        int64_t *dst[] = {&li->alarm_zombies, &li->alarm_fds, &li->alarm_rss,
                          &li->alarm_processes, &li->alarm_sessions};
        for (size_t i = 0; i < ARRAY_LEN(keys); i++) {
            lua_getfield(L, a, keys[i]);
            *dst[i] = lua_isinteger(L, -1) ? lua_tointeger(L, -1) : -1;
            lua_pop(L, 1);
        }
    } else {
        li->alarm_zombies = li->alarm_fds = li->alarm_rss = li->alarm_processes =
            li->alarm_sessions = -1;
    }
    lua_pop(L, 2);
    p->name = get_str(L, t, "name", "unnamed");
    p->isolation = get_str(L, t, "isolation", "process");
    lua_getfield(L, t, "network");
    p->network = lua_isstring(L, -1) ? xstrdup(lua_tostring(L, -1)) : xstrdup("allowlist");
    lua_pop(L, 1);
    /* mounts: { {"/host/src", "dest/in/root", ro = true}, ... } */
    lua_getfield(L, t, "mounts");
    size_t nm = lua_istable(L, -1) ? lua_rawlen(L, -1) : 0;
    p->mounts = xcalloc(nm + 1, sizeof *p->mounts);
    for (size_t i = 0; i < nm; i++) {
        lua_rawgeti(L, -1, (lua_Integer)i + 1);
        if (lua_istable(L, -1)) {
            lua_rawgeti(L, -1, 1);
            lua_rawgeti(L, -2, 2);
            lua_getfield(L, -3, "ro");
            if (lua_isstring(L, -3) && lua_isstring(L, -2)) {
                struct sandbox_mount *m = &p->mounts[p->nmounts++];
                m->src = xstrdup(lua_tostring(L, -3));
                m->dest = xstrdup(lua_tostring(L, -2));
                m->ro = lua_toboolean(L, -1);
            }
            lua_pop(L, 3);
        }
        lua_pop(L, 1);
    }
    lua_pop(L, 1);
    lua_getfield(L, t, "env");
    p->env_path = get_str(L, lua_gettop(L), "path", "/usr/bin:/bin");
    lua_getfield(L, -1, "allow");
    p->env_allow = read_strv(L, -1);
    lua_getfield(L, -2, "deny");
    p->env_deny = read_strv(L, -1);
    lua_pop(L, 3);
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
        d->limits = (struct tool_limits){
            .memory = get_int(L, tt, "limits", "memory"),
            .address_space = get_int(L, tt, "limits", "address_space"),
            .processes = get_int(L, tt, "limits", "processes"),
            .file_size = get_int(L, tt, "limits", "file_size"),
            .open_files = get_int(L, tt, "limits", "open_files"),
        };
        lua_getfield(L, tt, "raw_argv");
        d->raw_argv = lua_toboolean(L, -1);
        lua_pop(L, 1);
        lua_getfield(L, tt, "argv");
        d->has_argv = lua_isfunction(L, -1);
        lua_getfield(L, tt, "output");
        if (lua_istable(L, -1)) {
            lua_getfield(L, -1, "format");
            d->has_output_check = lua_isstring(L, -1) && strcmp(lua_tostring(L, -1), "json") == 0;
            lua_pop(L, 1);
        }
        lua_pop(L, 2);
        lua_getfield(L, tt, "env");
        d->env_allow = read_strv(L, -1);
        lua_pop(L, 1);
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

static char *slurp(const char *path, size_t max, size_t *len, char **err)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        *err = xasprintf("%s: %s", path, strerror(errno));
        return NULL;
    }
    struct stat st;
    if (fstat(fd, &st) < 0 || !S_ISREG(st.st_mode) || (size_t)st.st_size > max) {
        *err = xasprintf("%s: not a regular file of at most %zu bytes", path, max);
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

/* Where `require "plugins.X"` looks: $STOCKADE_PLUGIN_PATH (colon-separated), else the
 * plugins/ directory beside the policy's directory, then the installed set. */
static void set_plugin_dirs(struct policy *p)
{
    const char *env = getenv("STOCKADE_PLUGIN_PATH");
    char *copy = xstrdup(p->path);
    char *dir = dirname(copy);
    char *list = env && *env ? xstrdup(env)
                             : xasprintf("%s/../plugins:%s/plugins:" STOCKADE_DATADIR "/plugins",
                                         dir, dir);
    free(copy);
    for (char *save = NULL, *tok = strtok_r(list, ":", &save); tok && p->nplugin_dirs < 8;
         tok = strtok_r(NULL, ":", &save))
        p->plugin_dirs[p->nplugin_dirs++] = xstrdup(tok);
    free(list);
}

extern char **environ;

/* The list of {name, regex, open, replace} on top of the stack, compiled. */
static struct redact_rules *compile_redact_rules(lua_State *L, size_t hold, char **err)
{
    size_t n = lua_rawlen(L, -1);
    struct redact_rule_spec *specs = xcalloc(n ? n : 1, sizeof *specs);
    for (size_t i = 0; i < n; i++) {
        lua_rawgeti(L, -1, (lua_Integer)i + 1);
        static const char *const fields[] = {"name", "regex", "open", "replace"};
        const char **dst[] = {&specs[i].name, &specs[i].regex, &specs[i].open,
                              &specs[i].replace};
        for (int f = 0; f < 4; f++) {
            lua_getfield(L, -1, fields[f]);
            *dst[f] = lua_isstring(L, -1) ? lua_tostring(L, -1) : "";
            lua_pop(L, 1);      /* the string stays alive in the table */
        }
        lua_pop(L, 1);          /* ...and the table in the list on the stack */
    }
    struct redact_rules *r = redact_rules_compile(specs, n, hold, err);
    free(specs);
    return r;
}

/* engine.init(P, env): each tool's redaction chain; read back what the C fast path
 * needs. The environment is given to the engine only (for the values of denied names),
 * never to the policy. */
/* The policy chunk (argument 1) with its own environment, made in a protected call. */
static int give_chunk_env(lua_State *L)
{
    push_env(L, true);
    lua_setupvalue(L, 1, 1);
    return 1;
}

/* What the policy file returned (argument 1), read inside a protected call: the file may
 * have left the state at its cap, or returned a table whose metamethods raise, and
 * neither may panic the loader (nor `policy.reload`, which aborted the server). */
static int read_policy(lua_State *L)
{
    struct policy *p = policy_of(L);
    if (!lua_istable(L, 1))
        return luaL_error(L, "must return stockade.policy{...}, returned %s",
                          luaL_typename(L, 1));
    lua_settop(L, 1);
    if (lua_getfield(L, 1, "timeouts") != LUA_TTABLE)
        return luaL_error(L, "must return stockade.policy{...}");
    lua_pop(L, 1);
    read_settings(p, 1);
    read_tools(p, 1);
    lua_rawsetp(L, LUA_REGISTRYINDEX, &key_policy_table);
    return 0;
}

/* engine.init(P, environ), built inside the protected call. */
static int push_engine_init(lua_State *L, const void *ud)
{
    (void)ud;
    luaL_checkstack(L, 6, "init");
    lua_rawgetp(L, LUA_REGISTRYINDEX, &key_engine);
    lua_getfield(L, -1, "init");
    lua_remove(L, -2);
    lua_rawgetp(L, LUA_REGISTRYINDEX, &key_policy_table);
    lua_newtable(L);
    for (char **e = environ; e && *e; e++) {
        const char *eq = strchr(*e, '=');
        if (!eq)
            continue;
        lua_pushlstring(L, *e, (size_t)(eq - *e));
        lua_pushstring(L, eq + 1);
        lua_settable(L, -3);
    }
    return 2;
}

static enum policy_rc init_engine(struct policy *p, char **err)
{
    lua_State *L = p->L;
    struct hook_entry e = {push_engine_init, NULL, 1, 0, 0};
    enum policy_rc rc = policy_enter(p, &e, "init", err);
    if (rc != POLICY_OK)
        return rc;
    struct redact_rules *shared = NULL;
    bool ok = true;
    for (size_t i = 0; ok && i < p->ntools; i++) {
        struct tool_def *d = &p->tools[i];
        lua_getfield(L, -1, d->name);
        struct redact_rules *rules = NULL;
        lua_getfield(L, -1, "regex_shared");
        bool is_shared = lua_toboolean(L, -1);
        lua_pop(L, 1);
        if (is_shared && shared) {
            rules = redact_rules_ref(shared);
        } else {
            lua_getfield(L, -1, "regex");
            rules = compile_redact_rules(L, (size_t)p->limits.redact_hold, err);
            lua_pop(L, 1);
            if (!rules) {
                ok = false;
                lua_pop(L, 1);
                break;
            }
            if (is_shared)
                shared = redact_rules_ref(rules);
        }
        lua_getfield(L, -1, "window");
        size_t window = (size_t)lua_tointeger(L, -1);
        lua_getfield(L, -2, "lua");
        bool lua = lua_toboolean(L, -1);
        lua_getfield(L, -3, "lua_always");
        bool lua_always = lua_toboolean(L, -1);
        lua_getfield(L, -4, "prefixes");
        char **prefixes = read_strv(L, -1);
        lua_getfield(L, -5, "iprefixes");
        d->redact = redact_set_new(rules, lua, prefixes, read_strv(L, -1), window, lua_always);
        d->redact_active = lua || redact_rules_count(rules) > 0;
        redact_rules_unref(rules);
        lua_pop(L, 6);
    }
    redact_rules_unref(shared);
    lua_pop(L, 1);
    return ok ? POLICY_OK : POLICY_ERR;
}

struct policy *policy_load(const char *path, char **err)
{
    size_t len;
    char *text = slurp(path, POLICY_FILE_MAX, &len, err);
    if (!text) {
        char *m = *err;
        *err = xasprintf("policy %s", m);
        free(m);
        return NULL;
    }
    struct policy *p = xcalloc(1, sizeof *p);
    p->path = xstrdup(path);
    p->refcount = 1;
    p->mem_limit = 256u << 20;          /* until the policy says otherwise */
    p->instr_limit = 100000000;
    set_plugin_dirs(p);
    p->L = lua_newstate(policy_alloc, p);
    if (!p->L) {
        *err = xasprintf("policy %s: cannot create a Lua state", path);
        goto fail;
    }
    lua_State *L = p->L;
    *(struct policy **)lua_getextraspace(L) = p;
    lua_atpanic(L, policy_panic);

    lua_pushcfunction(L, open_state);
    if (policy_pcall(p, 0, 0, "open", err) != POLICY_OK)
        goto fail_msg;

    char *chunkname = xasprintf("@%s", path);
    int rc = luaL_loadbufferx(L, text, len, chunkname, "t");
    free(chunkname);
    if (rc != LUA_OK) {
        *err = xstrdup(lua_tostring(L, -1));    /* FILE:LINE: as Lua says it */
        lua_pop(L, 1);
        goto fail;
    }
    lua_pushcfunction(L, give_chunk_env);
    lua_insert(L, -2);
    if (policy_pcall(p, 1, 1, "load", err) != POLICY_OK)
        goto fail_msg;
    p->loading = true;
    rc = policy_pcall(p, 0, 1, "load", err);
    p->loading = false;
    if (rc != POLICY_OK)
        goto fail_msg;
    lua_pushcfunction(L, read_policy);
    lua_insert(L, -2);
    if (policy_pcall(p, 1, 0, "load", err) != POLICY_OK)
        goto fail_msg;
    if (init_engine(p, err) != POLICY_OK)
        goto fail_msg;
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
    /* One form for every load error, FILE:LINE: message, so editors and CI annotate it:
     * messages raised in the policy already start with a location; others (a budget,
     * engine.init) get the policy's line that was running, or its first. */
    {
        char *m = *err;
        const char *colon = strchr(m, ':');
        bool located = colon && colon > m && colon[1] >= '0' && colon[1] <= '9';
        if (!located) {
            *err = xasprintf("%s:%d: %s", path, p->load_line > 0 ? p->load_line : 1, m);
            free(m);
        }
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
        redact_set_free(p->tools[i].redact);
        strv_free(p->tools[i].env_allow);
    }
    free(p->tools);
    for (size_t i = 0; i < p->nplugin_dirs; i++)
        free(p->plugin_dirs[i]);
    free(p->path);
    free(p->name);
    free(p->isolation);
    free(p->network);
    for (size_t i = 0; i < p->nmounts; i++) {
        free((char *)p->mounts[i].src);
        free((char *)p->mounts[i].dest);
    }
    free(p->mounts);
    free(p->env_path);
    strv_free(p->env_allow);
    strv_free(p->env_deny);
    free(p->last_error);
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
    luaL_checkstack(L, 6, "call view");
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

struct tool_hook_call {
    const struct tool_def *tool;
    const char *hook;
    const struct policy_call_view *view;
};

/* The tool's hook (as a function or whatever the tool table now holds there: calling
 * anything else fails the hook, closed) and the call's view. */
static int push_tool_hook(lua_State *L, const void *ud)
{
    const struct tool_hook_call *c = ud;
    policy_of(L)->hook_tool = c->tool;
    luaL_checkstack(L, 4, "hook");
    lua_rawgeti(L, LUA_REGISTRYINDEX, c->tool->ref);
    lua_getfield(L, -1, c->hook);
    lua_remove(L, -2);
    push_call_view(L, c->view);
    return 1;
}

bool policy_accept(struct policy *p, const struct tool_def *t, const struct policy_call_view *v,
                   char **reason)
{
    lua_State *L = p->L;
    int top = lua_gettop(L);
    *reason = NULL;
    if (!t->has_accept)
        return true;
    struct tool_hook_call c = {t, "accept", v};
    struct hook_entry e = {push_tool_hook, &c, 2, 0, 0};
    char *err = NULL;
    enum policy_rc rc = policy_enter(p, &e, "accept", &err);
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
    struct tool_hook_call c = {t, "idempotent", v};
    struct hook_entry e = {push_tool_hook, &c, 1, 0, 0};
    bool out = false;
    if (policy_enter(p, &e, "idempotent", NULL) == POLICY_OK)
        out = lua_type(L, -1) == LUA_TBOOLEAN && lua_toboolean(L, -1);
    lua_settop(L, top);
    return out;
}

/* ---- helpers a policy calls ------------------------------------------------------- */

static int l_core_log(lua_State *L)
{
    static const char *const levels[] = {"error", "warn", "info", "debug", NULL};
    int level = luaL_checkoption(L, 1, "info", levels);
    const char *msg = luaL_checkstring(L, 2);
    struct policy *p = policy_of(L);
    /* fields are not logged raw: they may carry argv values */
    log_msg((enum log_level)level, "policy %s: %.300s", p->path, msg);
    return 0;
}

/* The session root a helper was given: call.session, a session table, or a string. */
static const char *session_root_arg(lua_State *L, int idx)
{
    if (lua_type(L, idx) == LUA_TSTRING)
        return lua_tostring(L, idx);
    luaL_checktype(L, idx, LUA_TTABLE);
    if (lua_getfield(L, idx, "session") == LUA_TTABLE) {
        lua_getfield(L, -1, "root");
        lua_replace(L, -2);
    } else {
        lua_pop(L, 1);
        lua_getfield(L, idx, "root");
    }
    const char *root = lua_tostring(L, -1);
    lua_pop(L, 1);          /* the string stays alive in the table */
    if (!root || root[0] != '/')
        luaL_argerror(L, idx, "expected a session (with an absolute root)");
    return root;
}

/* Canonical path of `p` (relative to the workspace) if it stays beneath `root`,
 * symlinks resolved inside the root; NULL and a reason otherwise. The kernel does the
 * walk (openat2 RESOLVE_BENEATH), so there is no check-then-use race in the parsing. */
static char *resolve_beneath(const char *root, const char *p, const char **why)
{
    int rootfd = open(root, O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (rootfd < 0) {
        *why = "the session root is not there";
        return NULL;
    }
    size_t rlen = strlen(root);
    char *rel;
    if (p[0] == '/') {
        if (strncmp(p, root, rlen) != 0 || (p[rlen] != '/' && p[rlen] != 0)) {
            close(rootfd);
            *why = "absolute path outside the session root";
            return NULL;
        }
        rel = xstrdup(p[rlen] ? p + rlen + 1 : ".");
    } else {
        rel = xasprintf("workspace/%s", p);
    }
    struct open_how how = {.flags = O_PATH | O_CLOEXEC,
                           .resolve = RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS};
    char *out = NULL;
    int fd = (int)syscall(SYS_openat2, rootfd, rel, &how, sizeof how);
    char *leaf = NULL;
    if (fd < 0 && errno == ENOENT) {
        /* not there yet (an output file): its parent must be beneath */
        char *slash = strrchr(rel, '/');
        if (slash && slash[1] && strcmp(slash + 1, "..") && strcmp(slash + 1, ".")) {
            leaf = xstrdup(slash + 1);
            *slash = 0;
            fd = (int)syscall(SYS_openat2, rootfd, rel, &how, sizeof how);
        }
    }
    if (fd < 0) {
        *why = errno == EXDEV ? "path leaves the session root"
               : errno == ELOOP ? "path goes through a magic link"
               : errno == ENOENT ? "no such file or directory"
                                 : "path cannot be resolved";
    } else {
        char link[64], buf[4096];
        snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
        ssize_t n = readlink(link, buf, sizeof buf - 1);
        if (n > 0) {
            buf[n] = 0;
            out = leaf ? xasprintf("%s/%s", buf, leaf) : xstrdup(buf);
        } else {
            *why = "path cannot be resolved";
        }
        close(fd);
    }
    free(leaf);
    free(rel);
    close(rootfd);
    return out;
}

static int l_core_path_resolve(lua_State *L)
{
    const char *root = session_root_arg(L, 1);
    const char *path = luaL_checkstring(L, 2);
    const char *why = NULL;
    char *out = resolve_beneath(root, path, &why);
    if (!out) {
        lua_pushnil(L);
        lua_pushfstring(L, "%s: %s", path, why);
        return 2;
    }
    lua_pushstring(L, out);
    free(out);
    return 1;
}

/* true, or false and the first path of the list that leaves the session root. */
static int l_core_paths_beneath(lua_State *L)
{
    const char *root = session_root_arg(L, 1);
    luaL_checktype(L, 2, LUA_TTABLE);
    lua_Integer n = (lua_Integer)lua_rawlen(L, 2);
    for (lua_Integer i = 1; i <= n; i++) {
        lua_rawgeti(L, 2, i);
        const char *path = lua_tostring(L, -1);
        if (!path)
            return luaL_error(L, "paths_beneath: element %d is not a string", (int)i);
        const char *why = NULL;
        char *out = resolve_beneath(root, path, &why);
        /* a path that does not exist at all cannot be read outside either */
        if (!out && strcmp(why, "no such file or directory") != 0) {
            lua_pushboolean(L, 0);
            lua_pushfstring(L, "%s: %s", path, why);
            return 2;
        }
        free(out);
        lua_pop(L, 1);
    }
    lua_pushboolean(L, 1);
    return 1;
}

/* ---- the engine's hooks ----------------------------------------------------------- */

/* Push engine[fn], P and the tool's name (inside the protected entry). */
static void push_engine_call(lua_State *L, const char *fn, const struct tool_def *t)
{
    policy_of(L)->hook_tool = t;
    luaL_checkstack(L, 8, "engine call");
    lua_rawgetp(L, LUA_REGISTRYINDEX, &key_engine);
    lua_getfield(L, -1, fn);
    lua_remove(L, -2);
    lua_rawgetp(L, LUA_REGISTRYINDEX, &key_policy_table);
    lua_pushstring(L, t->name);
}

static const char *const redact_modes[] = {"more", "eof", "quiet"};

struct redact_call {
    const struct tool_def *tool;
    const char *stream, *session_id, *text;
    size_t len;
    enum redact_mode mode;
};

static int push_redact(lua_State *L, const void *ud)
{
    const struct redact_call *c = ud;
    push_engine_call(L, "redact", c->tool);
    lua_pushstring(L, c->stream);
    lua_pushstring(L, c->session_id ? c->session_id : "");
    lua_pushlstring(L, c->text, c->len);
    lua_pushstring(L, redact_modes[c->mode]);
    return 6;
}

enum policy_rc policy_redact(struct policy *p, const struct tool_def *t, const char *stream,
                             const char *session_id, const char *text, size_t len,
                             enum redact_mode mode, struct buf *out, size_t *consumed,
                             int64_t *count)
{
    lua_State *L = p->L;
    int top = lua_gettop(L);
    struct redact_call c = {t, stream, session_id, text, len, mode};
    struct hook_entry e = {push_redact, &c, 3, 1u << 0, 0};
    enum policy_rc rc = policy_enter(p, &e, "redact", NULL);
    if (rc == POLICY_OK) {
        size_t olen;
        const char *o = lua_tolstring(L, -3, &olen);
        lua_Integer used = lua_tointeger(L, -2);
        if (!o || used < 0 || (size_t)used > len) {
            rc = POLICY_ERR;
        } else {
            buf_append(out, o, olen);
            *consumed = (size_t)used;
            *count += lua_tointeger(L, -1);
        }
    }
    lua_settop(L, top);
    return rc;
}

struct classify_call {
    const struct tool_def *tool;
    const struct policy_classify_input *in;
};

static int push_classify(lua_State *L, const void *ud)
{
    const struct classify_call *c = ud;
    const struct policy_classify_input *in = c->in;
    push_engine_call(L, "classify", c->tool);
    lua_createtable(L, 0, 6);
    if (in->has_exit_code) {
        lua_pushinteger(L, in->exit_code);
        lua_setfield(L, -2, "exit_code");
    }
    if (in->signal) {
        lua_pushinteger(L, in->signal);
        lua_setfield(L, -2, "signal");
    }
    if (in->layer) {
        lua_pushstring(L, in->layer);
        lua_setfield(L, -2, "layer");
    }
    lua_pushlstring(L, in->stdout_tail, in->stdout_tail_len);
    lua_setfield(L, -2, "stdout_tail");
    lua_pushlstring(L, in->stderr_tail, in->stderr_tail_len);
    lua_setfield(L, -2, "stderr_tail");
    lua_pushinteger(L, in->duration_ms);
    lua_setfield(L, -2, "duration_ms");
    return 3;
}

bool policy_classify(struct policy *p, const struct tool_def *t,
                     const struct policy_classify_input *in, char **class, bool *retryable,
                     char **message)
{
    lua_State *L = p->L;
    int top = lua_gettop(L);
    struct classify_call c = {t, in};
    struct hook_entry e = {push_classify, &c, 3, 1u << 0 | 1u << 2, 0};
    bool changed = false;
    if (policy_enter(p, &e, "classify", NULL) == POLICY_OK && lua_isstring(L, -3)) {
        *class = xstrdup(lua_tostring(L, -3));
        *retryable = lua_toboolean(L, -2);
        /* the Lua redactors have seen the message (engine.classify); the regex ones
         * run here, in the core */
        int64_t redactions = 0;
        *message = lua_isstring(L, -1) ? redact_set_apply(t->redact, lua_tostring(L, -1),
                                                          &redactions)
                                       : NULL;
        changed = true;
    }
    lua_settop(L, top);
    return changed;
}

/* Whether push_msgpack takes o: bounded depth, string keys only, plain types. */
static bool msgpack_is_plain(const msgpack_object *o, int depth)
{
    if (depth > 32)
        return false;
    switch (o->type) {
    case MSGPACK_OBJECT_NIL:
    case MSGPACK_OBJECT_BOOLEAN:
    case MSGPACK_OBJECT_POSITIVE_INTEGER:
    case MSGPACK_OBJECT_NEGATIVE_INTEGER:
    case MSGPACK_OBJECT_FLOAT32:
    case MSGPACK_OBJECT_FLOAT64:
    case MSGPACK_OBJECT_STR:
    case MSGPACK_OBJECT_BIN: return true;
    case MSGPACK_OBJECT_ARRAY:
        for (uint32_t i = 0; i < o->via.array.size; i++)
            if (!msgpack_is_plain(&o->via.array.ptr[i], depth + 1))
                return false;
        return true;
    case MSGPACK_OBJECT_MAP:
        for (uint32_t i = 0; i < o->via.map.size; i++)
            if (o->via.map.ptr[i].key.type != MSGPACK_OBJECT_STR ||
                !msgpack_is_plain(&o->via.map.ptr[i].val, depth + 1))
                return false;
        return true;
    default:
        return false;
    }
}

/* msgpack -> Lua, for structured args (checked by msgpack_is_plain first). Inside the
 * protected entry: raises on a refused allocation. */
static void push_msgpack(lua_State *L, const msgpack_object *o)
{
    luaL_checkstack(L, 4, "args");
    switch (o->type) {
    case MSGPACK_OBJECT_BOOLEAN: lua_pushboolean(L, o->via.boolean); return;
    case MSGPACK_OBJECT_POSITIVE_INTEGER:
        if (o->via.u64 > INT64_MAX)
            lua_pushnumber(L, (lua_Number)o->via.u64);
        else
            lua_pushinteger(L, (lua_Integer)o->via.u64);
        return;
    case MSGPACK_OBJECT_NEGATIVE_INTEGER: lua_pushinteger(L, o->via.i64); return;
    case MSGPACK_OBJECT_FLOAT32:
    case MSGPACK_OBJECT_FLOAT64: lua_pushnumber(L, o->via.f64); return;
    case MSGPACK_OBJECT_STR: lua_pushlstring(L, o->via.str.ptr, o->via.str.size); return;
    case MSGPACK_OBJECT_BIN: lua_pushlstring(L, o->via.bin.ptr, o->via.bin.size); return;
    case MSGPACK_OBJECT_ARRAY:
        lua_createtable(L, (int)o->via.array.size, 0);
        for (uint32_t i = 0; i < o->via.array.size; i++) {
            push_msgpack(L, &o->via.array.ptr[i]);
            lua_rawseti(L, -2, (lua_Integer)i + 1);
        }
        return;
    case MSGPACK_OBJECT_MAP:
        lua_createtable(L, 0, (int)o->via.map.size);
        for (uint32_t i = 0; i < o->via.map.size; i++) {
            const msgpack_object_kv *kv = &o->via.map.ptr[i];
            lua_pushlstring(L, kv->key.via.str.ptr, kv->key.via.str.size);
            push_msgpack(L, &kv->val);
            lua_rawset(L, -3);
        }
        return;
    default:        /* NIL, and nothing else gets past msgpack_is_plain */
        lua_rawgetp(L, LUA_REGISTRYINDEX, &key_json);
        lua_getfield(L, -1, "null");
        lua_remove(L, -2);
        return;
    }
}

struct argv_call {
    const struct tool_def *tool;
    const msgpack_object *args;
    const struct policy_call_view *view;
};

static int push_argv(lua_State *L, const void *ud)
{
    const struct argv_call *c = ud;
    push_engine_call(L, "argv", c->tool);
    push_msgpack(L, c->args);
    push_call_view(L, c->view);
    return 4;
}

bool policy_argv(struct policy *p, const struct tool_def *t, const msgpack_object *args,
                 const struct policy_call_view *v, char ***argv, size_t *argc, char **reason)
{
    lua_State *L = p->L;
    int top = lua_gettop(L);
    *reason = NULL;
    if (!msgpack_is_plain(args, 0)) {
        *reason = xstrdup("args: nested too deep or not JSON-like (string keys only)");
        return false;
    }
    struct argv_call c = {t, args, v};
    struct hook_entry e = {push_argv, &c, 2, 1u << 1, 1};
    char *err = NULL;
    enum policy_rc rc = policy_enter(p, &e, "argv", &err);
    bool ok = false;
    if (rc != POLICY_OK) {
        *reason = xasprintf("refused: the argv hook for %s failed%s", t->name,
                            rc == POLICY_NOMEM     ? " (memory cap exceeded)"
                            : rc == POLICY_TIMEOUT ? " (instruction budget exceeded)"
                                                   : "");
        free(err);
    } else if (!lua_istable(L, -2)) {
        const char *why = lua_tostring(L, -1);
        *reason = xasprintf("refused: %.300s", why ? why : "args rejected");
        (*reason)[strcspn(*reason, "\r\n")] = 0;
    } else {
        size_t n = lua_rawlen(L, -2);
        *argv = xcalloc(n + 1, sizeof **argv);
        *argc = n;
        for (size_t i = 0; i < n; i++) {
            lua_rawgeti(L, -2, (lua_Integer)i + 1);
            size_t len;
            const char *s = lua_tolstring(L, -1, &len);
            (*argv)[i] = s && strlen(s) == len ? xstrdup(s) : xstrdup("");
            lua_pop(L, 1);
        }
        ok = true;
    }
    lua_settop(L, top);
    return ok;
}

struct output_call {
    const struct tool_def *tool;
    const char *text;
    size_t len;
};

static int push_check_output(lua_State *L, const void *ud)
{
    const struct output_call *c = ud;
    push_engine_call(L, "check_output", c->tool);
    lua_pushlstring(L, c->text, c->len);
    lua_rawgetp(L, LUA_REGISTRYINDEX, &key_json);
    return 4;
}

bool policy_check_output(struct policy *p, const struct tool_def *t, const char *text,
                         size_t len, char **reason)
{
    if (!t->has_output_check)
        return true;
    lua_State *L = p->L;
    int top = lua_gettop(L);
    struct output_call c = {t, text, len};
    struct hook_entry e = {push_check_output, &c, 2, 1u << 1, 0};
    bool ok = false;
    char *err = NULL;
    if (policy_enter(p, &e, "output", &err) != POLICY_OK) {
        *reason = xasprintf("output check failed: %s", err ? err : "error");
    } else if (lua_toboolean(L, -2)) {
        ok = true;
    } else {
        const char *why = lua_tostring(L, -1);
        *reason = xasprintf("%.300s", why ? why : "output rejected");
    }
    free(err);
    lua_settop(L, top);
    return ok;
}

/* Names the core sets itself, and the loader's: never from a request. */
static const char *const env_reserved[] = {
    "SESSION_ID", "AGENT_ROOT", "HOME", "TMPDIR", "XDG_CACHE_HOME", "PATH", "STOCKADE_DEPTH",
    NULL,
};

static bool in_strv(char *const *v, const char *name)
{
    for (; v && *v; v++)
        if (strcmp(*v, name) == 0)
            return true;
    return false;
}

/* The refusal of an env entry (malloc'd), or NULL. */
static char *env_refusal(const struct policy *p, const struct tool_def *t, const char *entry)
{
    size_t n = strcspn(entry, "=");
    char name[256];
    if (n == 0 || n >= sizeof name || entry[n] != '=')
        return xstrdup("env: malformed entry");
    memcpy(name, entry, n);
    name[n] = 0;
    for (size_t i = 0; i < n; i++) {
        char ch = name[i];
        if (!((ch >= 'A' && ch <= 'Z') || (ch >= 'a' && ch <= 'z') || ch == '_' ||
              (i > 0 && ch >= '0' && ch <= '9')))
            return xasprintf("env key forbidden: '%.64s' is not a variable name", name);
    }
    if (in_strv((char *const *)env_reserved, name) || strncmp(name, "LD_", 3) == 0)
        return xasprintf("env key forbidden: %s is set by stockade only", name);
    /* deny wins over allow, whoever allows */
    for (char **g = p->env_deny; g && *g; g++)
        if (fnmatch(*g, name, 0) == 0)
            return xasprintf("env key forbidden: %s matches the policy's deny list (%s)", name, *g);
    if (!in_strv(p->env_allow, name) && !in_strv(t->env_allow, name))
        return xasprintf("env key forbidden: %s is not allowed for %s", name, t->name);
    return NULL;
}

bool policy_env_allowed(const struct policy *p, const struct tool_def *t, const char *entry,
                        char **why)
{
    *why = env_refusal(p, t, entry);
    return *why == NULL;
}

struct redact_chain_target {
    struct policy *policy;
    const struct tool_def *tool;
    const char *stream, *session_id;
};

static bool redact_chain(void *ud, const char *text, size_t len, enum redact_mode mode,
                         struct buf *out, size_t *consumed, int64_t *count)
{
    struct redact_chain_target *t = ud;
    return policy_redact(t->policy, t->tool, t->stream, t->session_id, text, len, mode, out,
                         consumed, count) == POLICY_OK;
}

void policy_redact_feed(struct policy *p, const struct tool_def *t, const char *stream,
                        const char *session_id, struct redact_stream *rs, const char *data,
                        size_t n, enum redact_mode mode, int64_t *count, redact_sink sink,
                        void *ud)
{
    struct redact_chain_target target = {p, t, stream, session_id};
    redact_stream_feed(t->redact, rs, data, n, mode, redact_chain, &target, count, sink, ud);
}

/* ---- describing a policy to another Lua state (gates, tests) ------------------------ */

/* Lines first..last of a source file, for comparing hooks by their text. */
static void push_source_lines(lua_State *to, const char *source, int first, int last)
{
    size_t len;
    char *err = NULL;
    char *text = source[0] == '@' ? slurp(source + 1, 1 << 20, &len, &err) : NULL;
    free(err);
    if (!text || first < 1 || last < first) {
        lua_pushstring(to, "");
        free(text);
        return;
    }
    const char *p = text, *start = NULL, *end = text + len;
    for (int line = 1; p < end; line++) {
        const char *nl = memchr(p, '\n', (size_t)(end - p));
        const char *stop = nl ? nl + 1 : end;
        if (line == first)
            start = p;
        if (line == last) {
            end = stop;
            break;
        }
        p = stop;
    }
    lua_pushlstring(to, start ? start : "", start ? (size_t)(end - start) : 0);
    free(text);
}

/* Copy the value at `idx` of `from` onto `to`: plain data as is, functions as
 * {kind = "function", where = "file:line", source = "..."}. */
static void copy_value(lua_State *from, int idx, lua_State *to, int depth)
{
    idx = lua_absindex(from, idx);
    luaL_checkstack(to, 6, "describe");
    switch (lua_type(from, idx)) {
    case LUA_TBOOLEAN: lua_pushboolean(to, lua_toboolean(from, idx)); return;
    case LUA_TNUMBER:
        if (lua_isinteger(from, idx))
            lua_pushinteger(to, lua_tointeger(from, idx));
        else
            lua_pushnumber(to, lua_tonumber(from, idx));
        return;
    case LUA_TSTRING: {
        size_t n;
        const char *s = lua_tolstring(from, idx, &n);
        lua_pushlstring(to, s, n);
        return;
    }
    case LUA_TFUNCTION: {
        lua_Debug ar;
        lua_pushvalue(from, idx);
        lua_getinfo(from, ">S", &ar);
        lua_createtable(to, 0, 3);
        lua_pushstring(to, "function");
        lua_setfield(to, -2, "kind");
        lua_pushfstring(to, "%s:%d", ar.short_src, ar.linedefined);
        lua_setfield(to, -2, "where");
        push_source_lines(to, ar.source, ar.linedefined, ar.lastlinedefined);
        lua_setfield(to, -2, "source");
        return;
    }
    case LUA_TTABLE:
        /* lua_checkstack reports a refused allocation instead of raising */
        if (depth > 24 || !lua_checkstack(from, 4)) {
            lua_pushstring(to, "(nested too deep)");
            return;
        }
        lua_newtable(to);
        lua_pushnil(from);
        while (lua_next(from, idx)) {
            int kt = lua_type(from, -2);
            /* keys the core adds for itself (_chain) are not the policy's */
            if ((kt == LUA_TSTRING && lua_tostring(from, -2)[0] != '_') || kt == LUA_TNUMBER) {
                copy_value(from, -2, to, depth + 1);
                copy_value(from, -1, to, depth + 1);
                lua_rawset(to, -3);
            }
            lua_pop(from, 1);
        }
        return;
    default:
        lua_pushnil(to);
    }
}

void policy_describe(struct policy *p, struct lua_State *to)
{
    lua_State *L = p->L;
    int top = lua_gettop(L);
    lua_rawgetp(L, LUA_REGISTRYINDEX, &key_policy_table);
    copy_value(L, -1, to, 0);
    lua_pushstring(to, p->path);
    lua_setfield(to, -2, "file");
    lua_pushstring(to, p->sha256);
    lua_setfield(to, -2, "sha256");
    lua_settop(L, top);
}
