#include "redact.h"

#include <stdlib.h>
#include <string.h>
#include <strings.h>

struct redact_prefix {
    const char *s;
    size_t len;
    bool ci;
};

struct redact_set {
    bool lua_always;            /* a redactor without prefix, or a function */
    size_t window;
    char **prefixes;            /* NULL-terminated */
    char **iprefixes;           /* the same, ASCII case-insensitive, lower-cased */
    /* the prefixes indexed by their first byte (an i-prefix under both cases), so the
     * scan compares only where a prefix can begin */
    struct redact_prefix *index;
    uint16_t at[257];           /* entries for byte c: [at[c], at[c+1]) */
    uint8_t starts[256];        /* 1: some prefix starts with byte c */
};

static void strv_free_all(char **v)
{
    for (char **p = v; p && *p; p++)
        free(*p);
    free(v);
}

/* Counting sort of the prefixes by first byte (an i-prefix under both of its cases). */
static void index_prefixes(struct redact_set *set)
{
    size_t n = 0;
    for (char **p = set->prefixes; p && *p; p++)
        n++;
    for (char **p = set->iprefixes; p && *p; p++)
        n += 2;
    set->index = xcalloc(n + 1, sizeof *set->index);
    size_t count[256] = {0};
    for (int pass = 0; pass < 2; pass++) {
        size_t next[256];
        if (pass == 1) {
            size_t at = 0;
            for (int c = 0; c < 256; c++) {
                set->at[c] = (uint16_t)at;
                next[c] = at;
                at += count[c];
            }
            set->at[256] = (uint16_t)at;
            for (int c = 0; c < 256; c++)
                set->starts[c] = count[c] > 0;
        }
        for (int ci = 0; ci < 2; ci++) {
            for (char **p = ci ? set->iprefixes : set->prefixes; p && *p; p++) {
                unsigned char c = (unsigned char)(*p)[0];
                unsigned char cs[2] = {c, (unsigned char)(ci && c >= 'a' && c <= 'z' ? c - 32 : c)};
                for (int k = 0; k < (ci && cs[1] != cs[0] ? 2 : 1); k++) {
                    if (pass == 0)
                        count[cs[k]]++;
                    else
                        set->index[next[cs[k]]++] = (struct redact_prefix){*p, strlen(*p), ci};
                }
            }
        }
    }
}

struct redact_set *redact_set_new(char **prefixes, char **iprefixes, size_t window,
                                  bool lua_always)
{
    struct redact_set *set = xcalloc(1, sizeof *set);
    set->prefixes = prefixes;
    set->iprefixes = iprefixes;
    set->window = window;
    set->lua_always = lua_always;
    index_prefixes(set);
    return set;
}

void redact_set_free(struct redact_set *set)
{
    if (!set)
        return;
    strv_free_all(set->prefixes);
    strv_free_all(set->iprefixes);
    free(set->index);
    free(set);
}

size_t redact_stream_held(const struct redact_stream *rs)
{
    return rs->carry.len;
}

void redact_stream_free(struct redact_stream *rs)
{
    buf_free(&rs->carry);
}

/* The longest tail of text that is the beginning of some redactor's prefix. */
static size_t partial_prefix_tail(const struct redact_set *set, const char *text, size_t len)
{
    size_t hold = 0;
    for (int ci = 0; ci < 2; ci++) {
        for (char **p = ci ? set->iprefixes : set->prefixes; p && *p; p++) {
            size_t plen = strlen(*p);
            for (size_t k = plen - 1 < len ? plen - 1 : len; k > hold; k--) {
                const char *tail = text + len - k;
                if (ci ? strncasecmp(tail, *p, k) == 0 : memcmp(tail, *p, k) == 0) {
                    hold = k;
                    break;
                }
            }
        }
    }
    return hold;
}

/* Offset of the first place in text where some redactor's literal prefix occurs, or
 * len when none does. */
static size_t first_prefix(const struct redact_set *set, const char *text, size_t len)
{
    /* One pass: only where a byte can start some prefix are the prefixes compared.
     * Output without those bytes costs a table lookup per byte. */
    const unsigned char *u = (const unsigned char *)text;
    const uint16_t *at = set->at;
    const uint8_t *starts = set->starts;
    for (size_t i = 0; i < len; i++) {
        /* the common case, skipped four bytes a step: none of them starts a prefix */
        while (i + 4 <= len &&
               !(starts[u[i]] | starts[u[i + 1]] | starts[u[i + 2]] | starts[u[i + 3]]))
            i += 4;
        while (i < len && !starts[u[i]])
            i++;
        if (i == len)
            break;
        unsigned c = u[i];
        for (unsigned k = at[c]; k < at[c + 1]; k++) {
            const struct redact_prefix *rp = &set->index[k];
            if (i + rp->len > len)
                continue;
            if (rp->ci ? strncasecmp(text + i, rp->s, rp->len) == 0
                       : memcmp(text + i + 1, rp->s + 1, rp->len - 1) == 0)
                return i;
        }
    }
    return len;
}

void redact_stream_feed(const struct redact_set *set, struct redact_stream *rs,
                        const char *data, size_t n, enum redact_mode mode,
                        redact_chain_fn chain, void *chain_ud, int64_t *count,
                        redact_sink sink, void *sink_ud)
{
    struct buf *carry = &rs->carry;
    if (n)
        buf_append(carry, data, n);
    /* Redactors match from their literal prefix on: text before the first prefix goes
     * out without Lua, and Lua sees a region of two windows from each prefix. Only
     * function redactors (or prefix-less patterns) need Lua over everything. */
    size_t off = 0, region_max = 2 * (set->window ? set->window : 1);
    while (off < carry->len) {
        const char *text = carry->data + off;
        size_t len = carry->len - off;
        size_t region = len;
        enum redact_mode m = mode;
        if (!set->lua_always) {
            size_t occ = first_prefix(set, text, len);
            if (occ == len) {
                /* nothing to find, except a prefix that the next read completes */
                size_t hold = mode == REDACT_EOF ? 0 : partial_prefix_tail(set, text, len);
                sink(sink_ud, text, len - hold);
                off += len - hold;
                break;
            }
            if (occ > 0) {
                sink(sink_ud, text, occ);
                off += occ;
                continue;
            }
            if (len > region_max) {
                region = region_max;
                m = REDACT_MORE;
            }
        }
        struct buf out = {0};
        size_t used = 0;
        bool ok = chain(chain_ud, text, region, m, &out, &used, count);
        if (ok && used == 0 && region < len) {
            /* a match longer than its declared window: decide on the region as it is */
            ok = chain(chain_ud, text, region, REDACT_EOF, &out, &used, count);
        }
        if (!ok) {
            /* fail closed: what could not be checked does not leave */
            static const char withheld[] = "[stockade: output withheld: redaction failed]\n";
            sink(sink_ud, withheld, sizeof withheld - 1);
            used = region;
        } else if (out.len) {
            sink(sink_ud, out.data, out.len);
        }
        buf_free(&out);
        off += used;
        if (used == 0)
            break;      /* held: it may still be the start of a secret */
    }
    if (off == 0)
        return;
    memmove(carry->data, carry->data + off, carry->len - off);
    carry->len -= off;
}
