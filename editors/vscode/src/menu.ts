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
    { label: '$(cloud-download) Choose a model…', description: 'a hub model downloads on first use', action: 'model' },
    { label: '$(graph) Show stats', action: 'stats' },
    { label: '$(output) Show log', action: 'log' },
    { label: '$(gear) Open settings', action: 'settings' },
  );
  return items;
}
