/* `stockade doctor`: what the host can give, layer by layer, with the reason and the fix
 * when it cannot (the peers' most common complaint is a bare "Permission denied"). */
#include "cli.h"
#include "sandbox.h"
#include "session.h"
#include "util.h"
#include "version.h"

#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* What each level gives and does not: printed so that nobody believes it gives more.
 * The README's threat model says the same at more length. */
static const char *const process_gives[] = {
    "writes only beneath the session root (Landlock); TCP refused with network \"none\"",
    "no socket family but AF_UNIX; with network \"none\" no new AF_UNIX socket either "
    "(socketpair only): no host daemon's pathname socket",
    "no SysV IPC, no POSIX message queues, no xattr writes; no mount, ptrace, bpf, "
    "namespaces, io_uring, keyctl, TIOCSTI (seccomp)",
    "the cwd is entered through a pinned fd; privileged code never follows a path the "
    "tool could plant",
    "the call's whole tree ends with the call; memory of the tree (resident, memfds) "
    "watched 20 times a second; limits.disk and limits.inodes of the root watched",
    NULL,
};
static const char *const process_root_gives[] = {
    "a uid per session (kept roots keep theirs): sessions cannot read each other's "
    "private files or signal each other; RLIMIT_NPROC per session",
    NULL,
};
static const char *const proc_private =
    "/proc lists only the session's own processes (hidepid=2, in a mount namespace of the "
    "call's own)";
static const char *const proc_host =
    "/proc is the host's: every process and its command line is listed (a private one "
    "needs root and a mount namespace)";
static const char *const process_lacks[] = {
    "reads: the tool reads whatever the host's file modes let its uid read",
    "utime(NULL) on a world-writable host file (Landlock has no right for timestamps)",
    "network \"loopback\" is refused at load: it would be the host's whole network",
    NULL,
};
static const char *const process_nonroot_lacks[] = {
    "not root: every session runs as the supervisor's uid: Landlock keeps sessions' files "
    "apart (reads handled too: the state dir's ancestors cannot be listed), but there is "
    "no per-session process cap",
    NULL,
};
static const char *const strict_gives[] = {
    "the uid, Landlock, seccomp and limits of process (SysV IPC and AF_UNIX allowed: the "
    "namespaces make them the session's own)",
    "the host read-only and mostly absent (only /usr, /bin, /lib*, /sbin, /etc, a sysfs of "
    "its own); /tmp and /var/tmp the session's own, nosuid, nodev",
    "its own pid namespace per call (/proc shows the call only), network namespace (no "
    "host interface, lo only), IPC namespace per session (SysV counted in memory), uts",
    NULL,
};
static const char *const all_lack[] = {
    "hard tree-wide limits: memory, disk and inodes are watched (a tree may overshoot by "
    "what it allocates in 50 ms, or writes between two walks of its root: 250 ms, longer "
    "for a large root), CPU is per process (RLIMIT_CPU); no I/O bandwidth limit",
    "the kernel's own attack surface: syscalls outside the deny list are allowed",
    NULL,
};
static const char *const operator_adds[] = {
    "a delegated cgroup v2 subtree (memory.max, pids.max, io.max) for hard tree-wide "
    "limits; stockade does not use one today",
    "a file system with project quotas, or a size-limited one, under the state dir for "
    "hard disk limits",
    "root for the supervisor (per-session uids); a state dir outside /tmp and /var/tmp "
    "(beneath one, strict gives that one as a 64 MiB tmpfs, not the session's tmp)",
    NULL,
};

static void print_list(const char *mark, const char *const *items)
{
    for (const char *const *i = items; *i; i++)
        printf("    %s %s\n", mark, *i);
}

static void print_guarantees(bool root, bool mountns)
{
    printf("guarantees, isolation process%s:\n", root ? "" : " (not root)");
    print_list("+", process_gives);
    if (root)
        print_list("+", process_root_gives);
    if (root && mountns)
        printf("    + %s\n", proc_private);
    else
        printf("    - %s\n", proc_host);
    print_list("-", process_lacks);
    if (!root)
        print_list("-", process_nonroot_lacks);
    print_list("-", all_lack);
    printf("guarantees, isolation strict:\n");
    print_list("+", strict_gives);
    if (!root)
        print_list("-", process_nonroot_lacks);
    print_list("-", all_lack);
    printf("the operator must add:\n");
    print_list("*", operator_adds);
}

static const char doctor_usage[] =
    "usage: stockade doctor [--json]\n"
    "Which isolation layers this host can give (uid, Landlock, seccomp, namespaces, ...),\n"
    "and for each one it cannot, why and the fix.\n"
    "  --json   one JSON document on stdout: {version, root, layers: [{name, available,\n"
    "           reason}], landlock_abi, levels: {strict, process}, guarantees: {process:\n"
    "           {gives, lacks}, strict: {gives, lacks}, operator_adds}}\n"
    "Exit status: 0 both isolation levels available, 1 strict unavailable, 125 usage error.\n";

/* items as JSON strings, a comma before each but the list's first (*first tracks it) */
static void json_items(struct buf *b, bool *first, const char *const *items)
{
    for (const char *const *i = items; *i; i++) {
        if (!*first)
            buf_append_lit(b, ",");
        *first = false;
        json_cstr(b, *i);
    }
}

/* print_guarantees as JSON: {process: {gives, lacks}, strict: {gives, lacks},
 * operator_adds}. */
