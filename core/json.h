#ifndef STOCKADE_JSON_H
#define STOCKADE_JSON_H
/* A small JSON writer for results and logs. Bytes that are not valid UTF-8 (tools emit
 * anything) are written as U+FFFD, so the document is always valid JSON. */
#include "util.h"

void json_string(struct buf *b, const char *s, size_t len);
void json_cstr(struct buf *b, const char *s);      /* NULL -> null */

struct call_result;
void json_call_result(struct buf *b, const struct call_result *r, const char *session_id);

#endif
