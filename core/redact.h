#ifndef STOCKADE_REDACT_H
#define STOCKADE_REDACT_H
/* Streaming redaction of a tool's output, one stream at a time. Two stages:
 *
 *  - regex redactors (declarative, `regex = ...`), all of a chain compiled into one
 *    Vectorscan database of their openers (how each secret begins), scanned once per
 *    read in streaming mode; each opener found is resolved by the rule's PCRE2 pattern,
 *    anchored where the opener starts and with the text before it in view, using hard
 *    partial matching: a match that may still grow is held back (and only that), up to
 *    limits.redact_hold bytes. Nothing depends on a window: a match of any length is
 *    found whatever the reads, and emitted bytes are never taken back.
 *  - Lua redactors (functions, Lua patterns), on what the first stage emits, through a
 *    callback into the policy (the slow path, with a literal-prefix prefilter).
 *
 * A redact_rules is compiled once per chain when a policy loads (shared by the tools with
 * the same chain); a redact_set is one tool's (rules + Lua prefix index); a
 * redact_stream is one stream's state while a call runs (it owns what is held back). */
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "util.h"

#define REDACT_HOLD_DEFAULT (1 << 20)   /* limits.redact_hold when the policy says none */

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
struct redact_rules;

/* A regex redactor as the policy declared it (engine.lua has checked the fields). */
struct redact_rule_spec {
    const char *name;       /* for messages */
    const char *regex;      /* PCRE2; the named group (?<secret>...), if any, is replaced */
    const char *open;       /* Vectorscan: matches how every match of regex begins */
    const char *replace;    /* literal text put in place of the secret */
};

/* Compile a chain's regex redactors; NULL and *err (malloc'd, one line) when one is not
 * usable. hold_max: the most a possibly-growing match may hold back (fail closed past it). */
struct redact_rules *redact_rules_compile(const struct redact_rule_spec *specs, size_t n,
                                          size_t hold_max, char **err);
struct redact_rules *redact_rules_ref(struct redact_rules *rules);
/* Whether the rules' Vectorscan database came from the cache (below) rather than a
 * compile. */
bool redact_rules_cached(const struct redact_rules *rules);
/* Where compiled databases are cached (malloc'd; NULL: no cache): $STOCKADE_CACHE_DIR
 * ("off": none), else /var/cache/stockade as root, else $XDG_CACHE_HOME/stockade, else
 * ~/.cache/stockade. A cache file is loaded only from a directory and a file both owned
 * by the effective uid and writable by nobody else; anything else is compiled. */
char *redact_cache_dir(void);
size_t redact_rules_count(const struct redact_rules *rules);
/* Every secret the rules redact in text (as one stream, to its end), in order: found is
 * called with the secret's offsets and the rule's index in specs. For the CI gates. */
typedef void (*redact_found_fn)(void *ud, size_t start, size_t end, unsigned rule);
void redact_rules_find(const struct redact_rules *rules, const char *text, size_t len,
                       redact_found_fn found, void *ud);
void redact_rules_unref(struct redact_rules *rules);

/* rules: the chain's regex stage (a reference is taken; NULL: none). lua: the chain has
 * Lua redactors; prefixes / iprefixes (NULL-terminated, taken over): literals that begin
 * every match of those (iprefixes: ASCII case-insensitive, lower-cased); window: their
 * longest declared match; lua_always: some has no literal prefix, so every byte must go
 * through Lua. */
struct redact_set *redact_set_new(struct redact_rules *rules, bool lua, char **prefixes,
                                  char **iprefixes, size_t window, bool lua_always);
void redact_set_free(struct redact_set *set);

struct redact_regex_stream;
struct redact_stream {
    struct redact_regex_stream *rx;     /* the regex stage's state, opened on first use */
    struct buf carry;                   /* past the regex stage, not yet past Lua */
};

/* text as a whole through the set's regex stage (a classify message, which the Lua
 * stage has seen already): a malloc'd string; *count grows by the redactions. */
char *redact_set_apply(const struct redact_set *set, const char *text, int64_t *count);

/* Bytes held back: output that may still be the start of a secret. */
size_t redact_stream_held(const struct redact_stream *rs);
void redact_stream_free(struct redact_stream *rs);

/* data (or, with REDACT_EOF, the end) goes in; redacted text comes out through sink, in
 * order; *count grows by the number of redactions. chain: the Lua stage. */
void redact_stream_feed(const struct redact_set *set, struct redact_stream *rs,
                        const char *data, size_t n, enum redact_mode mode,
                        redact_chain_fn chain, void *chain_ud, int64_t *count,
                        redact_sink sink, void *sink_ud);

#endif
