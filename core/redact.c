#include "redact.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <hs.h>
#include <inttypes.h>
#include <limits.h>
#include <pcre2.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* ---- the regex stage: compiled rules ------------------------------------------------ */

#define OPEN_WIDTH_MAX 256      /* an opener is short: it is what begins a secret */
#define LOOKBEHIND 256          /* emitted bytes kept in view before what is held */
#define MATCH_LIMIT 10000000    /* PCRE2 backtracking steps for one resolution */

/* The work budget. MATCH_LIMIT bounds one attempt, not how many there are: text dense
 * with openers (`pwd=` x N) starts an attempt every few bytes, and a rule that scans to
 * the end of the run costs each of them the whole run, O(n^2) in a read that the loop
 * waits for. So a stream's resolving may cost at most BUDGET_NS_PER_BYTE of the
 * supervisor's CPU per byte it has read, plus BUDGET_START_NS, with BUDGET_MAX_NS saved up
 * at most (what one read can stall the loop); past it the stream fails closed like
 * limits.redact_hold. The default set costs a fraction of it on any input we know of
 * (tests/redact/test_dense_openers.py): the budget is for a policy's pathological regex,
 * which then costs its own call. CPU
 * time of the thread, not the wall clock: a loaded machine does not spend it. */
#define BUDGET_NS_PER_BYTE 1000
#define BUDGET_START_NS 100000000
#define BUDGET_MAX_NS 250000000
#define BUDGET_CHECK_EVERY 8    /* attempts between two looks at the clock */

struct redact_rule {
    char *name;
    char *replace;
    size_t replace_len;
    pcre2_code *re;
    int secret_group;           /* 0: the whole match */
    uint32_t lookbehind;        /* how far before its start the regex may look */
    /* probes made and full matches they saved (verdict_no_match), lately */
    uint32_t probes, saved, skipped;
};

/* One Vectorscan pattern: a rule's opener, or one fixed-width sequence of it. */
struct opener_pat {
    unsigned rule;
    unsigned width;             /* 0: of varying width, reported with its start (SOM) */
};

/* A remembered verdict on an opener in its surroundings (verdict_no_match). */
#define VERDICT_SLOTS 4096
#define VERDICT_KEY_MAX 58

enum { VERDICT_NONE, VERDICT_NOMATCH, VERDICT_MATCH_POSSIBLE };

struct verdict {
    uint32_t rule;
    uint8_t len, what;
    char key[VERDICT_KEY_MAX];
};

struct redact_rules {
    unsigned refs;
    size_t n;
    struct redact_rule *rule;
    size_t hold_max;
    size_t open_width;          /* the widest opener */
    hs_database_t *db;          /* every rule's opener, id = index in pat */
    struct opener_pat *pat;
    size_t npat;
    bool cached;                /* db was loaded from the cache */
    hs_scratch_t *scratch;      /* the loop is one thread: one scratch per database */
    pcre2_code *open_any;       /* the openers as one PCRE2 alternation (quiet tails) */
    bool *jitted;               /* rule i's re JIT-compiled ([n]: open_any's), on first use */
    struct verdict *verdicts;   /* VERDICT_SLOTS of them, filled as streams are resolved */
    pcre2_match_data *md;
    pcre2_match_context *mctx;
    pcre2_jit_stack *jit_stack;
};

/* options: PCRE2_ANCHORED for a rule (anchored when compiled: JIT does not take it at
 * match time), 0 for the openers' alternation. */
static pcre2_code *compile_pcre(const char *re, uint32_t options, char **why)
{
    int code;
    PCRE2_SIZE at;
    pcre2_code *c = pcre2_compile((PCRE2_SPTR)re, PCRE2_ZERO_TERMINATED, options, &code, &at,
                                  NULL);
    if (!c) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(code, msg, sizeof msg);
        *why = xasprintf("at offset %zu: %s", (size_t)at, (char *)msg);
        return NULL;
    }
    return c;
}

/* JIT-compiled when first used, not when the policy loads: most rules of a set never
 * fire in a call, and compiling them all is most of a policy's load once the openers'
 * database comes from the cache. No JIT (an exotic platform) is only slower. */
static void jit_once(pcre2_code *c, bool *done)
{
    if (!*done)
        (void)pcre2_jit_compile(c, PCRE2_JIT_COMPLETE | PCRE2_JIT_PARTIAL_HARD);
    *done = true;
}

void redact_rules_unref(struct redact_rules *r)
{
    if (!r || --r->refs > 0)
        return;
    for (size_t i = 0; i < r->n; i++) {
        free(r->rule[i].name);
        free(r->rule[i].replace);
        pcre2_code_free(r->rule[i].re);
    }
    free(r->rule);
    free(r->jitted);
    free(r->pat);
    free(r->verdicts);
    hs_free_scratch(r->scratch);
    hs_free_database(r->db);
    pcre2_code_free(r->open_any);
    pcre2_match_data_free(r->md);
    pcre2_match_context_free(r->mctx);
    pcre2_jit_stack_free(r->jit_stack);
    free(r);
}

bool redact_rules_cached(const struct redact_rules *r)
{
    return r && r->cached;
}

size_t redact_rules_count(const struct redact_rules *r)
{
    return r ? r->n : 0;
}

struct redact_rules *redact_rules_ref(struct redact_rules *r)
{
    if (r)
        r->refs++;
    return r;
}

/* ---- the compiled database, cached ------------------------------------------------------
 *
 * hs_compile_multi dominates a policy's load (most of `stockade run true`), so the
 * serialized database is kept in a file named by a hash of what it was compiled from
 * (every opener, the library's version and the platform; the patterns, flags and mode
 * follow from those, see CACHE_MAGIC). Loading
 * it is deserializing bytes into code the matcher trusts: a file anyone else could have
 * written is memory corruption waiting to happen. So a file is loaded only from a
 * directory that the effective uid owns and nobody else may write, itself owned by the
 * effective uid and writable by nobody else, opened without following a symlink, checked
 * on the open fds; its contents must repeat the whole key and carry a checksum. Anything
 * else, or any error, and the database is compiled as if there were no cache. */

/* the format, and how the patterns are derived from the openers (expand_opener): a
 * change to either changes this */
