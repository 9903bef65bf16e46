/**
 * The first-run offer end to end through the extension as VS Code runs it: extension.ts activated with the
 * REAL vscode-languageclient (only the `vscode` module is a stand-in), which starts the real
 * `completiond lsp` with no model set. The server's `window/showMessageRequest` must come out as VS Code's
 * own notification (window.showInformationMessage with a button per action: the language client's native
 * rendering, not ours), and the button clicked must reach the server: recorded in first-run.json, and
 * acted on (the bundled-model notice for "Not now"; for "Download", offline, the one could-not-download
 * notice and the bundled model again).
 *
 * Environment as protocol.test.ts (COMPLETIOND_LSP_CMD, COMPLETIOND_PROTOCOL_REQUIRED).
 */
import assert from 'node:assert/strict';
import * as fs from 'node:fs';
import Module from 'node:module';
import * as os from 'node:os';
import * as path from 'node:path';
import { afterEach, test } from 'node:test';
import { packageJson, schema } from './fakes';

const DEADLINE_MS = Number(process.env.COMPLETIOND_TEST_TIMEOUT_MS ?? 240_000);
const cmd: string[] | undefined = process.env.COMPLETIOND_LSP_CMD ? JSON.parse(process.env.COMPLETIOND_LSP_CMD) : undefined;
const skip = cmd === undefined && process.env.COMPLETIOND_PROTOCOL_REQUIRED !== '1' ? 'set COMPLETIOND_LSP_CMD to run the server' : false;

/** The server settings for the extension: `server.python` + `-m completiond.cli`, or `server.path`. */
function serverSettings(): Record<string, unknown> {
  assert.ok(cmd, 'COMPLETIOND_LSP_CMD is not set');
  const lsp = cmd.indexOf('lsp');
  const extra = cmd.slice(lsp + 1);
  return cmd[1] === '-m' ? { 'server.python': cmd[0], 'server.args': extra } : { 'server.path': cmd[0], 'server.args': extra };
}

class EventEmitter<T> {
  private listeners: ((e: T) => unknown)[] = [];
  event = (listener: (e: T) => unknown) => {
    this.listeners.push(listener);
    return { dispose: () => (this.listeners = this.listeners.filter((l) => l !== listener)) };
  };
  fire(e: T): void {
    this.listeners.forEach((l) => l(e));
  }
  dispose(): void {
    this.listeners = [];
  }
}

class Disposable {
  constructor(private readonly fn: () => unknown = () => undefined) {}
  static from(...items: { dispose(): unknown }[]) {
    return new Disposable(() => items.forEach((i) => i.dispose()));
  }
  dispose() {
    this.fn();
  }
}

class CancellationTokenSource {
  private emitter = new EventEmitter<void>();
  token = { isCancellationRequested: false, onCancellationRequested: this.emitter.event };
  cancel() {
    this.token.isCancellationRequested = true;
    this.emitter.fire();
  }
  dispose() {}
}

/** Whatever the client registers and we do not model: a callable, constructible no-op returning a disposable. */
function anything(): any {
  const f = function () {
    return { dispose: () => undefined };
  };
  return new Proxy(f, {
    // Not a thenable (an await on it would never settle) nor iterable.
    get: (target, prop) => (prop === 'prototype' ? target.prototype : prop === 'then' || typeof prop === 'symbol' ? undefined : anything()),
    apply: () => ({ dispose: () => undefined }),
    construct: () => ({ dispose: () => undefined }),
  });
}

