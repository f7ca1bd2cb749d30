/* Session roots: created with the right modes, removed whole, and removal never follows
 * a symlink out of the root or walks into another file system. */
#include "check.h"
#include "root.h"
#include "util.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

static char base[] = "/tmp/stockade-test-root-XXXXXX";

static bool exists(const char *path)
{
    struct stat st;
    return lstat(path, &st) == 0;
}

static void write_file(const char *path, const char *text)
{
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) {
        ssize_t n = write(fd, text, strlen(text));
        (void)n;
        close(fd);
    }
}

static void test_ids(void)
{
    CHECK(root_id_valid("abc"));
    CHECK(root_id_valid("a.b-c_d9"));
    CHECK(root_id_valid("0123456789012345678901234567890123456789012345678901234567890123"));
    CHECK(!root_id_valid("01234567890123456789012345678901234567890123456789012345678901234"));
    CHECK(!root_id_valid(""));
    CHECK(!root_id_valid(".hidden"));
    CHECK(!root_id_valid("-x"));
    CHECK(!root_id_valid("a/b"));
    CHECK(!root_id_valid(".."));
    CHECK(!root_id_valid("a b"));
    CHECK(!root_id_valid(NULL));
}

static void test_create_and_modes(const char *state)
{
    char *root = root_create(state, "s1", getuid(), getgid(), false);
    CHECK(root != NULL);
    const char *subs[] = {"workspace", "tmp", "cache", "home"};
    for (size_t i = 0; i < 4; i++) {
        char *p = xasprintf("%s/%s", root, subs[i]);
        struct stat st;
        CHECK(stat(p, &st) == 0 && S_ISDIR(st.st_mode) && (st.st_mode & 07777) == 0700);
        free(p);
    }
    struct stat st;
    CHECK(stat(root, &st) == 0 && (st.st_mode & 07777) == 0700);
    /* a second create without reuse is refused, with reuse it is fine */
    errno = 0;
    CHECK(root_create(state, "s1", getuid(), getgid(), false) == NULL && errno == EEXIST);
    char *again = root_create(state, "s1", getuid(), getgid(), true);
    CHECK(again != NULL);
    free(again);
    CHECK(root_create(state, "../evil", getuid(), getgid(), false) == NULL);
    CHECK(root_remove(state, "s1") == 0);
    CHECK(!exists(root));
    free(root);
}

static void test_symlinks_are_not_followed(const char *state)
{
    char *outside = xasprintf("%s/outside", base);
    char *precious = xasprintf("%s/precious.txt", outside);
    char *subdir = xasprintf("%s/keep", outside);
    mkdir(outside, 0755);
    mkdir(subdir, 0755);
    write_file(precious, "do not delete");

    char *root = root_create(state, "s2", getuid(), getgid(), false);
    CHECK(root != NULL);
    char *l1 = xasprintf("%s/workspace/link-to-dir", root);
    char *l2 = xasprintf("%s/tmp/link-to-file", root);
    char *l3 = xasprintf("%s/home/dangling", root);
    char *nested = xasprintf("%s/workspace/a/b/c", root);
    char *nested_link = xasprintf("%s/workspace/a/b/c/up", root);
    CHECK(symlink(outside, l1) == 0);
    CHECK(symlink(precious, l2) == 0);
    CHECK(symlink("/nonexistent/x", l3) == 0);
    char *a = xasprintf("%s/workspace/a", root), *ab = xasprintf("%s/workspace/a/b", root);
    mkdir(a, 0700);
    mkdir(ab, 0700);
    mkdir(nested, 0700);
    CHECK(symlink(outside, nested_link) == 0);
    /* the workspace itself replaced by a symlink to the outside dir */
    char *cache = xasprintf("%s/cache", root);
    CHECK(rmdir(cache) == 0 && symlink(outside, cache) == 0);

    CHECK(root_remove(state, "s2") == 0);
    CHECK(!exists(root));
    CHECK(exists(precious) && exists(subdir));
    free(l1), free(l2), free(l3), free(nested), free(nested_link), free(a), free(ab);
    free(cache), free(root), free(outside), free(precious), free(subdir);
}

static void test_deep_tree(const char *state)
{
    /* deeper than we have descriptors for a recursive walk: nested with mkdirat */
    char *root = root_create(state, "s3", getuid(), getgid(), false);
    CHECK(root != NULL);
    char *ws = xasprintf("%s/workspace", root);
    int fd = open(ws, O_RDONLY | O_DIRECTORY);
    int levels = 3000, made = 0;
    for (int i = 0; i < levels && fd >= 0; i++) {
        if (mkdirat(fd, "d", 0700) < 0)
            break;
        int next = openat(fd, "d", O_RDONLY | O_DIRECTORY);
        if (i % 100 == 0) {
            int f = openat(fd, "file", O_WRONLY | O_CREAT, 0600);
            if (f >= 0)
                close(f);
        }
        close(fd);
        fd = next;
        made++;
    }
    if (fd >= 0)
        close(fd);
    CHECK(made == levels);
    CHECK(root_remove(state, "s3") == 0);
    CHECK(!exists(root));
    free(ws);
    free(root);
}

