/** The status menu (a QuickPick opened from the status item): what runs, and what can be done. Pure. */
import { snoozeEnd } from './pause';
import { metrics, StatusParams, suggestionSummary } from './status';

export type MenuAction =
  | 'stats'
  | 'snooze'
  | 'resume'
  | 'languageOff'
  | 'languageOn'
  | 'enable'
  | 'disable'
  | 'restart'
  | 'model'
  | 'log'
  | 'settings';

/** One row: an action, or (no action) a separator with its label. */
export interface MenuItem {
  label: string;
  description?: string;
  detail?: string;
  action?: MenuAction;
}

export interface MenuState {
  status: StatusParams | undefined;
  /** 'starting', 'notFound', 'stopped' while the language server is not serving */
  clientState?: string;
  enabled: boolean;
  /** ms since the epoch, Infinity (until restart), or undefined when not snoozed */
  snoozedUntil?: number;
  /** the active editor's language id, if there is one */
  languageId?: string;
  languageOff?: boolean;
}

const STATE_WORDS: Record<string, string> = {
  starting: 'starting',
  loading: 'loading the model',
  ready: 'ready',
  busy: 'generating',
  error: 'error',
  stopped: 'daemon stopped',
  notFound: 'server not found',
};

/** The menu's first row: state, model and device, last latency, and this session's suggestions. */
export function summaryItem(s: MenuState): MenuItem {
  const st = s.status;
  const state = s.clientState === 'notFound' || s.clientState === 'stopped' ? s.clientState : st?.state ?? s.clientState ?? 'starting';
  const icon = state === 'error' || state === 'notFound' ? '$(error)' : state === 'ready' ? '$(sparkle)' : '$(pulse)';
  const model = st?.model ? `${st.model}${st.device ? ` on ${st.device}` : ''}` : 'model not loaded yet';
  const last = st ? metrics(st) : '';
  const details = [
    last ? `last completion ${last}` : 'no completion yet',
    suggestionSummary(st?.suggestions),
    st?.modelMismatch || (state === 'error' && st?.message) || '',
  ].filter((x) => x);
  return { label: `${icon} ${STATE_WORDS[state] ?? state}`, description: model, detail: details.join(' · '), action: 'stats' };
}

export function menuItems(s: MenuState): MenuItem[] {
  const items: MenuItem[] = [summaryItem(s), { label: 'Suggestions' }];
  if (s.snoozedUntil !== undefined) {
    items.push({ label: '$(bell) Resume suggestions', description: `snoozed ${snoozeEnd(s.snoozedUntil)}`, action: 'resume' });
  } else {
    items.push({ label: '$(bell-slash) Snooze…', description: '5, 15 or 60 minutes, or until VS Code restarts', action: 'snooze' });
  }
  if (s.languageId) {
    items.push(
      s.languageOff
        ? { label: `$(check) Turn on for ${s.languageId}`, description: 'off for this language', action: 'languageOn' }
        : { label: `$(circle-slash) Turn off for ${s.languageId}`, description: 'completiond.disabledLanguages', action: 'languageOff' },
    );
  }
  items.push(
    s.enabled
      ? { label: '$(circle-slash) Turn inline completions off', description: 'everywhere', action: 'disable' }
      : { label: '$(check) Turn inline completions on', description: 'off everywhere now', action: 'enable' },
    { label: 'completiond' },
    { label: '$(debug-restart) Restart the daemon', description: 'reloads the model', action: 'restart' },
    { label: '$(cloud-download) Choose a model…', description: 'downloads it, with progress', action: 'model' },
    { label: '$(graph) Show stats', action: 'stats' },
    { label: '$(output) Show log', action: 'log' },
    { label: '$(gear) Open settings', action: 'settings' },
  );
  return items;
}

/** A QuickPick row with any action id (none: a separator). */
export interface PickRow {
  label: string;
  description?: string;
  detail?: string;
  action?: string;
}

/** One model of the server's catalog (`completiond.models`). */
export interface CatalogModel {
  name: string;
  repo: string;
  downloadGb?: number;
  cpu?: string;
  gpuMsPerToken?: number;
  languages?: string[];
  gated?: boolean;
}

/** The answer of `completiond.models`. */
export interface Catalog {
  current?: string;
  recommended?: string;
  models?: CatalogModel[];
}

/** Action ids of the model picker: `use:<hub id>`, the bundled model, or any other (the setting). */
export const USE_MODEL = 'use:';
export const BUNDLED_MODEL = 'bundled';
export const OTHER_MODEL = 'other';

/** The model picker's rows: the catalog (recommended first), the bundled model, and "another…". */
export function modelItems(catalog: Catalog | undefined): PickRow[] {
  const current = (catalog?.current ?? '').toLowerCase();
  const models = [...(catalog?.models ?? [])].filter((m) => m && typeof m.repo === 'string' && typeof m.name === 'string');
  models.sort((a, b) => Number(b.repo === catalog?.recommended) - Number(a.repo === catalog?.recommended));
  const rows: PickRow[] = models.map((m) => {
    const inUse = current === m.repo.toLowerCase() || current === m.name.toLowerCase();
    const recommended = m.repo === catalog?.recommended;
    const size = typeof m.downloadGb === 'number' ? `${m.downloadGb.toFixed(1)} GB download` : '';
    const langs = m.languages && !(m.languages.length === 1 && m.languages[0] === '*') ? m.languages.join(', ') : 'every language';
    const speed = [m.cpu ? `CPU ${m.cpu}` : '', typeof m.gpuMsPerToken === 'number' ? `GPU ~${Math.max(1, Math.round(m.gpuMsPerToken))} ms/token` : '']
      .filter((x) => x)
      .join(' · ');
    return {
      label: `${inUse ? '$(check)' : recommended ? '$(star-full)' : '$(cloud-download)'} ${m.name}`,
      description: [m.repo, size, recommended ? 'recommended for this machine' : '', inUse ? 'in use' : ''].filter((x) => x).join(' · '),
      detail: [speed, langs, m.gated ? 'gated: accept its licence on the hub, then log in' : ''].filter((x) => x).join(' · '),
      action: USE_MODEL + m.repo,
    };
  });
  rows.push(
    { label: 'Other' },
    { label: `${current === '' ? '$(check)' : '$(package)'} The bundled model`, description: 'Python only, a small demo', action: BUNDLED_MODEL },
    { label: '$(gear) Another model…', description: 'a hub id or a local directory, in completiond.model', action: OTHER_MODEL },
  );
  return rows;
}
