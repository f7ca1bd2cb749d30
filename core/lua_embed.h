#ifndef STOCKADE_LUA_EMBED_H
#define STOCKADE_LUA_EMBED_H
#include <stddef.h>

/* The modules of lua/ and plugins/, compiled in (see contrib/embed-lua.sh): binary chunks,
 * precompiled at build time with their debug information, to load in mode "b" (their
 * chunk name is the one baked in: "=lua/X.lua", "=plugins/X.lua (built in)"). */
struct lua_embedded {
    const char *name;   /* "stockade" for lua/stockade.lua, "plugins.git" for plugins/git.lua */
    const char *file;   /* source path, for error messages */
    const char *chunk;
    size_t len;
};
extern const struct lua_embedded lua_embedded[];

#endif
