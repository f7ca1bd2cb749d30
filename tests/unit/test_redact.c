/* The regex stage of redaction (core/redact.c): exact at every read boundary, a hold
 * that fails closed at its limit, matches spanning many reads, and the cache of the
 * compiled matcher, which must refuse a file it did not write itself. */
#include "check.h"
#include "redact.h"

#include <dirent.h>
#include <fcntl.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static const struct redact_rule_spec specs[] = {
    {"token", "(?<![A-Za-z0-9_])tok_(?<secret>[A-Za-z0-9]{8,}+)", "tok_", "[TOKEN]"},
    {"key", "-----BEGIN K-----[A-Za-z0-9+/=\\n]*+-----END K-----", "-----BEGIN K", "[KEY]"},
    {"pass", "(?i)password[ \\t]*=[ \\t]*(?<secret>\\S{4,}+)", "(?i)pass(?:word|wd)?", "[PASS]"},
};
#define NSPECS (sizeof specs / sizeof *specs)

static struct redact_rules *compile(size_t hold)
{
    char *err = NULL;
    struct redact_rules *r = redact_rules_compile(specs, NSPECS, hold, &err);
    if (!r) {
        fprintf(stderr, "compile: %s\n", err);
        free(err);
    }
    return r;
}

/* A set of the rules (it holds the only reference to them), or NULL. */
static struct redact_set *new_set(size_t hold)
{
    struct redact_rules *r = compile(hold);
    CHECK(r != NULL);
    if (!r)
        return NULL;
    struct redact_set *set = redact_set_new(r, false, NULL, NULL, 0, false);
    redact_rules_unref(r);
    return set;
}

static void append(void *ud, const char *data, size_t n)
{
    buf_append(ud, data, n);
}

/* text through a fresh stream, cut at the offsets in cuts (ascending, ncuts of them);
 * the output as a NUL-terminated string in *out (freed by the caller). */
static int64_t run_cuts(const struct redact_set *set, const char *text, const size_t *cuts,
                        size_t ncuts, struct buf *out)
{
    struct redact_stream rs = {0};
    int64_t count = 0;
    size_t from = 0, len = strlen(text);
    out->len = 0;
    for (size_t k = 0; k <= ncuts; k++) {
        size_t to = k < ncuts ? cuts[k] : len;
        redact_stream_feed(set, &rs, text + from, to - from, REDACT_MORE, NULL, NULL, &count,
                           append, out);
        from = to;
    }
    redact_stream_feed(set, &rs, NULL, 0, REDACT_EOF, NULL, NULL, &count, append, out);
    redact_stream_free(&rs);
    buf_append(out, "", 1);
    return count;
}

static const char sample[] =
    "a tok_abcdefgh1 and xtok_notasecret, password = hunter22 then\n"
    "-----BEGIN K-----\nAAAA/BBBB+CCCC==\n-----END K----- tok_ZZZZZZZZZ";
static const char sample_out[] =
    "a tok_[TOKEN] and xtok_notasecret, password = [PASS] then\n"
    "[KEY] tok_[TOKEN]";

/* Every way of cutting the sample into two reads, and three, and one byte per read, gives
 * the same output as one read. */
static void test_every_boundary(void)
{
    struct redact_set *set = new_set(0);
    if (!set)
        return;
    struct buf out = {0};
    size_t len = strlen(sample);
    CHECK(run_cuts(set, sample, NULL, 0, &out) == 4);
    CHECK_STR(out.data, sample_out);
    int bad = 0;
    for (size_t i = 0; i <= len; i++) {
        for (size_t j = i; j <= len; j++) {
            size_t cuts[2] = {i, j};
            int64_t n = run_cuts(set, sample, cuts, 2, &out);
            if (n != 4 || strcmp(out.data, sample_out) != 0) {
                if (!bad++)
                    fprintf(stderr, "cut at %zu,%zu: %s\n", i, j, out.data);
            }
        }
    }
    CHECK(bad == 0);
    size_t *bytes = xcalloc(len, sizeof *bytes);
    for (size_t i = 0; i < len; i++)
        bytes[i] = i + 1;
    CHECK(run_cuts(set, sample, bytes, len - 1, &out) == 4);
    CHECK_STR(out.data, sample_out);
    free(bytes);
    buf_free(&out);
    redact_set_free(set);
}

