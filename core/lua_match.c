/* Lua's pattern matching with a step budget, for policies. The standard string.find,
 * match, gmatch and gsub run to completion inside one C call, outside the instruction
 * hook: an unanchored `s:find("[%w_]+%s*=")` over 32 KB of hostile argv is quadratic and
 * took seconds against a one-second hook budget. These are the same semantics (Lua 5.4's
 * manual, section 6.4.1), with every step of the matcher charged to the hook's budget,
 * so a pattern over budget raises like any other hook over budget. The same goes for
 * plain finds (naive search is O(n*m)), string.rep of empty strings and table.move,
 * whose loops do not allocate and so escape the memory cap as well. */
#include "lua_match.h"

#include <ctype.h>
#include <lauxlib.h>
#include <lua.h>
#include <string.h>

#define MAX_CAPTURES 32
#define MAX_DEPTH 200           /* recursion of the matcher, as in Lua */
#define CAP_UNFINISHED (-1)
#define CAP_POSITION (-2)
#define ESC '%'
#define SPECIALS "^$*+?.([%-"
#define FLUSH_STEPS 4096        /* charge the budget this often */

static lua_match_charge_fn charge_fn;

void lua_match_set_charge(lua_match_charge_fn fn)
{
    charge_fn = fn;
}

struct match_state {
    const char *src_init, *src_end, *p_end;
    lua_State *L;
    int depth;
    int level;
    int64_t steps;
    struct {
        const char *init;
        ptrdiff_t len;
    } capture[MAX_CAPTURES];
};

static void charge(lua_State *L, int64_t steps)
{
    if (charge_fn && steps > 0)
        charge_fn(L, steps);
}

static inline void step(struct match_state *ms, int64_t n)
{
    ms->steps += n;
    if (ms->steps >= FLUSH_STEPS) {
        int64_t s = ms->steps;
        ms->steps = 0;
        charge(ms->L, s);
    }
}

static const char *match(struct match_state *ms, const char *s, const char *p);

static int check_capture(struct match_state *ms, int l)
{
    l -= '1';
    if (l < 0 || l >= ms->level || ms->capture[l].len == CAP_UNFINISHED)
        return luaL_error(ms->L, "invalid capture index %%%d", l + 1);
    return l;
}

static int capture_to_close(struct match_state *ms)
{
    int level = ms->level;
    for (level--; level >= 0; level--)
        if (ms->capture[level].len == CAP_UNFINISHED)
            return level;
    return luaL_error(ms->L, "invalid pattern capture");
}

static const char *class_end(struct match_state *ms, const char *p)
{
    switch (*p++) {
    case ESC:
        if (p == ms->p_end)
            luaL_error(ms->L, "malformed pattern (ends with '%%')");
        return p + 1;
    case '[':
        if (*p == '^')
            p++;
        do {
            if (p == ms->p_end)
                luaL_error(ms->L, "malformed pattern (missing ']')");
            if (*(p++) == ESC && p < ms->p_end)
                p++;
        } while (*p != ']');
        return p + 1;
    default:
        return p;
    }
}

static int match_class(int c, int cl)
{
    int res;
    switch (tolower(cl)) {
    case 'a': res = isalpha(c); break;
    case 'c': res = iscntrl(c); break;
    case 'd': res = isdigit(c); break;
    case 'g': res = isgraph(c); break;
    case 'l': res = islower(c); break;
    case 'p': res = ispunct(c); break;
    case 's': res = isspace(c); break;
    case 'u': res = isupper(c); break;
    case 'w': res = isalnum(c); break;
    case 'x': res = isxdigit(c); break;
    case 'z': res = c == 0; break;      /* deprecated, still in Lua 5.4 */
    default: return cl == c;
    }
    return islower(cl) ? res : !res;
}

