/**
 * Speaks LSP through vscode-jsonrpc to the real `completiond lsp` and gets an
 * inline completion, the way vscode-languageclient does.
 *
 *   COMPLETIOND_LSP_CMD    JSON list: the server command (default: ["completiond", "lsp", "--no-daemon"])
 *   COMPLETIOND_TEST_MODEL model directory sent as the `model` setting (default: "" = the bundled model)
 *   COMPLETIOND_PROTOCOL_REQUIRED=1  fail instead of skipping when no server can be found
 *
 * tests/test_vscode.py sets all three.
 */
import assert from 'node:assert/strict';
import { ChildProcess, spawn } from 'node:child_process';
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { after, before, test } from 'node:test';
import { createMessageConnection, MessageConnection, StreamMessageReader, StreamMessageWriter } from 'vscode-jsonrpc/node';
import { which } from '../resolve';

const DEADLINE_MS = Number(process.env.COMPLETIOND_TEST_TIMEOUT_MS ?? 240_000);

function serverCommand(): string[] | undefined {
  if (process.env.COMPLETIOND_LSP_CMD) return JSON.parse(process.env.COMPLETIOND_LSP_CMD);
  const exe = which('completiond', { env: process.env, platform: process.platform, home: os.homedir(), isFile: (p) => fs.existsSync(p) });
  return exe ? [exe, 'lsp', '--no-daemon'] : undefined;
}

const cmd = serverCommand();
const skip = cmd === undefined && process.env.COMPLETIOND_PROTOCOL_REQUIRED !== '1' ? 'no completiond server found (set COMPLETIOND_LSP_CMD)' : false;

const settings = {
  model: process.env.COMPLETIOND_TEST_MODEL ?? '',
  device: 'cpu',
  temperature: 0,
  maxTokens: 12,
  multiline: 'never',
  workspaceContext: false,
  enable: true,
};

let proc: ChildProcess;
let conn: MessageConnection;
let tmp: string;
const statuses: any[] = [];
const logs: string[] = [];
const configurationRequests: any[] = [];

function diagnostics(): string {
  return `\n--- statuses: ${JSON.stringify(statuses)}\n--- server log:\n${logs.slice(-60).join('\n')}`;
}

before(async () => {
  if (skip) return;
  assert.ok(cmd, 'no completiond server found: set COMPLETIOND_LSP_CMD');
  tmp = fs.mkdtempSync(path.join(os.tmpdir(), 'completiond-protocol-'));
  proc = spawn(cmd[0], cmd.slice(1), {
    stdio: ['pipe', 'pipe', 'pipe'],
    env: { ...process.env, XDG_CONFIG_HOME: path.join(tmp, 'config'), XDG_RUNTIME_DIR: tmp, HF_HUB_OFFLINE: '1', TRANSFORMERS_OFFLINE: '1' },
  });
  proc.stderr!.on('data', (d: Buffer) => logs.push(...d.toString().trimEnd().split('\n')));
  proc.on('exit', (code, signal) => logs.push(`[server exited: code ${code}, signal ${signal}]`));
  conn = createMessageConnection(new StreamMessageReader(proc.stdout!), new StreamMessageWriter(proc.stdin!));
  conn.onRequest('workspace/configuration', (params: { items: { section?: string }[] }) => {
    configurationRequests.push(params);
    return params.items.map((item) => (item.section === 'completiond' ? settings : null));
  });
  conn.onRequest('window/workDoneProgress/create', () => null);
  conn.onRequest('client/registerCapability', () => null);
  conn.onRequest('window/showMessageRequest', () => null);
  conn.onNotification('completiond/status', (p: unknown) => void statuses.push(p));
  conn.onNotification('window/logMessage', (p: { message: string }) => void logs.push(`[logMessage] ${p.message}`));
  conn.onNotification('window/showMessage', (p: { message: string }) => void logs.push(`[showMessage] ${p.message}`));
  conn.onNotification(() => undefined);
  conn.listen();
});

after(async () => {
  if (skip || !conn) return;
  try {
    await withTimeout(conn.sendRequest('shutdown'), 30_000, 'shutdown');
    await conn.sendNotification('exit');
  } catch (err) {
    logs.push(`[shutdown failed: ${err}]`);
  }
  const exited = await new Promise<boolean>((resolve) => {
    if (proc.exitCode !== null) return resolve(true);
    const timer = setTimeout(() => resolve(false), 20_000);
    proc.once('exit', () => {
      clearTimeout(timer);
      resolve(true);
    });
  });
  if (!exited) proc.kill('SIGKILL');
  conn.dispose();
  fs.rmSync(tmp, { recursive: true, force: true });
  assert.ok(exited, 'the server did not exit after shutdown/exit' + diagnostics());
});

function withTimeout<T>(p: Thenable<T>, ms: number, what: string): Promise<T> {
  return new Promise((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error(`${what}: no answer in ${ms} ms`)), ms);
    p.then(
      (v) => {
        clearTimeout(timer);
        resolve(v);
      },
      (e) => {
        clearTimeout(timer);
        reject(e);
      },
    );
  });
}

const uri = 'file:///tmp/completiond-protocol/example.py';
const text = 'def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    return ';
const position = { line: 5, character: 11 };

async function inlineCompletion(): Promise<any> {
  return withTimeout(
    conn.sendRequest('textDocument/inlineCompletion', {
      textDocument: { uri },
      position,
      context: { triggerKind: 1 },
    }),
    DEADLINE_MS - 20_000,
    'textDocument/inlineCompletion',
  );
}

