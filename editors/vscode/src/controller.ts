/**
 * The extension's logic, written against `Host` and `LspClient` so that it runs
 * (and is tested) without VS Code.
 */
import { ClientFactory, Clock, Disposable, Host, LspClient, systemClock } from './host';
import { BUNDLED_MODEL, Catalog, MenuAction, menuItems, modelItems, OTHER_MODEL, USE_MODEL } from './menu';
import { languageIsOff, languageSwitch, snoozeEnd, SNOOZE_CHOICES, snoozeMinutes } from './pause';
import { resolveServer, ResolveOptions } from './resolve';
import { ClientState, formatStats, StatusParams, statusView, suggestionCounts, suggestionSummary } from './status';

export const SECTION = 'completiond';
export const STATUS_NOTIFICATION = 'completiond/status';
export const SERVER_COMMANDS = {
  stats: 'completiond.stats',
  restartDaemon: 'completiond.restartDaemon',
  /** the catalog for the model picker */
  models: 'completiond.models',
  /** what became of a suggestion (the server counts them; nothing leaves the machine) */
  suggestionEvent: 'completiond.suggestionEvent',
};
/** Our commands: distinct from the server's, which vscode-languageclient registers itself. */
export const COMMANDS = {
  toggle: 'completiond.toggle',
  restart: 'completiond.restart',
  showStats: 'completiond.showStats',
  showLog: 'completiond.showLog',
  acceptWord: 'completiond.acceptWord',
  acceptLine: 'completiond.acceptLine',
  /** the status item's click: a QuickPick of the state and the actions below */
  showMenu: 'completiond.showMenu',
  /** argument: minutes, or "restart" (until VS Code restarts); none: the menu asks */
  snooze: 'completiond.snooze',
  resume: 'completiond.resume',
  /** argument: a language id; none: the active editor's language */
  toggleLanguage: 'completiond.toggleLanguage',
};
/** VS Code's command that hides the ghost text on screen (a snooze or a switched-off language hides it at once). */
export const BUILTIN_HIDE = 'editor.action.inlineSuggest.hide';
/** A `when` context key: true while snoozed (the Command Palette offers Resume only then). */
export const SNOOZED_CONTEXT = 'completiond.snoozed';
export const BUILTIN_ACCEPT_WORD = 'editor.action.inlineSuggest.acceptNextWord';
export const BUILTIN_ACCEPT_LINE = 'editor.action.inlineSuggest.acceptNextLine';
export const HOW_TO_INSTALL = 'How to install';
export const OPEN_SETTINGS = 'Open Settings';
export const SHOW_LOG = 'Show Log';

/** Server setting keys: `completiond.<key>` with no further dot (client-only ones have one). */
export function serverSettingKeys(schema: Record<string, unknown>): string[] {
  const prefix = SECTION + '.';
  return Object.keys(schema)
    .filter((k) => k.startsWith(prefix) && !k.slice(prefix.length).includes('.'))
    .map((k) => k.slice(prefix.length));
}

/**
 * Every contributed setting of package.json's `contributes.configuration`, which is one object or (as
 * here: basic settings first, advanced ones in their own titled sections) a list of sections.
 */
export function contributedSettings(configuration: unknown): Record<string, unknown> {
  const sections = Array.isArray(configuration) ? configuration : [configuration];
  const out: Record<string, unknown> = {};
  for (const section of sections) {
    const props = (section as { properties?: unknown } | null | undefined)?.properties;
    if (props && typeof props === 'object') Object.assign(out, props);
  }
  return out;
}

export type Environment = Pick<ResolveOptions, 'env' | 'platform' | 'home' | 'isFile' | 'isDir'>;

export class Controller implements Disposable {
  private client: LspClient | undefined;
  private clientState: ClientState | undefined;
  private lastStatus: StatusParams | undefined;
  private readonly disposables: Disposable[] = [];
  private readonly clientDisposables: Disposable[] = [];
  private readonly statusBar;
  private readonly keys: string[];
  /** ms since the epoch, or Infinity until VS Code restarts; undefined when not snoozed (this window only) */
  private snoozedUntilMs: number | undefined;
  private snoozeTimer: Disposable | undefined;