/* Openers that repeat in the same surroundings are settled from remembered verdicts:
 * the verdicts never hide a secret that begins like the non-secrets before it. */
static void test_repeated_openers(void)
{
    struct redact_set *set = new_set(0);
    if (!set)
        return;
    struct buf text = {0}, want = {0}, out = {0};
    for (int i = 0; i < 300; i++) {
        /* not secrets: too short, or a token inside a word, or no value */
        buf_printf(&text, "tok_ab xtok_abcdefgh1 password; ");
        buf_printf(&want, "tok_ab xtok_abcdefgh1 password; ");
        if (i % 50 == 49) {
            buf_printf(&text, "tok_abcdefgh%d password = hunter%d ", i, i);
            buf_printf(&want, "tok_[TOKEN] password = [PASS] ");
        }
    }
    int64_t n = run_cuts(set, text.data, NULL, 0, &out);
    CHECK(n == 12);
    CHECK_STR(out.data, want.data);
    size_t cuts[64];
    for (size_t k = 0; k < 64; k++)
        cuts[k] = (k + 1) * (text.len / 65) + k % 7;
    n = run_cuts(set, text.data, cuts, 64, &out);
    CHECK(n == 12);
    CHECK_STR(out.data, want.data);
    buf_free(&text);
    buf_free(&want);
    buf_free(&out);
    redact_set_free(set);
}

/* One key of 256 KiB in reads of 1000 bytes: nothing of it leaves before its end comes,
 * the text around it does, whole. */
static void test_match_spanning_reads(void)
{
    struct redact_set *set = new_set(0);
    if (!set)
        return;
    struct buf text = {0}, out = {0};
    buf_printf(&text, "before ");
    buf_printf(&text, "-----BEGIN K-----\n");
    for (int i = 0; i < 256 * 16; i++)
        buf_printf(&text, "QUJDREVGR0hJSktMTU5PUFFSU1RVVldYWVo+/0123456789abcdefghijklmnopq\n");
    buf_printf(&text, "-----END K----- after");
    struct redact_stream rs = {0};
    int64_t count = 0;
    bool early = false;
    for (size_t off = 0; off < text.len; off += 1000) {
        size_t n = text.len - off < 1000 ? text.len - off : 1000;
        redact_stream_feed(set, &rs, text.data + off, n, REDACT_MORE, NULL, NULL, &count,
                           append, &out);
        if (out.len > strlen("before "))
            early = true;
    }
    CHECK(!early);
    CHECK(redact_stream_held(&rs) > 256 * 1024);
    redact_stream_feed(set, &rs, NULL, 0, REDACT_EOF, NULL, NULL, &count, append, &out);
    buf_append(&out, "", 1);
    CHECK_STR(out.data, "before [KEY] after");
    CHECK(count == 1);
    redact_stream_free(&rs);
    buf_free(&text);
    buf_free(&out);
    redact_set_free(set);
}

/* A match growing past the hold limit fails closed: what it covers never leaves, nor does
 * anything after it; a notice says the output was withheld. */
static void test_hold_limit(void)
{
    struct redact_set *set = new_set(4096);
    if (!set)
        return;
    struct buf out = {0};
    struct redact_stream rs = {0};
    int64_t count = 0;
    const char *head = "ok -----BEGIN K-----\n";
    redact_stream_feed(set, &rs, head, strlen(head), REDACT_MORE, NULL, NULL, &count, append,
                       &out);
    char body[512];
    memset(body, 'A', sizeof body);
    for (int i = 0; i < 64; i++)
        redact_stream_feed(set, &rs, body, sizeof body, REDACT_MORE, NULL, NULL, &count,
                           append, &out);
    const char *tail = "\n-----END K----- visible tok_abcdefgh1";
    redact_stream_feed(set, &rs, tail, strlen(tail), REDACT_MORE, NULL, NULL, &count, append,
                       &out);
    redact_stream_feed(set, &rs, NULL, 0, REDACT_EOF, NULL, NULL, &count, append, &out);
    buf_append(&out, "", 1);
    CHECK(strncmp(out.data, "ok ", 3) == 0);
    CHECK(strstr(out.data, "AAAA") == NULL);
    CHECK(strstr(out.data, "BEGIN K") == NULL);
    CHECK(strstr(out.data, "visible") == NULL);
    CHECK(strstr(out.data, "withheld") != NULL);
    CHECK(count >= 1);
    /* the held text stayed within the limit (plus one read) */
    redact_stream_free(&rs);
    buf_free(&out);
    redact_set_free(set);
}

