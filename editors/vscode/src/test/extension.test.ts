/**
 * extension.ts (the glue to the real API) loaded with `vscode` and
 * `vscode-languageclient/node` replaced by mock modules: checks what it hands to
 * the LanguageClient and how it maps settings, status and commands onto VS Code.
 */
import assert from 'node:assert/strict';
import * as fs from 'node:fs';
import Module from 'node:module';
import * as os from 'node:os';
import * as path from 'node:path';
import { afterEach, beforeEach, test } from 'node:test';
import { REST_MS } from '../rest';
import { flush, packageJson, schema } from './fakes';

const ConfigurationTarget = { Global: 1, Workspace: 2, WorkspaceFolder: 3 };

class ThemeColor {
  constructor(public id: string) {}
}

/** The mock `vscode` module. */
function makeVscode() {
  const defaults = new Map<string, unknown>();
  for (const [key, prop] of Object.entries(schema)) defaults.set(key.slice('completiond.'.length), (prop as any).default);
  const user = new Map<string, unknown>();
  const workspace = new Map<string, unknown>();
  const configListeners: ((e: { affectsConfiguration(s: string): boolean }) => void)[] = [];
  const commands = new Map<string, (...a: unknown[]) => unknown>();
  const state = {
    user,
    workspace,
    updates: [] as { key: string; value: unknown; target: number }[],
    errors: [] as { message: string; actions: string[] }[],
    errorChoice: undefined as string | undefined,
    executed: [] as { id: string; args: unknown[] }[],
    statusItems: [] as any[],
    logLines: [] as string[],
    commands,
    /** QuickPicks shown, and the label of the row the next one picks */
    quickPicks: [] as { rows: any[]; options: any }[],
    pickLabel: undefined as string | undefined,
    activeTextEditor: { document: { languageId: 'python' } } as { document: { languageId: string } } | undefined,
    editorListeners: [] as ((e: unknown) => void)[],
    selectionListeners: [] as ((e: unknown) => void)[],
  };
  const fire = (keys: string[]) => {
    const e = { affectsConfiguration: (s: string) => keys.some((k) => `completiond.${k}` === s || `completiond.${k}`.startsWith(s + '.')) };
    configListeners.forEach((l) => l(e));
  };
  const vscode = {
    ConfigurationTarget,
    ThemeColor,
    QuickPickItemKind: { Separator: -1, Default: 0 },
    InlineCompletionTriggerKind: { Invoke: 0, Automatic: 1 },
    StatusBarAlignment: { Left: 1, Right: 2 },
    Uri: {
      joinPath: (base: { path: string }, ...parts: string[]) => ({ path: path.posix.join(base.path, ...parts) }),
      file: (p: string) => ({ path: p }),
    },
    workspace: {
      getConfiguration: (section: string) => {
        assert.equal(section, 'completiond');
        return {
          get: (key: string) => (workspace.has(key) ? workspace.get(key) : user.has(key) ? user.get(key) : defaults.get(key)),
          inspect: (key: string) => ({ key, defaultValue: defaults.get(key), globalValue: user.get(key), workspaceValue: workspace.get(key) }),
          update: async (key: string, value: unknown, target: number) => {
            state.updates.push({ key, value, target });
            (target === ConfigurationTarget.Global ? user : workspace).set(key, value);
            fire([key]);
          },
        };
      },
      onDidChangeConfiguration: (l: (e: { affectsConfiguration(s: string): boolean }) => void) => {
        configListeners.push(l);
        return { dispose: () => undefined };
      },
    },
    window: {
      createOutputChannel: () => ({ appendLine: (l: string) => void state.logLines.push(l), show: () => undefined, dispose: () => undefined }),
      createStatusBarItem: (id: string, alignment: number, priority: number) => {
        const item = { id, alignment, priority, shown: false, show() {
          this.shown = true;
        }, dispose: () => undefined } as any;
        state.statusItems.push(item);
        return item;
      },
      showErrorMessage: async (message: string, ...actions: string[]) => {
        state.errors.push({ message, actions });
        return state.errorChoice;
      },
      showInformationMessage: async () => undefined,
      showQuickPick: async (rows: any[], options: any) => {
        state.quickPicks.push({ rows, options });
        return rows.find((r) => r.kind !== -1 && state.pickLabel !== undefined && r.label.includes(state.pickLabel));
      },
      get activeTextEditor() {
        return state.activeTextEditor;
      },
      onDidChangeActiveTextEditor: (l: (e: unknown) => void) => {
        state.editorListeners.push(l);
        return { dispose: () => undefined };
      },
      onDidChangeTextEditorSelection: (l: (e: unknown) => void) => {
        state.selectionListeners.push(l);
        return { dispose: () => undefined };
      },
    },
    commands: {
      registerCommand: (id: string, run: (...a: unknown[]) => unknown) => {
        assert.ok(!commands.has(id), `command ${id} registered twice`);
        commands.set(id, run);
        return { dispose: () => commands.delete(id) };
      },
      executeCommand: async (id: string, ...args: unknown[]) => {
        state.executed.push({ id, args });
        return commands.get(id)?.(...args);
      },
    },
  };
  return { vscode, state, fire };
}

