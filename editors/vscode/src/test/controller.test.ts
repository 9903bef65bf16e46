import assert from 'node:assert/strict';
import { test } from 'node:test';
import { BUILTIN_ACCEPT_LINE, BUILTIN_ACCEPT_WORD, COMMANDS, Controller, HOW_TO_INSTALL, serverSettingKeys } from '../controller';
import { clientRecorder, FakeHost, fakeEnvironment, flush, packageJson, schema } from './fakes';

const installed = fakeEnvironment(['/usr/bin/completiond']);

async function started(host = new FakeHost()) {
  const rec = clientRecorder();
  const c = new Controller(host, rec.factory, installed);
  assert.equal(await c.start(), true);
  return { host, c, client: rec.clients[0], rec };
}

test('server settings are the flat completiond.* keys; client-only ones have a further dot', () => {
  const keys = serverSettingKeys(schema);
  assert.ok(keys.includes('enable') && keys.includes('maxTokens') && keys.includes('temperature'));
  assert.ok(!keys.some((k) => k.includes('.')));
  for (const clientOnly of ['server.path', 'server.python', 'server.args', 'trace.server', 'editor.disabledLanguages']) {
    assert.ok(`completiond.${clientOnly}` in schema, clientOnly);
    assert.ok(!keys.includes(clientOnly));
  }
});

test('start: launches `completiond lsp` with every server setting as initializationOptions, null where not set', async () => {
  const host = new FakeHost();
  host.change({ maxTokens: 16, enable: true });
  const { client } = await started(host);
  assert.deepEqual(client.server, { command: '/usr/bin/completiond', args: ['lsp'] });
  const init = client.options.initializationOptions as { completiond: Record<string, unknown> };
  assert.deepEqual(Object.keys(init.completiond), serverSettingKeys(schema));
  assert.equal(init.completiond.maxTokens, 16);
  assert.equal(init.completiond.enable, true);
  assert.equal(init.completiond.temperature, null); // not set: the server keeps config.toml / its default
  assert.ok(!('server' in init.completiond));
  assert.match(host.lines.join('\n'), /starting: \/usr\/bin\/completiond lsp/);
});

test('workspace/configuration: the completiond section, single keys, and others left to the client', async () => {
  const { client, host } = await started();
  host.change({ maxTokens: 12 });
  const section = client.options.configuration('completiond') as Record<string, unknown>;
  assert.equal(section.maxTokens, 12);
  assert.deepEqual(Object.keys(section), serverSettingKeys(schema));
  assert.equal(client.options.configuration('completiond.maxTokens'), 12);
  assert.equal(client.options.configuration('completiond.topK'), null);
  assert.equal(client.options.configuration('completiond.server.path'), undefined);
  assert.equal(client.options.configuration('editor'), undefined);
  assert.equal(client.options.configuration(undefined), undefined);
});

test('trustRemoteCode is sent only for a model named in user settings, never one a workspace picks', async () => {
  const host = new FakeHost();
  host.change({ trustRemoteCode: true, model: 'org/user-model' });
  const { client } = await started(host);
  const init = client.options.initializationOptions as { completiond: Record<string, unknown> };
  assert.equal(init.completiond.trustRemoteCode, true);
  host.change({ model: 'org/from-the-repository' });
  host.fromWorkspace.add('model');
  assert.equal((client.options.configuration('completiond') as Record<string, unknown>).trustRemoteCode, false);
  assert.equal(client.options.configuration('completiond.trustRemoteCode'), false);
});

test('a settings change is pushed with workspace/didChangeConfiguration', async () => {
  const { client, host } = await started();
  host.change({ temperature: 0.5, multiline: 'never' });
  await flush();
  const sent = client.notifications.filter((n) => n.method === 'workspace/didChangeConfiguration');
  assert.equal(sent.length, 1);
  assert.equal(sent[0].params.settings.completiond.temperature, 0.5);
  assert.equal(sent[0].params.settings.completiond.multiline, 'never');
  assert.equal(client.stopped, 0);
});

