/* libFuzzer target: arbitrary bytes into the decoder and the dispatcher of `serve`, over
 * one connection per input, with process creation stubbed (spawn_stub.c). Whatever
 * arrives, the server must answer or drop the peer — never crash, leak or hang. */
#include "fuzz_server.h"
#include "server.h"

#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <unistd.h>

static struct server *srv;

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc, (void)argv;
    srv = fuzz_server_start("fuzz", "policies/default.lua");
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    int p[2];
    if (pipe2(p, O_CLOEXEC) < 0)
        abort();
    int out = open("/dev/null", O_WRONLY | O_CLOEXEC);
    struct srv_conn *conn = server_attach(srv, p[0], out, geteuid());
    server_feed(conn, data, size);
    fuzz_server_settle(srv);
    /* The peer goes away: EOF on its stream closes and frees the connection. */
    close(p[1]);
    fuzz_server_settle(srv);
    return 0;
}
