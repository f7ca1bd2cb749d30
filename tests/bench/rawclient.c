/* A raw MessagePack-RPC client of `stockade serve` (PROTOCOL.md) for the benchmark:
 * msgpack-c on a pipe, no threads, nothing between the request and the wire.
 * tests/bench/run.py compiles it with cc ... -lmsgpackc.
 *
 *   rawclient [OPTIONS] -- SERVE_ARGV...
 *
 *   --mode seq     open --sessions M sessions (one after another, --open-gap-ms G apart:
 *                  default 0, back to back), then -n N sequential
 *                  calls in the first one (after --warmup W). Prints
 *                    rss_idle KB        the supervisor's VmRSS after hello (x5 samples)
 *                    open NS            each session.open's round trip
 *                    rss_open KB / kids_rss KB / kids_pss KB / kids N
 *                                       after the opens: the supervisor, and the sum over
 *                                       its descendants (zygotes, shims) (x5 samples)
 *                    lat NS             each call's round trip
 *                    close NS           each session.close's round trip
 *   --mode par     K = --inflight sessions, K calls kept in flight (one per session,
 *                  pipelined on the one connection), N calls per repetition, --reps R;
 *                  prints "rate CALLS_PER_S" per repetition
 *   --mode stream  one call per repetition; prints "stream NS BYTES" (BYTES: the stdout
 *                  the tool wrote, as delivered plus truncated); with --stream the call
 *                  asks for call.output notifications and BYTES counts what arrived
 *   --tool NAME --arg A (repeatable) --timeout-ms T
 *
 * Any response that is not class OK, an RPC error, or the server dying is a failure:
 * exit 1 with the reason on stderr (the benchmark fails on crashes, never on numbers). */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <msgpack.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static int to_srv = -1, from_srv = -1;
static pid_t srv_pid;
static msgpack_unpacker unp;
static uint32_t next_id = 1;
static int want_stream;
static long long stream_bytes;

static long long now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void die(const char *fmt, const char *a)
{
    fprintf(stderr, "rawclient: ");
    fprintf(stderr, fmt, a);
    fputc('\n', stderr);
    if (srv_pid > 0) {
        int st;
        close(to_srv);
        if (waitpid(srv_pid, &st, WNOHANG) == srv_pid && WIFSIGNALED(st))
            fprintf(stderr, "rawclient: the server died of signal %d\n", WTERMSIG(st));
    }
    exit(1);
}

/* ---- msgpack helpers ------------------------------------------------------------------ */

static void pack_str(msgpack_packer *pk, const char *s)
{
    size_t n = strlen(s);
    msgpack_pack_str(pk, n);
    msgpack_pack_str_body(pk, s, n);
}

static const msgpack_object *map_get(const msgpack_object *m, const char *key)
{
    if (!m || m->type != MSGPACK_OBJECT_MAP)
        return NULL;
    size_t kl = strlen(key);
    for (uint32_t i = 0; i < m->via.map.size; i++) {
        const msgpack_object *k = &m->via.map.ptr[i].key;
        if (k->type == MSGPACK_OBJECT_STR && k->via.str.size == kl &&
            memcmp(k->via.str.ptr, key, kl) == 0)
            return &m->via.map.ptr[i].val;
    }
    return NULL;
}

static int str_is(const msgpack_object *o, const char *s)
{
    return o && o->type == MSGPACK_OBJECT_STR && o->via.str.size == strlen(s) &&
           memcmp(o->via.str.ptr, s, o->via.str.size) == 0;
}

static char *str_dup(const msgpack_object *o)
{
    if (!o || o->type != MSGPACK_OBJECT_STR)
        return strdup("?");
    return strndup(o->via.str.ptr, o->via.str.size);
}

static long long int_of(const msgpack_object *o)
{
    if (!o)
        return 0;
    if (o->type == MSGPACK_OBJECT_POSITIVE_INTEGER)
        return (long long)o->via.u64;
    if (o->type == MSGPACK_OBJECT_NEGATIVE_INTEGER)
        return o->via.i64;
    return 0;
}

static void write_all(const char *p, size_t n)
{
    while (n) {
        ssize_t w = write(to_srv, p, n);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            die("write to the server: %s", strerror(errno));
        }
        p += w, n -= (size_t)w;
    }
}

/* ---- requests ---------------------------------------------------------------------------- */

struct opt {
    const char *tool;
    const char *args[32];
    int nargs;
    long long timeout_ms;
};
static struct opt O = {.tool = "true"};