  constructor(
    private readonly host: Host,
    private readonly createClient: ClientFactory,
    private readonly environment: Environment,
    private readonly clock: Clock = systemClock,
  ) {
    this.keys = serverSettingKeys(host.settingsSchema());
    this.statusBar = host.createStatusBar(COMMANDS.showMenu);
    this.disposables.push(
      this.statusBar,
      host.registerCommand(COMMANDS.toggle, () => this.toggle()),
      host.registerCommand(COMMANDS.restart, () => this.restart()),
      host.registerCommand(COMMANDS.showStats, () => this.showStats()),
      host.registerCommand(COMMANDS.showLog, () => host.log.show()),
      // VS Code's own partial accepts, reported to the server: its stable API tells extensions about
      // full accepts only (through the item's command, which the server sets).
      host.registerCommand(COMMANDS.acceptWord, () => this.acceptPart(BUILTIN_ACCEPT_WORD, 'word')),
      host.registerCommand(COMMANDS.acceptLine, () => this.acceptPart(BUILTIN_ACCEPT_LINE, 'line')),
      host.registerCommand(COMMANDS.showMenu, () => this.showMenu()),
      host.registerCommand(COMMANDS.snooze, (minutes) => this.snooze(minutes)),
      host.registerCommand(COMMANDS.resume, () => this.resume()),
      host.registerCommand(COMMANDS.toggleLanguage, (languageId) => this.toggleLanguage(languageId)),
      host.onDidChangeSettings((affects) => void this.settingsChanged(affects)),
      host.onDidChangeActiveEditor(() => this.render()),
    );
    this.render();
  }

  /**
   * The `completiond` section as the server reads it: every server key, with null
   * for those the user left at their default, so that the server's own layering
   * (defaults < config.toml < editor) keeps config.toml values for them.
   */
  serverSettings(): Record<string, unknown> {
    const out: Record<string, unknown> = {};
    for (const key of this.keys) out[key] = this.host.isSettingSet(key) ? this.host.getSetting(key) : null;
    // trustRemoteCode runs a model repository's own code: honoured only for a model the user named in user
    // settings, never for one a workspace's settings pick (.vscode/settings.json comes with the repository).
    if (out.trustRemoteCode === true && ['model', 'draftModel'].some((k) => this.host.isSetInWorkspace?.(k) === true)) {
      out.trustRemoteCode = false;
    }
    return out;
  }

  get enabled(): boolean {
    return this.host.getSetting('enable') !== false;
  }

  /**
   * Whether to ask the server for this document. A snooze holds back only the suggestions that come
   * while typing: one the user asks for (invoked, Alt+\) still comes.
   */
  shouldComplete(languageId: string, invoked = false): boolean {
    if (!this.enabled || this.languageOff(languageId)) return false;
    return invoked || this.snoozedUntil === undefined;
  }

  /** Off in the server's `disabledLanguages` (what every client gets) or this editor's own list. */
  languageOff(languageId: string): boolean {
    return languageIsOff(languageId, this.host.getSetting('disabledLanguages'), this.host.getSetting('editor.disabledLanguages'));
  }

  /** When the snooze ends (Infinity: at restart), or undefined when not snoozed. */
  get snoozedUntil(): number | undefined {
    // The clock decides, not only the timer: a machine that slept past the end resumes at once.
    if (this.snoozedUntilMs !== undefined && this.clock.now() >= this.snoozedUntilMs) this.endSnooze();
    return this.snoozedUntilMs;
  }

