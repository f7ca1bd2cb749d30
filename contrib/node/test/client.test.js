// stockade-client against a real `stockade serve` (STOCKADE_BIN).
import { test } from 'node:test';
import assert from 'node:assert/strict';
import net from 'node:net';
import { mkdtempSync, rmSync } from 'node:fs';
import path from 'node:path';
import {
  BadRequest, CallResult, Client, ConnectionClosed, NoSuchSession, PolicyViolation, ProtocolError,
  ToolTimeout,
} from '../index.js';
import { serverArgv } from './helpers.js';

async function withServer(fn) {
  const [argv, cleanup] = serverArgv();
  const c = Client.spawn(argv, { rpcTimeoutMs: 30000, stderr: 'ignore' });
  try {
    await fn(c);
  } finally {
    await c.close();
    cleanup();
  }
}

test('hello says protocol 2', () => withServer(async (c) => {
  const info = await c.hello('node-test');
  assert.equal(info.protocol, 2);
  assert.equal(typeof info.policy.sha256, 'string');
}));

test('a session runs calls and returns typed results', () => withServer(async (c) => {
  const s = await c.openSession({ labels: { via: 'node' } });
  assert.match(s.id, /^[0-9a-f-]{36}$/);
  const r = await s.call('echo', ['hi']);
  assert.ok(r instanceof CallResult && r.ok);
  assert.equal(r.exitCode, 0);
  assert.deepEqual(r.stdout, Buffer.from('hi\n'));
  const refused = await s.call('no-such-tool');
  assert.equal(refused.class, 'POLICY_VIOLATION');
  assert.throws(() => refused.raiseForClass(), PolicyViolation);
  const slow = await s.call('sh', ['-c', 'sleep 5'], { timeoutMs: 200 });
  assert.equal(slow.class, 'TOOL_TIMEOUT');
  assert.equal(slow.layer, 'timeout');
  assert.throws(() => slow.raiseForClass(), ToolTimeout);
  const st = await c.stats();
  assert.deepEqual(st.session_labels[s.id], { via: 'node' });
  assert.deepEqual(await s.close(), { removed: true, calls_killed: 0 });
  assert.deepEqual(await s.close(), { removed: false, calls_killed: 0 });
}));

test('streamed output is an async iterator', () => withServer(async (c) => {
  const s = await c.openSession();
  const h = s.stream('sh', ['-c', 'printf a; sleep 0.2; printf b; printf e >&2']);
  const got = { stdout: '', stderr: '' };
  for await (const chunk of h) got[chunk.stream] += chunk.data.toString();
  assert.deepEqual(got, { stdout: 'ab', stderr: 'e' });
  assert.ok((await h.result).ok);
  await s.close();
}));

test('an AbortSignal cancels the call', () => withServer(async (c) => {
  const s = await c.openSession();
  const ac = new AbortController();
  const h = s.stream('sh', ['-c', 'echo ready; exec sleep 30'], { signal: ac.signal });
  for await (const chunk of h) {
    if (chunk.data.toString().includes('ready')) ac.abort();
  }
  const r = await h.result;
  assert.equal(r.class, 'CANCELLED');
  assert.ok(r.durationMs < 20000);
  assert.throws(() => s.startCall('echo', ['x'], { signal: ac.signal }), { name: 'AbortError' });
  await s.close();
}));

test('errors of the RPC slot reject with their class', () => withServer(async (c) => {
  await assert.rejects(c.call('never-opened', 'echo', ['x']), NoSuchSession);
  const s = await c.openSession();
  await assert.rejects(c.request('call', { session_id: s.id, tool: 'echo', deadline: 5 }),
    (e) => e instanceof BadRequest && e.message.includes('deadline') && e.retryable === false);
  await s.close();
}));

test('a server that sends garbage is a ProtocolError at once', async () => {
  const dir = mkdtempSync('/var/tmp/stockade-node-fake-');
  const sockPath = path.join(dir, 's.sock');
  const server = net.createServer((conn) => conn.once('data', () => conn.write(Buffer.from([0xc1]))));
  await new Promise((resolve) => server.listen(sockPath, resolve));
  try {
    const c = await Client.connectUnix(sockPath, { rpcTimeoutMs: 60000 });
    const t0 = Date.now();
    await assert.rejects(c.hello(), ProtocolError);
    assert.ok(Date.now() - t0 < 30000, 'waited out rpcTimeoutMs');
    await c.close();
  } finally {
    server.close();
    rmSync(dir, { recursive: true, force: true });
  }
});

test('a server that dies fails the calls in flight with ConnectionClosed', async () => {
  const [argv, cleanup] = serverArgv();
  const c = Client.spawn(argv, { rpcTimeoutMs: 60000, stderr: 'ignore' });
  try {
    const s = await c.openSession();
    const h = s.startCall('sleep', ['5']);
    await c.stats();                // the call was read before the kill
    c.child.kill('SIGKILL');        // the server this test started, by its pid
    await assert.rejects(h.result, ConnectionClosed);
    assert.equal(c.closed, true);
    await assert.rejects(c.hello(), ConnectionClosed);
  } finally {
    await c.close();
    cleanup();
  }
});