static uint32_t send_req(const char *method, const char *sid)
{
    msgpack_sbuffer sb;
    msgpack_packer pk;
    msgpack_sbuffer_init(&sb);
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    uint32_t id = next_id++;
    msgpack_pack_array(&pk, 4);
    msgpack_pack_uint32(&pk, 0);
    msgpack_pack_uint32(&pk, id);
    pack_str(&pk, method);
    msgpack_pack_array(&pk, 1);     /* protocol 2: params are [the one argument, a map] */
    if (strcmp(method, "call") == 0) {
        int n = 3 + (O.timeout_ms > 0) + (want_stream > 0);
        msgpack_pack_map(&pk, (size_t)n);
        pack_str(&pk, "session_id");
        pack_str(&pk, sid);
        pack_str(&pk, "tool");
        pack_str(&pk, O.tool);
        pack_str(&pk, "argv");
        msgpack_pack_array(&pk, (size_t)O.nargs);
        for (int i = 0; i < O.nargs; i++)
            pack_str(&pk, O.args[i]);
        if (O.timeout_ms > 0) {
            pack_str(&pk, "timeout_ms");
            msgpack_pack_int64(&pk, O.timeout_ms);
        }
        if (want_stream) {
            pack_str(&pk, "stream");
            msgpack_pack_true(&pk);
        }
    } else if (sid) {
        msgpack_pack_map(&pk, 1);
        pack_str(&pk, "session_id");
        pack_str(&pk, sid);
    } else if (strcmp(method, "hello") == 0) {
        msgpack_pack_map(&pk, 1);
        pack_str(&pk, "client");
        pack_str(&pk, "bench-rawclient");
    } else {
        msgpack_pack_map(&pk, 0);
    }
    write_all(sb.data, sb.size);
    msgpack_sbuffer_destroy(&sb);
    return id;
}

/* The next response; notifications are counted (call.output) and skipped. The returned
 * object lives until the next call. On return *id is its msgid and *result its result
 * map; an RPC error is fatal. */
static msgpack_unpacked cur;
static const msgpack_object *next_response(uint32_t *id)
{
    for (;;) {
        msgpack_unpack_return r = msgpack_unpacker_next(&unp, &cur);
        if (r == MSGPACK_UNPACK_SUCCESS) {
            const msgpack_object *o = &cur.data;
            if (o->type != MSGPACK_OBJECT_ARRAY || o->via.array.size < 3)
                die("%s", "a message that is not an array");
            long long kind = int_of(&o->via.array.ptr[0]);
            if (kind == 2) {
                /* [2, method, [map]] */
                const msgpack_object *args = &o->via.array.ptr[2];
                const msgpack_object *p = args->type == MSGPACK_OBJECT_ARRAY &&
                                          args->via.array.size == 1 ? args->via.array.ptr : NULL;
                const msgpack_object *d = map_get(p, "data");
                if (str_is(&o->via.array.ptr[1], "call.output") && d &&
                    (d->type == MSGPACK_OBJECT_BIN || d->type == MSGPACK_OBJECT_STR) &&
                    str_is(map_get(p, "stream"), "stdout"))
                    stream_bytes += d->via.bin.size;
                continue;
            }
            if (kind != 1 || o->via.array.size != 4)
                die("%s", "an unexpected message kind");
            *id = (uint32_t)int_of(&o->via.array.ptr[1]);
            const msgpack_object *err = &o->via.array.ptr[2];
            if (err->type != MSGPACK_OBJECT_NIL) {
                char *c = str_dup(map_get(err, "class")), *m = str_dup(map_get(err, "message"));
                fprintf(stderr, "rawclient: RPC error %s: %s\n", c, m);
                die("%s", "request refused");
            }
            return &o->via.array.ptr[3];
        }
        if (r == MSGPACK_UNPACK_PARSE_ERROR)
            die("%s", "undecodable stream from the server");
        if (msgpack_unpacker_buffer_capacity(&unp) < 65536 &&
            !msgpack_unpacker_reserve_buffer(&unp, 1 << 20))
            die("%s", "out of memory");
        ssize_t n = read(from_srv, msgpack_unpacker_buffer(&unp),
                         msgpack_unpacker_buffer_capacity(&unp));
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            die("%s", "the server closed the connection");
        msgpack_unpacker_buffer_consumed(&unp, (size_t)n);
    }
}

static void check_ok(const msgpack_object *res)
{
    const msgpack_object *cls = map_get(res, "class");
    if (!str_is(cls, "OK")) {
        char *c = str_dup(cls), *m = str_dup(map_get(res, "message"));
        fprintf(stderr, "rawclient: call answered %s: %s\n", c, m);
        die("%s", "a call failed");
    }
}

static const msgpack_object *roundtrip(const char *method, const char *sid, long long *ns)
{
    long long t0 = now_ns();
    uint32_t want = send_req(method, sid), got;
    const msgpack_object *res = next_response(&got);
    if (ns)
        *ns = now_ns() - t0;
    if (got != want)
        die("%s", "a response to a request not sent");
    return res;
}

