/* The warm per-session zygote: a process that builds a session's namespaces and mount
 * tree once (the "world"), then makes the calls' shims ahead of time (spares), so that a
 * call costs a message rather than a fork and a mount tree. Also the server's spawner: the
 * same without namespaces, for process isolation. */
#include "zygote.h"
#include "proc.h"
#include "root.h"
#include "sandbox.h"
#include "spawn.h"
#include "util.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/mount.h>
#include <net/if.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/pidfd.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#define ZYG_FD 3
#define ZYG_MAX_MSG (512 * 1024)
#define ZYG_MAGIC 0x5a594730u
#define ZYG_SPARE 0x5a595350u      /* "make me a spare" */
#define ZYG_ASK_R 4                /* the zygote's end of the shims' ask pipe */
#define ZYG_ASK_W 5
#define ZYG_MAX_FDS 64             /* descriptors one message carries at most */

/* A spawn_req flattened for the socket: fixed fields, then NUL-separated strings:
 * path, cwd, session_root, argv..., envp..., rw_paths... */
struct zyg_msg {
    uint32_t magic;
    uint32_t argc, envc, rwc;
    uint32_t drop_user, with_stdin, landlock, seccomp, walls;
    uint32_t ask_successor;     /* its zygote's next spare: asked for once the tool runs */
    uint32_t uid, gid;
    uint64_t cwd_dev, cwd_ino;  /* the workspace the session created (spawn.h) */
    struct spawn_limits limits;
    uint32_t len;           /* bytes of strings that follow */
};

static void put_str(struct buf *b, const char *s)
{
    buf_append(b, s ? s : "", strlen(s ? s : "") + 1);
}

static char *next_str(char **p, char *end)
{
    char *s = *p;
    char *nul = s < end ? memchr(s, 0, (size_t)(end - s)) : NULL;
    if (!nul)
        return NULL;
    *p = nul + 1;
    return s;
}

/* fds travel with the message (SCM_RIGHTS); -1 entries are left out */
static ssize_t send_with_fds(int sock, const void *data, size_t len, const int *fds, int nfds)
{
    char cbuf[CMSG_SPACE(sizeof(int) * ZYG_MAX_FDS)];
    memset(cbuf, 0, sizeof cbuf);
    struct iovec iov = {(void *)data, len};
    struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1};
    if (nfds > 0) {
        mh.msg_control = cbuf;
        mh.msg_controllen = CMSG_SPACE(sizeof(int) * (size_t)nfds);
        struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);
        cm->cmsg_level = SOL_SOCKET;
        cm->cmsg_type = SCM_RIGHTS;
        cm->cmsg_len = CMSG_LEN(sizeof(int) * (size_t)nfds);
        memcpy(CMSG_DATA(cm), fds, sizeof(int) * (size_t)nfds);
    }
    ssize_t n;
    do
        n = sendmsg(sock, &mh, MSG_NOSIGNAL);
    while (n < 0 && errno == EINTR);
    return n;
}

static ssize_t recv_with_fds_flags(int sock, void *data, size_t len, int *fds, int maxfds,
                                   int *nfds, int flags)
{
    char cbuf[CMSG_SPACE(sizeof(int) * ZYG_MAX_FDS)];
    struct iovec iov = {data, len};
    struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf,
                        .msg_controllen = sizeof cbuf};
    ssize_t n;
    do
        n = recvmsg(sock, &mh, MSG_CMSG_CLOEXEC | flags);
    while (n < 0 && errno == EINTR);
    *nfds = 0;
    for (struct cmsghdr *cm = CMSG_FIRSTHDR(&mh); n >= 0 && cm; cm = CMSG_NXTHDR(&mh, cm)) {
        if (cm->cmsg_level != SOL_SOCKET || cm->cmsg_type != SCM_RIGHTS)
            continue;
        int k = (int)((cm->cmsg_len - CMSG_LEN(0)) / sizeof(int));
        for (int i = 0; i < k; i++) {
            int fd;
            memcpy(&fd, CMSG_DATA(cm) + i * sizeof(int), sizeof fd);
            if (*nfds < maxfds)
                fds[(*nfds)++] = fd;
            else
                close(fd);
        }
    }
    if (n >= 0 && (mh.msg_flags & (MSG_TRUNC | MSG_CTRUNC))) {
        errno = EMSGSIZE;
        return -1;
    }
    return n;
}

static ssize_t recv_with_fds(int sock, void *data, size_t len, int *fds, int maxfds, int *nfds)
{
    return recv_with_fds_flags(sock, data, len, fds, maxfds, nfds, 0);
}

/* -- inside the zygote: building the session's world -- */

static void zdie(const char *what)
{
    /* the supervisor reads this line from the zygote's first message */
    char msg[256];
    snprintf(msg, sizeof msg, "E%d:%s: %s", errno, what, strerror(errno));
    send_with_fds(ZYG_FD, msg, strlen(msg), NULL, 0);
    _exit(1);
}

static int write_file(const char *path, const char *text)
{
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    ssize_t n = write(fd, text, strlen(text));
    close(fd);
    return n == (ssize_t)strlen(text) ? 0 : -1;
}

static int clone_tree(const char *path, bool recursive)
{
    return (int)syscall(SYS_open_tree, AT_FDCWD, path,
                        OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC | (recursive ? AT_RECURSIVE : 0));
}

static int set_attr(int fd, unsigned long long attr, bool recursive)
{
    struct mount_attr a = {.attr_set = attr};
    return (int)syscall(SYS_mount_setattr, fd, "",
                        AT_EMPTY_PATH | (recursive ? AT_RECURSIVE : 0), &a, sizeof a);
}

static int attach(int fd, const char *where)
{
    return (int)syscall(SYS_move_mount, fd, "", AT_FDCWD, where, MOVE_MOUNT_F_EMPTY_PATH);
}

/* mkdir -p, inside the new root's tmpfs scaffolds */
static void mkdirs(const char *path, mode_t mode)
{
    char *p = xstrdup(path);
    for (char *s = p + 1; *s; s++) {
        if (*s == '/') {
            *s = 0;
            mkdir(p, mode);
            *s = '/';
        }
    }
    mkdir(p, mode);
    free(p);
}