test('changing server.* restarts the language server with the new command', async () => {
  const host = new FakeHost();
  const rec = clientRecorder();
  const c = new Controller(host, rec.factory, fakeEnvironment(['/usr/bin/completiond', '/opt/cd/bin/completiond']));
  await c.start();
  host.change({ 'server.path': '/opt/cd/bin/completiond', 'server.args': ['--no-daemon'] });
  await flush();
  assert.equal(rec.clients.length, 2);
  assert.equal(rec.clients[0].stopped, 1);
  assert.deepEqual(rec.clients[1].server, { command: '/opt/cd/bin/completiond', args: ['lsp', '--no-daemon'] });
  assert.equal(rec.clients[1].running, true);
});

test('not found: red status, an error with "How to install" that opens the README', async () => {
  const host = new FakeHost();
  host.errorChoice = HOW_TO_INSTALL;
  const rec = clientRecorder();
  const c = new Controller(host, rec.factory, fakeEnvironment([]));
  assert.equal(await c.start(), false);
  await flush();
  assert.equal(rec.clients.length, 0);
  assert.equal(host.status.error, true);
  assert.equal(host.errors.length, 1);
  assert.match(host.errors[0].message, /not found/);
  assert.deepEqual(host.errors[0].actions, [HOW_TO_INSTALL, 'Open Settings']);
  assert.equal(host.readmeOpened, 1);
});

test('"Open Settings" opens the server settings', async () => {
  const host = new FakeHost();
  host.errorChoice = 'Open Settings';
  const c = new Controller(host, clientRecorder().factory, fakeEnvironment([]));
  await c.start();
  await flush();
  assert.deepEqual(host.settingsOpened, ['completiond.server']);
});

test('a server that fails to start: an error that offers the log', async () => {
  const host = new FakeHost();
  host.errorChoice = 'Show Log';
  const c = new Controller(
    host,
    (server, options) => {
      const { clients, factory } = clientRecorder();
      const client = factory(server, options);
      clients[0].failStart = new Error('spawn EACCES');
      return client;
    },
    installed,
  );
  assert.equal(await c.start(), false);
  await flush();
  assert.match(host.errors[0].message, /EACCES/);
  assert.equal(host.logShown, 1);
  assert.equal(host.status.error, true);
});

test('completiond/status notifications drive the status bar', async () => {
  const { client, host } = await started();
  assert.match(host.status.text, /loading~spin/);
  client.notify('completiond/status', { state: 'loading', progress: 0.5 });
  assert.match(host.status.text, /50%/);
  client.notify('completiond/status', { state: 'ready', latencyMs: 80, draftAcceptance: 0.8, tokensPerSecond: 30 });
  assert.equal(host.status.text, '$(sparkle) completiond 80 ms · 30 tok/s');
  client.notify('completiond/status', { state: 'error', message: 'model failed to load' });
  assert.equal(host.status.error, true);
  assert.match(host.lines.join('\n'), /model failed to load/);
});

test('toggle flips completiond.enable, stops asking for completions, and tells the server', async () => {
  const { client, host, c } = await started();
  assert.equal(client.options.shouldComplete('python'), true);
  await host.commands.get(COMMANDS.toggle)!();
  await flush();
  assert.equal(host.settings.get('enable'), false);
  assert.equal(client.options.shouldComplete('python'), false);
  assert.match(host.status.text, /circle-slash/);
  const last = client.notifications[client.notifications.length - 1];
  assert.equal(last.params.settings.completiond.enable, false);
  await host.commands.get(COMMANDS.toggle)!();
  await flush();
  assert.equal(c.enabled, true);
  assert.equal(client.options.shouldComplete('python'), true);
});

