#ifndef STOCKADE_RPC_H
#define STOCKADE_RPC_H
/* MessagePack-RPC framing over one byte stream (a pipe pair or a Unix socket): bounded
 * reads, a bounded write queue with back-pressure, and nothing else — what a message
 * means is the server's business.
 *
 * Incoming bytes are pre-scanned before msgpack-c sees them: msgpack-c allocates room for
 * a container's declared element count as soon as it reads the header, so a 5-byte
 * message claiming a billion elements would cost gigabytes. The scan finds each message's
 * end, bounds every count and the total size by max_message, and only a complete,
 * bounded message is handed to msgpack_unpack_next(). */
#include <ev.h>
#include <msgpack.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

#include "util.h"

#define RPC_MAX_MESSAGE_DEFAULT (16u << 20)
#define RPC_SLOW_READER_MS_DEFAULT 60000

/* Work one connection may make the loop do per turn before the others get theirs: a
 * pipelined flood is served a slice at a time. */
#define RPC_DISPATCH_MAX 64
#define RPC_DISPATCH_SLICE_MS 5

enum rpc_scan {
    RPC_SCAN_NEED_MORE,
    RPC_SCAN_COMPLETE,
    RPC_SCAN_TOO_BIG,
    RPC_SCAN_INVALID,
};

/* Resumable scan of the message starting at data[0]: *pos and *pending carry the
 * progress between calls (start with 0 and 1). On COMPLETE, *pos is its length. */
enum rpc_scan rpc_scan(const unsigned char *data, size_t len, size_t max_message, size_t *pos,
                       uint64_t *pending);
/* The msgid of a request from its first bytes, when they are [0, msgid, ...]. */
bool rpc_peek_msgid(const unsigned char *data, size_t len, uint32_t *msgid);

struct rpc_conn;
struct rpc_handlers {
    /* a complete message; the object lives until the callback returns */
    void (*on_message)(struct rpc_conn *c, const msgpack_object *msg);
    /* the stream is over (EOF, error, or unparseable); the conn is freed after this */
    void (*on_close)(struct rpc_conn *c, const char *why);
    /* the write queue crossed the high (true) or low (false) water mark */
    void (*on_pressure)(struct rpc_conn *c, bool high);
};

struct rpc_conn {
    struct ev_loop *loop;
    int rfd, wfd;
    ev_io rw, ww;
    ev_timer linger;            /* bounds the flush after close */
    ev_timer backlog;           /* complete messages left for the next turn */
    ev_timer stall;             /* output queued and none taken for slow_reader_ms */
    int64_t slow_reader_ms;     /* 0: no limit */
    struct buf in;              /* bytes read, not yet dispatched */
    size_t scan_pos;
    uint64_t scan_pending;
    struct buf out;             /* bytes queued, out_off of them already written */
    size_t out_off;
    size_t max_message;
    bool under_pressure;
    bool closed;                /* no more reading; flushed then freed */
    unsigned busy;              /* inside dispatch: a close frees `c` only on the way out */
    bool free_pending;
    uid_t peer_uid;
    /* told of each error response queued (the server counts them); NULL: nobody */
    void (*on_error_sent)(struct rpc_conn *c, const char *class);
    const struct rpc_handlers *h;
    void *ud;                   /* the server's per-connection state */
    msgpack_packer pk;          /* packs straight into `out` */
};

struct rpc_conn *rpc_conn_new(struct ev_loop *loop, int rfd, int wfd, size_t max_message,
                              const struct rpc_handlers *h, void *ud);
/* Stop reading (on_close runs now), write what is queued for at most flush_ms, then
 * close the fds and free: from here on `c` belongs to the loop. */
void rpc_conn_close(struct rpc_conn *c, const char *why, int flush_ms);
/* Bytes as if read from the peer (the fuzz harness's door into the decoder). */
void rpc_conn_feed(struct rpc_conn *c, const void *data, size_t n);
/* After packing a message into c->pk: start writing it. */
void rpc_conn_flush(struct rpc_conn *c);
size_t rpc_conn_queued(const struct rpc_conn *c);
/* Write what is queued now, blocking, until it is out or until_ms (now_ms()) passes: for
 * a server about to exec, whose loop will not turn again. */
void rpc_conn_flush_until(struct rpc_conn *c, int64_t until_ms);
/* Bytes all connections hold for messages not yet complete (or not yet dispatched),
 * and the bound on it: a connection whose unfinished message would go past the bound
 * is dropped (its peer can retry), so that clients stalling mid-message cannot take
 * the server's memory between them. The bound is RPC_INPUT_BUDGET_MESSAGES times the
 * largest message allowed. */
#define RPC_INPUT_BUDGET_MESSAGES 4
size_t rpc_input_held(void);

/* Packing helpers over c->pk. */
void rpc_pack_str(msgpack_packer *pk, const char *s);
void rpc_pack_kv_str(msgpack_packer *pk, const char *k, const char *v);  /* v NULL -> nil */
void rpc_pack_kv_int(msgpack_packer *pk, const char *k, int64_t v);
void rpc_pack_kv_bool(msgpack_packer *pk, const char *k, bool v);
void rpc_pack_key(msgpack_packer *pk, const char *k);
/* [1, msgid, error, nil] with an error map; class/message/layer as in PROTOCOL.md. */
void rpc_send_error(struct rpc_conn *c, uint32_t msgid, const char *class, bool retryable,
                    const char *message, const char *layer);
/* The same, echoing a msgid that is not a uint32 as it was sent (PROTOCOL.md: such a
 * request is still answered, so that its client does not wait forever). */
void rpc_send_error_echo(struct rpc_conn *c, const msgpack_object *msgid, const char *class,
                         bool retryable, const char *message, const char *layer);

/* Reading params: a key in a map, or NULL. */
const msgpack_object *rpc_map_get(const msgpack_object *map, const char *key);
char *rpc_obj_strdup(const msgpack_object *o);   /* str (or bin) -> NUL-terminated copy */

#endif