/* p at '[', ec at the closing ']' */
static int match_bracket_class(int c, const char *p, const char *ec)
{
    int sig = 1;
    if (*(p + 1) == '^') {
        sig = 0;
        p++;
    }
    while (++p < ec) {
        if (*p == ESC) {
            p++;
            if (match_class(c, (unsigned char)*p))
                return sig;
        } else if (*(p + 1) == '-' && p + 2 < ec) {
            p += 2;
            if ((unsigned char)*(p - 2) <= c && c <= (unsigned char)*p)
                return sig;
        } else if ((unsigned char)*p == c) {
            return sig;
        }
    }
    return !sig;
}

static int single_match(struct match_state *ms, const char *s, const char *p, const char *ep)
{
    if (s >= ms->src_end)
        return 0;
    int c = (unsigned char)*s;
    switch (*p) {
    case '.': return 1;
    case ESC: return match_class(c, (unsigned char)*(p + 1));
    case '[': return match_bracket_class(c, p, ep - 1);
    default: return (unsigned char)*p == c;
    }
}

static const char *match_balance(struct match_state *ms, const char *s, const char *p)
{
    if (p >= ms->p_end - 1)
        luaL_error(ms->L, "malformed pattern (missing arguments to '%%b')");
    if (s >= ms->src_end || *s != *p)
        return NULL;
    int b = *p, e = *(p + 1), cont = 1;
    while (++s < ms->src_end) {
        step(ms, 1);
        if (*s == e) {
            if (--cont == 0)
                return s + 1;
        } else if (*s == b) {
            cont++;
        }
    }
    return NULL;
}

static const char *max_expand(struct match_state *ms, const char *s, const char *p,
                              const char *ep)
{
    ptrdiff_t i = 0;
    while (single_match(ms, s + i, p, ep)) {
        i++;
        step(ms, 1);
    }
    while (i >= 0) {
        const char *res = match(ms, s + i, ep + 1);
        if (res)
            return res;
        i--;
    }
    return NULL;
}

static const char *min_expand(struct match_state *ms, const char *s, const char *p,
                              const char *ep)
{
    for (;;) {
        const char *res = match(ms, s, ep + 1);
        if (res)
            return res;
        if (!single_match(ms, s, p, ep))
            return NULL;
        s++;
    }
}

static const char *start_capture(struct match_state *ms, const char *s, const char *p,
                                 ptrdiff_t what)
{
    int level = ms->level;
    if (level >= MAX_CAPTURES)
        luaL_error(ms->L, "too many captures");
    ms->capture[level].init = s;
    ms->capture[level].len = what;
    ms->level = level + 1;
    const char *res = match(ms, s, p);
    if (!res)
        ms->level--;
    return res;
}

static const char *end_capture(struct match_state *ms, const char *s, const char *p)
{
    int l = capture_to_close(ms);
    ms->capture[l].len = s - ms->capture[l].init;
    const char *res = match(ms, s, p);
    if (!res)
        ms->capture[l].len = CAP_UNFINISHED;
    return res;
}

static const char *match_capture(struct match_state *ms, const char *s, int l)
{
    l = check_capture(ms, l);
    size_t len = (size_t)ms->capture[l].len;
    step(ms, (int64_t)len / 16);
    if ((size_t)(ms->src_end - s) >= len && memcmp(ms->capture[l].init, s, len) == 0)
        return s + len;
    return NULL;
}

