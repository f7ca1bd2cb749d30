#include "util.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

enum log_level log_threshold = LOG_WARN;
bool log_json;
int log_fd = 2;
static const char *const level_names[] = {"error", "warn", "info", "debug"};

/* Rate limit: the same message again within a second is counted, not written; the
 * count goes out with the next different message (or the same one a second later). */
static char last_line[1024];
static int64_t last_at;
static unsigned last_repeats;

int write_all(int fd, const void *data, size_t n)
{
    const char *p = data;
    while (n > 0) {
        ssize_t w = write(fd, p, n);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0) {
            if (w == 0)
                errno = EIO;
            return -1;
        }
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

uint64_t log_dropped;

/* A log that cannot take the line (ENOSPC, EFBIG past RLIMIT_FSIZE, EIO) costs the line,
 * counted, never the caller. */
static void write_line(const char *p, size_t n)
{
    /* under a file size limit, a line that would cross it is dropped whole rather than
     * cut (the kernel writes what fits) */
    struct rlimit rl;
    struct stat st;
    if (getrlimit(RLIMIT_FSIZE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY &&
        fstat(log_fd, &st) == 0 && S_ISREG(st.st_mode) &&
        (uint64_t)st.st_size + n > (uint64_t)rl.rlim_cur) {
        log_dropped++;
        return;
    }
    if (write_all(log_fd, p, n) < 0)
        log_dropped++;
}

void log_json_line(const char *level, const char *json_fields)
{
    struct buf b = {0};
    int64_t now = wall_ms();
    buf_printf(&b, "{\"ts\":%lld.%03lld,\"level\":\"%s\",%s}\n", (long long)(now / 1000),
               (long long)(now % 1000), level, json_fields);
    write_line(b.data, b.len);
    buf_free(&b);
}

static void vlog(enum log_level level, const char *fmt, va_list ap, int err)
{
    char line[1024];
    int n = vsnprintf(line, sizeof line, fmt, ap);
    if (n < 0)
        return;
    if (err)
        snprintf(line + strlen(line), sizeof line - strlen(line), ": %s", strerror(err));
    int64_t now = now_ms();
    if (strcmp(line, last_line) == 0 && now - last_at < 1000) {
        last_repeats++;
        return;
    }
    unsigned repeats = last_repeats;
    last_repeats = 0;
    last_at = now;
    snprintf(last_line, sizeof last_line, "%s", line);
    if (!log_json) {
        char text[1200];
        int m = snprintf(text, sizeof text, "stockade: %s: %s%s\n", level_names[level], line,
                         repeats ? " (and the previous message repeated)" : "");
        if (m > 0)
            write_line(text, (size_t)m < sizeof text ? (size_t)m : sizeof text - 1);
        return;
    }
    struct buf f = {0};
    buf_append_lit(&f, "\"event\":\"log\",\"msg\":");
    json_cstr(&f, line);
    if (repeats)
        buf_printf(&f, ",\"previous_repeated\":%u", repeats);
    log_json_line(level_names[level], f.data);
    buf_free(&f);
}

void log_msg(enum log_level level, const char *fmt, ...)
{
    if (level > log_threshold)
        return;
    va_list ap;
    va_start(ap, fmt);
    vlog(level, fmt, ap, 0);
    va_end(ap);
}

void die(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vlog(LOG_ERROR, fmt, ap, 0);
    va_end(ap);
    exit(125);
}

void die_errno(const char *fmt, ...)
{
    int err = errno;
    va_list ap;
    va_start(ap, fmt);
    vlog(LOG_ERROR, fmt, ap, err);
    va_end(ap);
    exit(125);
}

void *xmalloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    if (!p)
        abort();
    return p;
}

void *xcalloc(size_t n, size_t size)
{
    void *p = calloc(n ? n : 1, size ? size : 1);
    if (!p)
        abort();
    return p;
}

void *xrealloc(void *p, size_t n)
{
    p = realloc(p, n ? n : 1);
    if (!p)
        abort();
    return p;
}

char *xstrdup(const char *s)
{
    char *p = strdup(s);
    if (!p)
        abort();
    return p;
}

char *xasprintf(const char *fmt, ...)
{
    va_list ap;
    char *s;
    va_start(ap, fmt);
    int n = vasprintf(&s, fmt, ap);
    va_end(ap);
    if (n < 0)
        abort();
    return s;
}

void buf_append(struct buf *b, const void *p, size_t n)
{
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->len + n + 1)
            cap *= 2;
        b->data = xrealloc(b->data, cap);
        b->cap = cap;
    }
    if (n)
        memcpy(b->data + b->len, p, n);
    b->len += n;
    b->data[b->len] = 0;
}

