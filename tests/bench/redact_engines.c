/* Why the redaction engine is Vectorscan + PCRE2 (README, Redaction): the openers of a
 * secret set scanned in one pass, streaming, by Vectorscan (with and without
 * start-of-match) and by PCRE2-JIT as one alternation with hard partial matching.
 *
 *   cc -O2 -I/usr/include/hs tests/bench/redact_engines.c -o redact_engines -lhs -lpcre2-8
 *   ./redact_engines FILE CHUNK      # e.g. 64 MiB of base64, 65536
 */
#define PCRE2_CODE_UNIT_WIDTH 8
#include <hs.h>
#include <pcre2.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
static const char *pats[] = {"\\bAKIA",
                             "\\bASIA",
                             "\\bgh[pousr]_",
                             "\\bgithub_pat_",
                             "\\bglpat-",
                             "\\bgl(?:dt|ft|cbt|rt|soat|imt|ptt|agent)-",
                             "\\bxox[abeprs]-",
                             "\\bxapp-",
                             "\\bsk-",
                             "\\bsk_(?:live|test)_",
                             "\\brk_(?:live|test)_",
                             "\\beyJ",
                             "-----BEGIN ",
                             "\\bAIza",
                             "\\bya29\\.",
                             "\\bGOCSPX-",
                             "\\bhf_",
                             "\\bnpm_",
                             "\\bpypi-AgE",
                             "\\bATATT3",
                             "AccountKey=",
                             "(?i)pass(?:word|wd)?",
                             "(?i)secret",
                             "(?i)api[_-]?key",
                             "(?i)token",
                             "(?i)authorization",
                             "(?i)x-api-key",
                             "(?i)cookie",
                             "://",
                             "client-key-data",
                             "\"auth\"",
                             "(?i)aws_secret_access_key",
                             "(?i)aws_session_token",
                             "(?i)client_secret"};
#define N (sizeof pats / sizeof *pats)
static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}
static long hits;

static int on(unsigned id, unsigned long long f, unsigned long long t, unsigned fl, void *c) {
    (void)id, (void)f, (void)t, (void)fl, (void)c;
    hits++;
    return 0;
}
int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s FILE CHUNK\n", argv[0]);
        return 2;
    }
    FILE *f = fopen(argv[1], "rb");
    size_t cap = 64 << 20;
    char *buf = malloc(cap);
    size_t len = fread(buf, 1, cap, f);
    fclose(f);
    size_t chunk = atoi(argv[2]);
    for (int som = 0; som < 2; som++) {
        unsigned flags[N], ids[N];
        for (unsigned i = 0; i < N; i++) {
            flags[i] = som ? HS_FLAG_SOM_LEFTMOST : 0;
            ids[i] = i;
        }
        hs_database_t *db;
        hs_compile_error_t *ce;
        if (hs_compile_multi(pats, flags, ids, N,
                             HS_MODE_STREAM | (som ? HS_MODE_SOM_HORIZON_LARGE : 0), NULL, &db,
                             &ce)) {
            printf("err %s\n", ce->message);
            return 1;
        }
        size_t ss;
        hs_stream_size(db, &ss);
        hs_scratch_t *sc = NULL;
        hs_alloc_scratch(db, &sc);
        hs_stream_t *st;
        hs_open_stream(db, 0, &st);
        hits = 0;
        double t0 = now();
        for (size_t o = 0; o < len; o += chunk) {
            size_t n = len - o < chunk ? len - o : chunk;
            hs_scan_stream(st, buf + o, n, 0, sc, on, NULL);
        }
        hs_close_stream(st, sc, on, NULL);
        double dt = now() - t0;
        printf("hs som=%d stream_size=%zu: %.0f MB/s hits=%ld\n", som, ss, len / dt / 1e6, hits);
    }
    // pcre2: alternation, jit, scanning
    char alt[8192] = "";
    strcat(alt, "(?:");
    for (unsigned i = 0; i < N; i++) {
        if (i)
            strcat(alt, "|");
        const char *p = pats[i];
        if (!strncmp(p, "(?i)", 4)) {
            strcat(alt, "(?i:");
            strcat(alt, p + 4);
            strcat(alt, ")");
        } else
            strcat(alt, p);
    }
    strcat(alt, ")");
    int e;
    PCRE2_SIZE eo;
    pcre2_code *re = pcre2_compile((PCRE2_SPTR)alt, PCRE2_ZERO_TERMINATED, 0, &e, &eo, NULL);
    if (!re) {
        printf("pcre err %d at %zu\n", e, eo);
        return 1;
    }
    pcre2_jit_compile(re, PCRE2_JIT_COMPLETE | PCRE2_JIT_PARTIAL_HARD);
    pcre2_match_data *md = pcre2_match_data_create_from_pattern(re, NULL);
    hits = 0;
    double t0 = now();
    for (size_t o = 0; o < len; o += chunk) {
        size_t n = len - o < chunk ? len - o : chunk;
        size_t s = 0;
        while (s < n) {
            int rc = pcre2_match(re, (PCRE2_SPTR)buf + o, n, s, PCRE2_PARTIAL_HARD, md, NULL);
            if (rc < 0 && rc != PCRE2_ERROR_PARTIAL)
                break;
            PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
            hits++;
            if (rc == PCRE2_ERROR_PARTIAL)
                break;
            s = ov[1] > s ? ov[1] : s + 1;
        }
    }
    double dt = now() - t0;
    printf("pcre2 jit partial_hard: %.0f MB/s hits=%ld\n", len / dt / 1e6, hits);
    return 0;
}