static const char *match(struct match_state *ms, const char *s, const char *p)
{
    if (ms->depth-- == 0)
        luaL_error(ms->L, "pattern too complex");
init:
    step(ms, 1);
    if (p != ms->p_end) {
        switch (*p) {
        case '(':
            if (*(p + 1) == ')')
                s = start_capture(ms, s, p + 2, CAP_POSITION);
            else
                s = start_capture(ms, s, p + 1, CAP_UNFINISHED);
            break;
        case ')':
            s = end_capture(ms, s, p + 1);
            break;
        case '$':
            if (p + 1 != ms->p_end)
                goto dflt;
            s = s == ms->src_end ? s : NULL;
            break;
        case ESC:
            switch (*(p + 1)) {
            case 'b':
                s = match_balance(ms, s, p + 2);
                if (s) {
                    p += 4;
                    goto init;
                }
                break;
            case 'f': {
                p += 2;
                if (*p != '[')
                    luaL_error(ms->L, "missing '[' after '%%f' in pattern");
                const char *ep = class_end(ms, p);
                char previous = s == ms->src_init ? '\0' : *(s - 1);
                char current = s < ms->src_end ? *s : '\0';
                if (!match_bracket_class((unsigned char)previous, p, ep - 1) &&
                    match_bracket_class((unsigned char)current, p, ep - 1)) {
                    p = ep;
                    goto init;
                }
                s = NULL;
                break;
            }
            case '0': case '1': case '2': case '3': case '4':
            case '5': case '6': case '7': case '8': case '9':
                s = match_capture(ms, s, (unsigned char)*(p + 1));
                if (s) {
                    p += 2;
                    goto init;
                }
                break;
            default:
                goto dflt;
            }
            break;
        default:
        dflt: {
            const char *ep = class_end(ms, p);
            if (!single_match(ms, s, p, ep)) {
                if (*ep == '*' || *ep == '?' || *ep == '-') {
                    p = ep + 1;
                    goto init;
                }
                s = NULL;
            } else {
                switch (*ep) {
                case '?': {
                    const char *res = match(ms, s + 1, ep + 1);
                    if (res) {
                        s = res;
                    } else {
                        p = ep + 1;
                        goto init;
                    }
                    break;
                }
                case '+':
                    s = max_expand(ms, s + 1, p, ep);
                    break;
                case '*':
                    s = max_expand(ms, s, p, ep);
                    break;
                case '-':
                    s = min_expand(ms, s, p, ep);
                    break;
                default:
                    s++;
                    p = ep;
                    goto init;
                }
            }
            break;
        }
        }
    }
    ms->depth++;
    return s;
}

/* Plain search, charged by what it compares. */
static const char *mem_find(struct match_state *ms, const char *s1, size_t l1, const char *s2,
                            size_t l2)
{
    if (l2 == 0)
        return s1;
    if (l2 > l1)
        return NULL;
    const char *init;
    l2--;
    l1 = l1 - l2;
    while (l1 > 0 && (init = memchr(s1, *s2, l1)) != NULL) {
        step(ms, (int64_t)((init - s1) / 64) + 1 + (int64_t)l2 / 128);
        init++;
        if (memcmp(init, s2 + 1, l2) == 0)
            return init - 1;
        l1 -= (size_t)(init - s1);
        s1 = init;
    }
    step(ms, (int64_t)l1 / 64);
    return NULL;
}

static ptrdiff_t get_one_capture(struct match_state *ms, int i, const char *s, const char *e,
                                 const char **cap)
{
    if (i >= ms->level) {
        if (i != 0)
            luaL_error(ms->L, "invalid capture index %%%d", i + 1);
        *cap = s;
        return e - s;
    }
    ptrdiff_t capl = ms->capture[i].len;
    *cap = ms->capture[i].init;
    if (capl == CAP_UNFINISHED)
        luaL_error(ms->L, "unfinished capture");
    else if (capl == CAP_POSITION)
        lua_pushinteger(ms->L, (ms->capture[i].init - ms->src_init) + 1);
    return capl;
}

static void push_one_capture(struct match_state *ms, int i, const char *s, const char *e)
{
    const char *cap;
    ptrdiff_t l = get_one_capture(ms, i, s, e, &cap);
    if (l != CAP_POSITION)
        lua_pushlstring(ms->L, cap, (size_t)l);
}

static int push_captures(struct match_state *ms, const char *s, const char *e)
{
    int n = ms->level == 0 && s ? 1 : ms->level;
    luaL_checkstack(ms->L, n, "too many captures");
    for (int i = 0; i < n; i++)
        push_one_capture(ms, i, s, e);
    return n;
}

static bool no_specials(const char *p, size_t l)
{
    size_t upto = 0;
    do {
        if (strpbrk(p + upto, SPECIALS))
            return false;
        upto += strlen(p + upto) + 1;
    } while (upto <= l);
    return true;
}

