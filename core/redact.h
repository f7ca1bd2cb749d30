#ifndef STOCKADE_REDACT_H
#define STOCKADE_REDACT_H
/* Streaming redaction of a tool's output, one stream at a time. A redact_set is built
 * once per tool when a policy loads (it owns the tool's literal-prefix index); a
 * redact_stream is one stream's state while a call runs (it owns what is held back).
 * The redactors themselves run through a callback (the policy's Lua chain): this module
 * decides what text they must see and what may go out untouched. */
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "util.h"

enum redact_mode {
    REDACT_MORE,    /* more output may follow */
    REDACT_EOF,     /* the stream ended: everything goes, redacted */
    REDACT_QUIET,   /* the tool went quiet: release what cannot start a secret */
};

/* What the policy's chain returned for one region: redacted text appended to out, and
 * how many input bytes it covers. False: the chain failed (the region is withheld). */
typedef bool (*redact_chain_fn)(void *ud, const char *text, size_t len, enum redact_mode mode,
                                struct buf *out, size_t *consumed, int64_t *count);
typedef void (*redact_sink)(void *ud, const char *data, size_t n);

struct redact_set;

/* prefixes / iprefixes (NULL-terminated, taken over): literals that begin every match
 * of the chain's redactors (iprefixes: ASCII case-insensitive, lower-cased); window: the
 * chain's longest declared match; lua_always: some redactor has no literal prefix, so
 * every byte must go through the chain. */
struct redact_set *redact_set_new(char **prefixes, char **iprefixes, size_t window,
                                  bool lua_always);
void redact_set_free(struct redact_set *set);

struct redact_stream {
    struct buf carry;           /* read, not yet past redaction */
};

/* Bytes held back: output that may still be the start of a secret. */
size_t redact_stream_held(const struct redact_stream *rs);
void redact_stream_free(struct redact_stream *rs);

/* data (or, with REDACT_EOF, the end) goes in; redacted text comes out through sink, in
 * order; *count grows by the number of redactions. */
void redact_stream_feed(const struct redact_set *set, struct redact_stream *rs,
                        const char *data, size_t n, enum redact_mode mode,
                        redact_chain_fn chain, void *chain_ud, int64_t *count,
                        redact_sink sink, void *sink_ud);

#endif