static void touch(const char *path)
{
    int fd = open(path, O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
    if (fd >= 0)
        close(fd);
}

#define NEWROOT "/tmp/.stockade-root"

/* Of the host, a tool sees the programs and libraries it runs and /etc, nothing else (no
 * /srv, /opt, /home, /var, no checkout of anyone's). */
static const char *const system_dirs[] = {"/usr", "/bin", "/sbin", "/lib", "/lib32",
                                          "/lib64", "/libx32", "/etc", "/proc"};
static const char *const world_devs[] = {"null", "zero", "full", "random", "urandom", "tty"};

/* What the world is built from: detached copies of host trees (open_tree fds), taken
 * before anything is mounted over the host's. -1: not there. */
struct world_parts {
    int sys[ARRAY_LEN(system_dirs)];
    char syslink[ARRAY_LEN(system_dirs)][256];     /* merged /usr: /bin -> usr/bin */
    int session, session_tmp[2];    /* the session's root; its tmp, for /tmp and /var/tmp */
    int dev[ARRAY_LEN(world_devs)];
    int *mounts;                                    /* cfg->nmounts of them */
};

/* Detached copies of a session's root and of its tmp (nosuid, nodev, and private: a
 * mount made beneath them in a world never shows on the host). The tmp is the tool's to
 * replace (a kept root): pinned beneath the root. Done in the zygote's own copy of the
 * host tree, or by the supervisor for a zygote made ahead (zygote_bind). 0, or -1 with
 * errno and *what. */
static int session_trees_clone(const char *session_root, int *root_tree, int tmp_trees[2],
                               const char **what)
{
    struct mount_attr a = {.attr_set = MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV,
                           .propagation = MS_PRIVATE};
    *root_tree = tmp_trees[0] = tmp_trees[1] = -1;
    *what = "open the session root";
    int root = open(session_root, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (root < 0)
        return -1;
    *what = "clone the session root";
    *root_tree = (int)syscall(SYS_open_tree, root, "", OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC |
                              AT_EMPTY_PATH);
    int tmp = -1;
    if (*root_tree >= 0) {
        *what = "session root attributes";
        if (syscall(SYS_mount_setattr, *root_tree, "", AT_EMPTY_PATH, &a, sizeof a) == 0) {
            *what = "clone the session tmp";
            tmp = root_open_beneath(root, "tmp", O_PATH | O_DIRECTORY, 0);
        }
    }
    /* two: one for /tmp, one for /var/tmp (a detached copy cannot be copied again in
     * another mount namespace) */
    bool ok = tmp >= 0;
    for (int i = 0; ok && i < 2; i++) {
        tmp_trees[i] = (int)syscall(SYS_open_tree, tmp, "", OPEN_TREE_CLONE |
                                    OPEN_TREE_CLOEXEC | AT_EMPTY_PATH);
        *what = "session tmp attributes";
        ok = tmp_trees[i] >= 0 &&
             syscall(SYS_mount_setattr, tmp_trees[i], "", AT_EMPTY_PATH, &a, sizeof a) == 0;
    }
    int e = errno;
    if (tmp >= 0)
        close(tmp);
    close(root);
    if (!ok) {
        close_quietly(root_tree);
        close_quietly(&tmp_trees[0]);
        close_quietly(&tmp_trees[1]);
        errno = e;
        return -1;
    }
    return 0;
}

static void world_map_ids(uid_t outer_uid, gid_t outer_gid)
{
    /* We outside are an ordinary uid inside, not root: the zygote keeps the capabilities
     * it got with the namespace (enough to build the mount tree), and a tool exec'd as a
     * non-zero uid gets none. setgroups is denied before gid_map. */
    char map[64];
    write_file("/proc/self/setgroups", "deny");
    snprintf(map, sizeof map, "1000 %u 1\n", (unsigned)outer_uid);
    if (write_file("/proc/self/uid_map", map) < 0)
        zdie("uid_map");
    snprintf(map, sizeof map, "1000 %u 1\n", (unsigned)outer_gid);
    if (write_file("/proc/self/gid_map", map) < 0)
        zdie("gid_map");
}

/* Everything we need from the host tree: the system directories (read-only), the session
 * root, the devices, the policy's mounts. */
static void world_take(const struct zygote_config *cfg, struct world_parts *w)
{
    for (size_t i = 0; i < ARRAY_LEN(system_dirs); i++) {
        w->sys[i] = -1;
        w->syslink[i][0] = 0;
        struct stat st;
        if (lstat(system_dirs[i], &st) < 0)
            continue;
        if (S_ISLNK(st.st_mode)) {
            ssize_t n = readlink(system_dirs[i], w->syslink[i], sizeof w->syslink[i] - 1);
            w->syslink[i][n > 0 ? n : 0] = 0;
            continue;
        }
        w->sys[i] = clone_tree(system_dirs[i], true);
        /* /proc keeps its own attributes: a user namespace may mount a new proc only
         * where a fully visible one exists; each call mounts its own over it anyway */
        if (w->sys[i] < 0 || (strcmp(system_dirs[i], "/proc") != 0 &&
                              set_attr(w->sys[i], MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID |
                                       MOUNT_ATTR_NODEV, true) < 0))
            zdie(system_dirs[i]);
    }
    w->session = w->session_tmp[0] = w->session_tmp[1] = -1;
    if (cfg->session_root) {
        const char *what = NULL;
        if (session_trees_clone(cfg->session_root, &w->session, w->session_tmp, &what) < 0)
            zdie(what);
    }
    for (size_t i = 0; i < ARRAY_LEN(world_devs); i++) {
        char p[32];
        snprintf(p, sizeof p, "/dev/%s", world_devs[i]);
        w->dev[i] = clone_tree(p, false);
    }
    w->mounts = xcalloc(cfg->nmounts + 1, sizeof *w->mounts);
    /* a world made ahead gets them with its session, as they are then (zygote_bind) */
    for (size_t i = 0; cfg->session_root && i < cfg->nmounts; i++) {
        w->mounts[i] = clone_tree(cfg->mounts[i].src, true);
        if (w->mounts[i] < 0)
            zdie(cfg->mounts[i].src);
        if (cfg->mounts[i].ro && set_attr(w->mounts[i], MOUNT_ATTR_RDONLY, true) < 0)
            zdie("read-only mount");
    }
}

/* The state dir lies beneath `dir` (/tmp or /var/tmp: tests, odd set-ups). */
static bool state_dir_beneath(const struct zygote_config *cfg, const char *dir)
{
    size_t n = strlen(dir);
    return strncmp(cfg->state_dir, dir, n) == 0 &&
           (cfg->state_dir[n] == '/' || cfg->state_dir[n] == 0);
}

/* The new root: an empty tmpfs (in a scaffold tmpfs over /tmp, this mount namespace
 * only) with the parts attached where a tool expects them. */
static void world_assemble(const struct zygote_config *cfg, struct world_parts *w)
{
    if (mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=64k") < 0)
        zdie("scaffold tmpfs");
    mkdir(NEWROOT, 0755);
    if (mount("tmpfs", NEWROOT, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m") < 0)
        zdie("root tmpfs");
    char path[4096];
    for (size_t i = 0; i < ARRAY_LEN(system_dirs); i++) {
        snprintf(path, sizeof path, NEWROOT "%s", system_dirs[i]);
        if (w->syslink[i][0] && symlink(w->syslink[i], path) < 0)
            zdie(system_dirs[i]);
        if (w->sys[i] >= 0) {
            mkdir(path, 0755);
            if (attach(w->sys[i], path) < 0)
                zdie(system_dirs[i]);
        }
    }
    /* empty: the host's personal and runtime dirs do not exist here */
    static const char *const empties[] = {"/home", "/root", "/run", "/var", "/var/tmp",
                                          "/tmp", "/dev", "/mnt", "/sys"};
    for (size_t i = 0; i < ARRAY_LEN(empties); i++) {
        snprintf(path, sizeof path, NEWROOT "%s", empties[i]);
        mkdir(path, 0755);
    }
    /* A sysfs of the world's own network namespace: the host's lists the host's
     * interfaces. Where even that cannot be mounted, /sys stays empty. */
    mount("sysfs", NEWROOT "/sys", "sysfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
    /* /tmp and /var/tmp are the session's tmp. Where the state dir lies beneath one of
     * them (tests, odd set-ups), the path to the session root must exist there: that one
     * is a tmpfs of the world's own instead (writable, nosuid, nodev, bounded), which
     * holds that path; the session root is attached on it (world_attach_session). */
    static const char *const tmps[] = {"/tmp", "/var/tmp"};
    for (size_t i = 0; i < ARRAY_LEN(tmps); i++) {
        snprintf(path, sizeof path, NEWROOT "%s", tmps[i]);
        if (state_dir_beneath(cfg, tmps[i]) &&
            mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777,size=64m") < 0)
            zdie(tmps[i]);
    }
    /* A minimal /dev. */
    if (mount("tmpfs", NEWROOT "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=0755,size=64k") < 0)
        zdie("/dev");
    for (size_t i = 0; i < ARRAY_LEN(world_devs); i++) {
        snprintf(path, sizeof path, NEWROOT "/dev/%s", world_devs[i]);
        touch(path);
        if (w->dev[i] >= 0 && attach(w->dev[i], path) < 0)
            zdie(path);
    }
    mkdir(NEWROOT "/dev/shm", 01777);
    mount("tmpfs", NEWROOT "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
          "mode=1777,size=64m");
    static const char *const links[][2] = {
        {"/proc/self/fd", NEWROOT "/dev/fd"}, {"/proc/self/fd/0", NEWROOT "/dev/stdin"},
        {"/proc/self/fd/1", NEWROOT "/dev/stdout"}, {"/proc/self/fd/2", NEWROOT "/dev/stderr"},
    };
    for (size_t i = 0; i < ARRAY_LEN(links); i++)
        if (symlink(links[i][0], links[i][1]) < 0)
            zdie(links[i][1]);
}

/* What is the session's in the world, beneath `top` (the new root before the pivot, ""
 * after): its tmp at /tmp and /var/tmp, its root, the policy's mounts inside the root. */
static void world_attach_session(const struct zygote_config *cfg, struct world_parts *w,
                                 const char *top, const char *session_root)
{
    char path[4096];
    static const char *const tmps[] = {"/tmp", "/var/tmp"};
    for (size_t i = 0; i < ARRAY_LEN(tmps); i++) {
        if (state_dir_beneath(cfg, tmps[i]))
            continue;       /* a tmpfs of the world's own, holding the path to the root */
        snprintf(path, sizeof path, "%s%s", top, tmps[i]);
        if (attach(w->session_tmp[i], path) < 0)
            zdie(tmps[i]);
    }
    /* The session's own root, at the same path as outside (AGENT_ROOT means the same
     * thing on both sides); no other session exists here. */
    snprintf(path, sizeof path, "%s%s", top, session_root);
    mkdirs(path, 0711);     /* traversable by the tool's uid, not listable */
    if (attach(w->session, path) < 0)
        zdie("attach the session root");
    /* The policy's mounts, inside the session root: the root is the tool's (a kept root
     * has had tools in it), so each destination is made and entered beneath it, never
     * through a symlink a tool planted, and refused if it cannot be. */
    int sroot = open(path, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (sroot < 0)
        zdie("open the session root");
    for (size_t i = 0; i < cfg->nmounts; i++) {
        int dest = root_mkdirs_beneath(sroot, cfg->mounts[i].dest, 0755);
        if (dest < 0 || syscall(SYS_move_mount, w->mounts[i], "", dest, "",
                                MOVE_MOUNT_F_EMPTY_PATH | MOVE_MOUNT_T_EMPTY_PATH) < 0)
            zdie(cfg->mounts[i].dest);
        close(dest);
    }
    close(sroot);
    free(w->mounts);
    w->mounts = NULL;
    close_quietly(&w->session);
    close_quietly(&w->session_tmp[0]);
    close_quietly(&w->session_tmp[1]);
}

static void world_seal_and_pivot(void)
{
    /* Nothing more is created in the root: read-only from here on. */
    if (mount(NULL, NEWROOT, NULL, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, "mode=0755") < 0)
        zdie("read-only root");
    /* Swap roots; the old one is detached, unreachable. */
    if (chdir(NEWROOT) < 0 || syscall(SYS_pivot_root, ".", ".") < 0 ||
        umount2(".", MNT_DETACH) < 0 || chdir("/") < 0)
        zdie("pivot_root");
}

/* Network: a namespace of our own; lo up for "loopback", down for "none". */
static void world_network(const struct zygote_config *cfg)
{
    if (cfg->loopback_up) {
        int s = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
        struct ifreq ifr;
        memset(&ifr, 0, sizeof ifr);
        strcpy(ifr.ifr_name, "lo");
        if (s >= 0 && ioctl(s, SIOCGIFFLAGS, &ifr) == 0) {
            ifr.ifr_flags |= IFF_UP;
            ioctl(s, SIOCSIFFLAGS, &ifr);
        }
        if (s >= 0)
            close(s);
    }
    if (sethostname("stockade", 8) < 0)
        zdie("sethostname");
}

/* In the zygote (its own namespaces, as yet the host's mount tree): build the session's
 * world and enter it. Dies with a message to the supervisor on any failure. */
static void build_world(const struct zygote_config *cfg, uid_t outer_uid, gid_t outer_gid,
                        bool userns, struct world_parts *w)
{
    if (userns)
        world_map_ids(outer_uid, outer_gid);
    if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0)
        zdie("make / private");
    world_take(cfg, w);
    world_assemble(cfg, w);
    if (cfg->session_root)
        world_attach_session(cfg, w, NEWROOT, cfg->session_root);
    world_seal_and_pivot();
    world_network(cfg);
}

/* A world made ahead of its session (cfg->session_root NULL) waits here for the session
 * (zygote_bind): the path of its root, with detached copies of the root and its tmp the
 * supervisor took. The root, sealed read-only at the pivot, is writable only while they
 * are attached; no tool has run here yet. */
static void world_bind(const struct zygote_config *cfg, struct world_parts *w)
{
    char msg[4096 + 2];
    int fds[ZYG_MAX_FDS], nfds;
    ssize_t n = recv_with_fds(ZYG_FD, msg, sizeof msg - 1, fds, ZYG_MAX_FDS, &nfds);
    if (n <= 0)
        _exit(0);           /* stopped before it had a session */
    msg[n] = 0;
    if (n < 3 || msg[0] != 'B' || msg[1] != '/' || strlen(msg) != (size_t)n ||
        (size_t)nfds != 3 + cfg->nmounts) {
        errno = EPROTO;
        zdie("the session to bind");
    }
    w->session = fds[0];
    w->session_tmp[0] = fds[1];
    w->session_tmp[1] = fds[2];
    for (size_t i = 0; i < cfg->nmounts; i++)
        w->mounts[i] = fds[3 + i];
    if (mount(NULL, "/", NULL, MS_REMOUNT | MS_NOSUID | MS_NODEV, "mode=0755") < 0)
        zdie("writable root");
    world_attach_session(cfg, w, "", msg + 1);
    if (mount(NULL, "/", NULL, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, "mode=0755") < 0)
        zdie("read-only root");
}

/* A request as the zygote got it, checked and pointing into its buffer. */
struct zyg_request {
    struct spawn_req req;
    bool ask_successor;
    char **argv, **envp, **rw;
};

static void zyg_request_free(struct zyg_request *r)
{
    free(r->argv);
    free(r->envp);
    free(r->rw);
    *r = (struct zyg_request){0};
}

static bool zyg_request_parse(char *msg, size_t n, struct zyg_request *r)
{
    *r = (struct zyg_request){0};
    struct zyg_msg h;
    if (n < sizeof h)
        return false;
    memcpy(&h, msg, sizeof h);
    char *p = msg + sizeof h, *end = msg + n;
    char *path = next_str(&p, end), *cwd = next_str(&p, end), *root = next_str(&p, end);
    bool ok = h.magic == ZYG_MAGIC && path && cwd && root && h.argc < 100000 &&
              h.envc < 100000 && h.rwc < 1000 &&
              (h.walls & ~(uint32_t)(SANDBOX_NET_CLOSED | SANDBOX_HOST_SHARED)) == 0;
    if (!ok)
        return false;
    r->argv = xcalloc(h.argc + 1, sizeof *r->argv);
    r->envp = xcalloc(h.envc + 1, sizeof *r->envp);
    r->rw = xcalloc(h.rwc + 1, sizeof *r->rw);
    for (uint32_t i = 0; ok && i < h.argc; i++)
        ok = (r->argv[i] = next_str(&p, end)) != NULL;
    for (uint32_t i = 0; ok && i < h.envc; i++)
        ok = (r->envp[i] = next_str(&p, end)) != NULL;
    for (uint32_t i = 0; ok && i < h.rwc; i++)
        ok = (r->rw[i] = next_str(&p, end)) != NULL;
    if (!ok) {
        zyg_request_free(r);
        return false;
    }
    r->req = (struct spawn_req){
        .landlock_fd = -1,
        .path = path, .argv = r->argv, .envp = r->envp, .cwd = cwd,
        .cwd_dev = (dev_t)h.cwd_dev, .cwd_ino = (ino_t)h.cwd_ino,
        .drop_user = h.drop_user, .uid = h.uid, .gid = h.gid, .limits = h.limits,
        .with_stdin = h.with_stdin, .landlock = h.landlock, .seccomp = h.seccomp,
        .walls = h.walls, .session_root = root,
        .rw_paths = (const char *const *)r->rw,
    };
    r->ask_successor = h.ask_successor != 0;
    return true;
}

/* The next call's shim, made ahead of time: a clone of the zygote that waits for its
 * request. A call then costs the zygote a message, not a fork (forking is what a call
 * spends most of its time on here); the zygote makes the next spare after answering,
 * while the call runs. In a session's world the spare is pid 1 of a fresh pid namespace
 * in a copy of the mount tree, so that its /proc shows its own processes only.
 *
 * A spare is a runner: after its call (tree reaped, report written) it waits for the
 * next request on the same socket, until the supervisor closes it (a one-call shim is a
 * runner whose socket is closed once its request is sent). */
static _Noreturn void spare_main(int sock, bool world, pid_t zygote, char *buf)
{
    /* the request socket becomes fd 3 (over our copy of the supervisor's socket, which
     * is not ours to hold), the zygote's ask pipe fd 4; nothing else the zygote had open
     * stays */
    /* a spare outlives its zygote by nothing: the supervisor counts on a live zygote's
     * spares only (its calls re-arm this for the supervisor's death, checked again) */
    if (prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0) < 0 || (!world && getppid() != zygote))
        _exit(1);
    if (dup2(sock, ZYG_FD) < 0 || dup2(ZYG_ASK_W, SHIM_READY_FD) < 0)
        _exit(1);
    close_range(SHIM_READY_FD + 1, ~0U, 0);
    if (world && mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL) < 0)
        _exit(1);
    spawn_shim_prepare(true);
    /* The filter its first call attaches, compiled now if it was not before this spare
     * was forked (a run's spawner starts before its policy is read): off the call's path.
     * Only the likeliest (a closed network; the spawner's calls share the host), the one
     * that costs a compile of its own; another is compiled when a call needs it. */
    if (sandbox_seccomp_prepare_walls(SANDBOX_NET_CLOSED | (world ? 0 : SANDBOX_HOST_SHARED)) < 0)
        _exit(1);
    spawn_runner_init(world ? 0 : zygote);
    for (;;) {
        int fds[5], nfds;
        ssize_t n = recv_with_fds(ZYG_FD, buf, ZYG_MAX_MSG, fds, 5, &nfds);
        struct zyg_request r;
        if (n <= 0 || nfds < 4 || !zyg_request_parse(buf, (size_t)n, &r))
            _exit(0);       /* the supervisor is done with it, went away, or sent garbage */
        if (nfds == 5)
            r.req.landlock_fd = fds[4];
        bool ok = spawn_runner_call(&r.req, fds[0], fds[1], fds[2], fds[3], r.ask_successor);
        if (nfds == 5)
            close(fds[4]);
        zyg_request_free(&r);
        if (!ok)
            _exit(0);
    }
}

static void spare_release(struct zyg_spare *sp)
{
    close_quietly(&sp->sock);
    close_quietly(&sp->pidfd);
    sp->pid = -1;
}

static bool spare_make(struct zyg_spare *sp, bool world, char *buf)
{
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) < 0)
        return false;
    int size = ZYG_MAX_MSG * 2;
    setsockopt(sv[0], SOL_SOCKET, SO_SNDBUF, &size, sizeof size);
    setsockopt(sv[1], SOL_SOCKET, SO_RCVBUF, &size, sizeof size);
    pid_t zygote = getpid();
    int pidfd = -1;
    int flags = (world ? CLONE_NEWPID | CLONE_NEWNS : 0) | CLONE_PIDFD | SIGCHLD;
    pid_t pid = (pid_t)syscall(SYS_clone, flags, NULL, &pidfd, NULL, 0);
    if (pid == 0)
        spare_main(sv[1], world, zygote, buf);
    int e = errno;
    close(sv[1]);
    if (pid < 0) {
        close(sv[0]);
        errno = e;
        return false;
    }
    *sp = (struct zyg_spare){pid, pidfd, sv[0]};
    return true;
}

/* Make a spare and hand it to the supervisor: {pid, 0} with its pidfd and request socket,
 * or {-1, errno}. */
static void spare_deliver(bool world, char *buf)
{
    struct zyg_spare sp;
    int32_t answer[2] = {-1, 0};
    if (spare_make(&sp, world, buf))
        answer[0] = (int32_t)sp.pid;
    else
        answer[1] = errno;
    int fds[2] = {answer[0] > 0 ? sp.pidfd : -1, answer[0] > 0 ? sp.sock : -1};
    send_with_fds(ZYG_FD, answer, sizeof answer, fds, answer[0] > 0 ? 2 : 0);
    if (answer[0] > 0)
        spare_release(&sp);
}

/* The zygote only makes spares: when the supervisor asks (a ZYG_SPARE word: a session's
 * first, or to make up for one lost) and when a spare's shim has started its tool (a byte
 * on the ask pipe: its successor, forked while that call runs rather than during the
 * next one's start). The supervisor talks to each spare directly, so a call's path has
 * no hop through here. */
static void zygote_serve(bool world)
{
    char *buf = xmalloc(ZYG_MAX_MSG);
    for (;;) {
        struct pollfd pf[2] = {{ZYG_FD, POLLIN, 0}, {ZYG_ASK_R, POLLIN, 0}};
        if (poll(pf, 2, -1) < 0)
            continue;
        if (pf[1].revents & POLLIN) {
            char asks[8];
            ssize_t k = read(ZYG_ASK_R, asks, sizeof asks);
            for (ssize_t i = 0; i < k; i++)
                spare_deliver(world, buf);
        }
        if (pf[0].revents & (POLLIN | POLLHUP | POLLERR)) {
            uint32_t ask;
            int nfds, none[1];
            ssize_t n = recv_with_fds(ZYG_FD, &ask, sizeof ask, none, 0, &nfds);
            if (n <= 0)
                _exit(0);           /* the supervisor closed the session */
            if (n == sizeof ask && ask == ZYG_SPARE)
                spare_deliver(world, buf);
        }
    }
}

static void spare_drop(struct zyg_spare *sp)
{
    if (sp->pidfd >= 0)
        pidfd_send_signal(sp->pidfd, SIGKILL, NULL, 0);
    close_quietly(&sp->pidfd);
    close_quietly(&sp->sock);
}

static int spare_ask(struct zygote *z)
{
    uint32_t ask = ZYG_SPARE;
    if (send_with_fds(z->sock, &ask, sizeof ask, NULL, 0) != sizeof ask)
        return -1;
    z->asked++;
    return 0;
}

/* Take the spares the zygote has delivered; with `wait`, block for one. -1 when the
 * zygote is gone or could not make one (errno).
 * Everything delivered is read, expected or not: a shim counted as lost (killed before
 * it could ask for its successor, as far as we knew) may have asked after all, and its
 * spare, left unread in the socket, would live on uncounted. */
static int spare_collect(struct zygote *z, bool wait)
{
    for (;;) {
        bool block = wait && z->asked + z->coming > 0;
        int32_t answer[2];
        int fds[2], nfds = 0;
        ssize_t n = recv_with_fds_flags(z->sock, answer, sizeof answer, fds, 2, &nfds,
                                        block ? 0 : MSG_DONTWAIT);
        if (n < 0 && !block && (errno == EAGAIN || errno == EWOULDBLOCK))
            return 0;
        if (n != sizeof answer) {
            for (int i = 0; i < nfds; i++)
                close(fds[i]);
            z->broken = true;       /* the session's calls fail from now on, never hang */
            errno = n < 0 ? errno : EPIPE;
            return -1;
        }
        if (z->asked > 0)
            z->asked--;
        else if (z->coming > 0)
            z->coming--;        /* else: the successor of a shim we counted as lost */
        /* more than it keeps ahead (a lost shim's ask, made up for, arrived after all):
         * closing its socket ends it */
        if (answer[0] <= 0 || nfds != 2 || z->npool >= z->want) {
            for (int i = 0; i < nfds; i++)
                close(fds[i]);
            if (answer[0] <= 0) {
                errno = answer[1] ? answer[1] : EAGAIN;
                return -1;
            }
            continue;
        }
        z->pool[z->npool++] = (struct zyg_spare){answer[0], fds[0], fds[1]};
        wait = false;
    }
    return 0;
}

void zygote_spare_lost(struct zygote *z)
{
    if (z && z->coming > 0)
        z->coming--;
}

struct zygote *zygote_start_begin(const struct zygote_config *cfg, char **err)
{
    const struct sandbox_caps *c = sandbox_caps();
    bool userns = !c->root && !cfg->plain;
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) < 0) {
        *err = xasprintf("zygote socketpair: %s", strerror(errno));
        return NULL;
    }
    int sndbuf = ZYG_MAX_MSG * 2;
    setsockopt(sv[0], SOL_SOCKET, SO_SNDBUF, &sndbuf, sizeof sndbuf);
    setsockopt(sv[1], SOL_SOCKET, SO_RCVBUF, &sndbuf, sizeof sndbuf);
    uid_t uid = getuid();
    gid_t gid = getgid();
    pid_t supervisor = getpid();
    sigset_t all, old;
    sigfillset(&all);
    sigprocmask(SIG_SETMASK, &all, &old);
    int pidfd = -1;
    int nsflags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS |
                  (userns ? CLONE_NEWUSER : 0);
    pid_t pid = (pid_t)syscall(SYS_clone, CLONE_PIDFD | SIGCHLD, NULL, &pidfd, NULL, 0);
    if (pid == 0) {
        struct sigaction sa;
        memset(&sa, 0, sizeof sa);
        sa.sa_handler = SIG_DFL;
        for (int sig = 1; sig < NSIG; sig++)
            sigaction(sig, &sa, NULL);
        /* the shims are reaped by the kernel: their status travels on their own pipe */
        sa.sa_handler = SIG_IGN;
        sigaction(SIGCHLD, &sa, NULL);
        sigset_t none;
        sigemptyset(&none);
        sigprocmask(SIG_SETMASK, &none, NULL);
        if (prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0) < 0 || getppid() != supervisor)
            _exit(1);
        if (dup2(sv[1], ZYG_FD) < 0)
            _exit(1);
        close_range(ZYG_FD + 1, ~0U, 0);
        /* the spares' shims ask for their successors on this pipe */
        int ask[2];
        if (pipe2(ask, O_CLOEXEC | O_NONBLOCK) < 0 || dup2(ask[0], ZYG_ASK_R) < 0 ||
            dup2(ask[1], ZYG_ASK_W) < 0)
            _exit(1);
        close_range(ZYG_ASK_W + 1, ~0U, 0);
        int devnull = open("/dev/null", O_RDWR | O_CLOEXEC);
        if (devnull >= 0) {
            dup2(devnull, 0);
            dup2(devnull, 1);
            close(devnull);
        }
        if (!cfg->plain) {
            /* made here, not by the clone: a network namespace takes the caller half a
             * millisecond, and the caller is the supervisor's loop */
            if (unshare(nsflags) < 0)
                zdie("namespaces");
            struct world_parts w;
            build_world(cfg, uid, gid, userns, &w);
            if (!cfg->session_root)
                world_bind(cfg, &w);
        }
        send_with_fds(ZYG_FD, "R", 1, NULL, 0);     /* ready */
        zygote_serve(!cfg->plain);
    }
    int e = errno;
    sigprocmask(SIG_SETMASK, &old, NULL);
    close(sv[1]);
    if (pid < 0) {
        close(sv[0]);
        *err = xasprintf("zygote clone: %s", strerror(e));
        return NULL;
    }
    /* ours from now on: never taken for an orphan to sweep */
    proc_keep(pid);
    struct zygote *z = xcalloc(1, sizeof *z);
    z->pid = pid;
    z->pidfd = pidfd;
    z->sock = sv[0];
    z->plain = cfg->plain;
    z->unbound = !cfg->plain && !cfg->session_root;
    z->starting = true;
    return z;
}