static void prep_state(struct match_state *ms, lua_State *L, const char *s, size_t ls,
                       const char *p, size_t lp)
{
    ms->L = L;
    ms->depth = MAX_DEPTH;
    ms->src_init = s;
    ms->src_end = s + ls;
    ms->p_end = p + lp;
    ms->steps = 0;
}

static void reprep_state(struct match_state *ms)
{
    ms->level = 0;
}

static size_t pos_relative(lua_Integer pos, size_t len)
{
    if (pos > 0)
        return (size_t)pos;
    if (pos == 0)
        return 1;
    if (pos < -(lua_Integer)len)
        return 1;
    return len + (size_t)pos + 1;
}

static int find_aux(lua_State *L, bool find)
{
    size_t ls, lp;
    const char *s = luaL_checklstring(L, 1, &ls);
    const char *p = luaL_checklstring(L, 2, &lp);
    size_t init = pos_relative(luaL_optinteger(L, 3, 1), ls) - 1;
    struct match_state ms;
    if (init > ls) {
        lua_pushnil(L);
        return 1;
    }
    prep_state(&ms, L, s, ls, p, lp);
    if (find && (lua_toboolean(L, 4) || no_specials(p, lp))) {
        const char *s2 = mem_find(&ms, s + init, ls - init, p, lp);
        charge(L, ms.steps);
        if (s2) {
            lua_pushinteger(L, (s2 - s) + 1);
            lua_pushinteger(L, (lua_Integer)((size_t)(s2 - s) + lp));
            return 2;
        }
    } else {
        const char *s1 = s + init;
        bool anchor = *p == '^';
        if (anchor) {
            p++;
            lp--;
            ms.p_end = p + lp;
        }
        do {
            reprep_state(&ms);
            const char *e = match(&ms, s1, p);
            if (e) {
                charge(L, ms.steps);
                if (find) {
                    lua_pushinteger(L, (s1 - s) + 1);
                    lua_pushinteger(L, e - s);
                    return push_captures(&ms, NULL, 0) + 2;
                }
                return push_captures(&ms, s1, e);
            }
        } while (s1++ < ms.src_end && !anchor);
        charge(L, ms.steps);
    }
    lua_pushnil(L);
    return 1;
}

static int l_find(lua_State *L)
{
    return find_aux(L, true);
}

static int l_match(lua_State *L)
{
    return find_aux(L, false);
}

/* gmatch's iterator: upvalues s, p, the next position and the last match's end (0-based
 * offsets; -1 for none). */
static int gmatch_next(lua_State *L)
{
    size_t ls, lp;
    const char *s = lua_tolstring(L, lua_upvalueindex(1), &ls);
    const char *p = lua_tolstring(L, lua_upvalueindex(2), &lp);
    lua_Integer at = lua_tointeger(L, lua_upvalueindex(3));
    lua_Integer last = lua_tointeger(L, lua_upvalueindex(4));
    struct match_state ms;
    prep_state(&ms, L, s, ls, p, lp);
    for (const char *src = s + at; src <= ms.src_end; src++) {
        reprep_state(&ms);
        const char *e = match(&ms, src, p);
        if (e && (last < 0 || e != s + last)) {
            charge(L, ms.steps);
            lua_pushinteger(L, e - s);
            lua_replace(L, lua_upvalueindex(3));
            lua_pushinteger(L, e - s);
            lua_replace(L, lua_upvalueindex(4));
            return push_captures(&ms, src, e);
        }
    }
    charge(L, ms.steps);
    lua_pushinteger(L, (lua_Integer)ls + 1);
    lua_replace(L, lua_upvalueindex(3));
    return 0;
}

static int l_gmatch(lua_State *L)
{
    size_t ls;
    luaL_checklstring(L, 1, &ls);
    luaL_checkstring(L, 2);
    size_t init = pos_relative(luaL_optinteger(L, 3, 1), ls) - 1;
    if (init > ls)
        init = ls + 1;
    lua_settop(L, 2);
    lua_pushinteger(L, (lua_Integer)init);
    lua_pushinteger(L, -1);
    lua_pushcclosure(L, gmatch_next, 4);
    return 1;
}

