#ifndef STOCKADE_UTIL_H
#define STOCKADE_UTIL_H
/* Small shared vocabulary: dying at start-up, logging, allocation that never returns NULL,
 * growable byte buffers and arrays, JSON strings, monotonic time, and the strict
 * duration/size parsers. The base layer: it includes no other header of the core. */
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define ARRAY_LEN(a) (sizeof(a) / sizeof((a)[0]))

enum log_level { LOG_ERROR, LOG_WARN, LOG_INFO, LOG_DEBUG };
extern enum log_level log_threshold;
extern bool log_json;           /* JSON lines (serve), or "stockade: level: text" */
extern int log_fd;              /* stderr, or --log FILE */
extern uint64_t log_dropped;    /* lines the log could not take (full, too big) */
/* One JSON-lines record: {"ts":...,"level":...,<fields>} where fields is already JSON
 * (`"k":v,...`). */
void log_json_line(const char *level, const char *json_fields);

/* die() is for start-up and usage errors only: at run time a failure is answered. */
_Noreturn void die(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
_Noreturn void die_errno(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void log_msg(enum log_level level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
#define LOG_E(...) log_msg(LOG_ERROR, __VA_ARGS__)
#define LOG_W(...) log_msg(LOG_WARN, __VA_ARGS__)
#define LOG_I(...) log_msg(LOG_INFO, __VA_ARGS__)
#define LOG_D(...) log_msg(LOG_DEBUG, __VA_ARGS__)

void *xmalloc(size_t n);
void *xcalloc(size_t n, size_t size);
void *xrealloc(void *p, size_t n);
char *xstrdup(const char *s);
char *xasprintf(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* Room for element n of an array of *cap elements of `size` bytes: doubles *cap when
 * full (to `first` when empty); returns the array, moved or not. */
void *xgrow(void *v, size_t *cap, size_t n, size_t size, size_t first);
/* Free a NULL-terminated array of strings and the array; NULL is fine. */
void strv_free(char **v);
size_t strv_len(char *const *v);            /* 0 for NULL */
char **strv_dup(char *const *v);            /* NULL for NULL */

/* A growable byte buffer; `data` is always NUL-terminated for convenience. */
struct buf {
    char *data;
    size_t len, cap;
};
void buf_append(struct buf *b, const void *p, size_t n);
void buf_printf(struct buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void buf_free(struct buf *b);
/* A JSON string; bytes that are not valid UTF-8 (tools emit anything) are written as
 * U+FFFD, so the document is always valid JSON. */
void json_string(struct buf *b, const char *s, size_t len);
void json_cstr(struct buf *b, const char *s);      /* NULL -> null */
/* Append a string literal (its length computed by the compiler, not by hand). */
#define buf_append_lit(b, lit) buf_append((b), "" lit, sizeof(lit) - 1)

int64_t now_ms(void);           /* CLOCK_MONOTONIC */
int64_t wall_ms(void);          /* CLOCK_REALTIME, for timestamps sent to clients */

/* "250ms", "30s", "10m", "2h" -> milliseconds; a bare number is refused (units are
 * required so that "30" is never read as 30 ms by one person and 30 s by another). */
int parse_duration_ms(const char *s, int64_t *out);
/* "512", "64KiB", "1MiB", "1GiB" (also KB/MB/GB as powers of 1000) -> bytes. */
int parse_size(const char *s, int64_t *out);

/* Write all of it, through EINTR and short writes. 0, or -1 with errno. */
int write_all(int fd, const void *data, size_t n);
int fd_set_nonblock(int fd);
int fd_set_cloexec(int fd);
void close_quietly(int *fd);    /* close and set to -1; no-op on -1 */

#endif