int zygote_start_fd(const struct zygote *z) { return z->sock; }

void zygote_one_shot(struct zygote *z)
{
    z->one_shot = true;
    z->want = 1;
    spare_ask(z);       /* queued on its socket: read once it has sent its ready word */
}

/* Its ready message (or its last words) has arrived: read it. -1 and *err, z marked
 * broken (not freed), when it could not build its world. */
static int start_complete(struct zygote *z, char **err)
{
    char hello[300];
    int nfds;
    int none[1];
    ssize_t n = recv_with_fds(z->sock, hello, sizeof hello - 1, none, 0, &nfds);
    z->starting = false;
    if (n != 1 || hello[0] != 'R') {
        hello[n > 1 ? n : 1] = 0;
        /* its last words: E<errno>:<what>: <why> */
        char *text = n > 1 ? hello + 1 : NULL;
        long code = text ? strtol(text, &text, 10) : 0;
        text = text && *text == ':' ? text + 1 : text;
        *err = xasprintf("the session's sandbox could not be built: %s",
                         text ? text : "the zygote died");
        z->broken = true;
        errno = code > 0 ? (int)code : EPIPE;   /* ENOSPC for namespaces: retryable */
        return -1;
    }
    /* the server's spawner serves every session's calls at once: keep a few ahead */
    z->want = z->plain && !z->one_shot ? ZYG_POOL : 1;
    while (z->plain && z->asked < z->want && spare_ask(z) == 0)
        ;
    /* a session's first runner, made while the client hears its session is open */
    if (!z->plain && zygote_runners_enabled())
        spare_ask(z);
    return 0;
}

