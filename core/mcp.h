#ifndef STOCKADE_MCP_H
#define STOCKADE_MCP_H
/* `stockade mcp`: the Model Context Protocol (JSON-RPC 2.0, one message per line) on a
 * pair of descriptors, in front of an in-process `serve`. The MCP side is a client of
 * the server over a socketpair inside the same event loop, so sessions, admission, the
 * call machinery, redaction, accounting and logs are the server's, unchanged: this
 * module only translates. One MCP connection has one stockade session, opened at its
 * first tools/call and closed when the client goes away. */
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define MCP_MAX_MESSAGE_DEFAULT (4u << 20)
#define MCP_MAX_DEPTH 64                /* nesting of arrays and objects in one message */

/* JSON-RPC 2.0 error codes */
enum {
    MCP_PARSE_ERROR = -32700,
    MCP_INVALID_REQUEST = -32600,
    MCP_METHOD_NOT_FOUND = -32601,
    MCP_INVALID_PARAMS = -32602,
    MCP_INTERNAL_ERROR = -32603,
};

enum mcp_kind { MCP_MSG_INVALID, MCP_MSG_REQUEST, MCP_MSG_NOTIFICATION, MCP_MSG_RESPONSE };

/* One decoded line. `root` owns the rest. */
struct mcp_msg {
    enum mcp_kind kind;
    struct json_t *root;
    struct json_t *id;          /* string or integer; NULL for a notification, or when an
                                 * invalid message's id cannot be recovered */
    const char *method;
    struct json_t *params;      /* NULL when absent (not checked here: its type is the
                                 * method's business) */
    int code;                   /* MCP_MSG_INVALID: the error to answer */
    char error[160];
};

/* Decode one message: nesting bounded by MCP_MAX_DEPTH before the parser sees it, valid
 * UTF-8, no NUL, no duplicate keys, exactly one JSON-RPC 2.0 object. Never fails to
 * fill *m; release with mcp_msg_free. */
void mcp_decode(const char *line, size_t len, struct mcp_msg *m);
void mcp_msg_free(struct mcp_msg *m);

struct mcp_opts {
    size_t max_message;         /* one line, in bytes */
    int64_t session_ttl_ms;     /* the session's lease; 0: the policy's */
};

struct server;
struct server_opts;
struct mcp;
struct msgpack_packer;

/* A JSON value as msgpack (structured args take the protocol's form); also used by
 * `stockade run --args`. */
void mcp_pack_json(struct msgpack_packer *pk, const struct json_t *v);

/* Speak MCP on in_fd / out_fd (borrowed, never closed here) to a connection of srv. */
struct mcp *mcp_new(struct server *srv, int in_fd, int out_fd, const struct mcp_opts *opts);
/* Bytes as if read from in_fd (the fuzz harness's door into the decoder). */
void mcp_feed(struct mcp *m, const void *data, size_t len);
/* Close the server connection (its calls end, CANCELLED) and release everything. */
void mcp_free(struct mcp *m);

/* `stockade mcp`: until stdin closes (or SIGTERM). Returns the exit status. */
int mcp_run(const struct server_opts *sopts, const struct mcp_opts *opts);

#endif
