/** Plain-object stand-ins for the VS Code API (Host) and the language client. */
import * as fs from 'fs';
import * as path from 'path';
import { contributedSettings } from '../controller';
import { ClientFactory, ClientOptions, Clock, Disposable, Host, LspClient, PickItem } from '../host';

export const PACKAGE_JSON = path.resolve(__dirname, '..', '..', 'package.json');
export const packageJson = JSON.parse(fs.readFileSync(PACKAGE_JSON, 'utf8'));
export const schema: Record<string, any> = contributedSettings(packageJson.contributes.configuration);

/** The defaults VS Code would return for every contributed setting. */
export function defaultSettings(): Map<string, unknown> {
  const values = new Map<string, unknown>();
  for (const [key, prop] of Object.entries(schema)) values.set(key.slice('completiond.'.length), structuredClone(prop.default));
  return values;
}

export class FakeHost implements Host {
  settings = defaultSettings();
  /** keys the user set (the rest are defaults) */
  explicit = new Set<string>();
  commands = new Map<string, (...args: unknown[]) => unknown>();
  executed: { id: string; args: unknown[] }[] = [];
  errors: { message: string; actions: string[] }[] = [];
  infos: string[] = [];
  lines: string[] = [];
  logShown = 0;
  readmeOpened = 0;
  settingsOpened: string[] = [];
  statusViews: { text: string; tooltip: string; error: boolean }[] = [];
  /** the action the next showError "clicks" */
  errorChoice: string | undefined;
  private listeners: ((affects: (s: string) => boolean) => void)[] = [];

  getSetting(key: string): unknown {
    return this.settings.get(key);
  }
  isSettingSet(key: string): boolean {
    return this.explicit.has(key);
  }
  /** keys a workspace's settings set (a subset of explicit) */
  fromWorkspace = new Set<string>();
  isSetInWorkspace(key: string): boolean {
    return this.fromWorkspace.has(key);
  }
  async updateSetting(key: string, value: unknown): Promise<void> {
    this.settings.set(key, value);
    this.explicit.add(key);
    this.fireChange([`completiond.${key}`]);
  }
  /** Change settings as the user would; listeners see which sections changed. */
  change(values: Record<string, unknown>): void {
    for (const [k, v] of Object.entries(values)) {
      this.settings.set(k, v);
      this.explicit.add(k);
    }
    this.fireChange(Object.keys(values).map((k) => `completiond.${k}`));
  }
  fireChange(changed: string[]): void {
    const affects = (section: string) => changed.some((c) => c === section || c.startsWith(section + '.'));
    for (const l of this.listeners) l(affects);
  }
  onDidChangeSettings(listener: (affects: (s: string) => boolean) => void): Disposable {
    this.listeners.push(listener);
    return { dispose: () => (this.listeners = this.listeners.filter((l) => l !== listener)) };
  }
  settingsSchema(): Record<string, unknown> {
    return schema;
  }
  registerCommand(id: string, run: (...args: unknown[]) => unknown): Disposable {
    if (this.commands.has(id)) throw new Error(`command ${id} already exists`);
    this.commands.set(id, run);
    return { dispose: () => this.commands.delete(id) };
  }
  async executeCommand(id: string, ...args: unknown[]): Promise<unknown> {
    this.executed.push({ id, args });
    const own = this.commands.get(id);
    return own ? own(...args) : undefined;
  }
  async showError(message: string, ...actions: string[]): Promise<string | undefined> {
    this.errors.push({ message, actions });
    return this.errorChoice;
  }
  async showInfo(message: string): Promise<string | undefined> {
    this.infos.push(message);
    return undefined;
  }
  async openReadme(): Promise<void> {
    this.readmeOpened++;
  }
  async openSettings(query: string): Promise<void> {
    this.settingsOpened.push(query);
  }
  createStatusBar() {
    return { update: (v: { text: string; tooltip: string; error: boolean }) => void this.statusViews.push(v), dispose: () => undefined };
  }
  get status() {
    return this.statusViews[this.statusViews.length - 1];
  }
  /** every QuickPick shown: its items and title */
  picks: { items: PickItem[]; title: string }[] = [];
  /** picks the row the next QuickPicks "click" (in order; undefined: Escape) */
  pickChoices: ((items: PickItem[]) => PickItem | undefined)[] = [];
  async showQuickPick<T extends PickItem>(items: T[], options: { title: string }): Promise<T | undefined> {
    this.picks.push({ items, title: options.title });
    const choose = this.pickChoices.shift();
    return choose ? (choose(items) as T | undefined) : undefined;
  }
  /** the active editor's language */
  language: string | undefined = 'python';
  private editorListeners: (() => void)[] = [];
  activeLanguageId(): string | undefined {
    return this.language;
  }
  onDidChangeActiveEditor(listener: () => void): Disposable {
    this.editorListeners.push(listener);
    return { dispose: () => (this.editorListeners = this.editorListeners.filter((l) => l !== listener)) };
  }
  /** The user switches to a document of another language. */
  switchTo(language: string | undefined): void {
    this.language = language;
    this.editorListeners.forEach((l) => l());
  }
  log = { appendLine: (line: string) => void this.lines.push(line), show: () => void this.logShown++ };
}

