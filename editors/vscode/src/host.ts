/**
 * The thin wrapper over the parts of the VS Code API that the extension uses.
 * `extension.ts` implements it with the real `vscode` module; the unit tests
 * implement it with plain objects.
 */

export interface Disposable {
  dispose(): unknown;
}

export interface StatusBar extends Disposable {
  update(view: { text: string; tooltip: string; error: boolean }): void;
}

export interface Log {
  appendLine(line: string): void;
  show(): void;
}

export interface Host {
  /** `vscode.workspace.getConfiguration('completiond').get(key)`; key without the prefix */
  getSetting(key: string): unknown;
  /** Whether the user set the key anywhere (user, workspace, folder, language), i.e. it is not just the default. */
  isSettingSet(key: string): boolean;
  /** Whether a workspace or workspace folder sets the key (its value then came with the project). */
  isSetInWorkspace?(key: string): boolean;
  /** Set a setting where its value comes from now (folder, workspace, else user settings). */
  updateSetting(key: string, value: unknown): Thenable<void>;
  /** Called with a predicate like `ConfigurationChangeEvent.affectsConfiguration`. */
  onDidChangeSettings(listener: (affects: (section: string) => boolean) => void): Disposable;
  /** every setting in `contributes.configuration` of this extension's package.json (all its sections) */
  settingsSchema(): Record<string, unknown>;
  registerCommand(id: string, run: (...args: unknown[]) => unknown): Disposable;
  executeCommand(id: string, ...args: unknown[]): Thenable<unknown>;
  showError(message: string, ...actions: string[]): Thenable<string | undefined>;
  showInfo(message: string, ...actions: string[]): Thenable<string | undefined>;
  /** Open the install instructions (the README shipped in the extension). */
  openReadme(): Thenable<unknown>;
  /** Open the Settings UI filtered by the query. */
  openSettings(query: string): Thenable<unknown>;
  createStatusBar(command: string): StatusBar;
  /** A QuickPick of the items (an item without `action` is a separator); the one picked, if any. */
  showQuickPick<T extends PickItem>(items: T[], options: { title: string; placeHolder?: string }): Thenable<T | undefined>;
  /** The language id of the active text editor's document (undefined: none, or not a text editor). */
  activeLanguageId(): string | undefined;
  /** Called when the active text editor (and so maybe its language) changes. */
  onDidChangeActiveEditor(listener: () => void): Disposable;
  log: Log;
}

/** A QuickPick row; one without an action is drawn as a separator labelled `label`. */
export interface PickItem {
  label: string;
  description?: string;
  detail?: string;
  action?: string;
}

/** Time, for the snooze (tests pass a fake one). */
export interface Clock {
  now(): number;
  /** Run once after `ms`; dispose cancels it. */
  setTimer(run: () => void, ms: number): Disposable;
}

export const systemClock: Clock = {
  now: () => Date.now(),
  setTimer: (run, ms) => {
    // Timers past ~24.8 days overflow to 1 ms in Node; snoozes are far shorter, but clamp anyway.
    const t = setTimeout(run, Math.min(ms, 2 ** 31 - 1));
    t.unref?.();
    return { dispose: () => clearTimeout(t) };
  },
};

/** The subset of vscode-languageclient's LanguageClient the controller drives. */
export interface LspClient {
  start(): Promise<void>;
  stop(): Promise<void>;
  isRunning(): boolean;
  onNotification(method: string, handler: (params: any) => void): Disposable;
  sendNotification(method: string, params: unknown): Promise<void>;
  sendRequest(method: string, params: unknown): Promise<unknown>;
}

export interface ClientOptions {
  /** sent as `initializationOptions` */
  initializationOptions: unknown;
  /** answer to a `workspace/configuration` item, or undefined to let the client answer */
  configuration(section: string | undefined): unknown;
  /** false: do not ask the server for inline completions in this document (invoked: the user asked for one, e.g. with Alt+\) */
  shouldComplete(languageId: string, invoked?: boolean): boolean;
}

export type ClientFactory = (server: { command: string; args: string[] }, options: ClientOptions) => LspClient;
