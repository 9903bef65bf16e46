/** What the status bar item shows, computed from `completiond/status` notifications. Pure. */
import { snoozeEnd } from './pause';

/** `stopped`: the shared daemon went away (killed, crashed); the next completion starts it again. */
export type ServerState = 'loading' | 'ready' | 'busy' | 'error' | 'stopped';

/** Params of the `completiond/status` notification (every field optional but state). */
export interface StatusParams {
  state: ServerState | string;
  latencyMs?: number | null;
  /** share of the speculative draft's tokens the model kept (older servers: `alpha`) */
  draftAcceptance?: number | null;
  alpha?: number | null;
  /** how the engine drafts by default (calibrated), and what the last completion's rounds drafted with */
  draft?: string | null;
  lastDraft?: string | null;
  tokensPerSecond?: number | null;
  message?: string | null;
  /** while loading: the phase, its percentage (0-100) and what it does (older servers: a fraction in [0, 1]) */
  progress?: LoadProgress | number | null;
  model?: string | null;
  device?: string | null;
  /** what users did with the suggestions (counted on this machine only) */
  suggestions?: SuggestionCounts | null;
  /** non-empty while the daemon serves other engine settings (model, device...) than this editor's */
  modelMismatch?: string | null;
}

/** The load's progress as the server sends it (`completiond/status` while `state` is loading). */
export interface LoadProgress {
  phase?: string | null;
  percentage?: number | null;
  message?: string | null;
}

/** The load's percentage (0-100) and what it is doing, from either form of `progress`. */
export function loadProgress(progress: LoadProgress | number | null | undefined): { percent?: number; message?: string } {
  if (num(progress)) return { percent: Math.round(Math.max(0, Math.min(1, progress)) * 100) };
  if (!progress || typeof progress !== 'object') return {};
  const percent = num(progress.percentage) ? Math.round(Math.max(0, Math.min(100, progress.percentage))) : undefined;
  const message = typeof progress.message === 'string' && progress.message ? progress.message
    : typeof progress.phase === 'string' && progress.phase ? progress.phase : undefined;
  return { percent, message };
}

/** As in `completiond.stats` (snake_case) or in the status notification (camelCase). */
export interface SuggestionCounts {
  shown?: number;
  accepted_full?: number;
  accepted_word?: number;
  accepted_line?: number;
  acceptedFull?: number;
  acceptedWord?: number;
  acceptedLine?: number;
  dismissed?: number;
}

/** The counts in the `completiond.stats` answer (the daemon's, else the language server's). */
export function suggestionCounts(stats: unknown): SuggestionCounts | undefined {
  if (!stats || typeof stats !== 'object') return undefined;
  const s = stats as { suggestions?: unknown; lsp?: { suggestions?: unknown } };
  const counts = s.suggestions ?? s.lsp?.suggestions;
  return counts && typeof counts === 'object' ? (counts as SuggestionCounts) : undefined;
}

/** "suggestions: 12 shown, 5 accepted (3 full, 1 word, 1 line), 4 dismissed", or '' without counts. */
export function suggestionSummary(c: SuggestionCounts | null | undefined): string {
  if (!c) return '';
  const n = (x: unknown) => (num(x) ? x : 0);
  const full = n(c.accepted_full ?? c.acceptedFull);
  const word = n(c.accepted_word ?? c.acceptedWord);
  const line = n(c.accepted_line ?? c.acceptedLine);
  return `suggestions: ${n(c.shown)} shown, ${full + word + line} accepted (${full} full, ${word} word, ${line} line), ${n(c.dismissed)} dismissed`;
}

/** Client-side states that the server does not send. */
export type ClientState = 'starting' | 'notFound' | 'stopped';

export interface StatusView {
  text: string;
  tooltip: string;
  error: boolean;
}

function num(x: unknown): x is number {
  return typeof x === 'number' && Number.isFinite(x);
}

export function formatLatency(ms: number): string {
  return ms >= 1000 ? `${(ms / 1000).toFixed(1)} s` : `${Math.round(ms)} ms`;
}

/** Metrics of the last completion ("123 ms · 45 tok/s"), or '' when none; a speed only once measured. */
export function metrics(p: Partial<StatusParams>): string {
  const parts: string[] = [];
  if (num(p.latencyMs)) parts.push(formatLatency(p.latencyMs));
  if (num(p.tokensPerSecond) && p.tokensPerSecond > 0) parts.push(`${p.tokensPerSecond.toFixed(0)} tok/s`);
  return parts.join(' · ');
}

/** Tooltip lines: the draft acceptance called what it is (not how often suggestions are accepted), counts. */
export function details(p: Partial<StatusParams>): string {
  const lines: string[] = [];
  const draft = num(p.draftAcceptance) ? p.draftAcceptance : num(p.alpha) ? p.alpha : undefined;
  if (draft !== undefined) lines.push(`draft tokens kept (speculative decoding): ${Math.round(draft * 100)}%`);
  if (typeof p.draft === 'string' && p.draft) lines.push(`draft: ${p.draft}${typeof p.lastDraft === 'string' && p.lastDraft ? ` (last completion: ${p.lastDraft})` : ''}`);
  const summary = suggestionSummary(p.suggestions);
  if (summary) lines.push(summary);
  return lines.map((l) => `\n${l}`).join('');
}

