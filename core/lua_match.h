#ifndef STOCKADE_LUA_MATCH_H
#define STOCKADE_LUA_MATCH_H
/* string.find/match/gmatch/gsub for policies, every matcher step charged to a budget;
 * string.rep and table.move charged by their count (see lua_match.c for why). */
#include <stdbool.h>
#include <stdint.h>

struct lua_State;

/* Called with the steps spent; raises (luaL_error) when the budget is gone. */
typedef void (*lua_match_charge_fn)(struct lua_State *L, int64_t steps);
void lua_match_set_charge(lua_match_charge_fn fn);

/* Replace the functions above in the state's global string and table libraries (before
 * any copy of them is made). */
void lua_match_install(struct lua_State *L);

/* check_pattern(p) for Lua: true, or nil and the error the matcher would raise. */
int lua_match_check(struct lua_State *L);

#endif