/** The QuickPick choice whose label contains `text`. */
export function pickLabel(text: string): (items: PickItem[]) => PickItem | undefined {
  return (items) => {
    const found = items.find((i) => i.action !== undefined && i.label.includes(text));
    if (!found) throw new Error(`no menu row with ${JSON.stringify(text)} in ${JSON.stringify(items.map((i) => i.label))}`);
    return found;
  };
}

/** A clock the test moves by hand; timers fire when it passes them. */
export class FakeClock implements Clock {
  constructor(public ms = Date.UTC(2026, 11, 6, 12, 0, 0)) {}
  private timers: { at: number; run: () => void; live: boolean }[] = [];
  now(): number {
    return this.ms;
  }
  setTimer(run: () => void, ms: number): Disposable {
    const t = { at: this.ms + ms, run, live: true };
    this.timers.push(t);
    return { dispose: () => void (t.live = false) };
  }
  /** Move time on, without firing timers (a machine asleep). */
  jump(ms: number): void {
    this.ms += ms;
  }
  advance(ms: number): void {
    this.ms += ms;
    for (const t of this.timers.filter((t) => t.live && t.at <= this.ms)) {
      t.live = false;
      t.run();
    }
  }
  get pending(): number {
    return this.timers.filter((t) => t.live).length;
  }
}

export class FakeClient implements LspClient {
  running = false;
  started = 0;
  stopped = 0;
  notifications: { method: string; params: any }[] = [];
  requests: { method: string; params: any }[] = [];
  handlers = new Map<string, (params: any) => void>();
  failStart: Error | undefined;
  answer: (method: string, params: any) => unknown = () => null;

  constructor(public server: { command: string; args: string[] }, public options: ClientOptions) {}

  async start(): Promise<void> {
    this.started++;
    if (this.failStart) throw this.failStart;
    this.running = true;
  }
  async stop(): Promise<void> {
    this.stopped++;
    this.running = false;
  }
  isRunning(): boolean {
    return this.running;
  }
  onNotification(method: string, handler: (params: any) => void): Disposable {
    this.handlers.set(method, handler);
    return { dispose: () => this.handlers.delete(method) };
  }
  async sendNotification(method: string, params: unknown): Promise<void> {
    this.notifications.push({ method, params });
  }
  async sendRequest(method: string, params: any): Promise<unknown> {
    this.requests.push({ method, params });
    return this.answer(method, params);
  }
  /** The server sends a notification. */
  notify(method: string, params: unknown): void {
    this.handlers.get(method)?.(params);
  }
}

export function clientRecorder(): { factory: ClientFactory; clients: FakeClient[] } {
  const clients: FakeClient[] = [];
  return {
    clients,
    factory: (server, options) => {
      const c = new FakeClient(server, options);
      clients.push(c);
      return c;
    },
  };
}

/** A fake file system: the listed files exist (directories are implied). */
export function fakeEnvironment(files: string[], extra: Partial<{ PATH: string; platform: string }> = {}) {
  const set = new Set(files);
  return {
    env: { PATH: extra.PATH ?? '/usr/local/bin:/usr/bin' },
    platform: extra.platform ?? 'linux',
    home: '/home/u',
    isFile: (p: string) => set.has(p),
    isDir: (p: string) => !set.has(p) && files.some((f) => f.startsWith(p.replace(/\/$/, '') + '/')),
  };
}

export async function flush(): Promise<void> {
  for (let i = 0; i < 5; i++) await new Promise((r) => setImmediate(r));
}