int zygote_start_finish(struct zygote *z, char **err)
{
    if (start_complete(z, err) < 0) {
        int e = errno;
        zygote_stop(z);
        errno = e;
        return -1;
    }
    return 0;
}

bool zygote_prepare_enabled(void)
{
    const char *v = getenv("STOCKADE_PREPARED");
    /* the session's root is handed over as a detached mount: open_tree takes root */
    return sandbox_caps()->root && !(v && strcmp(v, "0") == 0);
}

/* Detached copies of the policy's mounts, as world_take makes them (read-only where
 * asked), private: n of them in fds[], or -1 and *err (none left open). */
static int policy_mounts_clone(const struct sandbox_mount *mounts, size_t n, int *fds,
                               char **err)
{
    struct mount_attr a = {.propagation = MS_PRIVATE};
    for (size_t i = 0; i < n; i++) {
        fds[i] = clone_tree(mounts[i].src, true);
        a.attr_set = mounts[i].ro ? MOUNT_ATTR_RDONLY : 0;
        if (fds[i] < 0 || syscall(SYS_mount_setattr, fds[i], "", AT_EMPTY_PATH | AT_RECURSIVE,
                                  &a, sizeof a) < 0) {
            *err = xasprintf("%s: %s", mounts[i].src, strerror(errno));
            for (size_t j = 0; j <= i; j++)
                if (fds[j] >= 0)
                    close(fds[j]);
            return -1;
        }
    }
    return 0;
}