/** The mock `vscode-languageclient/node` module. */
function makeLanguageClient() {
  const clients: any[] = [];
  class LanguageClient {
    running = false;
    handlers = new Map<string, (p: unknown) => void>();
    requests: { method: string; params: unknown }[] = [];
    notifications: { method: string; params: any }[] = [];
    stopped = 0;
    constructor(public id: string, public name: string, public serverOptions: any, public clientOptions: any) {
      clients.push(this);
    }
    async start() {
      this.running = true;
    }
    async stop() {
      this.stopped++;
      this.running = false;
    }
    isRunning() {
      return this.running;
    }
    onNotification(method: string, h: (p: unknown) => void) {
      this.handlers.set(method, h);
      return { dispose: () => this.handlers.delete(method) };
    }
    async sendNotification(method: string, params: unknown) {
      this.notifications.push({ method, params });
    }
    async sendRequest(method: string, params: unknown) {
      this.requests.push({ method, params });
      return { requests: 1 };
    }
  }
  return { module: { LanguageClient, TransportKind: { stdio: 0, ipc: 1 } }, clients };
}

let mock: ReturnType<typeof makeVscode>;
let lc: ReturnType<typeof makeLanguageClient>;
let ext: typeof import('../extension');
let binDir: string;

function loadExtension(file = '../extension') {
  const mod = Module as unknown as { _load: (r: string, p: unknown, m: boolean) => unknown };
  const original = mod._load;
  mod._load = function (request: string, parent: unknown, isMain: boolean) {
    if (request === 'vscode') return mock.vscode;
    if (request === 'vscode-languageclient/node') return lc.module;
    return original.call(this, request, parent, isMain);
  };
  try {
    delete require.cache[require.resolve(file)];
    return require(file);
  } finally {
    mod._load = original;
  }
}

let extDir: string;

function context() {
  return { subscriptions: [] as { dispose(): unknown }[], extension: { packageJSON: packageJson }, extensionUri: { path: extDir }, extensionPath: extDir };
}

beforeEach(() => {
  mock = makeVscode();
  lc = makeLanguageClient();
  ext = loadExtension();
  binDir = fs.mkdtempSync(path.join(os.tmpdir(), 'completiond-bin-'));
  extDir = fs.mkdtempSync(path.join(os.tmpdir(), 'completiond-ext-'));
  fs.writeFileSync(path.join(extDir, 'readme.md'), '# completiond\n'); // the name vsce gives it
  fs.writeFileSync(path.join(binDir, 'completiond'), '#!/bin/sh\n', { mode: 0o755 });
  process.env.PATH = binDir;
  process.env.HOME = binDir;
});

afterEach(() => {
  fs.rmSync(binDir, { recursive: true, force: true });
  fs.rmSync(extDir, { recursive: true, force: true });
});