  /** Hold back suggestions for `minutes` (Infinity: until VS Code restarts); without a valid argument, ask. */
  async snooze(arg?: unknown): Promise<void> {
    let minutes = snoozeMinutes(arg);
    if (minutes === undefined) {
      const picked = await this.host.showQuickPick(
        SNOOZE_CHOICES.map((c) => ({ label: c.label, description: Number.isFinite(c.minutes) ? snoozeEnd(this.clock.now() + c.minutes * 60_000) : undefined, action: String(c.minutes) })),
        { title: 'completiond: snooze inline suggestions', placeHolder: 'For how long? (they come back by themselves)' },
      );
      if (!picked) return;
      minutes = Number(picked.action);
    }
    this.snoozeTimer?.dispose();
    this.snoozeTimer = undefined;
    this.snoozedUntilMs = Number.isFinite(minutes) ? this.clock.now() + minutes * 60_000 : Infinity;
    if (Number.isFinite(minutes)) this.snoozeTimer = this.clock.setTimer(() => this.endSnooze(), minutes * 60_000);
    this.host.log.appendLine(`suggestions snoozed ${snoozeEnd(this.snoozedUntilMs)}`);
    void this.host.executeCommand('setContext', SNOOZED_CONTEXT, true);
    await this.hideSuggestion();
    this.render();
  }

  /** End a snooze now. */
  resume(): void {
    const was = this.snoozedUntilMs !== undefined;
    this.endSnooze();
    if (was) this.host.log.appendLine('suggestions resumed');
  }

  private endSnooze(): void {
    this.snoozeTimer?.dispose();
    this.snoozeTimer = undefined;
    if (this.snoozedUntilMs === undefined) return;
    this.snoozedUntilMs = undefined;
    void this.host.executeCommand('setContext', SNOOZED_CONTEXT, false);
    this.render();
  }

  /**
   * Turn suggestions off (or back on) for a language: the argument, else the active editor's. Saved in
   * the settings (where the value comes from now), so it lasts and reaches the server at once.
   */
  async toggleLanguage(arg?: unknown): Promise<void> {
    const languageId = typeof arg === 'string' && arg ? arg : this.host.activeLanguageId();
    if (!languageId) {
      void this.host.showInfo('completiond: open a file first; its language is the one turned on or off.');
      return;
    }
    const on = this.languageOff(languageId);
    const writes = languageSwitch(languageId, on, this.host.getSetting('disabledLanguages'), this.host.getSetting('editor.disabledLanguages'));
    for (const w of writes) await this.host.updateSetting(w.key, w.value);
    this.host.log.appendLine(`suggestions turned ${on ? 'on' : 'off'} for ${languageId}`);
    if (!on) await this.hideSuggestion();
    this.render();
  }

  private async hideSuggestion(): Promise<void> {
    try {
      await this.host.executeCommand(BUILTIN_HIDE);
    } catch {
      // nothing on screen to hide, or an editor without inline suggestions
    }
  }

  /**
   * The model picker: the server's catalog (size, speed, languages, the one recommended here), the bundled
   * model, or another one in the settings. Picking one sets `completiond.model`; the server then downloads
   * it (progress in the status item) and switches to it.
   */
  async chooseModel(): Promise<void> {
    let catalog: Catalog | undefined;
    if (this.client?.isRunning()) {
      try {
        catalog = (await this.client.sendRequest('workspace/executeCommand', { command: SERVER_COMMANDS.models, arguments: [] })) as Catalog;
      } catch (err) {
        // An older server: the settings still take any model.
        this.host.log.appendLine(`${SERVER_COMMANDS.models} failed: ${errorText(err)}`);
      }
    }
    if (!catalog || !Array.isArray(catalog.models) || catalog.models.length === 0) {
      await this.host.openSettings('completiond.model');
      return;
    }
    const picked = await this.host.showQuickPick(modelItems(catalog), {
      title: 'completiond: choose a model',
      placeHolder: 'Downloaded once, then it loads from the cache',
    });
    if (!picked?.action) return;
    if (picked.action === OTHER_MODEL) {
      await this.host.openSettings('completiond.model');
      return;
    }
    const model = picked.action === BUNDLED_MODEL ? '' : picked.action.slice(USE_MODEL.length);
    if (model === String(this.host.getSetting('model') ?? '')) return;
    await this.host.updateSetting('model', model);
    this.host.log.appendLine(`model set to ${model || 'the bundled model'}`);
    void this.host.showInfo(
      model
        ? `completiond: switching to ${model}; it downloads first if it is not in the cache (progress in the status bar).`
        : 'completiond: switching to the bundled model.',
    );
  }

