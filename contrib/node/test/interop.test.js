// Interoperability: stockade driven by msgpack5rpc, a MessagePack-RPC implementation from
// npm that knows nothing of stockade, through the whole happy path and an error path.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import RpcSession from 'msgpack5rpc';
import { serverArgv } from './helpers.js';

test('msgpack5rpc: hello, open, call, streamed call, cancel, close, an error', async () => {
  const [argv, cleanup] = serverArgv();
  const child = spawn(argv[0], argv.slice(1), { stdio: ['pipe', 'pipe', 'ignore'] });
  const rpc = new RpcSession();
  rpc.attach(child.stdin, child.stdout);
  // msgpack5rpc's request(method, args, cb): args is the params array as the spec says
  const request = (method, arg) => new Promise((resolve, reject) => {
    rpc.request(method, arg === undefined ? [] : [arg], (err, res) => (err ? reject(err) : resolve(res)));
  });
  const notes = [];
  rpc.on('notification', (method, args) => notes.push([method, args]));
  try {
    const info = await request('hello', { client: 'msgpack5rpc' });
    assert.equal(info.protocol, 2);
    const { session_id: sid } = await request('session.open', { labels: { via: 'msgpack5rpc' } });
    const r = await request('call', { session_id: sid, tool: 'echo', argv: ['interop'] });
    assert.equal(r.class, 'OK');
    assert.equal(Buffer.from(r.stdout).toString(), 'interop\n');

    const streamed = await request('call', { session_id: sid, tool: 'sh', stream: true,
      argv: ['-c', 'printf one; printf two >&2'] });
    assert.equal(streamed.class, 'OK');
    const out = { stdout: '', stderr: '' };
    for (const [method, args] of notes) {
      if (method !== 'call.output') continue;
      assert.ok(Array.isArray(args) && args.length === 1, 'notification args are [map]');
      out[args[0].stream] += Buffer.from(args[0].data).toString();
    }
    assert.deepEqual(out, { stdout: 'one', stderr: 'two' });

    // cancel: a running call, cancelled from a second request
    const running = request('call', { session_id: sid, tool: 'sh', stream: true,
      argv: ['-c', 'echo ready; exec sleep 30'] });
    const readyMsgid = await new Promise((resolve) => {
      const onNote = (method, args) => {
        if (method === 'call.output' && Buffer.from(args[0].data).toString().includes('ready')) {
          rpc.removeListener('notification', onNote);
          resolve(args[0].msgid);
        }
      };
      rpc.on('notification', onNote);
    });
    assert.deepEqual(await request('cancel', { msgid: readyMsgid }), { cancelled: true });
    assert.equal((await running).class, 'CANCELLED');

    // an error path: a typo in a key is refused, naming the key
    await assert.rejects(request('call', { session_id: sid, tool: 'echo', deadline: 100 }),
      (err) => err.class === 'BAD_REQUEST' && err.message.includes('deadline'));
    await assert.rejects(request('session.renew', { session_id: 'never-seen' }),
      (err) => err.class === 'NO_SUCH_SESSION');

    assert.deepEqual(await request('session.close', { session_id: sid }),
      { removed: true, calls_killed: 0 });
  } finally {
    child.stdin.end();
    await new Promise((resolve) => (child.exitCode !== null ? resolve() : child.once('exit', resolve)));
    cleanup();
  }
});