#define CACHE_MAGIC "stockade-hsdb 2\n"
#define CACHE_FILE_MAX (64u << 20)
#define CACHE_FILES_MAX 32          /* rule sets kept; the oldest goes first */

char *redact_cache_dir(void)
{
    const char *env = getenv("STOCKADE_CACHE_DIR");
    if (env && *env)
        return strcmp(env, "off") == 0 ? NULL : xstrdup(env);
    if (geteuid() == 0)
        return xstrdup("/var/cache/stockade");
    const char *xdg = getenv("XDG_CACHE_HOME");
    if (xdg && xdg[0] == '/')
        return xasprintf("%s/stockade", xdg);
    const char *home = getenv("HOME");
    if (home && home[0] == '/')
        return xasprintf("%s/.cache/stockade", home);
    return NULL;
}

static uint64_t fnv1a(uint64_t h, const void *data, size_t n)
{
    const unsigned char *p = data;
    for (size_t i = 0; i < n; i++)
        h = (h ^ p[i]) * 0x100000001b3ull;
    return h;
}
#define FNV_SEED 0xcbf29ce484222325ull

static void put_u64(struct buf *b, uint64_t v)
{
    buf_append(b, &v, sizeof v);
}

/* Each opener's width, as hs_expression_info gave it (kept in the cache with the
 * database: asking Vectorscan costs as much as loading it). */
struct opener_width {
    uint32_t min, max;
};

/* One rule set's place in the cache: the directory (-1: none, or not trusted), the file's
 * name, and the key, everything the database depends on as bytes, which the file must
 * begin with exactly. */
struct db_cache {
    char *dir;
    int dirfd;
    char name[32];
    struct buf key;
};

static void cache_open(struct db_cache *c, const char *const *pats, unsigned n)
{
    memset(c, 0, sizeof *c);
    c->dirfd = -1;
    if (!(c->dir = redact_cache_dir()))
        return;
    hs_platform_info_t plat;
    memset(&plat, 0, sizeof plat);
    if (hs_populate_platform(&plat) != HS_SUCCESS)
        memset(&plat, 0xff, sizeof plat);
    struct buf *key = &c->key;
    buf_append(key, CACHE_MAGIC, strlen(CACHE_MAGIC));
    buf_append(key, hs_version(), strlen(hs_version()) + 1);
    put_u64(key, plat.tune);
    put_u64(key, plat.cpu_features);
    put_u64(key, n);
    for (unsigned i = 0; i < n; i++)
        buf_append(key, pats[i], strlen(pats[i]) + 1);
    snprintf(c->name, sizeof c->name, "%016" PRIx64 ".hsdb", fnv1a(FNV_SEED, key->data, key->len));
}

static void cache_close(struct db_cache *c)
{
    close_quietly(&c->dirfd);
    free(c->dir);
    buf_free(&c->key);
}

/* A directory, regular file or fd that only the effective uid can have written. */
static bool owned_and_private(int fd, mode_t type)
{
    struct stat st;
    return fstat(fd, &st) == 0 && (st.st_mode & S_IFMT) == type && st.st_uid == geteuid() &&
           (st.st_mode & (S_IWGRP | S_IWOTH)) == 0;
}

/* The cache directory opened (made 0700 with its missing parents when create), or -1
 * when it is missing or not trusted. */
static int cache_dir_open(const char *dir, bool create)
{
    if (create) {
        char *path = xstrdup(dir);
        for (char *p = path + 1; *p; p++) {
            if (*p != '/')
                continue;
            *p = 0;
            (void)mkdir(path, 0700);
            *p = '/';
        }
        free(path);
        (void)mkdir(dir, 0700);
    }
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd >= 0 && !owned_and_private(fd, S_IFDIR))
        close_quietly(&fd);
    return fd;
}

/* The database and its openers' widths from the cache, or NULL. The file: the key, the
 * widths, the database's length, the database, a checksum of all before it. */
static hs_database_t *cache_load(struct db_cache *c, struct opener_width *widths, unsigned n)
{
    if (!c->dir || (c->dirfd = cache_dir_open(c->dir, false)) < 0)
        return NULL;
    int fd = openat(c->dirfd, c->name, O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0)
        return NULL;
    hs_database_t *db = NULL;
    char *data = NULL;
    size_t head = c->key.len + n * sizeof *widths + 8, len = 0, got = 0;
    struct stat st;
    if (!owned_and_private(fd, S_IFREG) || fstat(fd, &st) < 0 ||
        st.st_size > (off_t)CACHE_FILE_MAX || (size_t)st.st_size < head + 8)
        goto out;
    len = (size_t)st.st_size;
    data = xmalloc(len);
    while (got < len) {
        ssize_t k = read(fd, data + got, len - got);
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0)
            goto out;
        got += (size_t)k;
    }
    uint64_t db_len, sum;
    memcpy(&db_len, data + head - 8, sizeof db_len);
    memcpy(&sum, data + len - sizeof sum, sizeof sum);
    if (memcmp(data, c->key.data, c->key.len) != 0 || db_len != len - head - 8 ||
        fnv1a(FNV_SEED, data, len - sizeof sum) != sum)
        goto out;
    memcpy(widths, data + c->key.len, n * sizeof *widths);
    if (hs_deserialize_database(data + head, (size_t)db_len, &db) != HS_SUCCESS)
        db = NULL;
out:
    free(data);
    close(fd);
    return db;
}

/* Remove the least recently written cache file when there are more than CACHE_FILES_MAX. */
static void cache_trim(int dirfd)
{
    int fd = dup(dirfd);
    DIR *d = fd >= 0 ? fdopendir(fd) : NULL;
    if (!d) {
        if (fd >= 0)
            close(fd);
        return;
    }
    size_t files = 0;
    char oldest[NAME_MAX + 1] = "";
    struct timespec oldest_t = {0};
    struct dirent *e;
    while ((e = readdir(d))) {
        size_t l = strlen(e->d_name);
        struct stat st;
        if (l < 6 || strcmp(e->d_name + l - 5, ".hsdb") != 0 || e->d_name[0] == '.' ||
            fstatat(dirfd, e->d_name, &st, AT_SYMLINK_NOFOLLOW) < 0)
            continue;
        files++;
        if (!oldest[0] || st.st_mtim.tv_sec < oldest_t.tv_sec ||
            (st.st_mtim.tv_sec == oldest_t.tv_sec && st.st_mtim.tv_nsec < oldest_t.tv_nsec)) {
            snprintf(oldest, sizeof oldest, "%s", e->d_name);
            oldest_t = st.st_mtim;
        }
    }
    closedir(d);
    if (files > CACHE_FILES_MAX && oldest[0])
        (void)unlinkat(dirfd, oldest, 0);
}