test('activate starts `completiond lsp` over stdio with every server setting, null where unset', async () => {
  mock.state.user.set('maxTokens', 16);
  await ext.activate(context() as any);
  assert.equal(lc.clients.length, 1);
  const client = lc.clients[0];
  assert.equal(client.id, 'completiond');
  assert.deepEqual(client.serverOptions, { command: path.join(binDir, 'completiond'), args: ['lsp'], transport: 0 });
  const init = client.clientOptions.initializationOptions.completiond;
  assert.equal(init.maxTokens, 16);
  assert.equal(init.temperature, null);
  assert.equal(Object.keys(init).length, Object.keys(schema).filter((k) => !k.slice(12).includes('.')).length);
  assert.deepEqual(client.clientOptions.documentSelector, [{ scheme: 'file' }, { scheme: 'untitled' }, { scheme: 'vscode-notebook-cell' }]);
  assert.equal(client.running, true);
  await ext.deactivate();
  assert.equal(client.stopped, 1);
});

test('workspace/configuration middleware answers the completiond section and leaves others to the client', async () => {
  mock.state.workspace.set('multiline', 'never');
  await ext.activate(context() as any);
  const mw = lc.clients[0].clientOptions.middleware;
  const answers = await mw.workspace.configuration(
    { items: [{ section: 'completiond' }, { section: 'editor' }, { section: 'completiond.multiline' }] },
    undefined,
    async () => ['from-client-1', 'from-client-2', 'from-client-3'],
  );
  assert.equal(answers[0].multiline, 'never');
  assert.equal(answers[0].maxTokens, null);
  assert.equal(answers[1], 'from-client-2');
  assert.equal(answers[2], 'never');
  await ext.deactivate();
});

test('only inline completions are requested, and none while disabled or for a disabled language', async () => {
  await ext.activate(context() as any);
  const mw = lc.clients[0].clientOptions.middleware;
  assert.equal(mw.provideCompletionItem(), undefined);
  let asked = 0;
  const next = async () => {
    asked++;
    return [];
  };
  await mw.provideInlineCompletionItems({ languageId: 'python' }, {}, {}, {}, next);
  assert.equal(asked, 1);
  mock.state.user.set('editor.disabledLanguages', ['rust']);
  assert.equal(await mw.provideInlineCompletionItems({ languageId: 'rust' }, {}, {}, {}, next), undefined);
  // The server's own list (prose by default) holds back the request too: no round trip for nothing.
  assert.equal(await mw.provideInlineCompletionItems({ languageId: 'markdown' }, {}, {}, {}, next), undefined);
  await mock.state.commands.get('completiond.toggle')!();
  await flush();
  assert.equal(await mw.provideInlineCompletionItems({ languageId: 'python' }, {}, {}, {}, next), undefined);
  assert.equal(asked, 1);
  const pushed = lc.clients[0].notifications.find((n: any) => n.method === 'workspace/didChangeConfiguration');
  assert.equal(pushed.params.settings.completiond.enable, false);
  await ext.deactivate();
});

test('toggle writes where the value comes from', async () => {
  await ext.activate(context() as any);
  await mock.state.commands.get('completiond.toggle')!();
  assert.deepEqual(mock.state.updates.at(-1), { key: 'enable', value: false, target: ConfigurationTarget.Global });
  mock.state.workspace.set('enable', false);
  await mock.state.commands.get('completiond.toggle')!();
  assert.deepEqual(mock.state.updates.at(-1), { key: 'enable', value: true, target: ConfigurationTarget.Workspace });
  await ext.deactivate();
});

