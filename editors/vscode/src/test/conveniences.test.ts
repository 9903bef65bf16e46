/**
 * Issue 47's editor conveniences, through the Controller and the fake VS Code API: snooze (with a clock
 * the test moves), turning the current language off and on, and the status menu.
 */
import assert from 'node:assert/strict';
import { test } from 'node:test';
import { BUILTIN_HIDE, COMMANDS, Controller, SERVER_COMMANDS, SNOOZED_CONTEXT } from '../controller';
import { menuItems, modelItems } from '../menu';
import { clockTime, languageIsOff, languageSwitch, snoozeEnd, snoozeMinutes } from '../pause';
import { statusView } from '../status';
import { clientRecorder, FakeClock, FakeHost, fakeEnvironment, flush, packageJson, pickLabel } from './fakes';

const MINUTE = 60_000;

async function started(host = new FakeHost(), clock = new FakeClock()) {
  const rec = clientRecorder();
  const c = new Controller(host, rec.factory, fakeEnvironment(['/usr/bin/completiond']), clock);
  assert.equal(await c.start(), true);
  const client = rec.clients[0];
  client.notify('completiond/status', { state: 'ready', model: 'bundled', device: 'cpu', latencyMs: 42, tokensPerSecond: 30 });
  return { host, c, client, clock, rec };
}

function actions(host: FakeHost, i = -1): string[] {
  return host.picks.at(i)!.items.filter((r) => r.action).map((r) => r.label);
}

test('snooze for 5 minutes: typing suggestions stop, the status says until when, and they come back by themselves', async () => {
  const { host, c, clock } = await started();
  await host.commands.get(COMMANDS.snooze)!(5);
  assert.equal(c.shouldComplete('python'), false);
  assert.equal(c.shouldComplete('python', true), true, 'asked for (Alt+\\): still answered');
  const until = clockTime(clock.now() + 5 * MINUTE);
  assert.equal(host.status.text, `$(bell-slash) completiond ${until}`);
  assert.match(host.status.tooltip, new RegExp(`snoozed until ${until}; they come back by themselves`));
  assert.ok(host.executed.some((e) => e.id === BUILTIN_HIDE), 'the ghost text on screen is hidden at once');
  clock.advance(5 * MINUTE - 1000);
  assert.equal(c.shouldComplete('python'), false);
  clock.advance(1000);
  assert.equal(c.shouldComplete('python'), true);
  assert.match(host.status.text, /^\$\(sparkle\) completiond/, 'the status redraws when the snooze ends');
  assert.equal(clock.pending, 0);
  // The `when` key that shows Resume in the Command Palette followed it.
  const context = host.executed.filter((e) => e.id === 'setContext').map((e) => e.args);
  assert.deepEqual(context, [[SNOOZED_CONTEXT, true], [SNOOZED_CONTEXT, false]]);
  assert.ok(packageJson.contributes.menus.commandPalette.some((m: any) => m.command === COMMANDS.resume && m.when === SNOOZED_CONTEXT));
});

test('a machine that slept past the end of a snooze resumes at once (the clock decides, not only the timer)', async () => {
  const { c, clock } = await started();
  await c.snooze(15);
  clock.jump(16 * MINUTE);
  assert.equal(c.snoozedUntil, undefined);
  assert.equal(c.shouldComplete('python'), true);
});

test('Snooze… asks how long: 5, 15, 60 minutes or until restart; Escape changes nothing', async () => {
  const { host, c, clock } = await started();
  await host.commands.get(COMMANDS.snooze)!();
  assert.deepEqual(actions(host), ['5 minutes', '15 minutes', '1 hour', 'Until VS Code restarts']);
  assert.equal(host.picks[0].items[0].description, `until ${clockTime(clock.now() + 5 * MINUTE)}`);
  assert.equal(c.snoozedUntil, undefined);
  host.pickChoices.push(pickLabel('1 hour'));
  await host.commands.get(COMMANDS.snooze)!();
  assert.equal(c.snoozedUntil, clock.now() + 60 * MINUTE);
  // A new snooze replaces the old one, timer included.
  host.pickChoices.push(pickLabel('Until VS Code restarts'));
  await host.commands.get(COMMANDS.snooze)!();
  assert.equal(c.snoozedUntil, Infinity);
  assert.equal(host.status.text, '$(bell-slash) completiond');
  assert.match(host.status.tooltip, /snoozed until VS Code restarts/);
  clock.advance(24 * 60 * MINUTE);
  assert.equal(c.shouldComplete('python'), false, 'the open-ended snooze has no timer');
  await host.commands.get(COMMANDS.resume)!();
  assert.equal(c.shouldComplete('python'), true);
  assert.match(host.lines.join('\n'), /suggestions snoozed until VS Code restarts\n(.|\n)*suggestions resumed/);
});