  /** The status item's menu: the state at a glance, then the actions. */
  async showMenu(): Promise<void> {
    const languageId = this.host.activeLanguageId();
    const items = menuItems({
      status: this.lastStatus,
      clientState: this.clientState,
      enabled: this.enabled,
      snoozedUntil: this.snoozedUntil,
      languageId,
      languageOff: languageId ? this.languageOff(languageId) : undefined,
    });
    const picked = await this.host.showQuickPick(items, { title: 'completiond', placeHolder: 'completiond: state and actions' });
    if (picked?.action) await this.runMenuAction(picked.action as MenuAction, languageId);
  }

  async runMenuAction(action: MenuAction, languageId: string | undefined): Promise<void> {
    switch (action) {
      case 'stats':
        return this.showStats();
      case 'snooze':
        return this.snooze();
      case 'resume':
        return this.resume();
      case 'languageOff':
      case 'languageOn':
        return this.toggleLanguage(languageId);
      case 'enable':
      case 'disable':
        return this.toggle();
      case 'restart':
        return this.restart();
      case 'model':
        return this.chooseModel();
      case 'log':
        return this.host.log.show();
      case 'settings':
        await this.host.openSettings('@ext:completiond.completiond');
        return;
    }
  }

  get running(): boolean {
    return this.client?.isRunning() ?? false;
  }

  status(): StatusParams | undefined {
    return this.lastStatus;
  }

  async start(): Promise<boolean> {
    const resolution = resolveServer({
      ...this.environment,
      path: String(this.host.getSetting('server.path') ?? ''),
      python: String(this.host.getSetting('server.python') ?? ''),
      args: ((this.host.getSetting('server.args') as unknown[]) ?? []).map(String),
    });
    if (!resolution.ok) {
      this.clientState = 'notFound';
      this.render();
      this.host.log.appendLine(resolution.message);
      void this.host.showError(resolution.message, HOW_TO_INSTALL, OPEN_SETTINGS).then((choice) => {
        if (choice === HOW_TO_INSTALL) return this.host.openReadme();
        if (choice === OPEN_SETTINGS) return this.host.openSettings('completiond.server');
        return undefined;
      });
      return false;
    }
    const { command, args } = resolution.server;
    this.host.log.appendLine(`starting: ${[command, ...args].join(' ')}`);
    this.clientState = 'starting';
    this.lastStatus = undefined;
    this.render();
    const client = this.createClient(resolution.server, {
      initializationOptions: { [SECTION]: this.serverSettings() },
      configuration: (section) => this.configuration(section),
      shouldComplete: (languageId, invoked) => this.shouldComplete(languageId, invoked),
    });
    this.client = client;
    this.clientDisposables.push(client.onNotification(STATUS_NOTIFICATION, (params: StatusParams) => this.onStatus(params)));
    try {
      await client.start();
    } catch (err) {
      this.clientState = 'stopped';
      this.render();
      const message = `completiond: the language server failed to start (${[command, ...args].join(' ')}): ${errorText(err)}`;
      this.host.log.appendLine(message);
      void this.host.showError(message, SHOW_LOG, HOW_TO_INSTALL).then((choice) => {
        if (choice === SHOW_LOG) this.host.log.show();
        if (choice === HOW_TO_INSTALL) return this.host.openReadme();
        return undefined;
      });
      return false;
    }
    this.clientState = undefined;
    this.render();
    return true;
  }

  async stop(): Promise<void> {
    const client = this.client;
    this.client = undefined;
    this.clientDisposables.splice(0).forEach((d) => d.dispose());
    if (client?.isRunning()) {
      try {
        await client.stop();
      } catch (err) {
        this.host.log.appendLine(`stopping the language server: ${errorText(err)}`);
      }
    }
    this.clientState = 'stopped';
    this.render();
  }