int zygote_bind(struct zygote *z, const char *session_root, const struct sandbox_mount *mounts,
                size_t nmounts, char **err)
{
    if (!z->unbound) {
        *err = xasprintf("zygote_bind: this zygote has its session");
        errno = EINVAL;
        return -1;
    }
    /* it says nothing before its session: a word now is its last (its world failed) */
    struct pollfd pf = {z->sock, POLLIN, 0};
    if (poll(&pf, 1, 0) > 0 || !zygote_alive(z)) {
        if (start_complete(z, err) == 0)
            *err = xasprintf("a zygote made ahead spoke before its session");
        errno = EPIPE;
        return -1;
    }
    size_t len = strlen(session_root);
    if (session_root[0] != '/' || len > 4096) {
        *err = xasprintf("session root %s: not an absolute path of at most 4096 bytes",
                         session_root);
        errno = EINVAL;
        return -1;
    }
    if (nmounts > ZYG_MAX_FDS - 3) {
        *err = xasprintf("%zu policy mounts: a world made ahead takes at most %d",
                         nmounts, ZYG_MAX_FDS - 3);
        errno = E2BIG;
        return -1;
    }
    int trees[ZYG_MAX_FDS];
    const char *what = NULL;
    if (session_trees_clone(session_root, &trees[0], &trees[1], &what) < 0) {
        *err = xasprintf("%s: %s", what, strerror(errno));
        return -1;
    }
    if (policy_mounts_clone(mounts, nmounts, trees + 3, err) < 0) {
        int e = errno;
        for (int i = 0; i < 3; i++)
            close(trees[i]);
        errno = e;
        return -1;
    }
    char *msg = xasprintf("B%s", session_root);
    ssize_t n = send_with_fds(z->sock, msg, len + 1, trees, 3 + (int)nmounts);
    int e = errno;
    free(msg);
    for (size_t i = 0; i < 3 + nmounts; i++)
        close(trees[i]);
    if (n != (ssize_t)len + 1) {
        *err = xasprintf("hand the session to its zygote: %s", strerror(e));
        errno = e;
        return -1;
    }
    z->unbound = false;     /* starting: its ready word (or last words) comes next */
    z->made_ahead = true;
    return 0;
}