static void add_s(struct match_state *ms, luaL_Buffer *b, const char *s, const char *e)
{
    size_t l;
    lua_State *L = ms->L;
    const char *news = lua_tolstring(L, 3, &l);
    const char *p;
    while ((p = memchr(news, ESC, l)) != NULL) {
        luaL_addlstring(b, news, (size_t)(p - news));
        p++;
        if (*p == ESC) {
            luaL_addchar(b, *p);
        } else if (*p == '0') {
            luaL_addlstring(b, s, (size_t)(e - s));
        } else if (isdigit((unsigned char)*p)) {
            const char *cap;
            ptrdiff_t resl = get_one_capture(ms, *p - '1', s, e, &cap);
            if (resl == CAP_POSITION)
                luaL_addvalue(b);
            else
                luaL_addlstring(b, cap, (size_t)resl);
        } else {
            luaL_error(L, "invalid use of '%c' in replacement string", ESC);
        }
        l -= (size_t)(p + 1 - news);
        news = p + 1;
    }
    luaL_addlstring(b, news, l);
}

static bool add_value(struct match_state *ms, luaL_Buffer *b, const char *s, const char *e,
                      int tr)
{
    lua_State *L = ms->L;
    switch (tr) {
    case LUA_TFUNCTION: {
        lua_pushvalue(L, 3);
        int n = push_captures(ms, s, e);
        lua_call(L, n, 1);
        break;
    }
    case LUA_TTABLE:
        push_one_capture(ms, 0, s, e);
        lua_gettable(L, 3);
        break;
    default:
        add_s(ms, b, s, e);
        return true;
    }
    if (!lua_toboolean(L, -1)) {
        lua_pop(L, 1);
        luaL_addlstring(b, s, (size_t)(e - s));
        return false;
    }
    if (!lua_isstring(L, -1))
        return luaL_error(L, "invalid replacement value (a %s)", luaL_typename(L, -1));
    luaL_addvalue(b);
    return true;
}

static int l_gsub(lua_State *L)
{
    size_t srcl, lp;
    const char *src = luaL_checklstring(L, 1, &srcl);
    const char *p = luaL_checklstring(L, 2, &lp);
    const char *lastmatch = NULL;
    int tr = lua_type(L, 3);
    lua_Integer max_s = luaL_optinteger(L, 4, (lua_Integer)srcl + 1);
    bool anchor = *p == '^';
    lua_Integer n = 0;
    bool changed = false;
    struct match_state ms;
    luaL_Buffer b;
    luaL_argexpected(L, tr == LUA_TNUMBER || tr == LUA_TSTRING || tr == LUA_TFUNCTION ||
                     tr == LUA_TTABLE, 3, "string/function/table");
    luaL_buffinit(L, &b);
    if (anchor) {
        p++;
        lp--;
    }
    prep_state(&ms, L, src, srcl, p, lp);
    while (n < max_s) {
        reprep_state(&ms);
        const char *e = match(&ms, src, p);
        if (e && e != lastmatch) {
            n++;
            changed = add_value(&ms, &b, src, e, tr) || changed;
            src = lastmatch = e;
        } else if (src < ms.src_end) {
            luaL_addchar(&b, *src++);
        } else {
            break;
        }
        if (anchor)
            break;
    }
    charge(L, ms.steps);
    if (!changed) {
        lua_pushvalue(L, 1);
    } else {
        luaL_addlstring(&b, src, (size_t)(ms.src_end - src));
        luaL_pushresult(&b);
    }
    lua_pushinteger(L, n);
    return 2;
}

/* string.rep and table.move: charged by their count, then the library's own. (A rep of
 * an empty string loops its count without allocating: the count is what costs.) */
static int l_rep(lua_State *L)
{
    size_t l, lsep;
    luaL_checklstring(L, 1, &l);
    lua_Integer n = luaL_checkinteger(L, 2);
    luaL_optlstring(L, 3, "", &lsep);
    if (n > 0)
        charge(L, n / 16 + 1);
    if (n <= 0 || l + lsep == 0) {
        lua_pushliteral(L, "");
        return 1;
    }
    lua_pushvalue(L, lua_upvalueindex(1));
    lua_insert(L, 1);
    lua_call(L, lua_gettop(L) - 1, 1);
    return 1;
}