test('status notifications reach the status bar item; errors turn it red; click opens the menu', async () => {
  await ext.activate(context() as any);
  const item = mock.state.statusItems[0];
  assert.equal(item.shown, true);
  assert.equal(item.command, 'completiond.showMenu');
  lc.clients[0].handlers.get('completiond/status')({ state: 'ready', latencyMs: 42, alpha: 0.9 });
  assert.equal(item.text, '$(sparkle) completiond 42 ms');
  assert.match(item.tooltip, /draft tokens kept \(speculative decoding\): 90%/);
  assert.equal(item.backgroundColor, undefined);
  lc.clients[0].handlers.get('completiond/status')({ state: 'error', message: 'boom' });
  assert.ok(item.backgroundColor instanceof ThemeColor);
  assert.equal(item.backgroundColor.id, 'statusBarItem.errorBackground');
  await mock.state.commands.get('completiond.showStats')!();
  assert.deepEqual(lc.clients[0].requests.at(-1), { method: 'workspace/executeCommand', params: { command: 'completiond.stats', arguments: [] } });
  assert.ok(mock.state.logLines.some((l) => l === 'requests: 1'));
  await ext.deactivate();
});

test('the cursor at rest in an editor reaches the server as completiond/cursorRest (rest.ts)', async () => {
  await ext.activate(context() as any);
  const client = lc.clients[0];
  const editor = (scheme: string, line: number) => ({
    document: { uri: { scheme, toString: () => `${scheme}:///w/a.py` }, languageId: 'python', version: 3 },
    selection: { active: { line, character: 4 } },
  });
  const rests = () => client.notifications.filter((n: { method: string }) => n.method === 'completiond/cursorRest');
  mock.state.selectionListeners.forEach((l) => l({ textEditor: editor('file', 3) }));
  mock.state.selectionListeners.forEach((l) => l({ textEditor: editor('output', 30) })); // not a document the server has
  await new Promise((r) => setTimeout(r, 2 * REST_MS));
  assert.deepEqual(rests(), [], 'moved on to an output pane before resting: nothing');
  mock.state.selectionListeners.forEach((l) => l({ textEditor: editor('file', 12) }));
  for (let i = 0; i < 250 && rests().length === 0; i++) await new Promise((r) => setTimeout(r, 20));
  assert.deepEqual(rests(), [{ method: 'completiond/cursorRest', params: { textDocument: { uri: 'file:///w/a.py' }, position: { line: 12, character: 4 } } }]);
  await ext.deactivate();
});

const AUTOMATIC = { triggerKind: 1 };
const INVOKED = { triggerKind: 0 };

test('the status menu: a QuickPick with separators; Snooze… then 15 minutes holds back typing suggestions, not Alt+\\', async () => {
  await ext.activate(context() as any);
  const item = mock.state.statusItems[0];
  lc.clients[0].handlers.get('completiond/status')({ state: 'ready', model: 'bundled', device: 'cpu', latencyMs: 42 });
  mock.state.pickLabel = 'Snooze';
  await mock.state.commands.get(item.command)!();
  await flush();
  const menu = mock.state.quickPicks[0];
  assert.equal(menu.options.title, 'completiond');
  assert.match(menu.rows[0].label, /ready/);
  assert.match(menu.rows[0].description, /bundled on cpu/);
  assert.match(menu.rows[0].detail, /last completion 42 ms/);
  assert.ok(menu.rows.some((r) => r.kind === -1 && r.label === 'Suggestions'), 'separators are QuickPickItemKind.Separator');
  assert.ok(menu.rows.filter((r) => r.kind !== -1).every((r) => r.kind === 0));
  // The second QuickPick (how long) was shown and nothing picked in it yet: pick 15 minutes now.
  assert.equal(mock.state.quickPicks.length, 2);
  mock.state.pickLabel = '15 minutes';
  await mock.state.commands.get('completiond.snooze')!();
  assert.match(item.text, /^\$\(bell-slash\) completiond \d\d:\d\d$/);
  assert.ok(mock.state.executed.some((e) => e.id === 'editor.action.inlineSuggest.hide'));
  const mw = lc.clients[0].clientOptions.middleware;
  let asked = 0;
  const next = async () => {
    asked++;
    return [];
  };
  assert.equal(await mw.provideInlineCompletionItems({ languageId: 'python' }, {}, AUTOMATIC, {}, next), undefined);
  await mw.provideInlineCompletionItems({ languageId: 'python' }, {}, INVOKED, {}, next);
  assert.equal(asked, 1);
  await mock.state.commands.get('completiond.resume')!();
  assert.match(item.text, /sparkle/);
  await mw.provideInlineCompletionItems({ languageId: 'python' }, {}, AUTOMATIC, {}, next);
  assert.equal(asked, 2);
  await ext.deactivate();
});