/* ---- the cache of the compiled matcher ---- */

static char cache_dir[256];

/* The one cache file in the cache dir (malloc'd path), or NULL. */
static char *cache_file(void)
{
    DIR *d = opendir(cache_dir);
    if (!d)
        return NULL;
    char *path = NULL;
    struct dirent *e;
    while ((e = readdir(d))) {
        if (e->d_name[0] == '.')
            continue;
        free(path);
        path = xasprintf("%s/%s", cache_dir, e->d_name);
    }
    closedir(d);
    return path;
}

/* compile, and say whether the matcher came from the cache; the rules must work
 * either way */
static bool compiled_from_cache(void)
{
    struct redact_rules *r = compile(0);
    CHECK(r != NULL);
    if (!r)
        return false;
    bool cached = redact_rules_cached(r);
    struct redact_set *set = redact_set_new(r, false, NULL, NULL, 0, false);
    struct buf out = {0};
    CHECK(run_cuts(set, sample, NULL, 0, &out) == 4);
    CHECK_STR(out.data, sample_out);
    buf_free(&out);
    redact_set_free(set);
    redact_rules_unref(r);
    return cached;
}

static void flip_byte(const char *path, long at_from_end)
{
    int fd = open(path, O_RDWR);
    CHECK(fd >= 0);
    off_t end = lseek(fd, 0, SEEK_END);
    off_t at = end - at_from_end;
    unsigned char c = 0;
    CHECK(pread(fd, &c, 1, at) == 1);
    c ^= 0x5a;
    CHECK(pwrite(fd, &c, 1, at) == 1);
    close(fd);
}

static void test_cache(void)
{
    char tmpl[] = "/tmp/stockade-test-redact.XXXXXX";
    char *top = mkdtemp(tmpl);
    CHECK(top != NULL);
    if (!top)
        return;
    snprintf(cache_dir, sizeof cache_dir, "%s/sub/cache", top);
    setenv("STOCKADE_CACHE_DIR", cache_dir, 1);

    /* first: compiled and stored in a directory made 0700; then: loaded */
    CHECK(!compiled_from_cache());
    struct stat st;
    CHECK(stat(cache_dir, &st) == 0 && (st.st_mode & 0777) == 0700 && st.st_uid == geteuid());
    char *file = cache_file();
    CHECK(file != NULL);
    if (!file)
        goto out;
    CHECK(compiled_from_cache());

    /* corrupted content (in the middle of the database, and its last byte): compiled,
     * and the file rewritten */
    struct stat fst;
    CHECK(stat(file, &fst) == 0);
    flip_byte(file, fst.st_size / 2);
    CHECK(!compiled_from_cache());
    CHECK(compiled_from_cache());
    flip_byte(file, 1);
    CHECK(!compiled_from_cache());
    CHECK(compiled_from_cache());

    /* truncated */
    CHECK(truncate(file, fst.st_size - 100) == 0);
    CHECK(!compiled_from_cache());
    CHECK(compiled_from_cache());

    /* a file others may write */
    CHECK(chmod(file, 0666) == 0);
    CHECK(!compiled_from_cache());
    CHECK(compiled_from_cache());       /* replaced by one of its own */
    CHECK(stat(file, &fst) == 0 && (fst.st_mode & 022) == 0);

    /* a file someone else owns (root only can make one) */
    if (geteuid() == 0) {
        CHECK(chown(file, 65534, 65534) == 0);
        CHECK(!compiled_from_cache());
        CHECK(compiled_from_cache());
        CHECK(stat(file, &fst) == 0 && fst.st_uid == 0);
    } else {
        fprintf(stderr, "test_redact: not root: the foreign-owner case is skipped\n");
    }

    /* a symlink in its place, to a valid cache file */
    char *elsewhere = xasprintf("%s/valid", top);
    CHECK(rename(file, elsewhere) == 0);
    CHECK(symlink(elsewhere, file) == 0);
    CHECK(!compiled_from_cache());
    CHECK(lstat(file, &fst) == 0 && S_ISREG(fst.st_mode));   /* replaced, not followed */
    free(elsewhere);

    /* a directory others may write: neither read nor written */
    CHECK(compiled_from_cache());
    CHECK(chmod(cache_dir, 0777) == 0);
    CHECK(!compiled_from_cache());
    CHECK(chmod(cache_dir, 0700) == 0);
    CHECK(compiled_from_cache());
    if (geteuid() == 0) {
        CHECK(chown(cache_dir, 65534, 65534) == 0);
        CHECK(!compiled_from_cache());
        CHECK(chown(cache_dir, 0, 0) == 0);
    }

    /* a different rule set is a different file, and never mistaken for this one */
    static const struct redact_rule_spec other[] = {
        {"token", "(?<![A-Za-z0-9_])tok_(?<secret>[A-Za-z0-9]{9,}+)", "tok_", "[TOKEN]"},
    };
    char *err = NULL;
    struct redact_rules *r = redact_rules_compile(other, 1, 0, &err);
    CHECK(r != NULL && !redact_rules_cached(r));
    redact_rules_unref(r);
    free(err);

    /* switched off */
    setenv("STOCKADE_CACHE_DIR", "off", 1);
    CHECK(!compiled_from_cache());
out:
    free(file);
    unsetenv("STOCKADE_CACHE_DIR");
    check_remove_dir(top);
}

