#include "check.h"
#include "util.h"

#include <stdlib.h>

static int64_t dur(const char *s)
{
    int64_t v;
    return parse_duration_ms(s, &v) == 0 ? v : -1;
}

static int64_t size(const char *s)
{
    int64_t v;
    return parse_size(s, &v) == 0 ? v : -1;
}

static void test_durations(void)
{
    CHECK(dur("250ms") == 250);
    CHECK(dur("30s") == 30000);
    CHECK(dur("1.5s") == 1500);
    CHECK(dur("10m") == 600000);
    CHECK(dur("2h") == 7200000);
    CHECK(dur("0s") == 0);
    /* strict: units are required, nothing else is accepted */
    CHECK(dur("30") == -1);
    CHECK(dur("") == -1);
    CHECK(dur("s") == -1);
    CHECK(dur("-1s") == -1);
    CHECK(dur("5 s") == -1);
    CHECK(dur("5sec") == -1);
    CHECK(dur("1e3s") == -1 || dur("1e3s") == 1000000);
    CHECK(dur("banana") == -1);
    CHECK(dur(NULL) == -1);
}

static void test_sizes(void)
{
    CHECK(size("512") == 512);
    CHECK(size("64KiB") == 65536);
    CHECK(size("1MiB") == 1048576);
    CHECK(size("1GiB") == 1073741824LL);
    CHECK(size("1.5KiB") == 1536);
    CHECK(size("2MB") == 2000000);
    CHECK(size("1mib") == -1);
    CHECK(size("1.3B") == -1);      /* not a whole number of bytes */
    CHECK(size("x") == -1);
    CHECK(size("-5") == -1);
}

static void test_json_strings(void)
{
    struct buf b = {0};
    json_string(&b, "a\"b\\c\n\x01", 7);
    CHECK_STR(b.data, "\"a\\\"b\\\\c\\n\\u0001\"");
    buf_free(&b);
    /* invalid UTF-8 becomes U+FFFD; valid multibyte passes through */
    json_string(&b, "\xff\xfeok \xc3\xa9", 7);
    CHECK_STR(b.data, "\"\xef\xbf\xbd\xef\xbf\xbdok \xc3\xa9\"");
    buf_free(&b);
    /* an overlong encoding and a surrogate are not valid UTF-8 */
    json_string(&b, "\xc0\xaf\xed\xa0\x80", 5);
    CHECK(strstr(b.data, "\xc0") == NULL && strstr(b.data, "\xed\xa0") == NULL);
    buf_free(&b);
    /* a truncated sequence at the end */
    json_string(&b, "ab\xe2\x82", 4);
    CHECK_STR(b.data, "\"ab\xef\xbf\xbd\xef\xbf\xbd\"");
    buf_free(&b);
}

int main(void)
{
    test_durations();
    test_sizes();
    test_json_strings();
    return check_report("test_util");
}