static void json_guarantees(struct buf *b, bool root, bool mountns)
{
    const char *const proc_private_list[] = {proc_private, NULL};
    const char *const proc_host_list[] = {proc_host, NULL};
    bool first = true;
    buf_append_lit(b, "\"guarantees\":{\"process\":{\"gives\":[");
    json_items(b, &first, process_gives);
    if (root)
        json_items(b, &first, process_root_gives);
    if (root && mountns)
        json_items(b, &first, proc_private_list);
    first = true;
    buf_append_lit(b, "],\"lacks\":[");
    if (!(root && mountns))
        json_items(b, &first, proc_host_list);
    json_items(b, &first, process_lacks);
    if (!root)
        json_items(b, &first, process_nonroot_lacks);
    json_items(b, &first, all_lack);
    first = true;
    buf_append_lit(b, "]},\"strict\":{\"gives\":[");
    json_items(b, &first, strict_gives);
    first = true;
    buf_append_lit(b, "],\"lacks\":[");
    if (!root)
        json_items(b, &first, process_nonroot_lacks);
    json_items(b, &first, all_lack);
    first = true;
    buf_append_lit(b, "]},\"operator_adds\":[");
    json_items(b, &first, operator_adds);
    buf_append_lit(b, "]}");
}

static int doctor_json(void)
{
    const struct sandbox_caps *c = sandbox_caps_namespaces();
    struct buf b = {0};
    buf_printf(&b, "{\"version\":\"%s\",\"uid\":%u,\"root\":%s,\"landlock_abi\":%d,\"layers\":[",
               STOCKADE_VERSION, (unsigned)geteuid(), c->root ? "true" : "false",
               c->landlock_abi);
    for (int l = 0; l < LAYER_COUNT; l++) {
        buf_printf(&b, "%s{\"name\":", l ? "," : "");
        json_cstr(&b, sandbox_layer_name((enum sandbox_layer)l));
        buf_printf(&b, ",\"available\":%s,\"reason\":", c->available[l] ? "true" : "false");
        json_cstr(&b, c->available[l] ? NULL : c->reason[l]);
        buf_printf(&b, "}");
    }
    buf_printf(&b, "],\"levels\":{");
    static const char *const levels[] = {"strict", "process"};
    int status = 0;
    for (size_t i = 0; i < ARRAY_LEN(levels); i++) {
        char *why = NULL;
        bool allowed = sandbox_level_allowed(levels[i], &why);
        const char *layers[LAYER_COUNT + 2];
        size_t n = allowed ? sandbox_active_layers(levels[i], layers) : 0;
        buf_printf(&b, "%s\"%s\":{\"available\":%s,\"reason\":", i ? "," : "", levels[i],
                   allowed ? "true" : "false");
        json_cstr(&b, allowed ? NULL : why);
        free(why);
        buf_printf(&b, ",\"layers\":[");
        for (size_t k = 0; k < n; k++) {
            buf_printf(&b, k ? "," : "");
            json_cstr(&b, layers[k]);
        }
        buf_printf(&b, "]}");
        if (!allowed && strcmp(levels[i], "strict") == 0)
            status = 1;
    }
    buf_append_lit(&b, "},");
    json_guarantees(&b, c->root, c->available[LAYER_MOUNTNS]);
    buf_append_lit(&b, "}\n");
    fwrite(b.data, 1, b.len, stdout);
    buf_free(&b);
    return status;
}

int cli_doctor(int argc, char **argv)
{
    static const struct option opts[] = {
        {"json", no_argument, 0, 'j'}, {"help", no_argument, 0, 'h'}, {0, 0, 0, 0},
    };
    bool json = false;
    int opt;
    optind = 1;
    while ((opt = getopt_long(argc, argv, "+jh", opts, NULL)) != -1) {
        switch (opt) {
        case 'j': json = true; break;
        case 'h': fputs(doctor_usage, stdout); return 0;
        default: fputs(doctor_usage, stderr); return EXIT_USAGE;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "stockade doctor: unexpected argument '%s'\n", argv[optind]);
        return EXIT_USAGE;
    }
    if (json)
        return doctor_json();
    const struct sandbox_caps *c = sandbox_caps_namespaces();
    printf("stockade doctor: running as uid %u%s\n", (unsigned)geteuid(),
           c->root ? " (root: per-session service uids, no user namespace needed)" : "");
    for (int l = 0; l < LAYER_COUNT; l++) {
        const char *name = sandbox_layer_name((enum sandbox_layer)l);
        if (l == LAYER_USERNS && c->root) {
            printf("  %-9s not needed (root)%s%s\n", name,
                   c->available[l] ? "" : "; unavailable: ", c->available[l] ? "" : c->reason[l]);
            continue;
        }
        if (c->available[l]) {
            if (l == LAYER_LANDLOCK)
                printf("  %-9s available (ABI %d)\n", name, c->landlock_abi);
            else if (l == LAYER_UID) {
                struct uid_range r = UID_RANGE_DEFAULT;
                printf("  %-9s available (per-session uids %u-%u, --uid-range to change)\n", name,
                       (unsigned)r.first, (unsigned)(r.first + r.count - 1));
            } else
                printf("  %-9s available\n", name);
        } else {
            printf("  %-9s unavailable: %s\n", name, c->reason[l]);
        }
    }
    char *why = NULL;
    bool strict = sandbox_level_allowed("strict", &why);
    printf("isolation strict:  %s%s\n", strict ? "available" : "unavailable: ", strict ? "" : why);
    free(why);
    const char *layers[LAYER_COUNT + 2];
    size_t n = sandbox_active_layers("process", layers);
    printf("isolation process: available (");
    for (size_t i = 0; i < n; i++)
        printf("%s%s", i ? ", " : "", layers[i]);
    printf(")\n");
    print_guarantees(c->root, c->available[LAYER_MOUNTNS]);
    return strict ? 0 : 1;
}