static int l_move(lua_State *L)
{
    lua_Integer f = luaL_checkinteger(L, 2), e = luaL_checkinteger(L, 3);
    if (e >= f)
        charge(L, e - f >= INT64_MAX / 2 ? INT64_MAX / 2 : e - f + 1);
    lua_pushvalue(L, lua_upvalueindex(1));
    lua_insert(L, 1);
    lua_call(L, lua_gettop(L) - 1, LUA_MULTRET);
    return lua_gettop(L);
}

/* Replace fn in the table at idx by a C closure over the original. */
static void wrap(lua_State *L, int idx, const char *name, lua_CFunction fn)
{
    idx = lua_absindex(L, idx);
    lua_getfield(L, idx, name);
    lua_pushcclosure(L, fn, 1);
    lua_setfield(L, idx, name);
}

void lua_match_install(lua_State *L)
{
    lua_getglobal(L, "string");
    int s = lua_gettop(L);
    static const luaL_Reg fns[] = {
        {"find", l_find}, {"match", l_match}, {"gmatch", l_gmatch}, {"gsub", l_gsub},
        {NULL, NULL},
    };
    luaL_setfuncs(L, fns, 0);
    wrap(L, s, "rep", l_rep);
    lua_getglobal(L, "table");
    wrap(L, -1, "move", l_move);
    lua_pop(L, 2);
}

/* Walk a pattern as the matcher would, without a subject: every item, set, %b, %f,
 * capture and back-reference is checked. */
static int l_check(lua_State *L)
{
    size_t lp;
    const char *p = luaL_checklstring(L, 1, &lp);
    struct match_state ms;
    prep_state(&ms, L, "", 0, p, lp);
    const char *end = p + lp;
    int open[MAX_CAPTURES], nopen = 0, level = 0;
    bool closed[MAX_CAPTURES] = {false};
    if (p < end && *p == '^')
        p++;
    while (p < end) {
        switch (*p) {
        case '(':
            if (level >= MAX_CAPTURES)
                return luaL_error(L, "too many captures");
            if (p + 1 < end && p[1] == ')') {
                closed[level++] = true;
                p += 2;
                continue;
            }
            open[nopen++] = level++;
            p++;
            continue;
        case ')':
            if (nopen == 0)
                return luaL_error(L, "invalid pattern capture");
            closed[open[--nopen]] = true;
            p++;
            continue;
        case ESC:
            if (p + 1 < end && p[1] == 'b') {
                if (p + 3 >= end)
                    return luaL_error(L, "malformed pattern (missing arguments to '%%b')");
                p += 4;
                continue;
            }
            if (p + 1 < end && p[1] == 'f') {
                p += 2;
                if (p >= end || *p != '[')
                    return luaL_error(L, "missing '[' after '%%f' in pattern");
                p = class_end(&ms, p);
                continue;
            }
            if (p + 1 < end && isdigit((unsigned char)p[1])) {
                int l = p[1] - '1';
                if (l < 0 || l >= level || !closed[l])
                    return luaL_error(L, "invalid capture index %%%d", l + 1);
                p += 2;
                continue;
            }
            break;
        default:
            break;
        }
        p = class_end(&ms, p);
        if (p < end && (*p == '*' || *p == '+' || *p == '-' || *p == '?'))
            p++;
    }
    if (nopen > 0)
        return luaL_error(L, "unfinished capture");
    lua_pushboolean(L, 1);
    return 1;
}

int lua_match_check(lua_State *L)
{
    lua_pushcfunction(L, l_check);
    lua_insert(L, 1);
    if (lua_pcall(L, lua_gettop(L) - 1, 1, 0) != LUA_OK) {
        lua_pushnil(L);
        lua_insert(L, -2);
        return 2;
    }
    return 1;
}
