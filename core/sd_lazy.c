/* libsystemd loaded on first use: only `serve` under systemd (socket activation, notify)
 * calls it, and linking it made every start map it and its dependencies (libgcrypt,
 * liblzma, libzstd, liblz4, libcap, libgpg-error). These definitions stand in for the
 * library's own: core/service.c calls sd-daemon.h as usual. Without the library, nothing
 * was passed (no sockets) and notifications go nowhere, as sd-daemon(3) does outside
 * systemd. */
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <systemd/sd-daemon.h>

#ifndef SD_SONAME
#define SD_SONAME "libsystemd.so.0"
#endif

static void *lib;
static pthread_once_t load_once = PTHREAD_ONCE_INIT;

static void load(void)
{
    lib = dlopen(SD_SONAME, RTLD_NOW | RTLD_LOCAL);
}

static void *sym(const char *name)
{
    pthread_once(&load_once, load);
    return lib ? dlsym(lib, name) : NULL;
}

int sd_listen_fds(int unset_environment)
{
    /* nothing to load when systemd passed nothing (what sd_listen_fds(3) unsets, too) */
    if (!getenv("LISTEN_FDS")) {
        if (unset_environment) {
            unsetenv("LISTEN_PID");
            unsetenv("LISTEN_FDNAMES");
        }
        return 0;
    }
    static __typeof__(&sd_listen_fds) fn;
    if (!fn)
        fn = (__typeof__(&sd_listen_fds))sym("sd_listen_fds");
    return fn ? fn(unset_environment) : -ENOSYS;
}

int sd_is_socket_unix(int fd, int type, int listening, const char *path, size_t length)
{
    static __typeof__(&sd_is_socket_unix) fn;
    if (!fn)
        fn = (__typeof__(&sd_is_socket_unix))sym("sd_is_socket_unix");
    return fn ? fn(fd, type, listening, path, length) : -ENOSYS;
}

int sd_notify(int unset_environment, const char *state)
{
    if (!getenv("NOTIFY_SOCKET"))
        return 0;           /* not under systemd's notify: sd_notify(3) returns 0 too */
    static __typeof__(&sd_notify) fn;
    if (!fn)
        fn = (__typeof__(&sd_notify))sym("sd_notify");
    return fn ? fn(unset_environment, state) : -ENOSYS;
}

int sd_notifyf(int unset_environment, const char *format, ...)
{
    va_list ap;
    va_start(ap, format);
    char *state = NULL;
    int n = vasprintf(&state, format, ap);
    va_end(ap);
    if (n < 0)
        return -ENOMEM;
    int rc = sd_notify(unset_environment, state);
    free(state);
    return rc;
}
