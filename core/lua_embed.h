#ifndef STOCKADE_LUA_EMBED_H
#define STOCKADE_LUA_EMBED_H
#include <stddef.h>

/* The modules of lua/ and plugins/, compiled in (see contrib/embed-lua.sh). */
struct lua_embedded {
    const char *name;   /* "stockade" for lua/stockade.lua, "plugins.git" for plugins/git.lua */
    const char *file;   /* source path, for error messages */
    const char *src;
    size_t len;
};
extern const struct lua_embedded lua_embedded[];

#endif
