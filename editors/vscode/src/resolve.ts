/**
 * Finding the `completiond` language server to launch. Pure: the file system and
 * the environment come in as arguments, so the unit tests can fake them.
 */
import * as path from 'path';

export interface ServerCommand {
  command: string;
  args: string[];
}

export type Resolution = { ok: true; server: ServerCommand } | { ok: false; message: string };

export interface ResolveOptions {
  /** `completiond.server.path` */
  path: string;
  /** `completiond.server.python`: an interpreter or a virtual environment folder */
  python: string;
  /** `completiond.server.args`, appended after `lsp` */
  args: string[];
  env: { [name: string]: string | undefined };
  platform: string;
  home: string;
  isFile(p: string): boolean;
  isDir(p: string): boolean;
}

function expandHome(p: string, home: string): string {
  if (p === '~') return home;
  if (p.startsWith('~/') || p.startsWith('~\\')) return path.join(home, p.slice(2));
  return p;
}

/** Look `name` up on PATH (and the usual user script folders that GUI-started editors may lack). */
export function which(name: string, opts: Pick<ResolveOptions, 'env' | 'platform' | 'home' | 'isFile'>): string | undefined {
  const win = opts.platform === 'win32';
  const sep = win ? ';' : ':';
  const exts = win ? ['.exe', '.cmd', '.bat', ''] : [''];
  const dirs = (opts.env.PATH ?? opts.env.Path ?? '').split(sep).filter((d) => d.length > 0);
  if (!win) dirs.push(path.join(opts.home, '.local', 'bin'));
  for (const dir of dirs) {
    for (const ext of exts) {
      const candidate = path.join(dir, name + ext);
      if (opts.isFile(candidate)) return candidate;
    }
  }
  return undefined;
}

function pythonIn(dir: string, opts: ResolveOptions): string | undefined {
  const candidates =
    opts.platform === 'win32'
      ? [path.join(dir, 'Scripts', 'python.exe'), path.join(dir, 'python.exe')]
      : [path.join(dir, 'bin', 'python3'), path.join(dir, 'bin', 'python')];
  return candidates.find((c) => opts.isFile(c));
}

export const NOT_FOUND_HINT =
  'Install it (in a completiond checkout: `pip install -e .`; see the README), or set `completiond.server.path` ' +
  '(the executable) or `completiond.server.python` (a Python environment that has it).';

export function resolveServer(opts: ResolveOptions): Resolution {
  const extra = opts.args ?? [];
  const exe = expandHome((opts.path ?? '').trim(), opts.home);
  if (exe) {
    const found = exe.includes('/') || exe.includes('\\') ? (opts.isFile(exe) ? exe : undefined) : which(exe, opts);
    if (!found) {
      return { ok: false, message: `completiond.server.path is "${exe}", but there is no such executable. ${NOT_FOUND_HINT}` };
    }
    return { ok: true, server: { command: found, args: ['lsp', ...extra] } };
  }
  const python = expandHome((opts.python ?? '').trim(), opts.home);
  if (python) {
    let interpreter: string | undefined;
    if (opts.isDir(python)) {
      interpreter = pythonIn(python, opts);
    } else if (python.includes('/') || python.includes('\\')) {
      interpreter = opts.isFile(python) ? python : undefined;
    } else {
      interpreter = which(python, opts);
    }
    if (!interpreter) {
      return { ok: false, message: `completiond.server.python is "${python}", but no Python interpreter is there. ${NOT_FOUND_HINT}` };
    }
    return { ok: true, server: { command: interpreter, args: ['-m', 'completiond.cli', 'lsp', ...extra] } };
  }
  const found = which('completiond', opts);
  if (!found) {
    return { ok: false, message: `The completiond executable was not found on PATH. ${NOT_FOUND_HINT}` };
  }
  return { ok: true, server: { command: found, args: ['lsp', ...extra] } };
}
