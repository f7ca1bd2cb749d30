/* `stockade soak`: the soak driver is a program of its own (contrib/soak/stockade_soak, a
 * protocol client built on contrib/python/stockade_client) driving a real `stockade serve`
 * child; this finds it and runs it with our own binary as the server under test. */
#include "cli.h"
#include "util.h"
#include "version.h"

#include <libgen.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static bool is_file(const char *dir, const char *rel)
{
    char *path = xasprintf("%s/%s", dir, rel);
    struct stat st;
    bool yes = stat(path, &st) == 0 && S_ISREG(st.st_mode);
    free(path);
    return yes;
}

int cli_soak(int argc, char **argv)
{
    char self[4096];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    if (n <= 0)
        die_errno("readlink /proc/self/exe");
    self[n] = 0;
    char *copy = xstrdup(self);
    char *dir = dirname(copy);
    /* beside a built checkout; else installed beside us (BINDIR/../lib/python3/...: an
     * extracted package works wherever it lies); else where `make install` put it */
    char *pypath = NULL;
    char *beside = xasprintf("%s/../lib/python3/dist-packages", dir);
    if (is_file(dir, "contrib/soak/stockade_soak/__init__.py"))
        pypath = xasprintf("%s/contrib/python:%s/contrib/soak", dir, dir);
    else if (is_file(beside, "stockade_soak/__init__.py"))
        pypath = xstrdup(beside);
    else if (is_file(STOCKADE_PYTHONDIR, "stockade_soak/__init__.py"))
        pypath = xstrdup(STOCKADE_PYTHONDIR);
    else
        die("soak: the driver (stockade_soak) is neither beside %s nor in %s; "
            "`make install` puts it there", self, STOCKADE_PYTHONDIR);
    free(beside);
    free(copy);
    setenv("PYTHONPATH", pypath, 1);
    free(pypath);
    char **args = xcalloc((size_t)argc + 6, sizeof *args);
    size_t k = 0;
    args[k++] = "/usr/bin/python3";
    args[k++] = "-m";
    args[k++] = "stockade_soak";
    args[k++] = "--stockade";
    args[k++] = self;
    for (int i = 1; i < argc; i++)
        args[k++] = argv[i];
    args[k] = NULL;
    execv(args[0], args);
    die_errno("soak: cannot run %s", args[0]);
}
