// Shared by the node tests: where the binary and the policies are, a server per test.
import { mkdtempSync, rmSync } from 'node:fs';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

export const REPO = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '../../..');
export const BIN = process.env.STOCKADE_BIN ?? path.join(REPO, 'stockade');
export const POLICY = path.join(REPO, 'policies', 'default.lua');

/** [argv of a stdio server with its own state dir, a cleanup function]. */
export function serverArgv(extra = []) {
  const state = mkdtempSync('/var/tmp/stockade-node-');
  return [[BIN, 'serve', '--policy', POLICY, '--state-dir', state, ...extra],
    () => rmSync(state, { recursive: true, force: true })];
}