test('disabled languages get no completions', async () => {
  const { client, host } = await started();
  host.change({ 'editor.disabledLanguages': ['markdown'] });
  await flush();
  assert.equal(client.options.shouldComplete('markdown'), false);
  assert.equal(client.options.shouldComplete('python'), true);
});

test('restart asks the server to restart the daemon; without a server it restarts the client', async () => {
  const { client, host, rec } = await started();
  await host.commands.get(COMMANDS.restart)!();
  assert.deepEqual(client.requests[0], { method: 'workspace/executeCommand', params: { command: 'completiond.restartDaemon', arguments: [] } });
  client.running = false;
  await host.commands.get(COMMANDS.restart)!();
  assert.equal(rec.clients.length, 2);
  assert.equal(rec.clients[1].running, true);
});

test('clicking the status bar shows the server stats in the log, suggestion counts first', async () => {
  const { client, host } = await started();
  const suggestions = { shown: 9, accepted_full: 2, accepted_word: 1, accepted_line: 1, dismissed: 3 };
  client.answer = (_m, p) => (p.command === 'completiond.stats' ? { requests: 4, lsp: { suggestions } } : null);
  await host.commands.get(COMMANDS.showStats)!();
  assert.deepEqual(client.requests[0].params, { command: 'completiond.stats', arguments: [] });
  assert.match(host.lines.join('\n'), /suggestions: 9 shown, 4 accepted \(2 full, 1 word, 1 line\), 3 dismissed\nrequests: 4/);
  assert.equal(host.logShown, 1);
});

test('accept word / line run VS Code built-ins and report the partial accept to the server', async () => {
  const { host, client } = await started();
  await host.commands.get(COMMANDS.acceptWord)!();
  await host.commands.get(COMMANDS.acceptLine)!();
  assert.deepEqual(host.executed.map((e) => e.id), [BUILTIN_ACCEPT_WORD, BUILTIN_ACCEPT_LINE]);
  assert.deepEqual(
    client.requests.map((r) => r.params),
    [
      { command: 'completiond.suggestionEvent', arguments: [{ event: 'accepted', kind: 'word' }] },
      { command: 'completiond.suggestionEvent', arguments: [{ event: 'accepted', kind: 'line' }] },
    ],
  );
  await host.commands.get(COMMANDS.showLog)!();
  assert.equal(host.logShown, 1);
});

test('keybindings: only our accept-word on the key VS Code uses for it; nothing on editor-moving keys', () => {
  const taken = ['ctrl+alt+right', 'cmd+alt+right', 'ctrl+alt+left', 'cmd+alt+left'];
  for (const kb of packageJson.contributes.keybindings) {
    assert.ok(!taken.includes(kb.key) && !taken.includes(kb.mac), JSON.stringify(kb));
    assert.ok(kb.command.startsWith('completiond.'), `${kb.command}: VS Code binds its own commands already`);
  }
  const word = packageJson.contributes.keybindings.find((kb: { command: string }) => kb.command === COMMANDS.acceptWord);
  assert.deepEqual([word.key, word.mac], ['ctrl+right', 'cmd+right']);
  // One line of the suggestion: the line counterpart of the word key, only while a suggestion shows.
  const line = packageJson.contributes.keybindings.find((kb: { command: string }) => kb.command === COMMANDS.acceptLine);
  assert.ok(line, 'no key accepts one line');
  assert.deepEqual([line.key, line.mac], ['ctrl+down', 'cmd+down']);
  assert.match(line.when, /inlineSuggestionVisible && editorTextFocus && !editorReadonly/);
});

