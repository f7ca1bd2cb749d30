/* Root removal's speed (the walk a session's close runs in a remover thread): builds one
 * tree shape in DIR, times root_remove_tree_counted over it, and prints
 *   ms=<removal ms> entries=<n> passes=<n> max_dir_passes=<n>
 * Shapes: onefile N (N dirs of one file), empty N (N empty dirs), tree N (N files, 1,000
 * per directory), deep N (a chain N deep, a file every 100 levels).
 * Built by tests/bench/run.py with core/root.c and core/util.c. */
#include "root.h"
#include "util.h"

#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static void touch_at(int dir, const char *name)
{
    int fd = openat(dir, name, O_WRONLY | O_CREAT | O_CLOEXEC, 0600);
    if (fd < 0) {
        perror("create");
        exit(1);
    }
    close(fd);
}

static int mkdir_open(int dir, const char *name)
{
    if (mkdirat(dir, name, 0700) < 0) {
        perror("mkdir");
        exit(1);
    }
    int fd = openat(dir, name, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) {
        perror("open");
        exit(1);
    }
    return fd;
}

static long build(int top, const char *shape, long n)
{
    char name[32];
    long entries = 0;
    if (!strcmp(shape, "onefile") || !strcmp(shape, "empty")) {
        bool file = !strcmp(shape, "onefile");
        for (long i = 0; i < n; i++) {
            snprintf(name, sizeof name, "d%ld", i);
            int d = mkdir_open(top, name);
            if (file)
                touch_at(d, "f");
            close(d);
            entries += file ? 2 : 1;
        }
    } else if (!strcmp(shape, "tree")) {
        int d = -1;
        for (long i = 0; i < n; i++) {
            if (i % 1000 == 0) {
                if (d >= 0)
                    close(d);
                snprintf(name, sizeof name, "d%ld", i / 1000);
                d = mkdir_open(top, name);
                entries++;
            }
            snprintf(name, sizeof name, "f%ld", i % 1000);
            touch_at(d, name);
            entries++;
        }
        if (d >= 0)
            close(d);
    } else if (!strcmp(shape, "deep")) {
        int cur = dup(top);
        for (long i = 0; i < n; i++) {
            if (i % 100 == 0) {
                touch_at(cur, "f");
                entries++;
            }
            int next = mkdir_open(cur, "d");
            close(cur);
            cur = next;
            entries++;
        }
        close(cur);
    } else {
        fprintf(stderr, "unknown shape %s\n", shape);
        exit(2);
    }
    return entries;
}

int main(int argc, char **argv)
{
    if (argc != 4) {
        fprintf(stderr, "usage: %s DIR onefile|empty|tree|deep N\n", argv[0]);
        return 2;
    }
    int dir = open(argv[1], O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dir < 0) {
        perror(argv[1]);
        return 1;
    }
    unlinkat(dir, "t", AT_REMOVEDIR);
    int top = mkdir_open(dir, "t");
    long entries = build(top, argv[2], atol(argv[3]));
    close(top);
    struct root_remove_stats s;
    int64_t t0 = now_ms();
    int rc = root_remove_tree_counted(dir, "t", &s);
    int64_t ms = now_ms() - t0;
    if (rc < 0) {
        perror("root_remove_tree_counted");
        return 1;
    }
    printf("ms=%lld entries=%ld passes=%llu max_dir_passes=%llu\n", (long long)ms, entries,
           (unsigned long long)s.passes, (unsigned long long)s.max_dir_passes);
    close(dir);
    return 0;
}