  /** Answer for one `workspace/configuration` item; undefined lets the client answer it. */
  configuration(section: string | undefined): unknown {
    if (section === SECTION) return this.serverSettings();
    if (section !== undefined && section.startsWith(SECTION + '.')) {
      const key = section.slice(SECTION.length + 1);
      if (this.keys.includes(key)) return this.serverSettings()[key];
    }
    return undefined;
  }

  onStatus(params: StatusParams): void {
    if (!params || typeof params !== 'object') return;
    this.lastStatus = params;
    this.clientState = undefined;
    if (params.state === 'error' && params.message) this.host.log.appendLine(`server error: ${params.message}`);
    this.render();
  }

  async settingsChanged(affects: (section: string) => boolean): Promise<void> {
    if (!affects(SECTION)) return;
    if (affects(`${SECTION}.server`)) {
      this.host.log.appendLine('server settings changed: restarting the language server');
      await this.stop();
      await this.start();
      return;
    }
    this.render();
    if (this.client?.isRunning()) {
      await this.client.sendNotification('workspace/didChangeConfiguration', { settings: { [SECTION]: this.serverSettings() } });
    }
  }

  async toggle(): Promise<void> {
    await this.host.updateSetting('enable', !this.enabled);
    // onDidChangeSettings pushes the change to the server and redraws.
  }

  async restart(): Promise<void> {
    if (this.client?.isRunning()) {
      try {
        await this.client.sendRequest('workspace/executeCommand', { command: SERVER_COMMANDS.restartDaemon, arguments: [] });
        void this.host.showInfo('completiond: restarting the daemon.');
        return;
      } catch (err) {
        this.host.log.appendLine(`${SERVER_COMMANDS.restartDaemon} failed (${errorText(err)}): restarting the language server`);
      }
    }
    await this.stop();
    await this.start();
  }

  async acceptPart(builtin: string, kind: 'word' | 'line'): Promise<void> {
    await this.host.executeCommand(builtin);
    if (!this.client?.isRunning()) return;
    try {
      await this.client.sendRequest('workspace/executeCommand', {
        command: SERVER_COMMANDS.suggestionEvent,
        arguments: [{ event: 'accepted', kind }],
      });
    } catch (err) {
      this.host.log.appendLine(`${SERVER_COMMANDS.suggestionEvent} failed: ${errorText(err)}`);
    }
  }

  async showStats(): Promise<void> {
    if (!this.client?.isRunning()) {
      const choice = await this.host.showError('completiond: the language server is not running.', SHOW_LOG);
      if (choice === SHOW_LOG) this.host.log.show();
      return;
    }
    let stats: unknown;
    try {
      stats = await this.client.sendRequest('workspace/executeCommand', { command: SERVER_COMMANDS.stats, arguments: [] });
    } catch (err) {
      this.host.log.appendLine(`${SERVER_COMMANDS.stats} failed: ${errorText(err)}`);
      void this.host.showError(`completiond: could not get stats: ${errorText(err)}`);
      return;
    }
    this.host.log.appendLine('--- completiond stats ---');
    const summary = suggestionSummary(suggestionCounts(stats));
    if (summary) this.host.log.appendLine(summary);
    this.host.log.appendLine(formatStats(stats));
    this.host.log.show();
  }

  render(): void {
    const languageId = this.host.activeLanguageId();
    this.statusBar.update(
      statusView(this.lastStatus, this.clientState, this.enabled, {
        snoozedUntil: this.snoozedUntil,
        languageOff: languageId && this.languageOff(languageId) ? languageId : undefined,
      }),
    );
  }

  dispose(): void {
    this.snoozeTimer?.dispose();
    void this.stop();
    this.disposables.splice(0).forEach((d) => d.dispose());
  }
}

export function errorText(err: unknown): string {
  if (err instanceof Error) return err.message;
  if (err && typeof err === 'object' && 'message' in err) return String((err as { message: unknown }).message);
  return String(err);
}
