/**
 * Snoozing and per-language switches: what keeps this editor from asking for suggestions, other than
 * `completiond.enable`. Pure functions; the Controller keeps the state and the settings.
 */

/** The snooze lengths the menu offers, in minutes; `Infinity` lasts until VS Code restarts (or Resume). */
export const SNOOZE_CHOICES: { minutes: number; label: string }[] = [
  { minutes: 5, label: '5 minutes' },
  { minutes: 15, label: '15 minutes' },
  { minutes: 60, label: '1 hour' },
  { minutes: Infinity, label: 'Until VS Code restarts' },
];

/** A time of day as the status item shows it: 24-hour local "HH:MM". */
export function clockTime(ms: number): string {
  const d = new Date(ms);
  return `${String(d.getHours()).padStart(2, '0')}:${String(d.getMinutes()).padStart(2, '0')}`;
}

/** "until 14:35" for a timed snooze, "until VS Code restarts" for the open-ended one. */
export function snoozeEnd(until: number): string {
  return Number.isFinite(until) ? `until ${clockTime(until)}` : 'until VS Code restarts';
}

/**
 * The minutes a command argument asks for: a positive number (or its text), or "restart"/Infinity for
 * the open-ended snooze; undefined for anything else (the menu then asks).
 */
export function snoozeMinutes(arg: unknown): number | undefined {
  if (arg === 'restart' || arg === Infinity) return Infinity;
  const n = typeof arg === 'string' && arg.trim() !== '' ? Number(arg) : arg;
  return typeof n === 'number' && Number.isFinite(n) && n > 0 ? n : undefined;
}

/** The language ids of the server's `disabledLanguages` (comma-separated, matched without case). */
export function parseLanguageList(value: unknown): string[] {
  if (typeof value !== 'string') return [];
  return value
    .split(',')
    .map((v) => v.trim())
    .filter((v) => v !== '');
}

/** The client's `editor.disabledLanguages` (an array of ids). */
export function languageArray(value: unknown): string[] {
  return Array.isArray(value) ? value.filter((v): v is string => typeof v === 'string') : [];
}

function same(a: string, b: string): boolean {
  return a.toLowerCase() === b.toLowerCase();
}

/** Whether either list turns the language off (the server matches without case; so do we). */
export function languageIsOff(languageId: string, serverList: unknown, clientList: unknown): boolean {
  return [...parseLanguageList(serverList), ...languageArray(clientList)].some((v) => same(v, languageId));
}

/**
 * The writes that turn a language on or off. Off: added to the server's `disabledLanguages`, which every
 * client of the server honours. On: removed from both lists (either one would keep it off). Each
 * entry is a setting key and its new value; a list that needs no change is not written.
 */
export function languageSwitch(languageId: string, on: boolean, serverList: unknown, clientList: unknown): { key: string; value: unknown }[] {
  const server = parseLanguageList(serverList);
  const client = languageArray(clientList);
  if (!on) {
    return server.some((v) => same(v, languageId)) ? [] : [{ key: 'disabledLanguages', value: [...server, languageId].join(',') }];
  }
  const writes: { key: string; value: unknown }[] = [];
  if (server.some((v) => same(v, languageId))) writes.push({ key: 'disabledLanguages', value: server.filter((v) => !same(v, languageId)).join(',') });
  if (client.some((v) => same(v, languageId))) writes.push({ key: 'editor.disabledLanguages', value: client.filter((v) => !same(v, languageId)) });
  return writes;
}