test('settings layout: basic settings first, decoding internals in an advanced section, every enum described', () => {
  const sections: { title: string; order: number; properties: Record<string, any> }[] = packageJson.contributes.configuration;
  assert.ok(Array.isArray(sections) && sections.length >= 3, 'settings are one flat list');
  assert.deepEqual(sections.map((s) => s.order), sections.map((_, i) => i + 1));
  // Titled with the extension's name, the first section's settings show right under the extension.
  assert.equal(sections[0].title, packageJson.displayName);
  for (const key of ['enable', 'model']) assert.ok(`completiond.${key}` in sections[0].properties, key);
  const advanced = sections.find((s) => /advanced/i.test(s.title));
  assert.ok(advanced, 'no advanced section');
  assert.equal(advanced, sections[sections.length - 1]);
  for (const key of ['exitLayer', 'draftTokens', 'draftThreshold', 'seed', 'topP', 'topK', 'speculation']) {
    assert.ok(`completiond.${key}` in advanced.properties, key);
    assert.ok(!(`completiond.${key}` in sections[0].properties), key);
  }
  for (const section of sections) {
    const orders = Object.values(section.properties).map((p) => p.order);
    assert.deepEqual(orders, orders.map((_, i) => i + 1), section.title);
  }
  for (const [key, prop] of Object.entries(schema)) {
    if (!prop.enum) continue;
    assert.ok(Array.isArray(prop.enumDescriptions), `${key} has no enumDescriptions`);
    assert.equal(prop.enumDescriptions.length, prop.enum.length, key);
    assert.ok(prop.enumDescriptions.every((d: unknown) => typeof d === 'string' && d.length > 0), key);
  }
});

test('the server.python setting says how to install completiond from a clone (it is not on PyPI)', () => {
  const text = schema['completiond.server.python'].markdownDescription;
  assert.doesNotMatch(text, /pip install completiond/);
  assert.match(text, /pip install -e \./);
});

test('package.json: packaging builds and bundles first; Restricted Mode keeps workspaces from choosing what runs', () => {
  assert.equal(packageJson.main, './dist/extension.js');
  assert.match(packageJson.scripts['vscode:prepublish'], /build.*bundle/);
  assert.match(packageJson.scripts.bundle, /^esbuild .*--bundle.*--external:vscode/);
  const trust = packageJson.capabilities.untrustedWorkspaces;
  assert.equal(trust.supported, 'limited');
  // A machine-scoped setting cannot come from a workspace at all, so it needs no Restricted Mode entry
  // (trustRemoteCode is machine-scoped since issue 43).
  for (const key of ['server.path', 'server.python', 'server.args', 'model', 'draftModel', 'trustRemoteCode']) {
    const machine = schema[`completiond.${key}`].scope === 'machine';
    assert.ok(machine || trust.restrictedConfigurations.includes(`completiond.${key}`), key);
  }
  assert.equal(schema['completiond.trustRemoteCode'].scope, 'machine');
  for (const [key, prop] of Object.entries(schema)) {
    assert.ok((prop as any).description || (prop as any).markdownDescription, `${key} has no description`);
  }
  assert.deepEqual(schema['completiond.editor.disabledLanguages'].default, ['markdown', 'plaintext', 'scminput']);
});

test('package.json declares exactly the commands the controller registers, none clashing with server commands', async () => {
  const { host } = await started();
  const declared = packageJson.contributes.commands.map((c: { command: string }) => c.command).sort();
  assert.deepEqual(declared, [...host.commands.keys()].sort());
  assert.ok(!declared.includes('completiond.stats') && !declared.includes('completiond.restartDaemon'));
  for (const kb of packageJson.contributes.keybindings) assert.match(kb.when, /inlineSuggestionVisible/);
});

test('package.json: @types/vscode is pinned to engines.vscode; activation; entry point', () => {
  const engine = packageJson.engines.vscode.replace(/^\^/, '');
  assert.equal(packageJson.devDependencies['@types/vscode'], engine);
  assert.equal(packageJson.main, './dist/extension.js');
  assert.ok(packageJson.activationEvents.includes('onStartupFinished'));
});

test('dispose stops the client', async () => {
  const { c, client } = await started();
  c.dispose();
  await flush();
  assert.equal(client.running, false);
});