static void test_remove_missing_is_ok(const char *state)
{
    CHECK(root_remove(state, "never-created") == 0);
}

/* The pinned open, both ways: openat2 and the walk for kernels without it. */
static void test_open_beneath(const char *state)
{
    char *top = xasprintf("%s/beneath", state);
    CHECK(mkdir(top, 0755) == 0);
    char *p = xasprintf("%s/a", top);
    CHECK(mkdir(p, 0755) == 0);
    free(p);
    p = xasprintf("%s/a/f", top);
    write_file(p, "x");
    free(p);
    p = xasprintf("%s/link", top);
    CHECK(symlink("a", p) == 0);           /* even a symlink that stays inside */
    free(p);
    p = xasprintf("%s/a/up", top);
    CHECK(symlink("/etc", p) == 0);
    free(p);
    int dir = open(top, O_RDONLY | O_DIRECTORY);
    int (*const ways[])(int, const char *, int, mode_t) = {root_open_beneath, root_open_walk};
    for (size_t w = 0; w < 2; w++) {
        int fd = ways[w](dir, "a/f", O_RDONLY, 0);
        CHECK(fd >= 0);
        if (fd >= 0)
            close(fd);
        fd = ways[w](dir, "a//./f", O_RDONLY, 0);
        CHECK(fd >= 0);
        if (fd >= 0)
            close(fd);
        fd = ways[w](dir, "", O_RDONLY | O_DIRECTORY, 0);
        CHECK(fd >= 0);
        if (fd >= 0)
            close(fd);
        errno = 0;
        CHECK(ways[w](dir, "link/f", O_RDONLY, 0) < 0 && errno == ELOOP);
        errno = 0;
        CHECK(ways[w](dir, "link", O_RDONLY | O_DIRECTORY, 0) < 0);
        CHECK(ways[w](dir, "a/up/passwd", O_RDONLY, 0) < 0);
        errno = 0;
        CHECK(ways[w](dir, "a/../../x", O_RDONLY, 0) < 0 && errno == EXDEV);
        errno = 0;
        CHECK(ways[w](dir, "/etc/passwd", O_RDONLY, 0) < 0 && errno == EXDEV);
        fd = ways[w](dir, "a/new", O_WRONLY | O_CREAT | O_EXCL, 0600);
        CHECK(fd >= 0);
        if (fd >= 0)
            close(fd);
        p = xasprintf("%s/a/new", top);
        CHECK(unlink(p) == 0);
        free(p);
    }
    /* mkdir -p never through a planted symlink */
    int fd = root_mkdirs_beneath(dir, "a/b/c", 0755);
    CHECK(fd >= 0);
    if (fd >= 0)
        close(fd);
    p = xasprintf("%s/a/b/c", top);
    CHECK(exists(p));
    free(p);
    CHECK(root_mkdirs_beneath(dir, "link/x/y", 0755) < 0);
    CHECK(root_mkdirs_beneath(dir, "a/up/stockade-never", 0755) < 0);
    CHECK(!exists("/etc/stockade-never"));
    close(dir);
    free(top);
}

static void test_usage(const char *state)
{
    char *top = xasprintf("%s/usage", state);
    CHECK(mkdir(top, 0755) == 0);
    for (int i = 0; i < 10; i++) {
        char *p = xasprintf("%s/f%d", top, i);
        write_file(p, "some bytes");
        free(p);
    }
    char *deep = xasprintf("%s/d", top);
    CHECK(mkdir(deep, 0755) == 0);
    int dir = open(top, O_RDONLY | O_DIRECTORY);
    struct root_usage u;
    CHECK(root_usage_at(dir, 0, 0, &u) == 0);
    CHECK(u.inodes == 12 && u.bytes > 0);
    /* stops as soon as a cap is passed */
    CHECK(root_usage_at(dir, 0, 5, &u) == 0);
    CHECK(u.inodes == 6);
    /* deeper than it counts: over the caps, whatever they are */
    int cur = open(deep, O_RDONLY | O_DIRECTORY);
    for (int i = 0; i < ROOT_USAGE_MAX_DEPTH + 2 && cur >= 0; i++) {
        CHECK(mkdirat(cur, "d", 0755) == 0);
        int next = openat(cur, "d", O_RDONLY | O_DIRECTORY);
        close(cur);
        cur = next;
    }
    if (cur >= 0)
        close(cur);
    errno = 0;
    CHECK(root_usage_at(dir, 0, 0, &u) < 0 && errno == E2BIG);
    close(dir);
    free(deep);
    free(top);
}

int main(void)
{
    if (!mkdtemp(base))
        return 2;
    char *state = xasprintf("%s/state", base);
    test_ids();
    test_create_and_modes(state);
    test_symlinks_are_not_followed(state);
    test_deep_tree(state);
    test_remove_missing_is_ok(state);
    test_open_beneath(state);
    test_usage(state);
    /* clean up our own temp dir */
    int dfd = open("/tmp", O_RDONLY | O_DIRECTORY);
    root_remove_tree_at(dfd, base + 5);
    close(dfd);
    free(state);
    return check_report("test_root");
}