/** What stops this editor's suggestions other than `enable`: a snooze, or the active document's language. */
export interface Pause {
  /** ms since the epoch, or Infinity (until VS Code restarts) */
  snoozedUntil?: number;
  /** the active document's language id when it is turned off */
  languageOff?: string;
}

export function statusView(last: StatusParams | undefined, client: ClientState | undefined, enabled: boolean, pause: Pause = {}): StatusView {
  const click = 'Click for the menu.';
  if (client === 'notFound') {
    return { text: '$(error) completiond', tooltip: 'completiond: the server executable was not found. Run "completiond: Show Log" for details.', error: true };
  }
  if (client === 'stopped') {
    return { text: '$(debug-disconnect) completiond', tooltip: 'completiond: the language server is not running. Run "completiond: Restart Daemon" to start it.', error: true };
  }
  if (!enabled) {
    return { text: '$(circle-slash) completiond', tooltip: 'completiond: inline completions are off ("completiond: Toggle Inline Completions" turns them on).', error: false };
  }
  // An error outranks a pause: the user must see it, and resuming would not help.
  if (last?.state !== 'error' && pause.snoozedUntil !== undefined) {
    const end = snoozeEnd(pause.snoozedUntil);
    return {
      text: `$(bell-slash) completiond${Number.isFinite(pause.snoozedUntil) ? ' ' + end.replace('until ', '') : ''}`,
      tooltip: `completiond: suggestions snoozed ${end}; they come back by themselves (Alt+\\ still asks for one).\nClick for the menu to resume now.`,
      error: false,
    };
  }
  if (last?.state !== 'error' && pause.languageOff) {
    return {
      text: '$(circle-slash) completiond',
      tooltip: `completiond: off for ${pause.languageOff} files (completiond.disabledLanguages).\nClick for the menu to turn it on.`,
      error: false,
    };
  }
  if (client === 'starting' && !last) {
    return { text: '$(loading~spin) completiond', tooltip: 'completiond: starting the language server…', error: false };
  }
  const state = last?.state ?? 'loading';
  const m = last ? metrics(last) : '';
  const message = (last?.message ? `\n${last.message}` : '') + (last?.model ? `\nmodel: ${last.model}${last.device ? ` on ${last.device}` : ''}` : '');
  switch (state) {
    case 'starting':
    case 'loading': {
      const load = loadProgress(last?.progress);
      const pct = load.percent !== undefined ? ` ${load.percent}%` : '';
      const phase = load.message ? `\n${load.message}` : '';
      return { text: `$(loading~spin) completiond${pct}`, tooltip: `completiond: loading the model${pct}…${phase}${message}`, error: false };
    }
    case 'busy':
      return { text: `$(sync~spin) completiond${m ? ' ' + m : ''}`, tooltip: `completiond: generating…${message}\n${click}`, error: false };
    case 'stopped':
      return { text: '$(debug-disconnect) completiond', tooltip: `completiond: stopped${message}\n${click}`, error: false };
    case 'error':
      return { text: '$(error) completiond', tooltip: `completiond: error${message || '\n(no details; see the log)'}\n${click}`, error: true };
    case 'ready':
    default:
      if (last?.modelMismatch) {
        return {
          text: '$(warning) completiond',
          tooltip: `completiond: ${last.modelMismatch}${message}\n${click}`,
          error: false,
        };
      }
      return {
        text: `$(sparkle) completiond${m ? ' ' + m : ''}`,
        tooltip: `completiond: ready${m ? `\nlast completion: ${m}` : ''}${last ? details(last) : ''}${message}\n${click}`,
        error: false,
      };
  }
}

/** Render the result of the `completiond.stats` command as indented `key: value` lines. */
export function formatStats(stats: unknown, indent = ''): string {
  if (stats === null || stats === undefined) return `${indent}(no stats)`;
  if (typeof stats !== 'object') return `${indent}${String(stats)}`;
  const lines: string[] = [];
  for (const [key, value] of Object.entries(stats as Record<string, unknown>)) {
    if (value !== null && typeof value === 'object' && !Array.isArray(value)) {
      lines.push(`${indent}${key}:`);
      lines.push(formatStats(value, indent + '  '));
    } else if (Array.isArray(value)) {
      lines.push(`${indent}${key}: ${value.map((v) => (typeof v === 'object' ? JSON.stringify(v) : String(v))).join(', ')}`);
    } else if (typeof value === 'number' && !Number.isInteger(value)) {
      lines.push(`${indent}${key}: ${Number(value.toPrecision(4))}`);
    } else {
      lines.push(`${indent}${key}: ${String(value)}`);
    }
  }
  return lines.join('\n');
}