/* A zygote a session was given while it starts: 0 once it is ready, -1 with EINPROGRESS
 * while it builds, -1 with EPIPE (logged why) if it could not. Never waits. */
static int start_poll(struct zygote *z)
{
    struct pollfd pf = {z->sock, POLLIN, 0};
    if (poll(&pf, 1, 0) == 0) {
        errno = EINPROGRESS;
        return -1;
    }
    char *err = NULL;
    if (start_complete(z, &err) < 0) {
        LOG_W("%s", err);
        free(err);
        errno = EPIPE;
        return -1;
    }
    return 0;
}

int zygote_wait_fd(const struct zygote *z) { return z->sock; }

void zygote_wait_begin(struct zygote *z) { z->waiting++; }

void zygote_wait_end(struct zygote *z)
{
    if (z->waiting > 0)
        z->waiting--;
}

struct zygote *zygote_start(const struct zygote_config *cfg, char **err)
{
    struct zygote *z = zygote_start_begin(cfg, err);
    if (!z)
        return NULL;
    struct pollfd pf = {z->sock, POLLIN, 0};
    while (poll(&pf, 1, -1) < 0 && errno == EINTR)
        ;
    return zygote_start_finish(z, err) == 0 ? z : NULL;
}

/* A live spare off the pool: 0, or -1 with errno. Neither zygote is waited for: the
 * server's spawner says EWOULDBLOCK when it has none ready (the caller forks the shim
 * itself); a session's zygote is asked (its own spare, not only the one a running call's
 * shim asked for, which may be slow; one already asked for is not doubled) and says
 * EINPROGRESS: the caller waits for zygote_wait_fd, off the loop's critical path, and
 * tries again. */
