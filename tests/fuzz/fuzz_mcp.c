/* libFuzzer target: arbitrary bytes into `stockade mcp`'s line framing, JSON-RPC decoder
 * and dispatcher, in front of a real in-process server with process creation stubbed
 * (spawn_stub.c). Each input is also decoded line by line on its own. Whatever arrives,
 * the front end must answer or ignore it — never crash, leak or hang. */
#include "fuzz_server.h"
#include "mcp.h"

#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static struct server *srv;
static int devnull = -1;

static void close_devnull(void)
{
    close(devnull);
}

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc, (void)argv;
    srv = fuzz_server_start("fuzz-mcp", "tests/fixtures/mcp.lua");
    devnull = open("/dev/null", O_RDWR | O_CLOEXEC);
    atexit(close_devnull);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    /* the decoder alone, on each line */
    const char *p = (const char *)data, *end = p + size;
    while (p < end) {
        const char *nl = memchr(p, '\n', (size_t)(end - p));
        size_t len = (size_t)((nl ? nl : end) - p);
        struct mcp_msg msg;
        mcp_decode(p, len, &msg);
        mcp_msg_free(&msg);
        p += len + 1;
    }
    /* the whole front end: framing, dispatch, the server behind it */
    int in[2];
    if (pipe2(in, O_CLOEXEC) < 0)
        abort();
    struct mcp_opts mo = {.max_message = 16 * 1024};
    struct mcp *m = mcp_new(srv, in[0], devnull, &mo);
    mcp_feed(m, data, size);
    fuzz_server_settle(srv);
    /* the client goes away: EOF ends the front end and its server connection */
    close(in[1]);
    fuzz_server_settle(srv);
    mcp_free(m);
    close(in[0]);
    fuzz_server_settle(srv);
    return 0;
}
