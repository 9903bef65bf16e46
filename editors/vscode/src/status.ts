/** What the status bar item shows, computed from `completiond/status` notifications. Pure. */

export type ServerState = 'loading' | 'ready' | 'busy' | 'error';

/** Params of the `completiond/status` notification (every field optional but state). */
export interface StatusParams {
  state: ServerState | string;
  latencyMs?: number | null;
  alpha?: number | null;
  tokensPerSecond?: number | null;
  message?: string | null;
  /** loading progress in [0, 1], when the server reports one */
  progress?: number | null;
  model?: string | null;
  device?: string | null;
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

/** Metrics of the last completion ("123 ms · α 0.72 · 45 tok/s"), or '' when none. */
export function metrics(p: Partial<StatusParams>): string {
  const parts: string[] = [];
  if (num(p.latencyMs)) parts.push(formatLatency(p.latencyMs));
  if (num(p.alpha)) parts.push(`α ${p.alpha.toFixed(2)}`);
  if (num(p.tokensPerSecond)) parts.push(`${p.tokensPerSecond.toFixed(0)} tok/s`);
  return parts.join(' · ');
}

export function statusView(last: StatusParams | undefined, client: ClientState | undefined, enabled: boolean): StatusView {
  const click = 'Click for stats.';
  if (client === 'notFound') {
    return { text: '$(error) completiond', tooltip: 'completiond: the server executable was not found. Run "completiond: Show Log" for details.', error: true };
  }
  if (client === 'stopped') {
    return { text: '$(debug-disconnect) completiond', tooltip: 'completiond: the language server is not running. Run "completiond: Restart Daemon" to start it.', error: true };
  }
  if (!enabled) {
    return { text: '$(circle-slash) completiond', tooltip: 'completiond: inline completions are off ("completiond: Toggle Inline Completions" turns them on).', error: false };
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
      const pct = num(last?.progress) ? ` ${Math.round(Math.max(0, Math.min(1, last!.progress!)) * 100)}%` : '';
      return { text: `$(loading~spin) completiond${pct}`, tooltip: `completiond: loading the model${pct}…${message}`, error: false };
    }
    case 'busy':
      return { text: `$(sync~spin) completiond${m ? ' ' + m : ''}`, tooltip: `completiond: generating…${message}\n${click}`, error: false };
    case 'error':
      return { text: '$(error) completiond', tooltip: `completiond: error${message || '\n(no details; see the log)'}\n${click}`, error: true };
    case 'ready':
    default:
      return {
        text: `$(sparkle) completiond${m ? ' ' + m : ''}`,
        tooltip: `completiond: ready${m ? `\nlast completion: ${m}` : ''}${message}\n${click}`,
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
