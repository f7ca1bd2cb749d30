#include "json.h"
#include "call.h"

#include <string.h>

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

void json_call_result(struct buf *b, const struct call_result *r, const char *session_id)
{
    buf_append_lit(b, "{\"class\":");
    json_cstr(b, call_class_name(r->class));
    buf_printf(b, ",\"retryable\":%s,\"message\":", r->retryable ? "true" : "false");
    json_cstr(b, r->message);
    buf_append_lit(b, ",\"layer\":");
    json_cstr(b, r->layer);
    if (r->has_exit_code)
        buf_printf(b, ",\"exit_code\":%d", r->exit_code);
    else
        buf_printf(b, ",\"exit_code\":null");
    if (r->signal)
        buf_printf(b, ",\"signal\":%d", r->signal);
    else
        buf_printf(b, ",\"signal\":null");
    buf_append_lit(b, ",\"stdout\":");
    json_string(b, r->out.data ? r->out.data : "", r->out.len);
    buf_append_lit(b, ",\"stderr\":");
    json_string(b, r->err.data ? r->err.data : "", r->err.len);
    buf_printf(b,
               ",\"truncated\":{\"stdout\":%lld,\"stderr\":%lld},\"redactions\":%lld,"
               "\"duration_ms\":%lld,\"cpu_ms\":%lld,\"max_rss_kb\":%lld",
               (long long)r->truncated_out, (long long)r->truncated_err,
               (long long)r->redactions, (long long)r->duration_ms, (long long)r->cpu_ms,
               (long long)r->max_rss_kb);
    if (session_id) {
        buf_append_lit(b, ",\"session_id\":");
        json_cstr(b, session_id);
    }
    buf_append_lit(b, "}");
}