/** The stand-in `vscode` module: real behaviour where the first-run path needs it, no-ops elsewhere. */
function makeVscode(settings: Record<string, unknown>, click: string | undefined) {
  const defaults = new Map<string, unknown>();
  for (const [key, prop] of Object.entries(schema)) defaults.set(key.slice('completiond.'.length), (prop as any).default);
  const shown = {
    info: [] as { message: string; items: unknown[] }[],
    warnings: [] as string[],
    errors: [] as string[],
    lines: [] as string[],
    /** the status item, as the controller draws it */
    status: { text: '' } as { text: string },
  };
  const output = () => ({
    name: 'completiond',
    logLevel: 2,
    onDidChangeLogLevel: new EventEmitter<number>().event,
    append: (s: string) => void shown.lines.push(s),
    appendLine: (s: string) => void shown.lines.push(s),
    replace: () => undefined,
    clear: () => undefined,
    show: () => undefined,
    hide: () => undefined,
    trace: (s: string) => void shown.lines.push(s),
    debug: (s: string) => void shown.lines.push(s),
    info: (s: string) => void shown.lines.push(s),
    warn: (s: string) => void shown.lines.push(s),
    error: (s: unknown) => void shown.lines.push(String(s)),
    dispose: () => undefined,
  });
  const base = {
    EventEmitter,
    Disposable,
    CancellationTokenSource,
    CancellationError: class extends Error {},
    ThemeColor: class {
      constructor(public id: string) {}
    },
    Uri: { parse: (s: string) => ({ toString: () => s, fsPath: s }), file: (p: string) => ({ toString: () => `file://${p}`, fsPath: p }) },
    ConfigurationTarget: { Global: 1, Workspace: 2, WorkspaceFolder: 3 },
    StatusBarAlignment: { Left: 1, Right: 2 },
    QuickPickItemKind: { Separator: -1, Default: 0 },
    InlineCompletionTriggerKind: { Invoke: 0, Automatic: 1 },
    ProgressLocation: { SourceControl: 1, Window: 10, Notification: 15 },
    LogLevel: { Off: 0, Trace: 1, Debug: 2, Info: 3, Warning: 4, Error: 5 },
    version: '1.91.0',
    env: { language: 'en', appName: 'Visual Studio Code', machineId: 'test', sessionId: 'test', openExternal: async () => true },
    workspace: {
      textDocuments: [],
      notebookDocuments: [],
      workspaceFolders: undefined,
      getConfiguration: (section?: string) => ({
        get: (key: string, dflt?: unknown) => {
          if (section !== 'completiond') return dflt;
          return key in settings ? settings[key] : defaults.has(key) ? defaults.get(key) : dflt;
        },
        has: () => false,
        inspect: (key: string) => (section === 'completiond' ? { key, globalValue: settings[key] } : undefined),
        update: async () => undefined,
      }),
      onDidChangeConfiguration: new EventEmitter<unknown>().event,
      onDidOpenTextDocument: new EventEmitter<unknown>().event,
      onDidCloseTextDocument: new EventEmitter<unknown>().event,
      onDidChangeTextDocument: new EventEmitter<unknown>().event,
      onDidSaveTextDocument: new EventEmitter<unknown>().event,
      onWillSaveTextDocument: new EventEmitter<unknown>().event,
      onDidChangeWorkspaceFolders: new EventEmitter<unknown>().event,
      onDidOpenNotebookDocument: new EventEmitter<unknown>().event,
      onDidCloseNotebookDocument: new EventEmitter<unknown>().event,
      onDidChangeNotebookDocument: new EventEmitter<unknown>().event,
      onDidSaveNotebookDocument: new EventEmitter<unknown>().event,
      createFileSystemWatcher: anything(),
    },
    window: {
      activeTextEditor: undefined,
      visibleTextEditors: [],
      tabGroups: { all: [], onDidChangeTabs: new EventEmitter<unknown>().event, onDidChangeTabGroups: new EventEmitter<unknown>().event },
      onDidChangeActiveTextEditor: new EventEmitter<unknown>().event,
      onDidChangeVisibleTextEditors: new EventEmitter<unknown>().event,
      createOutputChannel: output,
      createStatusBarItem: () => Object.assign(shown.status, { show: () => undefined, hide: () => undefined, dispose: () => undefined }),
      // What VS Code does with a showMessageRequest: a notification with a button per action item; the
      // item clicked comes back (the same object).
      showInformationMessage: async (message: string, ...items: { title: string }[]) => {
        shown.info.push({ message, items });
        return items.find((i) => i && typeof i === 'object' && i.title === click);
      },
      showWarningMessage: async (message: string) => void shown.warnings.push(message),
      showErrorMessage: async (message: string) => void shown.errors.push(message),
      withProgress: async (_o: unknown, task: (p: unknown, t: unknown) => Promise<unknown>) =>
        task({ report: () => undefined }, new CancellationTokenSource().token),
      showQuickPick: async () => undefined,
    },
    languages: { match: () => 10 },
    commands: {
      registerCommand: () => ({ dispose: () => undefined }),
      executeCommand: async () => undefined,
    },
  };
  // Everything else (providers, diagnostics, other classes): no-ops.
  const deep = (obj: any): any =>
    new Proxy(obj, {
      get: (t, p) =>
        p in t
          ? t[p] && typeof t[p] === 'object' && !Array.isArray(t[p]) && p !== 'prototype' ? deep(t[p]) : t[p]
          : typeof p === 'symbol' || p === 'then' ? undefined : anything(),
    });
  return { vscode: deep(base), shown };
}

const homes: string[] = [];
let deactivate: (() => Promise<void>) | undefined;

async function closeWindow(): Promise<void> {
  await deactivate?.();
  deactivate = undefined;
}

afterEach(async () => {
  await closeWindow();
  for (const home of homes.splice(0)) fs.rmSync(home, { recursive: true, force: true });
});

async function until(what: string, ok: () => boolean, diagnostics: () => string): Promise<void> {
  const start = Date.now();
  while (!ok()) {
    if (Date.now() - start > DEADLINE_MS - 30_000) assert.fail(`timed out waiting for ${what}` + diagnostics());
    await new Promise((r) => setTimeout(r, 200));
  }
}

