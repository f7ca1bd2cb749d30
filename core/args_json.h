#ifndef STOCKADE_ARGS_JSON_H
#define STOCKADE_ARGS_JSON_H
/* Structured args given as JSON on a command line (`stockade run --args`), packed as the
 * msgpack map the protocol carries, so they take the server's path. */
#include <msgpack.h>
#include <stdbool.h>

/* false and a one-line *err (malloc'd) when text is not a JSON object. */
bool args_from_json(const char *text, msgpack_sbuffer *out, char **err);

#endif