test('the menu turns the active editor\'s language off in user settings, at once, and back on', async () => {
  await ext.activate(context() as any);
  mock.state.activeTextEditor = { document: { languageId: 'go' } };
  mock.state.pickLabel = 'Turn off for go';
  await mock.state.commands.get('completiond.showMenu')!();
  await flush();
  const update = mock.state.updates.at(-1)!;
  assert.equal(update.key, 'disabledLanguages');
  assert.equal(update.target, ConfigurationTarget.Global);
  assert.deepEqual(String(update.value).split(','), ['markdown', 'plaintext', 'text', 'scminput', 'gitcommit', 'gitrebase', 'help', 'go']);
  const pushed = lc.clients[0].notifications.filter((n: any) => n.method === 'workspace/didChangeConfiguration').at(-1);
  assert.match(pushed.params.settings.completiond.disabledLanguages, /,go$/);
  const mw = lc.clients[0].clientOptions.middleware;
  assert.equal(await mw.provideInlineCompletionItems({ languageId: 'go' }, {}, INVOKED, {}, async () => []), undefined);
  assert.match(mock.state.statusItems[0].text, /circle-slash/);
  mock.state.pickLabel = 'Turn on for go';
  await mock.state.commands.get('completiond.showMenu')!();
  await flush();
  assert.doesNotMatch(String(mock.state.updates.at(-1)!.value), /go/);
  assert.deepEqual(await mw.provideInlineCompletionItems({ languageId: 'go' }, {}, INVOKED, {}, async () => ['asked']), ['asked']);
  await ext.deactivate();
});

test('no server: an error with "How to install" that opens the bundled README (packed as readme.md)', async () => {
  process.env.PATH = '/nonexistent';
  mock.state.errorChoice = 'How to install';
  await ext.activate(context() as any);
  await flush();
  assert.equal(lc.clients.length, 0);
  assert.match(mock.state.errors[0].message, /not found/);
  assert.deepEqual(mock.state.executed.at(-1), { id: 'markdown.showPreview', args: [{ path: path.join(extDir, 'readme.md') }] });
  await ext.deactivate();
});

test('the esbuild bundle (the packaged entry point) needs nothing but vscode and Node built-ins', () => {
  const bundle = path.resolve(__dirname, '..', '..', packageJson.main);
  assert.ok(fs.existsSync(bundle), `${bundle} missing: npm test bundles it first (pretest)`);
  const mod = Module as unknown as { _load: (r: string, p: unknown, m: boolean) => unknown; builtinModules: string[] };
  const original = mod._load;
  const requested: string[] = [];
  mod._load = function (request: string, parent: unknown, isMain: boolean) {
    if (parent && (parent as { filename?: string }).filename === bundle) requested.push(request);
    // vscode-languageclient, inside the bundle, subclasses VS Code's classes when it loads: any name is a class.
    if (request === 'vscode') return new Proxy({}, { get: () => class {} });
    return original.call(this, request, parent, isMain);
  };
  try {
    delete require.cache[bundle];
    const loaded = require(bundle);
    assert.equal(typeof loaded.activate, 'function');
    assert.equal(typeof loaded.deactivate, 'function');
  } finally {
    mod._load = original;
  }
  const builtins = new Set(Module.builtinModules);
  const outside = requested.filter((r) => r !== 'vscode' && !builtins.has(r.replace(/^node:/, '')));
  assert.deepEqual(outside, [], 'the vsix ships no node_modules: everything else must be in the bundle');
  assert.ok(requested.includes('vscode'));
});
