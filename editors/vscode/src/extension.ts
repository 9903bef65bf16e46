/** VS Code entry point: wires the real `vscode` API and vscode-languageclient into the Controller. */
import * as fs from 'fs';
import * as os from 'os';
import * as path from 'path';
import * as vscode from 'vscode';
import { LanguageClient, LanguageClientOptions, ServerOptions, TransportKind } from 'vscode-languageclient/node';
import { contributedSettings, Controller, SECTION } from './controller';
import { ClientFactory, Host, LspClient, StatusBar } from './host';
import { CURSOR_REST_METHOD, CursorPlace, CursorRest } from './rest';

let controller: Controller | undefined;

function isFile(p: string): boolean {
  try {
    return fs.statSync(p).isFile();
  } catch {
    return false;
  }
}

function isDir(p: string): boolean {
  try {
    return fs.statSync(p).isDirectory();
  } catch {
    return false;
  }
}

/**
 * The README shipped in the extension: vsce packs README.md as `readme.md`, and a case-sensitive
 * file system finds only the name that is there.
 */
export function readmePath(extensionDir: string): string {
  let names: string[] = [];
  try {
    names = fs.readdirSync(extensionDir);
  } catch {
    // fall through to the name in the source tree
  }
  return path.join(extensionDir, names.find((n) => n.toLowerCase() === 'readme.md') ?? 'README.md');
}

/** Documents completions are offered in: files, unsaved buffers and notebook cells. */
export const DOCUMENT_SELECTOR = [{ scheme: 'file' }, { scheme: 'untitled' }, { scheme: 'vscode-notebook-cell' }];

function vscodeHost(context: vscode.ExtensionContext, log: vscode.LogOutputChannel): Host {
  const config = () => vscode.workspace.getConfiguration(SECTION);
  return {
    getSetting: (key) => config().get(key),
    isSettingSet: (key) => {
      const i = config().inspect(key);
      return (
        i !== undefined &&
        [i.globalValue, i.workspaceValue, i.workspaceFolderValue, i.globalLanguageValue, i.workspaceLanguageValue, i.workspaceFolderLanguageValue].some(
          (v) => v !== undefined,
        )
      );
    },
    isSetInWorkspace: (key) => {
      const i = config().inspect(key);
      return (
        i !== undefined &&
        [i.workspaceValue, i.workspaceFolderValue, i.workspaceLanguageValue, i.workspaceFolderLanguageValue].some((v) => v !== undefined)
      );
    },
    // Write where the value comes from now (a workspace value would hide a user one).
    updateSetting: (key, value) => {
      const i = config().inspect(key);
      const target =
        i?.workspaceFolderValue !== undefined
          ? vscode.ConfigurationTarget.WorkspaceFolder
          : i?.workspaceValue !== undefined
            ? vscode.ConfigurationTarget.Workspace
            : vscode.ConfigurationTarget.Global;
      return config().update(key, value, target);
    },
    onDidChangeSettings: (listener) => vscode.workspace.onDidChangeConfiguration((e) => listener((s) => e.affectsConfiguration(s))),
    settingsSchema: () => contributedSettings(context.extension.packageJSON?.contributes?.configuration),
    registerCommand: (id, run) => vscode.commands.registerCommand(id, run),
    executeCommand: (id, ...args) => vscode.commands.executeCommand(id, ...args),
    showError: (message, ...actions) => vscode.window.showErrorMessage(message, ...actions),
    showInfo: (message, ...actions) => vscode.window.showInformationMessage(message, ...actions),
    openReadme: () => vscode.commands.executeCommand('markdown.showPreview', vscode.Uri.file(readmePath(context.extensionPath))),
    openSettings: (query) => vscode.commands.executeCommand('workbench.action.openSettings', query),
    createStatusBar: (command): StatusBar => {
      const item = vscode.window.createStatusBarItem('completiond.status', vscode.StatusBarAlignment.Right, 100);
      item.name = 'completiond';
      item.command = command;
      item.show();
      return {
        update: (view) => {
          item.text = view.text;
          item.tooltip = view.tooltip;
          item.backgroundColor = view.error ? new vscode.ThemeColor('statusBarItem.errorBackground') : undefined;
        },
        dispose: () => item.dispose(),
      };
    },
    showQuickPick: async (items, options) => {
      // Rows without an action are separators (kind Separator), the rest keep their item to hand back.
      const rows = items.map((item) => ({
        label: item.label,
        description: item.description,
        detail: item.detail,
        kind: item.action === undefined ? vscode.QuickPickItemKind.Separator : vscode.QuickPickItemKind.Default,
        item,
      }));
      const picked = await vscode.window.showQuickPick(rows, { title: options.title, placeHolder: options.placeHolder, matchOnDescription: true });
      return picked?.item;
    },
    activeLanguageId: () => vscode.window.activeTextEditor?.document.languageId,
    onDidChangeActiveEditor: (listener) => vscode.window.onDidChangeActiveTextEditor(() => listener()),
    log: { appendLine: (line) => log.appendLine(line), show: () => log.show(true) },
  };
}