/* Written to a temporary file, renamed into place: a reader sees a whole file or none. */
static void cache_store(struct db_cache *c, const struct opener_width *widths, unsigned n,
                        const hs_database_t *db)
{
    if (!c->dir || (c->dirfd < 0 && (c->dirfd = cache_dir_open(c->dir, true)) < 0))
        return;
    char *bytes = NULL;
    size_t len = 0;
    if (hs_serialize_database(db, &bytes, &len) != HS_SUCCESS)
        return;
    struct buf file = {0};
    buf_append(&file, c->key.data, c->key.len);
    buf_append(&file, widths, n * sizeof *widths);
    put_u64(&file, len);
    buf_append(&file, bytes, len);
    put_u64(&file, fnv1a(FNV_SEED, file.data, file.len));
    free(bytes);
    char tmp[64];
    snprintf(tmp, sizeof tmp, ".%ld.tmp", (long)getpid());
    int dirfd = c->dirfd;
    int fd = openat(dirfd, tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0 && errno == EEXIST && unlinkat(dirfd, tmp, 0) == 0)
        fd = openat(dirfd, tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    bool ok = fd >= 0 && write_all(fd, file.data, file.len) == 0;
    if (fd >= 0)
        ok = close(fd) == 0 && ok;
    if (ok && renameat(dirfd, tmp, dirfd, c->name) == 0)
        cache_trim(dirfd);
    else if (fd >= 0)
        (void)unlinkat(dirfd, tmp, 0);
    buf_free(&file);
}

/* ---- openers as fixed-width alternatives -------------------------------------------------
 *
 * Tracking where a match starts (HS_FLAG_SOM_LEFTMOST) is most of Vectorscan's time on
 * text dense with openers (minified JS: 1,870 MB/s for the fixed-width openers of the
 * default set, 250 MB/s for its 21 of varying width). An opener that is a small finite
 * set of fixed-width sequences (literals, escapes, classes, groups, alternations, ? and
 * {m,n}) is compiled as those sequences instead, each without SOM: a match starts its
 * width before its end. Every start of every sequence is reported (SOM reports only the
 * leftmost for each end): more candidates at worst, each still a place where the opener
 * matches. A large set (runs of classes: `[a-z]{1,20}`) stays with SOM: it compiles ten
 * times slower and scans no faster. */

#define EXPAND_MAX 64           /* sequences per opener; more, and it keeps SOM */
#define EXPAND_REPEAT_MAX 64    /* the widest {m,n} taken apart */

struct alts {
    char **s;                   /* each a regex of fixed width w[i] */
    unsigned *w;
    size_t n, cap;
};

static void alts_add(struct alts *a, char *s, unsigned w)
{
    if (a->n == a->cap) {
        a->cap = a->cap ? 2 * a->cap : 8;
        a->s = xrealloc(a->s, a->cap * sizeof *a->s);
        a->w = xrealloc(a->w, a->cap * sizeof *a->w);
    }
    a->s[a->n] = s;
    a->w[a->n++] = w;
}

static void alts_free(struct alts *a)
{
    for (size_t i = 0; i < a->n; i++)
        free(a->s[i]);
    free(a->s);
    free(a->w);
    *a = (struct alts){0};
}

/* a := a followed by b; false when that is more than EXPAND_MAX */
static bool alts_then(struct alts *a, const struct alts *b)
{
    if (a->n * b->n > EXPAND_MAX)
        return false;
    struct alts out = {0};
    for (size_t i = 0; i < a->n; i++)
        for (size_t j = 0; j < b->n; j++)
            alts_add(&out, xasprintf("%s%s", a->s[i], b->s[j]), a->w[i] + b->w[j]);
    alts_free(a);
    *a = out;
    return true;
}

static void alts_move(struct alts *into, struct alts *from)
{
    for (size_t i = 0; i < from->n; i++)
        alts_add(into, from->s[i], from->w[i]);
    from->n = 0;
    alts_free(from);
}

static bool expand_alt(const char **p, struct alts *out, int depth);

/* One atom: a group, a class, an escape, `.` or a literal byte. */
static bool expand_atom(const char **p, struct alts *out, int depth)
{
    const char *s = *p;
    if (*s == '(') {
        s++;
        if (s[0] == '?' && s[1] == ':')
            s += 2;
        else if (s[0] == '?')
            return false;       /* look-around, flags, named groups: kept as they are */
        if (depth > 8 || !expand_alt(&s, out, depth + 1) || *s != ')')
            return false;
        *p = s + 1;
        return true;
    }
    const char *end = s + 1;
    if (*s == '[') {
        if (*end == '^')
            end++;
        if (*end == ']')
            end++;
        for (; *end != ']'; end++) {
            if (!*end)
                return false;
            if (*end == '\\') {
                if (!*++end)
                    return false;
                continue;       /* an escaped byte, whatever it is */
            }
            if (end[0] == '[' && end[1] == ':') {
                const char *close = strstr(end + 2, ":]");
                if (!close)
                    return false;
                end = close + 1;
            }
        }
        end++;
    } else if (*s == '\\') {
        /* a one-byte escape: punctuation, or a class of single bytes */
        if (!*end || (((*end | 32) >= 'a' && (*end | 32) <= 'z') && !strchr("dDwWsShHvVnrtfe", *end)) ||
            (*end >= '0' && *end <= '9'))
            return false;
        end++;
    } else if (!*s || strchr("^$*+?{|)", *s)) {
        return false;
    }
    alts_add(out, xasprintf("%.*s", (int)(end - s), s), 1);
    *p = end;
    return true;
}

/* An atom's quantifier, if any: ?, {m} or {m,n} (lazy or possessive alike); false for
 * one that is unbounded or too wide. */
static bool expand_quantifier(const char **p, unsigned *min, unsigned *max)
{
    const char *s = *p;
    *min = *max = 1;
    if (*s == '?') {
        *min = 0;
        s++;
    } else if (*s == '{') {
        char *e;
        unsigned long m = strtoul(s + 1, &e, 10), n = m;
        if (e == s + 1)
            return false;
        if (*e == ',') {
            const char *f = e + 1;
            n = strtoul(f, &e, 10);
            if (e == f)
                return false;
        }
        if (*e != '}' || n < m || n > EXPAND_REPEAT_MAX)
            return false;
        *min = (unsigned)m, *max = (unsigned)n;
        s = e + 1;
    } else if (*s == '*' || *s == '+') {
        return false;
    } else {
        return true;
    }
    if (*s == '?' || *s == '+')
        s++;
    if (*s == '?' || *s == '*' || *s == '+' || *s == '{')
        return false;
    *p = s;
    return true;
}

/* A sequence of quantified atoms, up to `|`, `)` or the end. */
static bool expand_seq(const char **p, struct alts *out, int depth)
{
    alts_add(out, xstrdup(""), 0);
    while (**p && **p != '|' && **p != ')') {
        struct alts atom = {0}, rep = {0}, power = {0};
        unsigned min, max;
        bool ok = expand_atom(p, &atom, depth) && expand_quantifier(p, &min, &max);
        /* atom{min,max}: atom^k for k from min to max */
        if (ok)
            alts_add(&power, xstrdup(""), 0);
        for (unsigned k = 0; ok && k <= max; k++) {
            if (k >= min) {
                for (size_t i = 0; i < power.n && rep.n <= EXPAND_MAX; i++)
                    alts_add(&rep, xstrdup(power.s[i]), power.w[i]);
                ok = rep.n <= EXPAND_MAX;
            }
            if (ok && k < max)
                ok = alts_then(&power, &atom);
        }
        ok = ok && alts_then(out, &rep);
        alts_free(&atom), alts_free(&rep), alts_free(&power);
        if (!ok)
            return false;
    }
    return true;
}

static bool expand_alt(const char **p, struct alts *out, int depth)
{
    for (;;) {
        struct alts seq = {0};
        if (!expand_seq(p, &seq, depth) || out->n + seq.n > EXPAND_MAX) {
            alts_free(&seq);
            return false;
        }
        alts_move(out, &seq);
        if (**p != '|')
            return true;
        (*p)++;
    }
}

/* The opener as fixed-width sequences (each a Vectorscan pattern, `(?i)` carried over),
 * or false. */
static bool expand_opener(const char *open, struct alts *out)
{
    const char *p = open, *flags = "";
    if (strncmp(p, "(?i)", 4) == 0) {
        flags = "(?i)";
        p += 4;
    }
    struct alts a = {0};
    if (!expand_alt(&p, &a, 0) || *p) {
        alts_free(&a);
        return false;
    }
    for (size_t i = 0; i < a.n; i++) {
        if (a.w[i] == 0) {
            alts_free(&a);
            return false;
        }
        alts_add(out, xasprintf("%s%s", flags, a.s[i]), a.w[i]);
    }
    alts_free(&a);
    return true;
}

/* The openers' database (r->db) and widths (each rule's open_width, r->open_width), from
 * the cache or compiled. */
static bool compile_openers(struct redact_rules *r, const struct redact_rule_spec *specs,
                            char **err)
{
    size_t n = r->n;
    const char **opens = xcalloc(n, sizeof *opens);
    struct opener_width *widths = xcalloc(n, sizeof *widths);
    struct alts pats = {0};
    unsigned *flags = NULL, *ids = NULL;
    hs_compile_error_t *hs_err = NULL;
    bool ok = false, som = false;
    size_t i;
    for (i = 0; i < n; i++)
        opens[i] = specs[i].open;
    struct db_cache cache;
    cache_open(&cache, opens, (unsigned)n);
    if ((r->db = cache_load(&cache, widths, (unsigned)n)))
        r->cached = true;
    for (i = 0; !r->cached && i < n; i++) {
        hs_expr_info_t *info = NULL;
        if (hs_expression_info(opens[i], HS_FLAG_SOM_LEFTMOST, &info, &hs_err) != HS_SUCCESS)
            goto bad_open;
        widths[i] = (struct opener_width){info->min_width, info->max_width};
        free(info);
    }
    /* what Vectorscan gets (the same whether the database is compiled or loaded): an
     * opener of fixed width as it is, one of varying width as its sequences, or else
     * with SOM */
    r->pat = xcalloc(1, sizeof *r->pat);
    for (i = 0; i < n; i++) {
        if (widths[i].max > OPEN_WIDTH_MAX || widths[i].min == 0) {
            *err = xasprintf("redactor %s: open must match between 1 and %d bytes",
                             specs[i].name, OPEN_WIDTH_MAX);
            goto out;
        }
        if (widths[i].max > r->open_width)
            r->open_width = widths[i].max;
        size_t first = pats.n;
        struct alts seqs = {0};
        if (widths[i].min == widths[i].max)
            alts_add(&pats, xstrdup(opens[i]), widths[i].max);
        else if (expand_opener(opens[i], &seqs))
            alts_move(&pats, &seqs);
        else
            alts_add(&pats, xstrdup(opens[i]), 0);
        alts_free(&seqs);
        r->pat = xrealloc(r->pat, pats.n * sizeof *r->pat);
        for (size_t k = first; k < pats.n; k++)
            r->pat[k] = (struct opener_pat){(unsigned)i, pats.w[k]};
    }
    r->npat = pats.n;
    flags = xcalloc(pats.n, sizeof *flags);
    ids = xcalloc(pats.n, sizeof *ids);
    for (size_t k = 0; k < pats.n; k++) {
        flags[k] = pats.w[k] ? 0 : HS_FLAG_SOM_LEFTMOST;
        som = som || !pats.w[k];
        ids[k] = (unsigned)k;
    }
    if (!r->cached) {
        unsigned mode = HS_MODE_STREAM | (som ? HS_MODE_SOM_HORIZON_SMALL : 0);
        if (hs_compile_multi((const char *const *)pats.s, flags, ids, (unsigned)pats.n, mode,
                             NULL, &r->db, &hs_err) != HS_SUCCESS) {
            i = hs_err->expression >= 0 && (size_t)hs_err->expression < pats.n
                    ? r->pat[hs_err->expression].rule : n;
            goto bad_open;
        }
        cache_store(&cache, widths, (unsigned)n, r->db);
    }
    ok = true;
    goto out;
bad_open:
    *err = xasprintf("redactor %s: bad open (for Vectorscan): %s", i < n ? specs[i].name : "?",
                     hs_err ? hs_err->message : "?");
out:
    if (hs_err)
        hs_free_compile_error(hs_err);
    cache_close(&cache);
    alts_free(&pats);
    free(opens), free(flags), free(ids), free(widths);
    return ok;
}

struct redact_rules *redact_rules_compile(const struct redact_rule_spec *specs, size_t n,
                                          size_t hold_max, char **err)
{
    struct redact_rules *r = xcalloc(1, sizeof *r);
    r->refs = 1;
    r->n = n;
    r->rule = xcalloc(n ? n : 1, sizeof *r->rule);
    r->jitted = xcalloc(n + 1, sizeof *r->jitted);
    r->verdicts = xcalloc(VERDICT_SLOTS, sizeof *r->verdicts);
    r->hold_max = hold_max ? hold_max : REDACT_HOLD_DEFAULT;
    struct buf any = {0};
    char *why = NULL;
    size_t i;
    for (i = 0; i < n; i++) {
        const struct redact_rule_spec *sp = &specs[i];
        struct redact_rule *rule = &r->rule[i];
        rule->name = xstrdup(sp->name);
        rule->replace = xstrdup(sp->replace);
        rule->replace_len = strlen(sp->replace);
        if (!(rule->re = compile_pcre(sp->regex, PCRE2_ANCHORED, &why))) {
            *err = xasprintf("redactor %s: bad regex %s", sp->name, why);
            goto fail;
        }
        int g = pcre2_substring_number_from_name(rule->re, (PCRE2_SPTR) "secret");
        rule->secret_group = g > 0 ? g : 0;
        if (pcre2_pattern_info(rule->re, PCRE2_INFO_MAXLOOKBEHIND, &rule->lookbehind) != 0)
            rule->lookbehind = UINT32_MAX;      /* probed only from the stream's start */
        buf_printf(&any, "%s(?:%s)", i ? "|" : "", sp->open);
    }
    if (n) {
        if (!compile_openers(r, specs, err))
            goto fail;
        if (hs_alloc_scratch(r->db, &r->scratch) != HS_SUCCESS) {
            *err = xasprintf("redactors: cannot allocate the matcher's scratch space");
            goto fail;
        }
        buf_append(&any, "", 1);
        if (!(r->open_any = compile_pcre(any.data, 0, &why))) {
            *err = xasprintf("redactors: the openers do not compile for PCRE2: %s", why);
            goto fail;
        }
    }
    r->md = pcre2_match_data_create(32, NULL);
    r->mctx = pcre2_match_context_create(NULL);
    pcre2_set_match_limit(r->mctx, MATCH_LIMIT);
    r->jit_stack = pcre2_jit_stack_create(32 * 1024, 1024 * 1024, NULL);
    pcre2_jit_stack_assign(r->mctx, NULL, r->jit_stack);
    buf_free(&any);
    return r;

fail:
    free(why);
    buf_free(&any);
    redact_rules_unref(r);
    return NULL;
}

/* ---- the regex stage: one stream ----------------------------------------------------- */

struct candidate {
    uint64_t start;             /* stream offset where an opener begins */
    uint64_t open_end;          /* ... and where it ends (its shortest match) */
    unsigned rule;
};

struct redact_regex_stream {
    const struct redact_rules *rules;
    hs_stream_t *hs;
    /* text[0..done) went out already (kept as look-behind); text[done..) is held */
    struct buf text;
    size_t done;
    uint64_t base;              /* stream offset of text.data[0] */
    /* openers found, not yet resolved: cand[head..end), sorted by (start, rule) (the rule
     * order is priority); resolved ones leave from the head, so no memmove per pop */
    struct candidate *cand;
    size_t head, end, cand_cap;
    size_t head_checked;        /* text.len when the head candidate was last found growing */
    redact_found_fn found;      /* told of each secret (the gates); NULL while serving */
    void *found_ud;
    bool withheld;              /* failed closed: the rest of the stream is dropped */
    bool budget_open;           /* budget_ns was given its start */
    int64_t budget_ns;          /* CPU time resolving may still spend (the work budget) */
    struct buf out;             /* one read's output, handed on in one piece */
};

static int on_opener(unsigned id, unsigned long long from, unsigned long long to,
                     unsigned flags, void *ud)
{
    (void)flags;
    struct redact_regex_stream *x = ud;
    const struct opener_pat *pat = &x->rules->pat[id];
    if (pat->width)
        from = to - pat->width;
    id = pat->rule;
    if (from < x->base + x->done)
        return 0;       /* inside what was already redacted */
    /* reports come in order of their end: a new one almost always goes last */
    size_t k = x->end;
    while (k > x->head && (x->cand[k - 1].start > from ||
                           (x->cand[k - 1].start == from && x->cand[k - 1].rule > id)))
        k--;
    if (k > x->head && x->cand[k - 1].start == from && x->cand[k - 1].rule == id)
        return 0;       /* the same opener, a longer end */
    if (x->end == x->cand_cap) {
        if (x->head > 0) {
            memmove(x->cand, x->cand + x->head, (x->end - x->head) * sizeof *x->cand);
            k -= x->head;
            x->end -= x->head;
            x->head = 0;
        } else {
            x->cand_cap = x->cand_cap ? 2 * x->cand_cap : 16;
            x->cand = xrealloc(x->cand, x->cand_cap * sizeof *x->cand);
        }
    }
    memmove(x->cand + k + 1, x->cand + k, (x->end - k) * sizeof *x->cand);
    x->cand[k] = (struct candidate){from, to, id};
    x->end++;
    return 0;
}

static void drop_candidates_before(struct redact_regex_stream *x, uint64_t off)
{
    while (x->head < x->end && x->cand[x->head].start < off)
        x->head++;
}

static void emit_to(struct redact_regex_stream *x, size_t to, redact_sink sink, void *ud)
{
    if (to > x->done) {
        sink(ud, x->text.data + x->done, to - x->done);
        x->done = to;
    }
}

/* Where the earliest opener that the bytes after text[from] could still complete
 * begins (text.len when none): those bytes must stay held while the tool is quiet. */
static size_t partial_opener(const struct redact_rules *r, const struct redact_regex_stream *x,
                             size_t from)
{
    for (size_t at = from; at < x->text.len;) {
        jit_once(r->open_any, &r->jitted[r->n]);
        int rc = pcre2_match(r->open_any, (PCRE2_SPTR)x->text.data, x->text.len, at,
                             PCRE2_PARTIAL_HARD, r->md, r->mctx);
        if (rc == PCRE2_ERROR_NOMATCH)
            return x->text.len;
        if (rc == PCRE2_ERROR_PARTIAL || rc < 0)
            return rc == PCRE2_ERROR_PARTIAL ? pcre2_get_ovector_pointer(r->md)[0] : from;
        at = pcre2_get_ovector_pointer(r->md)[0] + 1;
    }
    return x->text.len;
}

static const char WITHHELD_HOLD[] =
    "[stockade: output withheld: a possible secret outgrew limits.redact_hold]\n";
static const char WITHHELD_WORK[] =
    "[stockade: output withheld: redacting it outgrew its work budget]\n";

static void fail_closed_with(struct redact_regex_stream *x, const char *msg, int64_t *count,
                             redact_sink sink, void *ud)
{
    sink(ud, msg, strlen(msg));
    x->withheld = true;
    x->done = x->text.len;
    x->head = x->end = 0;
    ++*count;
}

static void fail_closed(struct redact_regex_stream *x, int64_t *count, redact_sink sink, void *ud)
{
    fail_closed_with(x, WITHHELD_HOLD, count, sink, ud);
}

static int64_t clock_ns(clockid_t clock)
{
    struct timespec ts;
    if (clock_gettime(clock, &ts) < 0)
        return 0;
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* When one read's resolving began, by the thread's CPU clock (a syscall) and by the
 * monotonic one (no syscall: the vDSO). */
struct budget_clock {
    int64_t cpu0, wall0;
};

static struct budget_clock budget_clock_start(void)
{
    return (struct budget_clock){clock_ns(CLOCK_THREAD_CPUTIME_ID), clock_ns(CLOCK_MONOTONIC)};
}

/* Whether resolving is still within the stream's budget, looked at every
 * BUDGET_CHECK_EVERY attempts (*attempts counts them). The CPU time spent is at most the
 * wall time gone by, so the CPU clock is asked only once that is over the budget:
 * asking it every few attempts was most of the cost of text dense with openers. */
static bool within_budget(const struct redact_regex_stream *x, const struct budget_clock *t,
                          unsigned *attempts)
{
    if (++*attempts % BUDGET_CHECK_EVERY)
        return true;
    return clock_ns(CLOCK_MONOTONIC) - t->wall0 <= x->budget_ns ||
           clock_ns(CLOCK_THREAD_CPUTIME_ID) - t->cpu0 <= x->budget_ns;
}

/* ---- verdicts on openers, remembered ----
 *
 * On text dense with openers, each costs an anchored PCRE2 match (50-180 ns), and most
 * fail within a few bytes of where the opener ends (`token,`, `apiKey)`, `://cdn.`).
 * Output repeats itself (log lines, generated code, JSON keys), so the same opener in
 * the same surroundings comes back again and again. A probe decides it on those
 * surroundings alone: the rule's PCRE2 pattern on the text from its look-behind's reach
 * before the opener to one byte past it, with hard partial matching. NOMATCH there means
 * no match can start at the opener whatever follows (every look-behind has its bytes,
 * and a partial match would have said PARTIAL), so the verdict is a function of those
 * bytes: remembered, exactly (the bytes themselves are the key, not a hash of them), it
 * settles the next such opener without PCRE2. A probe that could not decide is
 * remembered too, so a repeated undecidable opener costs a full match and no probe. */

/* Where the verdict on these bytes would be: a hash of them, eight at a time (a byte
 * at a time was a tenth of the time on `git log -p`). */
static size_t verdict_slot(unsigned rule, const char *key, size_t len)
{
    uint64_t h = 0x9e3779b97f4a7c15ull * (rule + 1) ^ len;
    for (size_t i = 0; i < len; i += 8) {
        uint64_t w = 0;
        memcpy(&w, key + i, len - i < 8 ? len - i : 8);
        h = (h ^ w) * 0xff51afd7ed558ccdull;
        h ^= h >> 32;
    }
    return (size_t)(h >> 20) & (VERDICT_SLOTS - 1);
}

/* Whether the candidate at the head can start no match: from the remembered verdicts,
 * else from probes (remembered), on one byte past the opener and then on 16. False: it
 * needs a full match. */
static bool verdict_no_match(const struct redact_rules *r, const struct redact_regex_stream *x,
                             size_t start)
{
    static const size_t reach[] = {1, 16};
    const struct candidate *c = &x->cand[x->head];
    struct redact_rule *rule = &r->rule[c->rule];
    /* where the surroundings do not repeat (a diff, prose), looking them up and probing
     * only add to the full match (a probe costs about what a full match does): once a
     * rule's probes save fewer full matches than they are, one opener in 16 is looked
     * at, to notice when that changes */
    if (rule->probes >= 64 && rule->saved < rule->probes && ++rule->skipped % 16)
        return false;
    if (rule->lookbehind > start && x->base > 0)
        return false;           /* the look-behind's reach went out with the emitted text */
    size_t from = rule->lookbehind > start ? 0 : start - rule->lookbehind;
    for (size_t i = 0; i < sizeof reach / sizeof *reach; i++) {
        size_t to = (size_t)(c->open_end - x->base) + reach[i];
        if (to > x->text.len || to - from > VERDICT_KEY_MAX)
            return false;
        const char *key = x->text.data + from;
        uint8_t len = (uint8_t)(to - from);
        struct verdict *v = &r->verdicts[verdict_slot(c->rule, key, len)];
        if (v->what == VERDICT_NONE || v->rule != c->rule || v->len != len ||
            memcmp(v->key, key, len) != 0) {
            if (++rule->probes >= 4096)
                rule->probes /= 2, rule->saved /= 2;
            int rc = pcre2_match(rule->re, (PCRE2_SPTR)key, len, start - from,
                                 PCRE2_PARTIAL_HARD, r->md, r->mctx);
            v->rule = c->rule;
            v->len = len;
            v->what = rc == PCRE2_ERROR_NOMATCH ? VERDICT_NOMATCH : VERDICT_MATCH_POSSIBLE;
            memcpy(v->key, key, len);
        }
        if (v->what == VERDICT_NOMATCH) {
            rule->saved++;
            return true;
        }
    }
    return false;
}

/* Resolve openers in order, emitting what no match can cover, up to `safe` (text
 * offsets below it cannot begin an opener not yet reported). t: when this read's
 * resolving began (the work budget). */
static void resolve(const struct redact_rules *r, struct redact_regex_stream *x, size_t safe,
                    enum redact_mode mode, const struct budget_clock *t, int64_t *count,
                    redact_sink sink, void *ud)
{
    unsigned attempts = 0;
    while (!x->withheld) {
        if (!within_budget(x, t, &attempts)) {
            fail_closed_with(x, WITHHELD_WORK, count, sink, ud);
            break;
        }
        if (x->head == x->end || x->cand[x->head].start - x->base >= safe) {
            emit_to(x, safe, sink, ud);
            return;
        }
        size_t start = (size_t)(x->cand[x->head].start - x->base);
        const struct redact_rule *rule = &r->rule[x->cand[x->head].rule];
        emit_to(x, start, sink, ud);
        /* a growing match is tried again once the held text has grown by a quarter (or
         * at the end, or when the tool is quiet): linear, however small the reads */
        size_t held = x->text.len - start;
        if (mode == REDACT_MORE && x->head_checked &&
            x->text.len < x->head_checked + held / 4 + 4096)
            return;
        jit_once(rule->re, &r->jitted[x->cand[x->head].rule]);
        if (!x->head_checked && verdict_no_match(r, x, start)) {
            x->head++;
            continue;
        }
        int rc = pcre2_match(rule->re, (PCRE2_SPTR)x->text.data, x->text.len, start,
                             mode == REDACT_EOF ? 0 : PCRE2_PARTIAL_HARD,
                             r->md, r->mctx);
        if (rc == PCRE2_ERROR_PARTIAL) {
            if (held > r->hold_max)
                fail_closed(x, count, sink, ud);
            x->head_checked = x->text.len;
            return;
        }
        x->head_checked = 0;
        if (rc == PCRE2_ERROR_NOMATCH) {
            x->head++;
            continue;
        }
        if (rc < 0) {           /* over the match limit, out of JIT stack */
            fail_closed(x, count, sink, ud);
            return;
        }
        PCRE2_SIZE *ov = pcre2_get_ovector_pointer(r->md);
        size_t g = rc > rule->secret_group ? (size_t)rule->secret_group : 0;
        size_t a = ov[2 * g], b = ov[2 * g + 1];
        if (a == PCRE2_UNSET || b <= a || a < start) {
            /* an empty secret redacts nothing: the opener was not one */
            x->head++;
            continue;
        }
        emit_to(x, a, sink, ud);
        if (x->found)
            x->found(x->found_ud, (size_t)(x->base + a), (size_t)(x->base + b),
                     x->cand[x->head].rule);
        sink(ud, rule->replace, rule->replace_len);
        ++*count;
        x->done = b;
        drop_candidates_before(x, x->base + b);
    }
}

/* A stream's state; a stream Vectorscan cannot open fails closed on its first read. */
static struct redact_regex_stream *regex_stream_open(const struct redact_rules *r)
{
    struct redact_regex_stream *x = xcalloc(1, sizeof *x);
    x->rules = r;
    if (hs_open_stream(r->db, 0, &x->hs) != HS_SUCCESS)
        x->hs = NULL;
    return x;
}

/* Drop emitted text but LOOKBEHIND bytes before what is held. Done before a read, not
 * after one: what a read emitted is handed on from the text, uncopied (regex_feed). */
static void trim_emitted(struct redact_regex_stream *x)
{
    if (x->done <= LOOKBEHIND)
        return;
    size_t drop = x->done - LOOKBEHIND;
    memmove(x->text.data, x->text.data + drop, x->text.len - drop);
    x->text.len -= drop;
    x->done -= drop;
    x->base += drop;
    if (x->head_checked)
        x->head_checked -= drop;
}

/* One read through the regex stage: what no secret can still cover goes to sink. */
static void regex_step(const struct redact_rules *r, struct redact_regex_stream *x,
                       const char *data, size_t n, enum redact_mode mode, int64_t *count,
                       redact_sink sink, void *ud)
{
    if (x->withheld)
        return;
    if (!x->hs) {
        fail_closed(x, count, sink, ud);
        return;
    }
    /* the work budget grows with what was read (saved up to a bound) */
    if (!x->budget_open) {
        x->budget_open = true;
        x->budget_ns = BUDGET_START_NS;
    }
    x->budget_ns += (int64_t)(n < BUDGET_MAX_NS ? n : BUDGET_MAX_NS) * BUDGET_NS_PER_BYTE;
    if (x->budget_ns > BUDGET_MAX_NS)
        x->budget_ns = BUDGET_MAX_NS;
    trim_emitted(x);
    /* an opener not reported yet ends past the text, so begins in its last bytes */
    size_t tail = r->open_width > 1 ? r->open_width - 1 : 0;
    if (n) {
        if (hs_scan_stream(x->hs, data, (unsigned)n, 0, r->scratch, on_opener, x) != HS_SUCCESS) {
            fail_closed(x, count, sink, ud);
            return;
        }
        /* Nothing held and no opener in the read (most reads of most output): it goes
         * out as it came, but its last bytes, and only those and the look-behind are
         * kept. */
        if (mode == REDACT_MORE && x->done == x->text.len && x->head == x->end &&
            n >= tail + LOOKBEHIND) {
            size_t keep_from = n - tail - LOOKBEHIND;
            sink(ud, data, n - tail);
            x->base += x->text.len + keep_from;
            x->text.len = 0;
            buf_append(&x->text, data + keep_from, LOOKBEHIND + tail);
            x->done = LOOKBEHIND;
            x->head_checked = 0;
            return;
        }
        buf_append(&x->text, data, n);
    }
    size_t safe;
    if (mode == REDACT_EOF) {
        hs_close_stream(x->hs, r->scratch, on_opener, x);
        x->hs = NULL;
        safe = x->text.len;
    } else {
        safe = x->text.len > x->done + tail ? x->text.len - tail : x->done;
        if (mode == REDACT_QUIET)
            safe = partial_opener(r, x, safe);
    }
    struct budget_clock t = budget_clock_start();
    resolve(r, x, safe, mode, &t, count, sink, ud);
    x->budget_ns -= clock_ns(CLOCK_THREAD_CPUTIME_ID) - t.cpu0;
    if (mode == REDACT_EOF)
        x->withheld = true;     /* nothing more can come */
}

/* A read's output, handed on in one piece (a piece per gap between openers would cost
 * the sink per piece): the first piece is only pointed to, and copied only when a second
 * one follows. The pieces stay valid until the next read (trim_emitted). */
struct pieces {
    struct buf *buf;
    const char *first;
    size_t first_len;
};

static void pieces_add(void *ud, const char *data, size_t n)
{
    struct pieces *o = ud;
    if (n == 0)
        return;
    if (!o->first && o->buf->len == 0) {
        o->first = data;
        o->first_len = n;
        return;
    }
    if (o->first) {
        buf_append(o->buf, o->first, o->first_len);
        o->first = NULL;
    }
    buf_append(o->buf, data, n);
}

static void append_sink(void *ud, const char *data, size_t n)
{
    buf_append(ud, data, n);
}

/* The regex stage: data in, what no secret can still cover out through sink. */
static void regex_feed(const struct redact_rules *r, struct redact_stream *rs, const char *data,
                       size_t n, enum redact_mode mode, int64_t *count, redact_sink sink,
                       void *ud)
{
    if (!rs->rx)
        rs->rx = regex_stream_open(r);
    struct pieces out = {&rs->rx->out, NULL, 0};
    out.buf->len = 0;
    regex_step(r, rs->rx, data, n, mode, count, pieces_add, &out);
    if (out.first)
        sink(ud, out.first, out.first_len);
    else if (out.buf->len)
        sink(ud, out.buf->data, out.buf->len);
}

static void regex_stream_free(struct redact_regex_stream *x)
{
    if (!x)
        return;
    if (x->hs)
        hs_close_stream(x->hs, NULL, NULL, NULL);
    buf_free(&x->text);
    buf_free(&x->out);
    free(x->cand);
    free(x);
}

static void discard_sink(void *ud, const char *data, size_t n)
{
    (void)ud, (void)data, (void)n;
}

void redact_rules_find(const struct redact_rules *r, const char *text, size_t len,
                       redact_found_fn found, void *ud)
{
    if (!r || !r->n)
        return;
    struct redact_stream rs = {.rx = regex_stream_open(r)};
    rs.rx->found = found;
    rs.rx->found_ud = ud;
    int64_t count = 0;
    regex_feed(r, &rs, text, len, REDACT_EOF, &count, discard_sink, NULL);
    regex_stream_free(rs.rx);
}

/* ---- a tool's set: the regex stage, then the Lua stage --------------------------------- */

struct redact_prefix {
    const char *s;
    size_t len;
    bool ci;
};

struct redact_set {
    struct redact_rules *rules; /* NULL: no regex redactors */
    bool lua;                   /* the chain has Lua redactors */
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

struct redact_set *redact_set_new(struct redact_rules *rules, bool lua, char **prefixes,
                                  char **iprefixes, size_t window, bool lua_always)
{
    struct redact_set *set = xcalloc(1, sizeof *set);
    set->rules = rules && rules->n ? redact_rules_ref(rules) : NULL;
    set->lua = lua;
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
    redact_rules_unref(set->rules);
    strv_free(set->prefixes);
    strv_free(set->iprefixes);
    free(set->index);
    free(set);
}

char *redact_set_apply(const struct redact_set *set, const char *text, int64_t *count)
{
    struct buf out = {0};
    if (set && set->rules) {
        struct redact_stream rs = {0};
        regex_feed(set->rules, &rs, text, strlen(text), REDACT_EOF, count, append_sink, &out);
        redact_stream_free(&rs);
    } else {
        buf_append(&out, text, strlen(text));
    }
    buf_append(&out, "", 1);
    return out.data;
}

size_t redact_stream_held(const struct redact_stream *rs)
{
    return rs->carry.len + (rs->rx ? rs->rx->text.len - rs->rx->done : 0);
}

void redact_stream_free(struct redact_stream *rs)
{
    regex_stream_free(rs->rx);
    rs->rx = NULL;
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

/* The Lua stage: text before the first literal prefix skips Lua. */
static void lua_feed(const struct redact_set *set, struct redact_stream *rs, const char *data,
                     size_t n, enum redact_mode mode, redact_chain_fn chain, void *chain_ud,
                     int64_t *count, redact_sink sink, void *sink_ud)
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


void redact_stream_feed(const struct redact_set *set, struct redact_stream *rs,
                        const char *data, size_t n, enum redact_mode mode,
                        redact_chain_fn chain, void *chain_ud, int64_t *count,
                        redact_sink sink, void *sink_ud)
{
    if (!set->rules) {
        lua_feed(set, rs, data, n, mode, chain, chain_ud, count, sink, sink_ud);
        return;
    }
    if (!set->lua) {
        regex_feed(set->rules, rs, data, n, mode, count, sink, sink_ud);
        return;
    }
    struct buf mid = {0};
    regex_feed(set->rules, rs, data, n, mode, count, append_sink, &mid);
    lua_feed(set, rs, mid.data, mid.len, mode, chain, chain_ud, count, sink, sink_ud);
    buf_free(&mid);
}