test('the menu while snoozed offers Resume, which ends the snooze now', async () => {
  const { host, c } = await started();
  await c.snooze('15');
  host.pickChoices.push(pickLabel('Resume suggestions'));
  await host.commands.get(COMMANDS.showMenu)!();
  assert.match(host.picks[0].items.find((r) => r.action === 'resume')!.description!, /^snoozed until \d\d:\d\d$/);
  assert.ok(!actions(host, 0).some((l) => l.includes('Snooze')));
  assert.equal(c.snoozedUntil, undefined);
  assert.match(host.status.text, /sparkle/);
});

test('an error outranks the snooze in the status item', async () => {
  const { c, client, host } = await started();
  await c.snooze(5);
  client.notify('completiond/status', { state: 'error', message: 'CUDA out of memory' });
  assert.equal(host.status.error, true);
  assert.match(host.status.tooltip, /CUDA out of memory/);
});

test('turning the current language off writes completiond.disabledLanguages, pushes it to the server, and holds back even Alt+\\', async () => {
  const { host, c, client } = await started();
  host.switchTo('go');
  await host.commands.get(COMMANDS.toggleLanguage)!();
  assert.equal(host.settings.get('disabledLanguages'), 'markdown,plaintext,text,scminput,gitcommit,gitrebase,help,go');
  assert.ok(host.explicit.has('disabledLanguages'));
  await flush();
  const pushed = client.notifications.filter((n) => n.method === 'workspace/didChangeConfiguration').at(-1)!;
  assert.match(pushed.params.settings.completiond.disabledLanguages, /,go$/);
  assert.equal(c.shouldComplete('go', true), false);
  assert.equal(c.shouldComplete('python'), true);
  assert.equal(host.status.text, '$(circle-slash) completiond');
  assert.match(host.status.tooltip, /off for go files/);
  assert.ok(host.executed.some((e) => e.id === BUILTIN_HIDE));
  host.switchTo('python');
  assert.match(host.status.text, /sparkle/, 'the status follows the active editor');
  await host.commands.get(COMMANDS.toggleLanguage)!('go');
  assert.equal(host.settings.get('disabledLanguages'), 'markdown,plaintext,text,scminput,gitcommit,gitrebase,help');
  assert.equal(c.shouldComplete('go'), true);
});

test('turning a language on removes it from both lists (server and editor), whatever its case', async () => {
  const { host, c } = await started();
  host.switchTo('markdown'); // off by default in both
  assert.equal(c.languageOff('markdown'), true);
  host.pickChoices.push(pickLabel('Turn on for markdown'));
  await host.commands.get(COMMANDS.showMenu)!();
  assert.equal(host.settings.get('disabledLanguages'), 'plaintext,text,scminput,gitcommit,gitrebase,help');
  assert.deepEqual(host.settings.get('editor.disabledLanguages'), ['plaintext', 'scminput']);
  assert.equal(c.shouldComplete('markdown'), true);
  host.change({ disabledLanguages: 'Go, rust' });
  assert.equal(c.languageOff('go'), true);
  await c.toggleLanguage('go');
  assert.equal(host.settings.get('disabledLanguages'), 'rust');
});

test('no editor open: the language switch says to open a file first and writes nothing', async () => {
  const { host, c } = await started();
  host.switchTo(undefined);
  await c.toggleLanguage();
  assert.match(host.infos.at(-1)!, /open a file first/);
  assert.ok(!host.explicit.has('disabledLanguages'));
  await host.commands.get(COMMANDS.showMenu)!();
  assert.ok(!actions(host).some((l) => /Turn (on|off) for/.test(l)));
});