function clientFactory(log: vscode.LogOutputChannel): ClientFactory {
  return (server, options): LspClient => {
    const serverOptions: ServerOptions = { command: server.command, args: server.args, transport: TransportKind.stdio };
    const clientOptions: LanguageClientOptions = {
      documentSelector: DOCUMENT_SELECTOR,
      outputChannel: log,
      initializationOptions: options.initializationOptions,
      middleware: {
        workspace: {
          configuration: async (params, token, next) => {
            const answers = await next(params, token);
            if (!Array.isArray(answers)) return answers;
            return params.items.map((item, i) => {
              const ours = options.configuration(item.section);
              return ours === undefined ? answers[i] : ours;
            });
          },
        },
        // The server also answers textDocument/completion (for editors without inline
        // completions). Here that would only compete with the inline requests, since the
        // daemon keeps the latest request per document: ask for inline ones only.
        provideCompletionItem: () => undefined,
        provideInlineCompletionItems: (document, position, context, token, next) =>
          options.shouldComplete(document.languageId, context.triggerKind === vscode.InlineCompletionTriggerKind.Invoke)
            ? next(document, position, context, token)
            : undefined,
      },
    };
    const client = new LanguageClient(SECTION, 'completiond', serverOptions, clientOptions);
    return {
      start: () => client.start(),
      stop: () => client.stop(),
      isRunning: () => client.isRunning(),
      onNotification: (method, handler) => client.onNotification(method, handler),
      sendNotification: (method, params) => client.sendNotification(method, params),
      sendRequest: (method, params) => client.sendRequest(method, params),
    };
  };
}

/** Cursor-rest hints (rest.ts) from the active editor's cursor to the running client: the daemon prefills there. */
function watchCursorRest(client: () => LspClient | undefined, allowed: (languageId: string) => boolean): vscode.Disposable[] {
  const rest = new CursorRest((params) => {
    const running = client();
    if (running?.isRunning()) running.sendNotification(CURSOR_REST_METHOD, params).catch(() => undefined);
  }, allowed);
  const synced = new Set(DOCUMENT_SELECTOR.map((d) => d.scheme)); // the documents the server has (not output panes)
  const place = (editor: vscode.TextEditor | undefined): CursorPlace | undefined =>
    editor && synced.has(editor.document.uri.scheme) ? {
      uri: editor.document.uri.toString(),
      languageId: editor.document.languageId,
      version: editor.document.version,
      line: editor.selection.active.line,
      character: editor.selection.active.character,
    } : undefined;
  return [
    rest,
    vscode.window.onDidChangeTextEditorSelection((e) => rest.moved(place(e.textEditor))),
    vscode.window.onDidChangeActiveTextEditor((editor) => rest.moved(place(editor))),
  ];
}

export async function activate(context: vscode.ExtensionContext): Promise<void> {
  const log = vscode.window.createOutputChannel('completiond', { log: true });
  context.subscriptions.push(log);
  const factory = clientFactory(log);
  let lsp: LspClient | undefined; // the client the controller runs now, for the cursor-rest hints
  context.subscriptions.push(...watchCursorRest(() => lsp, (languageId) => controller?.shouldComplete(languageId) ?? false));
  controller = new Controller(vscodeHost(context, log), (server, options) => (lsp = factory(server, options)), {
    env: process.env,
    platform: process.platform,
    home: os.homedir(),
    isFile,
    isDir,
  });
  context.subscriptions.push(controller);
  await controller.start();
}

export async function deactivate(): Promise<void> {
  const c = controller;
  controller = undefined;
  await c?.stop();
}
