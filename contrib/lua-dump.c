/* Build-time helper (contrib/embed-lua.sh): compile one Lua file to a binary chunk with
 * the Lua the binary links, so that the embedded modules are loaded, not parsed, at each
 * start. Debug information is kept: errors and tracebacks name the file and line.
 *
 *   lua-dump CHUNKNAME FILE > OUT      (CHUNKNAME as luaL_loadbuffer takes it: "=lua/x.lua") */
#include <lauxlib.h>
#include <lua.h>
#include <stdio.h>
#include <stdlib.h>

static int write_out(lua_State *L, const void *p, size_t n, void *ud)
{
    (void)L;
    return fwrite(p, 1, n, ud) == n ? 0 : 1;
}

int main(int argc, char **argv)
{
    if (argc != 3) {
        fprintf(stderr, "usage: lua-dump CHUNKNAME FILE\n");
        return 2;
    }
    FILE *f = fopen(argv[2], "rb");
    if (!f) {
        perror(argv[2]);
        return 1;
    }
    size_t cap = 1 << 16, len = 0;
    char *src = malloc(cap);
    size_t n;
    while (src && (n = fread(src + len, 1, cap - len, f)) > 0)
        if ((len += n) == cap)
            src = realloc(src, cap *= 2);
    fclose(f);
    lua_State *L = luaL_newstate();
    if (!src || !L)
        return 1;
    if (luaL_loadbufferx(L, src, len, argv[1], "t") != LUA_OK) {
        fprintf(stderr, "%s\n", lua_tostring(L, -1));
        return 1;
    }
    if (lua_dump(L, write_out, stdout, 0) != 0 || fflush(stdout) != 0) {
        fprintf(stderr, "lua-dump: cannot write the chunk\n");
        return 1;
    }
    lua_close(L);
    free(src);
    return 0;
}