test('the status menu: state, model, device, last latency, counts; then every action', async () => {
  const { host, client } = await started();
  client.notify('completiond/status', { state: 'ready', model: 'bundled', device: 'cpu', latencyMs: 42, tokensPerSecond: 30,
    suggestions: { shown: 7, acceptedFull: 2, acceptedWord: 1, acceptedLine: 0, dismissed: 3 } });
  await host.commands.get(COMMANDS.showMenu)!();
  const [summary, ...rest] = host.picks[0].items;
  assert.equal(summary.label, '$(sparkle) ready');
  assert.equal(summary.description, 'bundled on cpu');
  assert.match(summary.detail!, /last completion 42 ms · 30 tok\/s · suggestions: 7 shown, 3 accepted/);
  assert.deepEqual(rest.filter((r) => !r.action).map((r) => r.label), ['Suggestions', 'completiond']);
  assert.deepEqual(actions(host).slice(1), [
    '$(bell-slash) Snooze…',
    '$(circle-slash) Turn off for python',
    '$(circle-slash) Turn inline completions off',
    '$(debug-restart) Restart the daemon',
    '$(cloud-download) Choose a model…',
    '$(graph) Show stats',
    '$(output) Show log',
    '$(gear) Open settings',
  ]);
  assert.equal(host.picks[0].title, 'completiond');
});

test('each menu action does what it says', async () => {
  const { host, client, c } = await started();
  client.answer = (_m, p) => (p.command === SERVER_COMMANDS.stats ? { requests: 1 } : { restarted: true });
  const run = async (label: string) => {
    host.pickChoices.push(pickLabel(label));
    await host.commands.get(COMMANDS.showMenu)!();
    await flush();
  };
  await run('Restart the daemon');
  assert.equal(client.requests.at(-1)!.params.command, SERVER_COMMANDS.restartDaemon);
  await run('Show stats');
  assert.equal(client.requests.at(-1)!.params.command, SERVER_COMMANDS.stats);
  await run('ready'); // the summary row: the stats too
  assert.equal(client.requests.filter((r) => r.params.command === SERVER_COMMANDS.stats).length, 2);
  const shown = host.logShown;
  await run('Show log');
  assert.equal(host.logShown, shown + 1);
  await run('Open settings');
  await run('Choose a model');
  assert.deepEqual(host.settingsOpened, ['@ext:completiond.completiond', 'completiond.model']);
  await run('Turn inline completions off');
  assert.equal(c.enabled, false);
  assert.equal(c.shouldComplete('python', true), false);
  assert.ok(actions(host).includes('$(circle-slash) Turn inline completions off'));
  await run('Turn inline completions on');
  assert.equal(c.enabled, true);
  host.pickChoices.push(pickLabel('Snooze'), pickLabel('5 minutes'));
  await host.commands.get(COMMANDS.showMenu)!();
  assert.ok(c.snoozedUntil !== undefined);
});

test('the menu while the server is not found says so, and still offers the log and settings', () => {
  const items = menuItems({ status: undefined, clientState: 'notFound', enabled: true });
  assert.equal(items[0].label, '$(error) server not found');
  assert.ok(items.some((i) => i.action === 'log') && items.some((i) => i.action === 'settings'));
  const loading = menuItems({ status: { state: 'loading' }, enabled: true });
  assert.equal(loading[0].label, '$(pulse) loading the model');
  assert.equal(loading[0].description, 'model not loaded yet');
  assert.equal(loading[0].detail, 'no completion yet');
});

test('pure parts: snooze arguments, times, language lists', () => {
  assert.equal(snoozeMinutes(5), 5);
  assert.equal(snoozeMinutes('15'), 15);
  assert.equal(snoozeMinutes('restart'), Infinity);
  for (const bad of [0, -5, 'x', '', null, undefined, {}, NaN]) assert.equal(snoozeMinutes(bad), undefined, String(bad));
  assert.equal(clockTime(new Date(2026, 0, 1, 9, 5).getTime()), '09:05');
  assert.equal(snoozeEnd(Infinity), 'until VS Code restarts');
  assert.equal(languageIsOff('Python', 'markdown, python', []), true);
  assert.equal(languageIsOff('go', '', ['GO']), true);
  assert.equal(languageIsOff('go', null, null), false);
  assert.deepEqual(languageSwitch('go', false, 'markdown', ['go']), [{ key: 'disabledLanguages', value: 'markdown,go' }]);
  assert.deepEqual(languageSwitch('go', false, 'go', []), []);
  assert.deepEqual(languageSwitch('go', true, 'markdown', []), []);
  assert.deepEqual(statusView({ state: 'ready' }, undefined, true, { languageOff: 'go' }).text, '$(circle-slash) completiond');
  assert.match(statusView({ state: 'ready' }, undefined, false, { snoozedUntil: Infinity }).tooltip, /inline completions are off/,
    'completions off everywhere outranks a snooze');
});