static int spare_take(struct zygote *z, struct zyg_spare *out)
{
    if (spare_collect(z, false) < 0)
        return -1;
    for (;;) {
        while (z->npool > 0) {
            *out = z->pool[--z->npool];
            struct pollfd gone = {out->pidfd, POLLIN, 0};
            if (poll(&gone, 1, 0) <= 0) {
                /* calls still waiting: the one they asked for may be this one */
                if (!z->plain && z->waiting > 0 && z->asked == 0)
                    spare_ask(z);
                return 0;
            }
            spare_drop(out);        /* it died while it waited */
        }
        if (z->plain) {
            while (z->npool + z->asked + z->coming < z->want && spare_ask(z) == 0)
                ;
            errno = EWOULDBLOCK;
            return -1;
        }
        if (z->asked == 0 && spare_ask(z) < 0)
            return -1;
        errno = EINPROGRESS;
        return -1;
    }
}

/* The request as it goes to a spare or a runner (ask_successor patched per spare). */
static bool request_build(const struct spawn_req *req, struct buf *b)
{
    struct zyg_msg h = {
        .magic = ZYG_MAGIC, .argc = (uint32_t)strv_len(req->argv),
        .envc = (uint32_t)strv_len(req->envp),
        .rwc = (uint32_t)strv_len((char *const *)req->rw_paths), .drop_user = req->drop_user,
        .with_stdin = req->with_stdin, .landlock = req->landlock, .seccomp = req->seccomp,
        .walls = req->walls, .uid = req->uid, .gid = req->gid, .limits = req->limits,
        .cwd_dev = (uint64_t)req->cwd_dev, .cwd_ino = (uint64_t)req->cwd_ino,
    };
    buf_append(b, &h, sizeof h);
    put_str(b, req->path);
    put_str(b, req->cwd);
    put_str(b, req->session_root);
    for (uint32_t i = 0; i < h.argc; i++)
        put_str(b, req->argv[i]);
    for (uint32_t i = 0; i < h.envc; i++)
        put_str(b, req->envp[i]);
    for (uint32_t i = 0; i < h.rwc; i++)
        put_str(b, req->rw_paths[i]);
    if (b->len > ZYG_MAX_MSG) {
        buf_free(b);
        errno = E2BIG;
        return false;
    }
    return true;
}

static void request_set_ask(struct buf *b, bool ask)
{
    uint32_t v = ask;
    memcpy(b->data + offsetof(struct zyg_msg, ask_successor), &v, sizeof v);
}

static bool runner_alive(const struct zyg_spare *sp)
{
    struct pollfd gone = {sp->pidfd, POLLIN, 0};
    return poll(&gone, 1, 0) == 0;
}

/* An idle runner of the session's, alive: true and *out, else false. */
static bool runner_take(struct runner_pool *pool, struct zyg_spare *out)
{
    while (pool && pool->nidle > 0) {
        *out = pool->idle[--pool->nidle];
        if (runner_alive(out))
            return true;
        spare_drop(out);            /* it died while it waited */
    }
    return false;
}

/* Send the call to a live spare (or, with `pool`, an idle runner first): 0 and *used, or
 * -1 with errno. A spare that died while it waited is dropped (the pool is small); a send
 * that fails all the same is retried once with another. */
static int request_send(struct zygote *z, struct runner_pool *pool, struct buf *b,
                        struct spawn_pipes *p, int landlock_fd, struct zyg_spare *used,
                        bool *fresh)
{
    int fds[5] = {p->in[0], p->out[1], p->err[1], p->status[1], landlock_fd};
    int nfds = landlock_fd >= 0 ? 5 : 4;
    int e = 0;
    for (int attempt = 0; attempt < 2; attempt++) {
        struct zyg_spare sp;
        *fresh = !runner_take(pool, &sp);
        if (*fresh && spare_take(z, &sp) < 0)
            return -1;
        /* A fresh spare asks for its successor once its tool runs: in the spawner, whose
         * spares every session draws on, always; in a session's zygote, only as a
         * one-call shim (a runner pool grows on demand instead) */
        bool ask = *fresh && (z->plain || !pool) && !z->one_shot;
        request_set_ask(b, ask);
        if (send_with_fds(sp.sock, b->data, b->len, fds, nfds) == (ssize_t)b->len) {
            if (ask)
                z->coming++;
            *used = sp;
            return 0;
        }
        e = errno;
        spare_drop(&sp);
    }
    errno = e;
    return -1;
}

