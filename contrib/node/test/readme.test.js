// The README's TypeScript example compiles (tsc from the lock file, against index.d.ts)
// and runs as written, from the repository's root.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import { mkdirSync, readFileSync, writeFileSync } from 'node:fs';
import path from 'node:path';
import { BIN, REPO } from './helpers.js';

const PKG = path.join(REPO, 'contrib', 'node');

test('the README TypeScript example compiles and runs as written', () => {
  const readme = readFileSync(path.join(REPO, 'README.md'), 'utf8');
  const section = readme.slice(readme.indexOf('## `stockade serve` and the protocol'));
  const m = /```ts\n([\s\S]*?)```/.exec(section);
  assert.ok(m, 'no ts example in the README protocol section');
  let code = m[1];
  assert.ok(code.trim().split('\n').length <= 12, 'the example is meant to be short');
  if (path.resolve(BIN) !== path.join(REPO, 'stockade')) code = code.replace("'./stockade'", JSON.stringify(BIN));
  // inside the package, so that 'stockade-client' resolves to it (self-reference)
  const dir = path.join(PKG, 'build');
  mkdirSync(dir, { recursive: true });
  writeFileSync(path.join(dir, 'readme.ts'), code);
  execFileSync(path.join(PKG, 'node_modules', '.bin', 'tsc'), [
    '--strict', '--target', 'es2022', '--module', 'nodenext', '--moduleResolution', 'nodenext',
    '--types', 'node', '--rootDir', PKG, '--outDir', PKG, '--noEmitOnError', path.join(dir, 'readme.ts')], { cwd: PKG, stdio: 'inherit' });
  const out = execFileSync('node', [path.join(dir, 'readme.js')], { cwd: REPO, timeout: 120000 })
    .toString();
  const lines = out.trim().split('\n');
  assert.equal(lines[0], 'TOOL_TIMEOUT false timeout hello');
  assert.deepEqual(lines.slice(1), ['stdout 1', 'stdout 2', 'stdout 3']);
});