function freshHome(): string {
  const home = fs.mkdtempSync(path.join(os.tmpdir(), 'completiond-wrapper-'));
  homes.push(home);
  return home;
}

/** Activate extension.ts with the stand-in `vscode` and the real language client (a new VS Code window). */
async function activate(click: string | undefined, home = freshHome()) {
  // The server inherits the extension host's environment: this home's config, offline, an empty hub cache.
  const env: Record<string, string> = {
    XDG_CONFIG_HOME: path.join(home, 'config'),
    XDG_RUNTIME_DIR: home,
    HF_HUB_OFFLINE: '1',
    TRANSFORMERS_OFFLINE: '1',
    HF_HUB_CACHE: path.join(home, 'hf'),
    OMP_NUM_THREADS: '1',
  };
  const saved = Object.fromEntries(Object.keys(env).map((k) => [k, process.env[k]]));
  Object.assign(process.env, env);
  const { vscode, shown } = makeVscode({ model: '', device: 'cpu', maxTokens: 4, workspaceContext: false, ...serverSettings() }, click);
  const mod = Module as unknown as { _load: (r: string, p: unknown, m: boolean) => unknown };
  const original = mod._load;
  mod._load = function (request: string, parent: unknown, isMain: boolean) {
    if (request === 'vscode') return vscode;
    return original.call(this, request, parent, isMain);
  };
  let ext: typeof import('../extension');
  try {
    for (const key of Object.keys(require.cache)) if (key.includes('vscode-languageclient') || key.endsWith(path.join('out', 'extension.js'))) delete require.cache[key];
    ext = require('../extension');
  } finally {
    mod._load = original;
  }
  try {
    await ext.activate({ subscriptions: [], extension: { packageJSON: packageJson }, extensionPath: home } as any);
  } finally {
    for (const [k, v] of Object.entries(saved)) {
      if (v === undefined) delete process.env[k];
      else process.env[k] = v;
    }
  }
  deactivate = () => ext.deactivate();
  const file = path.join(home, 'config', 'completiond', 'first-run.json');
  const answer = () => (fs.existsSync(file) ? JSON.parse(fs.readFileSync(file, 'utf8')) : undefined);
  const diagnostics = () => `\n--- status: ${shown.status.text}\n--- shown: ${JSON.stringify(shown.info)}\n--- warnings: ${JSON.stringify(shown.warnings)}` +
    `\n--- errors: ${JSON.stringify(shown.errors)}\n--- log:\n${shown.lines.slice(-40).join('\n')}`;
  return { shown, answer, diagnostics, home };
}

test('VS Code\'s language client shows the first-run offer natively, "Not now" reaches the server, and a new window is not asked again', { skip, timeout: DEADLINE_MS }, async () => {
  const { shown, answer, diagnostics, home } = await activate('Not now');
  await until('first-run question', () => shown.info.some((i) => /Download/.test(i.message)), diagnostics);
  const offer = shown.info.find((i) => /Download/.test(i.message))!;
  assert.deepEqual(offer.items, [{ title: 'Download' }, { title: 'Not now' }], 'one button per action item');
  assert.match(offer.message, /\d+\.\d GB/);
  await until('the answer recorded', () => answer()?.answer === 'Not now', diagnostics);
  assert.ok(!('model' in answer()));
  await until('the bundled-model notice', () => shown.info.some((i) => /using the bundled model/.test(i.message)), diagnostics);
  assert.deepEqual(shown.errors, [], diagnostics());
  await closeWindow();
  // A new window with the same user config: the model loads, and no second question, whatever it would answer.
  const again = await activate('Download', home);
  await until('the model to load', () => again.shown.status.text.startsWith('$(sparkle)'), again.diagnostics);
  await new Promise((r) => setTimeout(r, 1500));
  assert.ok(!again.shown.info.some((i) => /Download/.test(i.message)), 'asked again' + again.diagnostics());
  assert.equal(again.answer().answer, 'Not now');
});

test('VS Code\'s language client: "Download" reaches the server; offline, one notice and the bundled model stays', { skip, timeout: DEADLINE_MS }, async () => {
  const { shown, answer, diagnostics } = await activate('Download');
  await until('first-run question', () => shown.info.some((i) => /Download/.test(i.message)), diagnostics);
  await until('the download to fail', () => typeof answer()?.failed === 'string', diagnostics);
  assert.equal(answer().answer, 'Download');
  await until('the one notice', () => shown.warnings.some((m) => /could not be downloaded/.test(m)), diagnostics);
  assert.equal(shown.warnings.filter((m) => /could not be downloaded/.test(m)).length, 1, diagnostics());
  assert.ok(!('model' in answer()), 'a failed download is not kept as the model');
  await until('the bundled model again', () => shown.status.text.startsWith('$(sparkle)'), diagnostics);
  assert.deepEqual(shown.errors, [], diagnostics());
});
