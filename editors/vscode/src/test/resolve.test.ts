import assert from 'node:assert/strict';
import { test } from 'node:test';
import { resolveServer, which } from '../resolve';
import { fakeEnvironment } from './fakes';

const base = { path: '', python: '', args: [] as string[] };

test('finds completiond on PATH and runs `completiond lsp`', () => {
  const r = resolveServer({ ...base, ...fakeEnvironment(['/usr/bin/completiond']) });
  assert.deepEqual(r, { ok: true, server: { command: '/usr/bin/completiond', args: ['lsp'] } });
});

test('PATH order wins; ~/.local/bin is searched last', () => {
  const env = fakeEnvironment(['/usr/bin/completiond', '/usr/local/bin/completiond', '/home/u/.local/bin/completiond']);
  assert.equal(which('completiond', env), '/usr/local/bin/completiond');
  assert.equal(which('completiond', fakeEnvironment(['/home/u/.local/bin/completiond'])), '/home/u/.local/bin/completiond');
});

test('extra args go after lsp', () => {
  const r = resolveServer({ ...base, args: ['--no-daemon'], ...fakeEnvironment(['/usr/bin/completiond']) });
  assert.ok(r.ok);
  assert.deepEqual(r.server.args, ['lsp', '--no-daemon']);
});

test('server.path: used as is, ~ expanded, bare names looked up on PATH', () => {
  let r = resolveServer({ ...base, path: '~/venv/bin/completiond', ...fakeEnvironment(['/home/u/venv/bin/completiond', '/usr/bin/completiond']) });
  assert.ok(r.ok);
  assert.equal(r.server.command, '/home/u/venv/bin/completiond');
  r = resolveServer({ ...base, path: 'completiond', ...fakeEnvironment(['/usr/bin/completiond']) });
  assert.ok(r.ok);
  assert.equal(r.server.command, '/usr/bin/completiond');
});

test('server.path that does not exist: a clear message, no fallback to PATH', () => {
  const r = resolveServer({ ...base, path: '/opt/nope/completiond', ...fakeEnvironment(['/usr/bin/completiond']) });
  assert.equal(r.ok, false);
  assert.match((r as { message: string }).message, /\/opt\/nope\/completiond/);
  assert.match((r as { message: string }).message, /pip install -e \./);
});

test('server.python: a virtual environment folder or an interpreter runs `python -m completiond.cli lsp`', () => {
  let r = resolveServer({ ...base, python: '/home/u/.venvs/cd', ...fakeEnvironment(['/home/u/.venvs/cd/bin/python']) });
  assert.deepEqual(r, { ok: true, server: { command: '/home/u/.venvs/cd/bin/python', args: ['-m', 'completiond.cli', 'lsp'] } });
  r = resolveServer({ ...base, python: '/usr/bin/python3.12', args: ['--no-daemon'], ...fakeEnvironment(['/usr/bin/python3.12']) });
  assert.deepEqual(r, { ok: true, server: { command: '/usr/bin/python3.12', args: ['-m', 'completiond.cli', 'lsp', '--no-daemon'] } });
  r = resolveServer({ ...base, python: 'python3', ...fakeEnvironment(['/usr/bin/python3']) });
  assert.ok(r.ok && r.server.command === '/usr/bin/python3');
});

test('server.python on Windows looks in Scripts', () => {
  const env = fakeEnvironment(['C:\\venv/Scripts/python.exe'], { platform: 'win32' });
  const r = resolveServer({ ...base, python: 'C:\\venv', ...env, isDir: (p) => p === 'C:\\venv', isFile: (p) => p.replace(/\\/g, '/').endsWith('Scripts/python.exe') });
  assert.ok(r.ok);
  assert.match(r.server.command, /Scripts.python\.exe$/);
});

test('server.python that has no interpreter: a clear message', () => {
  const r = resolveServer({ ...base, python: '/home/u/empty-venv', ...fakeEnvironment(['/home/u/empty-venv/pyvenv.cfg']) });
  assert.equal(r.ok, false);
  assert.match((r as { message: string }).message, /no Python interpreter/);
});

test('nothing found: says how to install and which settings to set', () => {
  const r = resolveServer({ ...base, ...fakeEnvironment([]) });
  assert.equal(r.ok, false);
  const msg = (r as { message: string }).message;
  assert.match(msg, /not found on PATH/);
  assert.match(msg, /README/);
  assert.match(msg, /completiond\.server\.path/);
  assert.match(msg, /completiond\.server\.python/);
});
