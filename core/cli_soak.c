/* `stockade soak`: the soak driver is a protocol client (contrib/python/stockade_client,
 * module soak) driving a real `stockade serve` child; this finds it and runs it with our
 * own binary as the server under test. */
#include "cli.h"
#include "util.h"

#include <libgen.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

int cli_soak(int argc, char **argv)
{
    char self[4096];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    if (n <= 0)
        die_errno("readlink /proc/self/exe");
    self[n] = 0;
    char *copy = xstrdup(self);
    char *dir = dirname(copy);
    /* beside a built checkout, then where a package would install it */
    char *candidates[] = {xasprintf("%s/contrib/python", dir),
                          xstrdup("/usr/share/stockade/python")};
    const char *pypath = NULL;
    for (size_t i = 0; i < ARRAY_LEN(candidates) && !pypath; i++) {
        char *mod = xasprintf("%s/stockade_client/soak.py", candidates[i]);
        struct stat st;
        if (stat(mod, &st) == 0)
            pypath = candidates[i];
        free(mod);
    }
    if (!pypath)
        die("soak: the driver (stockade_client/soak.py) is not installed beside %s", self);
    setenv("PYTHONPATH", pypath, 1);
    char **args = xcalloc((size_t)argc + 6, sizeof *args);
    size_t k = 0;
    args[k++] = "/usr/bin/python3";
    args[k++] = "-m";
    args[k++] = "stockade_client.soak";
    args[k++] = "--stockade";
    args[k++] = self;
    for (int i = 1; i < argc; i++)
        args[k++] = argv[i];
    args[k] = NULL;
    execv(args[0], args);
    die_errno("soak: cannot run %s", args[0]);
}