test('initialize: inline completions, the stats and restart commands, the completiond section', { skip, timeout: DEADLINE_MS }, async () => {
  const result: any = await withTimeout(
    conn.sendRequest('initialize', {
      processId: process.pid,
      clientInfo: { name: 'completiond-protocol-test' },
      rootUri: null,
      capabilities: {
        general: { positionEncodings: ['utf-16'] },
        workspace: { configuration: true, didChangeConfiguration: { dynamicRegistration: true }, executeCommand: {} },
        textDocument: {
          synchronization: { dynamicRegistration: false, didSave: false },
          inlineCompletion: { dynamicRegistration: false },
        },
        window: { workDoneProgress: true },
      },
      initializationOptions: { completiond: settings },
    }),
    60_000,
    'initialize',
  );
  assert.ok(result.capabilities.inlineCompletionProvider, 'no inlineCompletionProvider' + diagnostics());
  const commands: string[] = result.capabilities.executeCommandProvider?.commands ?? [];
  assert.ok(commands.includes('completiond.stats'), `commands: ${commands}`);
  assert.ok(commands.includes('completiond.restartDaemon'), `commands: ${commands}`);
  assert.ok(commands.includes('completiond.models'), `commands: ${commands}`);
  // Registered as a VS Code command by vscode-languageclient, so items can carry it (see below).
  assert.ok(commands.includes('completiond.suggestionEvent'), `commands: ${commands}`);
  await conn.sendNotification('initialized', {});
  await conn.sendNotification('textDocument/didOpen', { textDocument: { uri, languageId: 'python', version: 1, text } });
});

let first: any;

test('textDocument/inlineCompletion returns a suggestion at the cursor', { skip, timeout: DEADLINE_MS }, async () => {
  const started = Date.now();
  let result: any;
  // The first answers may come while the model loads: poll until one has an item.
  while (Date.now() - started < DEADLINE_MS - 15_000) {
    result = await inlineCompletion();
    if (result && (result.items ?? result).length > 0) break;
    await new Promise((r) => setTimeout(r, 500));
  }
  const items = result?.items ?? result;
  assert.ok(Array.isArray(items) && items.length > 0, `no inline completion in ${DEADLINE_MS} ms: ${JSON.stringify(result)}` + diagnostics());
  first = items[0];
  const insert = typeof first.insertText === 'string' ? first.insertText : first.insertText.value;
  assert.equal(typeof insert, 'string');
  assert.ok(insert.length > 0, 'empty insertText');
  if (first.range) {
    // The range starts at or before the cursor on the cursor's line, and what it covers before the cursor is repeated in insertText.
    assert.equal(first.range.start.line, position.line);
    assert.ok(first.range.start.character <= position.character);
    const typed = text.split('\n')[position.line].slice(first.range.start.character, position.character);
    assert.ok(insert.startsWith(typed), `insertText ${JSON.stringify(insert)} does not repeat ${JSON.stringify(typed)}`);
  }
  assert.ok(statuses.some((s) => s && s.state === 'ready'), 'no completiond/status ready notification' + diagnostics());
  // VS Code runs an item's command after accepting it whole: that is how the server counts full accepts.
  assert.deepEqual(first.command?.command, 'completiond.suggestionEvent');
  assert.deepEqual(first.command?.arguments, [{ event: 'accepted', kind: 'full' }]);
});

test('temperature 0: the same request gives the same suggestion', { skip, timeout: DEADLINE_MS }, async () => {
  if (!first) return; // the test before failed
  const again = await inlineCompletion();
  assert.deepEqual((again.items ?? again)[0], first);
});

test('workspace/didChangeConfiguration: enable=false stops suggestions, enable=true brings them back', { skip, timeout: DEADLINE_MS }, async () => {
  if (!first) return; // the test before failed
  await conn.sendNotification('workspace/didChangeConfiguration', { settings: { completiond: { ...settings, enable: false } } });
  const off = await inlineCompletion();
  assert.equal((off.items ?? off).length, 0, `suggestion while disabled: ${JSON.stringify(off)}`);
  await conn.sendNotification('workspace/didChangeConfiguration', { settings: { completiond: { ...settings, enable: true } } });
  const on = await inlineCompletion();
  assert.deepEqual((on.items ?? on)[0], first);
});

test('workspace/executeCommand completiond.stats answers an object', { skip, timeout: 60_000 }, async () => {
  const stats = await withTimeout(conn.sendRequest('workspace/executeCommand', { command: 'completiond.stats', arguments: [] }), 30_000, 'stats');
  assert.equal(typeof stats, 'object');
  assert.ok(stats !== null);
  assert.ok(!('error' in (stats as object)), `stats error: ${JSON.stringify(stats)}`);
});

test('workspace/executeCommand completiond.models answers the catalog for the model picker', { skip, timeout: 60_000 }, async () => {
  const catalog: any = await withTimeout(conn.sendRequest('workspace/executeCommand', { command: 'completiond.models', arguments: [] }), 30_000, 'models');
  const names = catalog.models.map((m: any) => m.name);
  assert.ok(names.includes('qwen2.5-coder-0.5b'), `models: ${names}`);
  assert.ok(catalog.models.some((m: any) => m.repo === catalog.recommended), `recommended ${catalog.recommended} not among ${names}`);
  const small = catalog.models.find((m: any) => m.name === 'qwen2.5-coder-0.5b');
  assert.equal(small.repo, 'Qwen/Qwen2.5-Coder-0.5B');
  assert.ok(small.downloadGb > 0.5 && small.downloadGb < 2, `downloadGb ${small.downloadGb}`);
  assert.match(small.cpu, /ms\/token/);
  assert.ok(Array.isArray(small.languages) && small.languages.length > 0);
  assert.equal(catalog.current, settings.model);
});
