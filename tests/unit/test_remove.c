/* Root removal at the sizes a tool can cheaply make: everything goes, whatever the shape,
 * and the work is linear in the entries (each directory is read a bounded number of
 * times, never once per subdirectory), with a few descriptors whatever the depth.
 * The time it takes is the bench's business (tests/bench/run.py, section 7). */
#include "check.h"
#include "root.h"
#include "util.h"

#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

/* In memory when /dev/shm is there: what is checked is the walk's passes, which do not
 * depend on the file system, and making 50,000 directories on a disk takes seconds. */
static char base[64];
static int base_fd = -1;

static void touch_at(int dir, const char *name)
{
    int fd = openat(dir, name, O_WRONLY | O_CREAT | O_CLOEXEC, 0600);
    if (fd >= 0)
        close(fd);
}

static int mkdir_open(int dir, const char *name)
{
    if (mkdirat(dir, name, 0700) < 0)
        return -1;
    return openat(dir, name, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
}

static bool gone(const char *name)
{
    struct stat st;
    return fstatat(base_fd, name, &st, AT_SYMLINK_NOFOLLOW) < 0 && errno == ENOENT;
}

/* Each directory is read a bounded number of times (max_passes: more only when its
 * subdirectories' names do not fit one batch), each entry a bounded number of times. A
 * walk that rescans a directory from its start after each subdirectory makes n passes
 * over a directory of n subdirectories: on ext4 each pass costs the directory's whole
 * size, removed entries included, so n^2. */
static void check_linear(const char *what, const struct root_remove_stats *s, uint64_t entries,
                         uint64_t max_passes)
{
    bool ok = s->max_dir_passes <= max_passes && s->entries_read <= 3 * entries + 64;
    if (!ok)
        fprintf(stderr, "%s: %llu entries read for %llu entries, %llu passes, at most %llu "
                "over one directory (allowed: %llu)\n", what,
                (unsigned long long)s->entries_read, (unsigned long long)entries,
                (unsigned long long)s->passes, (unsigned long long)s->max_dir_passes,
                (unsigned long long)max_passes);
    CHECK(ok);
}

/* A directory `top` of `count` subdirectories (names padded to `pad` characters), each
 * with one file or empty; removed, gone, and in at most `max_passes` over one directory. */
static void flat_case(const char *what, const char *top_name, int count, size_t pad,
                      bool with_file, uint64_t max_passes)
{
    int top = mkdir_open(base_fd, top_name);
    CHECK(top >= 0);
    char name[256];
    memset(name, 'n', pad);
    int made = 0;
    for (int i = 0; i < count && top >= 0; i++) {
        snprintf(name + pad, sizeof name - pad, "%d", i);
        int d = mkdir_open(top, name);
        if (d < 0)
            break;
        if (with_file)
            touch_at(d, "f");
        close(d);
        made++;
    }
    if (top >= 0)
        close(top);
    CHECK(made == count);
    struct root_remove_stats s;
    CHECK(root_remove_tree_counted(base_fd, top_name, &s) == 0);
    CHECK(gone(top_name));
    check_linear(what, &s, (uint64_t)count * (with_file ? 2 : 1), max_passes);
}

/* 10,000 directories of one file each: the shape that made the old walk quadratic. */
static void test_one_file_dirs(void)
{
    flat_case("10,000 one-file dirs", "one-file", 10000, 1, true, 2);
}

/* 20,000 empty directories: each goes in the pass that finds it. */
static void test_empty_dirs(void)
{
    flat_case("20,000 empty dirs", "empty", 20000, 1, false, 1);
}

/* More subdirectories than one pass keeps names for (long names: over a MiB of them):
 * the walk takes them a batch at a time and still removes everything. */
static void test_more_than_a_batch(void)
{
    flat_case("6,000 long-named dirs", "batches", 6000, 240, true, 3);
}

/* 10,000 levels deep, a file every 100 levels and a wide directory near the bottom, with
 * the descriptor limit lowered to 32: depth costs neither descriptors nor rescans. */
static void test_deep_with_few_descriptors(void)
{
    int cur = mkdir_open(base_fd, "deep");
    CHECK(cur >= 0);
    int levels = 0;
    uint64_t entries = 0;
    for (int i = 0; i < 10000 && cur >= 0; i++) {
        if (i % 100 == 0) {
            touch_at(cur, "f");
            entries++;
        }
        if (i == 9000) {
            for (int j = 0; j < 2000; j++) {
                char name[32];
                snprintf(name, sizeof name, "w%d", j);
                int d = mkdir_open(cur, name);
                if (d >= 0) {
                    touch_at(d, "f");
                    close(d);
                    entries += 2;
                }
            }
        }
        int next = mkdir_open(cur, "d");
        close(cur);
        cur = next;
        entries++;
        levels++;
    }
    if (cur >= 0)
        close(cur);
    CHECK(levels == 10000);
    struct rlimit old, low;
    CHECK(getrlimit(RLIMIT_NOFILE, &old) == 0);
    low = old;
    low.rlim_cur = 32;
    CHECK(setrlimit(RLIMIT_NOFILE, &low) == 0);
    struct root_remove_stats s;
    int rc = root_remove_tree_counted(base_fd, "deep", &s);
    setrlimit(RLIMIT_NOFILE, &old);
    CHECK(rc == 0);
    CHECK(gone("deep"));
    check_linear("10,000 deep", &s, entries, 3);
}

/* Whatever the entries are: files, symlinks (in and out of the tree), a fifo, a
 * directory without permissions for its owner; nothing outside is touched. */
static void test_mixed_and_outside(void)
{
    int out = mkdir_open(base_fd, "outside");
    CHECK(out >= 0);
    touch_at(out, "precious");
    int top = mkdir_open(base_fd, "mixed");
    CHECK(top >= 0);
    for (int i = 0; i < 50 && top >= 0; i++) {
        char name[32];
        snprintf(name, sizeof name, "m%d", i);
        int d = mkdir_open(top, name);
        if (d < 0)
            continue;
        char *target = xasprintf("%s/outside", base);
        CHECK(symlinkat(target, d, "up") == 0);
        free(target);
        CHECK(symlinkat("..", d, "parent") == 0);
        CHECK(mkfifoat(d, "fifo", 0600) == 0);
        int sub = mkdir_open(d, "locked");
        if (sub >= 0) {
            touch_at(sub, "f");
            fchmod(sub, 0);
            close(sub);
        }
        close(d);
    }
    if (top >= 0)
        close(top);
    struct root_remove_stats s;
    CHECK(root_remove_tree_counted(base_fd, "mixed", &s) == 0);
    CHECK(gone("mixed"));
    struct stat st;
    CHECK(fstatat(out, "precious", &st, 0) == 0);
    if (out >= 0)
        close(out);
}

/* Wide at every level: 60 levels, each with 400 subdirectories of one file and long
 * names, the way down made last (so a pass meets it first and the rest of the level's
 * names wait while the walk is below). The names the walk holds at once stay within one
 * budget for the whole walk, not a budget per level (60 × 100 KB here). */
static void test_wide_at_every_level(void)
{
    int cur = mkdir_open(base_fd, "wide-deep");
    CHECK(cur >= 0);
    char name[256];
    memset(name, 'w', 240);
    int levels = 0;
    for (int i = 0; i < 60 && cur >= 0; i++) {
        for (int j = 0; j < 400; j++) {
            snprintf(name + 240, sizeof name - 240, "%d", j);
            int d = mkdir_open(cur, name);
            if (d >= 0) {
                touch_at(d, "f");
                close(d);
            }
        }
        int next = mkdir_open(cur, "down");
        close(cur);
        cur = next;
        levels++;
    }
    if (cur >= 0)
        close(cur);
    CHECK(levels == 60);
    struct root_remove_stats s;
    CHECK(root_remove_tree_counted(base_fd, "wide-deep", &s) == 0);
    CHECK(gone("wide-deep"));
    const uint64_t bound = (1u << 20) + 60 * ((8u << 10) + 256);
    if (s.max_batch_held > bound)
        fprintf(stderr, "wide at every level: %llu bytes of names held at once (bound %llu)\n",
                (unsigned long long)s.max_batch_held, (unsigned long long)bound);
    CHECK(s.max_batch_held <= bound);
}

/* A tool that owns its files takes its own permissions away (chmod 555 on a directory
 * of thousands, 000 and 300 on others) before the session ends. A supervisor that is not
 * root removes the tree as the same owner, without CAP_DAC_OVERRIDE: the walk must give
 * the owner's permissions back, or the root stays (and a close is retried forever). Run
 * as an unprivileged uid: in a child as nobody when the suite runs as root. */
static int unwritable_cases(int dir)
{
    int top = mkdir_open(dir, "locked-top");
    if (top < 0)
        return 1;
    int made = 0;
    for (int i = 0; i < 3000; i++) {
        char name[32];
        snprintf(name, sizeof name, "d%d", i);
        int d = mkdir_open(top, name);
        if (d < 0)
            break;
        if (i % 3 == 0)
            touch_at(d, "f");
        if (i % 500 == 1)
            fchmod(d, 0);
        else if (i % 500 == 2)
            fchmod(d, 0300);
        else if (i % 500 == 3)
            fchmod(d, 0500);
        close(d);
        made++;
    }
    fchmod(top, 0555);
    close(top);
    if (made != 3000)
        return 2;
    struct root_remove_stats s;
    int rc = root_remove_tree_counted(dir, "locked-top", &s);
    struct stat st;
    bool is_gone = fstatat(dir, "locked-top", &st, AT_SYMLINK_NOFOLLOW) < 0 && errno == ENOENT;
    if (rc != 0 || !is_gone) {
        fprintf(stderr, "locked tree: rc %d, %s\n", rc, is_gone ? "gone" : "still there");
        return 3;
    }
    return 0;
}

static void test_unwritable_dirs_of_their_owner(void)
{
    if (geteuid() != 0) {
        CHECK(unwritable_cases(base_fd) == 0);
        return;
    }
    const uid_t nobody = 65534;
    CHECK(mkdirat(base_fd, "as-nobody", 0700) == 0);
    CHECK(fchownat(base_fd, "as-nobody", nobody, nobody, 0) == 0);
    pid_t pid = fork();
    if (pid == 0) {
        int dir = openat(base_fd, "as-nobody", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        if (dir < 0 || setgroups(0, NULL) < 0 || setresgid(nobody, nobody, nobody) < 0 ||
            setresuid(nobody, nobody, nobody) < 0)
            _exit(9);
        _exit(unwritable_cases(dir));
    }
    int status = -1;
    CHECK(pid > 0 && waitpid(pid, &status, 0) == pid);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
        fprintf(stderr, "unwritable dirs as nobody: status %#x\n", status);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

int main(void)
{
    struct stat st;
    snprintf(base, sizeof base, "%s/stockade-test-remove-XXXXXX",
             stat("/dev/shm", &st) == 0 && S_ISDIR(st.st_mode) && access("/dev/shm", W_OK) == 0
                 ? "/dev/shm" : "/tmp");
    if (!mkdtemp(base))
        return 2;
    base_fd = open(base, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (base_fd < 0)
        return 2;
    test_one_file_dirs();
    test_empty_dirs();
    test_more_than_a_batch();
    test_deep_with_few_descriptors();
    test_mixed_and_outside();
    test_unwritable_dirs_of_their_owner();
    test_wide_at_every_level();
    close(base_fd);
    check_remove_dir(base);
    return check_report("test_remove");
}
