#ifndef STOCKADE_LUA_EMBED_H
#define STOCKADE_LUA_EMBED_H
#include <stddef.h>

/* The modules of lua/, compiled in (see contrib/embed-lua.sh). */
struct lua_embedded {
    const char *name;   /* module name: "stockade" for lua/stockade.lua */
    const char *file;   /* source path, for error messages */
    const char *src;
    size_t len;
};
extern const struct lua_embedded lua_embedded[];

#endif