/* Hand the call to a spare and its pipes: with `pool`, to one of the session's runners
 * (out->pidfd the call's own copy, *runner holding it); without, to a one-call shim,
 * whose socket is closed once the request is sent, so that it ends after its call. */
static int start_on(struct zygote *z, struct runner_pool *pool, const struct spawn_req *req,
                    struct spawn_child *out, struct zyg_runner *runner)
{
    if (z->broken) {
        errno = EPIPE;
        return -1;
    }
    if (z->starting && start_poll(z) < 0)
        return -1;
    struct buf b = {0};
    if (!request_build(req, &b))
        return -1;
    struct spawn_pipes p;
    if (spawn_pipes_open(&p, req->with_stdin) < 0) {
        buf_free(&b);
        return -1;
    }
    struct zyg_spare sp;
    bool fresh;
    int rc = request_send(z, pool, &b, &p, req->landlock_fd, &sp, &fresh);
    int e = errno;
    if (rc == 0 && !pool) {
        close_quietly(&sp.sock);
        spawn_pipes_finish(&p, sp.pid, sp.pidfd, out);
    } else if (rc == 0) {
        int watch_fd = fcntl(sp.pidfd, F_DUPFD_CLOEXEC, 3);
        if (watch_fd < 0) {
            e = errno;
            spare_drop(&sp);        /* it has the call: ending it fails the call cleanly */
            rc = -1;
        } else {
            /* the call watches its own copy of the pidfd; the runner keeps the other */
            spawn_pipes_finish(&p, sp.pid, watch_fd, out);
            *runner = (struct zyg_runner){sp, fresh && z->plain && !z->one_shot};
            pool->busy++;
        }
    }
    buf_free(&b);
    spawn_pipes_close(&p);
    errno = e;
    return rc;
}

int zygote_spawn(struct zygote *z, const struct spawn_req *req, struct spawn_child *out)
{
    return start_on(z, NULL, req, out, NULL);
}

bool zygote_alive(struct zygote *z)
{
    if (!z || z->broken)
        return false;
    struct pollfd pf = {z->pidfd, POLLIN, 0};
    if (z->pidfd >= 0 && poll(&pf, 1, 0) == 1) {
        z->broken = true;       /* a pidfd is readable once its process has exited */
        return false;
    }
    return true;
}

bool zygote_runners_enabled(void)
{
    static int enabled = -1;
    if (enabled < 0) {
        const char *v = getenv("STOCKADE_RUNNERS");
        enabled = !(v && strcmp(v, "0") == 0);
    }
    return enabled;
}

int zygote_run(struct zygote *z, struct runner_pool **pool, const struct spawn_req *req,
               struct spawn_child *out, struct zyg_runner *runner)
{
    if (!*pool)
        *pool = xcalloc(1, sizeof **pool);
    return start_on(z, *pool, req, out, runner);
}

void zygote_runner_done(struct runner_pool *pool, struct zyg_runner *r, bool reported)
{
    if (r->sp.pid <= 0)
        return;
    if (pool && pool->busy > 0)
        pool->busy--;
    if (reported && pool && pool->nidle < RUNNERS_MAX && runner_alive(&r->sp)) {
        pool->idle[pool->nidle++] = r->sp;
    } else {
        spare_drop(&r->sp);
    }
    r->sp = (struct zyg_spare){-1, -1, -1};
}

unsigned zygote_runners_standby(const struct runner_pool *pool, unsigned *fds)
{
    if (!pool)
        return 0;
    if (fds)
        *fds += 2u * (unsigned)pool->nidle;
    return (unsigned)pool->nidle;
}

void zygote_runners_free(struct runner_pool *pool)
{
    if (!pool)
        return;
    while (pool->nidle > 0)
        spare_drop(&pool->idle[--pool->nidle]);
    free(pool);
}

unsigned zygote_standby(struct zygote *z, int wait_ms, unsigned *fds)
{
    if (!z)
        return 0;
    if (z->starting) {              /* only itself so far, and its socket */
        if (fds)
            *fds += 2;
        return zygote_alive(z) ? 1 : 0;
    }
    if (!zygote_alive(z)) {
        /* its spares died with it (PDEATHSIG): none is standing by, and none is coming */
        while (z->npool > 0)
            spare_drop(&z->pool[--z->npool]);
        z->asked = z->coming = 0;
        if (fds)
            *fds += 2u;         /* its pidfd and socket, held until it is replaced */
        return 0;
    }
    /* Spares asked for are on their way (a fork, under a millisecond): with wait_ms, wait
     * a little for them, so that a quiet server reports the same figure every time. Not
     * a session's zygote's: its spares are taken off its socket only by its calls, which
     * wait for that socket to turn readable (zygote_wait_fd); one taken here would leave
     * them waiting for nothing. Those on their way are counted as asked for. */
    bool collect = z->plain && wait_ms >= 0;
    if (wait_ms >= 0) {
        if (collect)
            spare_collect(z, false);    /* what arrived, expected or not */
        /* a spare killed while it waited in the pool stands by for nothing */
        int kept = 0;
        for (int i = 0; i < z->npool; i++) {
            struct pollfd sp = {z->pool[i].pidfd, POLLIN, 0};
            if (poll(&sp, 1, 0) == 1)
                spare_drop(&z->pool[i]);
            else
                z->pool[kept++] = z->pool[i];
        }
        z->npool = kept;
    }
    struct pollfd pf = {z->sock, POLLIN, 0};
    int64_t until = now_ms() + (wait_ms > 0 ? wait_ms : 0);
    for (int64_t left = collect ? wait_ms : -1; left >= 0 && !z->broken &&
                                                z->asked + z->coming > 0;
         left = until - now_ms()) {
        if (left > 0 && poll(&pf, 1, (int)left) <= 0)
            break;
        if (spare_collect(z, false) < 0 || left == 0)
            break;
    }
    if (fds)
        *fds += 2u + 2u * (unsigned)z->npool;   /* pidfd and socket, its own and each spare's */
    return 1u + (unsigned)(z->npool + z->asked + z->coming);
}

void zygote_stop(struct zygote *z)
{
    if (!z)
        return;
    /* SIGKILL of the zygote: its pid namespaces' inits get SIGUSR1 (PDEATHSIG) and end
     * their trees; the mount and network namespaces go with the last process. */
    while (z->npool > 0)
        spare_drop(&z->pool[--z->npool]);
    /* not waited for: a zygote slow to die (its namespaces to tear down, or frozen)
     * costs the loop nothing; it is reaped when it is gone */
    proc_kill_async(z->pid, z->pidfd);
    close_quietly(&z->sock);
    free(z);
}