static char *open_session(long long *ns)
{
    const msgpack_object *res = roundtrip("session.open", NULL, ns);
    char *sid = str_dup(map_get(res, "session_id"));
    if (strcmp(sid, "?") == 0)
        die("%s", "session.open without a session_id");
    return sid;
}

/* ---- memory --------------------------------------------------------------------------- */

static long status_kb(pid_t pid, const char *field)
{
    char path[64], line[256];
    snprintf(path, sizeof path, "/proc/%d/status", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f)
        return 0;
    long v = 0;
    size_t fl = strlen(field);
    while (fgets(line, sizeof line, f))
        if (strncmp(line, field, fl) == 0 && line[fl] == ':') {
            v = atol(line + fl + 1);
            break;
        }
    fclose(f);
    return v;
}

static long pss_kb(pid_t pid)
{
    char path[64], line[256];
    snprintf(path, sizeof path, "/proc/%d/smaps_rollup", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f)
        return 0;
    long v = 0;
    while (fgets(line, sizeof line, f))
        if (strncmp(line, "Pss:", 4) == 0) {
            v = atol(line + 4);
            break;
        }
    fclose(f);
    return v;
}

/* Sum VmRSS and Pss over every descendant of the server (not the server itself). */
static void kids_mem(long *rss, long *pss, long *count)
{
    enum { MAXP = 1 << 16 };
    static int pid_of[MAXP], ppid_of[MAXP];
    int np = 0;
    DIR *d = opendir("/proc");
    struct dirent *e;
    while (d && (e = readdir(d)) && np < MAXP) {
        if (e->d_name[0] < '0' || e->d_name[0] > '9')
            continue;
        char path[64], buf[512];
        snprintf(path, sizeof path, "/proc/%.16s/stat", e->d_name);
        int fd = open(path, O_RDONLY);
        if (fd < 0)
            continue;
        ssize_t n = read(fd, buf, sizeof buf - 1);
        close(fd);
        if (n <= 0)
            continue;
        buf[n] = 0;
        char *rp = strrchr(buf, ')');
        int ppid;
        char state;
        if (!rp || sscanf(rp + 1, " %c %d", &state, &ppid) != 2)
            continue;
        pid_of[np] = atoi(e->d_name);
        ppid_of[np] = ppid;
        np++;
    }
    if (d)
        closedir(d);
    static char in[MAXP];
    memset(in, 0, sizeof in);
    *rss = *pss = *count = 0;
    /* fixpoint over the parent links: a process is in if its parent is the server or in */
    for (int changed = 1; changed;) {
        changed = 0;
        for (int i = 0; i < np; i++) {
            if (in[i])
                continue;
            int par = ppid_of[i] == srv_pid;
            for (int j = 0; !par && j < np; j++)
                if (in[j] && pid_of[j] == ppid_of[i])
                    par = 1;
            if (par)
                in[i] = 1, changed = 1;
        }
    }
    for (int i = 0; i < np; i++)
        if (in[i]) {
            *rss += status_kb(pid_of[i], "VmRSS");
            *pss += pss_kb(pid_of[i]);
            (*count)++;
        }
}

static void sample_mem(const char *label, int with_kids)
{
    for (int i = 0; i < 5; i++) {
        printf("%s %ld\n", label, status_kb(srv_pid, "VmRSS"));
        if (with_kids) {
            long r, p, c;
            kids_mem(&r, &p, &c);
            printf("kids_rss %ld\nkids_pss %ld\nkids %ld\n", r, p, c);
        }
        usleep(50000);
    }
}

/* ---- main ----------------------------------------------------------------------------- */

