#include "util.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "json.h"

enum log_level log_threshold = LOG_WARN;
bool log_json;
int log_fd = 2;
static const char *const level_names[] = {"error", "warn", "info", "debug"};

/* Rate limit: the same message again within a second is counted, not written; the
 * count goes out with the next different message (or the same one a second later). */
static char last_line[1024];
static int64_t last_at;
static unsigned last_repeats;

static void write_line(const char *p, size_t n)
{
    while (n > 0) {
        ssize_t w = write(log_fd, p, n);
        if (w <= 0)
            return;
        p += w;
        n -= (size_t)w;
    }
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