/* A rule whose every attempt scans to the end of the run (a lazy look-ahead with no
 * bound), on text that is nothing but its opener: n^2 work, each attempt far under the
 * match limit. The stream's work budget stops it: the output is withheld with the
 * documented line, counted, and the CPU it cost stays bounded (without the budget, 256 KiB
 * of it costs tens of seconds). Ordinary text dense with the other rules' openers never
 * comes near the budget. */
static void test_work_budget(void)
{
    static const struct redact_rule_spec slow[] = {
        {"slow", "k=(?=[^\\n]*?Z)(?<secret>\\w+)", "k=", "[SLOW]"},
    };
    char *err = NULL;
    struct redact_rules *r = redact_rules_compile(slow, 1, 0, &err);
    CHECK(r != NULL);
    if (!r) {
        free(err);
        return;
    }
    struct redact_set *set = redact_set_new(r, false, NULL, NULL, 0, false);
    redact_rules_unref(r);
    struct buf out = {0};
    struct redact_stream rs = {0};
    int64_t count = 0;
    static char chunk[16384];
    for (size_t i = 0; i < sizeof chunk; i += 2)
        memcpy(chunk + i, "k=", 2);
    clock_t c0 = clock();
    for (int i = 0; i < 16; i++)
        redact_stream_feed(set, &rs, chunk, sizeof chunk, REDACT_MORE, NULL, NULL, &count,
                           append, &out);
    redact_stream_feed(set, &rs, NULL, 0, REDACT_EOF, NULL, NULL, &count, append, &out);
    double cpu = (double)(clock() - c0) / CLOCKS_PER_SEC;
    buf_append(&out, "", 1);
    CHECK(strstr(out.data, "[stockade: output withheld: redacting it outgrew its work budget]\n") != NULL);
    CHECK(count >= 1);
    CHECK(cpu < 3.0);
    redact_stream_free(&rs);
    redact_set_free(set);

    /* 4 MiB of ordinary text dense with openers: redacted, never withheld */
    set = new_set(0);
    if (!set) {
        buf_free(&out);
        return;
    }
    memset(&rs, 0, sizeof rs);
    count = 0;
    out.len = 0;
    static const char line[] = "tok_abc password pass tok_ -----BEGIN x password=hunter22 ";
    size_t filled = 0;
    while (filled + sizeof line - 1 <= sizeof chunk) {
        memcpy(chunk + filled, line, sizeof line - 1);
        filled += sizeof line - 1;
    }
    for (int i = 0; i < 256; i++)
        redact_stream_feed(set, &rs, chunk, filled, REDACT_MORE, NULL, NULL, &count, append,
                           &out);
    redact_stream_feed(set, &rs, NULL, 0, REDACT_EOF, NULL, NULL, &count, append, &out);
    buf_append(&out, "", 1);
    CHECK(strstr(out.data, "output withheld") == NULL);
    CHECK(strstr(out.data, "hunter22") == NULL);
    CHECK(count > 0);
    redact_stream_free(&rs);
    redact_set_free(set);
    buf_free(&out);
}

int main(void)
{
    setenv("STOCKADE_CACHE_DIR", "off", 1);
    test_every_boundary();
    test_repeated_openers();
    test_match_spanning_reads();
    test_hold_limit();
    test_cache();
    test_work_budget();
    return check_report("test_redact");
}