const CATALOG = {
  current: '',
  recommended: 'Qwen/Qwen2.5-Coder-0.5B',
  models: [
    { name: 'qwen2.5-coder-1.5b', repo: 'Qwen/Qwen2.5-Coder-1.5B', downloadGb: 3.08, cpu: 'usable (~103 / ~51 ms/token)', gpuMsPerToken: 3.1, languages: ['*'], gated: false },
    { name: 'qwen2.5-coder-0.5b', repo: 'Qwen/Qwen2.5-Coder-0.5B', downloadGb: 0.98, cpu: 'fast (~33 / ~16 ms/token)', gpuMsPerToken: 1, languages: ['*'], gated: false },
    { name: 'layerskip-codellama-7b', repo: 'facebook/layerskip-codellama-7B', downloadGb: 13.5, cpu: 'slow', gpuMsPerToken: 13.5, languages: ['python', 'cpp'], gated: true },
  ],
};

test('Choose a model…: the server\'s catalog, recommended first; picking one sets completiond.model, which the server loads', async () => {
  const { host, client } = await started();
  client.answer = (_m, p) => (p.command === SERVER_COMMANDS.models ? CATALOG : null);
  host.pickChoices.push(pickLabel('Choose a model'), pickLabel('qwen2.5-coder-1.5b'));
  await host.commands.get(COMMANDS.showMenu)!();
  await flush();
  const picker = host.picks[1];
  assert.equal(picker.title, 'completiond: choose a model');
  const rows = picker.items.filter((r) => r.action);
  assert.equal(rows[0].label, '$(star-full) qwen2.5-coder-0.5b');
  assert.equal(rows[0].description, 'Qwen/Qwen2.5-Coder-0.5B · 1.0 GB download · recommended for this machine');
  assert.equal(rows[0].detail, 'CPU fast (~33 / ~16 ms/token) · GPU ~1 ms/token · every language');
  assert.match(rows[2].detail!, /python, cpp · gated: accept its licence/);
  assert.deepEqual(rows.slice(-2).map((r) => r.label), ['$(check) The bundled model', '$(gear) Another model…']);
  assert.equal(host.settings.get('model'), 'Qwen/Qwen2.5-Coder-1.5B');
  const pushed = client.notifications.filter((n) => n.method === 'workspace/didChangeConfiguration').at(-1)!;
  assert.equal(pushed.params.settings.completiond.model, 'Qwen/Qwen2.5-Coder-1.5B');
  assert.match(host.infos.at(-1)!, /switching to Qwen\/Qwen2.5-Coder-1.5B; it downloads first/);
  // In use now: marked, and the bundled model one pick away.
  const inUse = modelItems({ ...CATALOG, current: 'Qwen/Qwen2.5-Coder-1.5B' });
  assert.match(inUse.find((r) => r.label.includes('1.5b'))!.label, /^\$\(check\)/);
  assert.match(inUse.find((r) => r.label.includes('1.5b'))!.description!, /in use$/);
  host.pickChoices.push(pickLabel('The bundled model'));
  await c_choose(host);
  assert.equal(host.settings.get('model'), '');
});

async function c_choose(host: FakeHost): Promise<void> {
  host.pickChoices.unshift(pickLabel('Choose a model'));
  await host.commands.get(COMMANDS.showMenu)!();
  await flush();
}

test('Choose a model… falls back to the setting when the server has no catalog (older server, not running) or for another model', async () => {
  const { host, client } = await started();
  client.answer = () => {
    throw new Error('unknown command');
  };
  await c_choose(host);
  assert.deepEqual(host.settingsOpened, ['completiond.model']);
  assert.match(host.lines.join('\n'), /completiond.models failed: unknown command/);
  client.answer = (_m, p) => (p.command === SERVER_COMMANDS.models ? CATALOG : null);
  host.pickChoices.push(pickLabel('Another model'));
  await c_choose(host);
  assert.deepEqual(host.settingsOpened, ['completiond.model', 'completiond.model']);
  assert.ok(!host.explicit.has('model'));
});