void buf_printf(struct buf *b, const char *fmt, ...)
{
    char tmp[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (n < 0)
        return;
    if ((size_t)n < sizeof tmp) {
        buf_append(b, tmp, (size_t)n);
        return;
    }
    char *big = xmalloc((size_t)n + 1);
    va_start(ap, fmt);
    vsnprintf(big, (size_t)n + 1, fmt, ap);
    va_end(ap);
    buf_append(b, big, (size_t)n);
    free(big);
}

void buf_free(struct buf *b)
{
    free(b->data);
    b->data = NULL;
    b->len = b->cap = 0;
}

static int64_t clock_ms(clockid_t id)
{
    struct timespec ts;
    clock_gettime(id, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

int64_t now_ms(void) { return clock_ms(CLOCK_MONOTONIC); }
int64_t wall_ms(void) { return clock_ms(CLOCK_REALTIME); }

/* Parse a non-negative decimal with an optional fraction; returns the end pointer. */
static const char *parse_decimal(const char *s, double *out)
{
    if (*s < '0' || *s > '9')
        return NULL;
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || v < 0 || v > 1e15)
        return NULL;
    *out = v;
    return end;
}

int parse_duration_ms(const char *s, int64_t *out)
{
    static const struct { const char *unit; double ms; } units[] = {
        {"ms", 1}, {"s", 1000}, {"m", 60000}, {"h", 3600000},
    };
    double v;
    const char *unit = s ? parse_decimal(s, &v) : NULL;
    if (!unit)
        return -1;
    for (size_t i = 0; i < ARRAY_LEN(units); i++) {
        if (strcmp(unit, units[i].unit) == 0) {
            double ms = v * units[i].ms;
            if (ms > 9e15 || ms != ms)
                return -1;
            *out = (int64_t)(ms + 0.5);
            return 0;
        }
    }
    return -1;
}

int parse_size(const char *s, int64_t *out)
{
    static const struct { const char *unit; double mult; } units[] = {
        {"", 1}, {"B", 1},
        {"KiB", 1024.0}, {"MiB", 1048576.0}, {"GiB", 1073741824.0}, {"TiB", 1099511627776.0},
        {"KB", 1e3}, {"MB", 1e6}, {"GB", 1e9}, {"TB", 1e12},
    };
    double v;
    const char *unit = s ? parse_decimal(s, &v) : NULL;
    if (!unit)
        return -1;
    for (size_t i = 0; i < ARRAY_LEN(units); i++) {
        if (strcmp(unit, units[i].unit) == 0) {
            double n = v * units[i].mult;
            if (n > 9e18 || n != (double)(int64_t)n)
                return -1;
            *out = (int64_t)n;
            return 0;
        }
    }
    return -1;
}

int fd_set_nonblock(int fd)
{
    int fl = fcntl(fd, F_GETFL);
    return fl < 0 ? -1 : fcntl(fd, F_SETFL, fl | O_NONBLOCK);
}

int fd_set_cloexec(int fd)
{
    int fl = fcntl(fd, F_GETFD);
    return fl < 0 ? -1 : fcntl(fd, F_SETFD, fl | FD_CLOEXEC);
}

void close_quietly(int *fd)
{
    if (*fd >= 0) {
        int saved = errno;
        close(*fd);
        errno = saved;
        *fd = -1;
    }
}

/* ---- JSON strings -------------------------------------------------------------- */

/* Length of the valid UTF-8 sequence at s (1..4), or 0 when it is not one. */
static size_t utf8_seq(const unsigned char *s, size_t avail)
{
    unsigned char c = s[0];
    size_t n;
    unsigned min;
    unsigned cp;
    if (c < 0x80)
        return 1;
    if ((c & 0xe0) == 0xc0) { n = 2; cp = c & 0x1f; min = 0x80; }
    else if ((c & 0xf0) == 0xe0) { n = 3; cp = c & 0x0f; min = 0x800; }
    else if ((c & 0xf8) == 0xf0) { n = 4; cp = c & 0x07; min = 0x10000; }
    else return 0;
    if (avail < n)
        return 0;
    for (size_t i = 1; i < n; i++) {
        if ((s[i] & 0xc0) != 0x80)
            return 0;
        cp = (cp << 6) | (s[i] & 0x3f);
    }
    if (cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff))
        return 0;
    return n;
}

void json_string(struct buf *b, const char *str, size_t len)
{
    const unsigned char *s = (const unsigned char *)str;
    buf_append_lit(b, "\"");
    size_t i = 0;
    while (i < len) {
        unsigned char c = s[i];
        if (c == '"' || c == '\\') {
            char esc[2] = {'\\', (char)c};
            buf_append(b, esc, 2);
            i++;
        } else if (c < 0x20) {
            switch (c) {
            case '\n': buf_append_lit(b, "\\n"); break;
            case '\r': buf_append_lit(b, "\\r"); break;
            case '\t': buf_append_lit(b, "\\t"); break;
            default: buf_printf(b, "\\u%04x", c);
            }
            i++;
        } else {
            size_t n = utf8_seq(s + i, len - i);
            if (n == 0) {
                buf_append_lit(b, "\xef\xbf\xbd");   /* U+FFFD */
                i++;
            } else {
                buf_append(b, s + i, n);
                i += n;
            }
        }
    }
    buf_append_lit(b, "\"");
}

void json_cstr(struct buf *b, const char *s)
{
    if (!s)
        buf_append_lit(b, "null");
    else
        json_string(b, s, strlen(s));
}

void strv_free(char **v)
{
    for (char **p = v; p && *p; p++)
        free(*p);
    free(v);
}

size_t strv_len(char *const *v)
{
    size_t n = 0;
    while (v && v[n])
        n++;
    return n;
}

char **strv_dup(char *const *v)
{
    if (!v)
        return NULL;
    size_t n = strv_len(v);
    char **copy = xcalloc(n + 1, sizeof *copy);
    for (size_t i = 0; i < n; i++)
        copy[i] = xstrdup(v[i]);
    return copy;
}

void *xgrow(void *v, size_t *cap, size_t n, size_t size, size_t first)
{
    if (n < *cap)
        return v;
    *cap = *cap ? *cap * 2 : first;
    return xrealloc(v, *cap * size);
}
