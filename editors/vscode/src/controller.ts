/**
 * The extension's logic, written against `Host` and `LspClient` so that it runs
 * (and is tested) without VS Code.
 */
import { ClientFactory, Disposable, Host, LspClient } from './host';
import { resolveServer, ResolveOptions } from './resolve';
import { ClientState, formatStats, StatusParams, statusView, suggestionCounts, suggestionSummary } from './status';

export const SECTION = 'completiond';
export const STATUS_NOTIFICATION = 'completiond/status';
export const SERVER_COMMANDS = {
  stats: 'completiond.stats',
  restartDaemon: 'completiond.restartDaemon',
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
};
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

  constructor(private readonly host: Host, private readonly createClient: ClientFactory, private readonly environment: Environment) {
    this.keys = serverSettingKeys(host.settingsSchema());
    this.statusBar = host.createStatusBar(COMMANDS.showStats);
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
      host.onDidChangeSettings((affects) => void this.settingsChanged(affects)),
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

  shouldComplete(languageId: string): boolean {
    if (!this.enabled) return false;
    const disabled = this.host.getSetting('editor.disabledLanguages');
    return !(Array.isArray(disabled) && disabled.includes(languageId));
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
      shouldComplete: (languageId) => this.shouldComplete(languageId),
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
    this.statusBar.update(statusView(this.lastStatus, this.clientState, this.enabled));
  }

  dispose(): void {
    void this.stop();
    this.disposables.splice(0).forEach((d) => d.dispose());
  }
}

export function errorText(err: unknown): string {
  if (err instanceof Error) return err.message;
  if (err && typeof err === 'object' && 'message' in err) return String((err as { message: unknown }).message);
  return String(err);
}