int main(int argc, char **argv)
{
    const char *mode = "seq";
    long n = 100, warmup = 5, sessions = 1, inflight = 1, reps = 1, open_gap_ms = 0;
    int i = 1;
    for (; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : "";
        if (strcmp(a, "--") == 0) {
            i++;
            break;
        } else if (strcmp(a, "--mode") == 0)
            mode = v, i++;
        else if (strcmp(a, "-n") == 0)
            n = atol(v), i++;
        else if (strcmp(a, "--warmup") == 0)
            warmup = atol(v), i++;
        else if (strcmp(a, "--sessions") == 0)
            sessions = atol(v), i++;
        else if (strcmp(a, "--open-gap-ms") == 0)
            open_gap_ms = atol(v), i++;
        else if (strcmp(a, "--inflight") == 0)
            inflight = atol(v), i++;
        else if (strcmp(a, "--reps") == 0)
            reps = atol(v), i++;
        else if (strcmp(a, "--tool") == 0)
            O.tool = v, i++;
        else if (strcmp(a, "--arg") == 0 && O.nargs < 32)
            O.args[O.nargs++] = v, i++;
        else if (strcmp(a, "--timeout-ms") == 0)
            O.timeout_ms = atoll(v), i++;
        else if (strcmp(a, "--stream") == 0)
            want_stream = 1;
        else {
            fprintf(stderr, "rawclient: unknown option %s\n", a);
            return 2;
        }
    }
    if (i >= argc) {
        fprintf(stderr, "usage: rawclient [--mode seq|par|stream] [OPTIONS] -- SERVE_ARGV...\n");
        return 2;
    }
    if (sessions < 1)
        sessions = 1;
    signal(SIGPIPE, SIG_IGN);
    setvbuf(stdout, NULL, _IOFBF, 1 << 16);

    int in[2], out[2];
    if (pipe2(in, O_CLOEXEC) || pipe2(out, O_CLOEXEC))
        die("pipe: %s", strerror(errno));
    srv_pid = fork();
    if (srv_pid < 0)
        die("fork: %s", strerror(errno));
    if (srv_pid == 0) {
        dup2(in[0], 0);
        dup2(out[1], 1);
        execv(argv[i], argv + i);
        perror("rawclient: exec the server");
        _exit(127);
    }
    close(in[0]);
    close(out[1]);
    to_srv = in[1];
    from_srv = out[0];
    msgpack_unpacker_init(&unp, 1 << 20);
    msgpack_unpacked_init(&cur);

    roundtrip("hello", NULL, NULL);
    int rc = 0;
    char **sid = calloc((size_t)(sessions > inflight ? sessions : inflight), sizeof *sid);

    if (strcmp(mode, "seq") == 0) {
        sample_mem("rss_idle", 0);
        for (long s = 0; s < sessions; s++) {
            long long ns;
            if (s > 0 && open_gap_ms > 0)
                usleep((useconds_t)open_gap_ms * 1000);
            sid[s] = open_session(&ns);
            printf("open %lld\n", ns);
        }
        usleep(200000);   /* let the zygotes settle */
        sample_mem("rss_open", 1);
        for (long k = 0; k < warmup + n; k++) {
            long long ns;
            check_ok(roundtrip("call", sid[0], &ns));
            if (k >= warmup)
                printf("lat %lld\n", ns);
        }
        for (long s = 0; s < sessions; s++) {
            long long ns;
            roundtrip("session.close", sid[s], &ns);
            printf("close %lld\n", ns);
        }
    } else if (strcmp(mode, "par") == 0) {
        for (long s = 0; s < inflight; s++)
            sid[s] = open_session(NULL);
        /* the slot of a msgid is msgid % 4096 -> session index */
        static long slot_of[1 << 16];
        for (long r = -1; r < reps; r++) {   /* r = -1: warm-up round */
            long want = r < 0 ? inflight * 2 : n, sent = 0, done = 0;
            long long t0 = now_ns();
            for (long s = 0; s < inflight && sent < want; s++, sent++) {
                uint32_t id = send_req("call", sid[s]);
                slot_of[id & 0xffff] = s;
            }
            while (done < want) {
                uint32_t id;
                const msgpack_object *res = next_response(&id);
                check_ok(res);
                done++;
                if (sent < want) {
                    long s = slot_of[id & 0xffff];
                    uint32_t nid = send_req("call", sid[s]);
                    slot_of[nid & 0xffff] = s;
                    sent++;
                }
            }
            long long dt = now_ns() - t0;
            if (r >= 0)
                printf("rate %.3f\n", (double)want * 1e9 / (double)dt);
        }
        for (long s = 0; s < inflight; s++)
            roundtrip("session.close", sid[s], NULL);
    } else if (strcmp(mode, "stream") == 0) {
        sid[0] = open_session(NULL);
        for (long r = 0; r < reps; r++) {
            long long ns;
            stream_bytes = 0;
            const msgpack_object *res = roundtrip("call", sid[0], &ns);
            check_ok(res);
            long long bytes = stream_bytes;
            if (!want_stream) {
                const msgpack_object *o = map_get(res, "stdout");
                bytes = (o ? (long long)o->via.bin.size : 0) +
                        int_of(map_get(map_get(res, "truncated"), "stdout"));
            }
            printf("stream %lld %lld\n", ns, bytes);
        }
        roundtrip("session.close", sid[0], NULL);
    } else {
        fprintf(stderr, "rawclient: unknown mode %s\n", mode);
        rc = 2;
    }
    fflush(stdout);
    close(to_srv);
    int st;
    while (waitpid(srv_pid, &st, 0) < 0 && errno == EINTR)
        ;
    if (WIFSIGNALED(st)) {
        fprintf(stderr, "rawclient: the server died of signal %d\n", WTERMSIG(st));
        return 1;
    }
    if (WIFEXITED(st) && WEXITSTATUS(st) != 0) {
        fprintf(stderr, "rawclient: the server exited %d\n", WEXITSTATUS(st));
        return 1;
    }
    return rc;
}
