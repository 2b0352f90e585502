// LooseLeaf in JupyterLab. For notebooks on the LooseLeaf kernel:
// - each code cell's text goes to the kernel as it changes, on the `looseleaf`
//   comm (ADR 45), at most once per THROTTLE_MS per cell, so that the platform
//   prepares the cell's worker before Run;
// - a badge on each code cell says where it will run and why, and its worker's
//   live state (planned, preparing, ready on a host/slot, running, saving, saved,
//   released), from what the kernel sends back on the comm (ADR 49); after a run,
//   where it ran, how its worker was prepared and its start delay, from the
//   execute reply's `metadata.looseleaf`;
// - a click on the badge pins the cell to GPU, then CPU, then back to LooseLeaf's
//   choice; the pin is kept in the cell's metadata (`looseleaf.device`, which
//   plain Jupyter ignores) and sent to the kernel, which applies it to the cell's
//   edits and runs;
// - a side panel shows the current notebook's session: GPU-slot seconds used
//   against what a pinned GPU would have held, the speculation hit rate, and the
//   cells run conservatively or that faulted names in.
import { JupyterFrontEnd, JupyterFrontEndPlugin } from '@jupyterlab/application';
import { Cell, ICellModel } from '@jupyterlab/cells';
import { INotebookTracker, NotebookPanel } from '@jupyterlab/notebook';
import { Kernel, KernelMessage } from '@jupyterlab/services';
import { Widget } from '@lumino/widgets';

/** The kernel's comm target for edits (src/kernel/comms.rs, EDIT_COMM_TARGET). */
const COMM_TARGET = 'looseleaf';

/** Typing sends a cell's text at most this often (the latest text wins). */
const THROTTLE_MS = 250;

/** A cell's pin, in its metadata under `looseleaf`. */
type Pin = 'gpu' | 'cpu' | null;

function pinOf(model: ICellModel): Pin {
  const meta = model.getMetadata('looseleaf') as { device?: string } | undefined;
  return meta?.device === 'gpu' || meta?.device === 'cpu' ? meta.device : null;
}

/** What the kernel's execute reply says about a run (`metadata.looseleaf`). */
interface Placement {
  device?: string;
  device_reason?: string;
  closure?: number;
  host?: string;
  slot?: number | null;
  prepare?: string;
  start_delay_ms?: number;
}

/** What the kernel says of a cell's worker now (`{"action": "state"}`). */
interface LiveState {
  state: string;
  device?: string;
  device_reason?: string;
  closure?: number;
  conservative?: string | null;
  host?: string;
  slot?: number | null;
  prepare?: string;
  outcome?: string;
  error?: string;
}

/** What a cell's last run cost (`{"action": "cost"}`, src/kernel/cost.rs). */
export interface RunCost {
  device: string;
  run_seconds: number;
  gpu_seconds: number;
}

/** A cost in words: GPU-slot seconds for a GPU cell, run time for a CPU one. */
export function costWords(c: RunCost): string {
  const n = (x: number) => (x < 10 ? x.toFixed(2) : x.toFixed(0));
  return c.device === 'gpu' ? `${n(c.gpu_seconds)} GPU-s` : `${n(c.run_seconds)} s CPU`;
}

/** The session's totals (`{"action": "session"}`, src/kernel/badge.rs). */
export interface SessionTotals {
  cells: number;
  gpu_cells: number;
  gpu_slot_seconds: number;
  pinned_gpu_seconds: number;
  hit_rate: number | null;
  conservative: number;
  faulted: number;
  failed: number;
}

/** The edit stream and badges of one notebook. */
class NotebookLink {
  /** The session's totals, for the side panel. */
  totals: SessionTotals | null = null;

  private comm: Kernel.IComm | null = null;
  private commKernel: Kernel.IKernelConnection | null = null;
  private watched = new WeakSet<ICellModel>();
  private timers = new Map<string, ReturnType<typeof setTimeout>>();
  private lastSent = new Map<string, number>();
  /** execute_request msg_id -> the cell it runs (JupyterLab's metadata.cellId). */
  private runs = new Map<string, string>();
  /** The text each cell last ran: its badge keeps the run's words while unchanged. */
  private ranText = new Map<string, string>();
  private kernelSeen: Kernel.IKernelConnection | null = null;

  constructor(
    private panel: NotebookPanel,
    private onTotals: (link: NotebookLink) => void
  ) {
    panel.sessionContext.kernelChanged.connect(() => this.onKernel());
    panel.content.modelContentChanged.connect(() => this.watchCells());
    void panel.sessionContext.ready.then(() => this.onKernel());
    this.watchCells();
  }

  /**
   * Undo the session's last cell (`%looseleaf undo`, outside the notebook's
   * history): what the kernel answered, in one line.
   */
  async undo(): Promise<string> {
    const kernel = await this.looseleafKernel();
    if (!kernel) {
      return 'This notebook has no LooseLeaf kernel.';
    }
    let said = '';
    const future = kernel.requestExecute({ code: '%looseleaf undo', silent: false, store_history: false });
    future.onIOPub = msg => {
      if (msg.header.msg_type === 'stream') {
        said += (msg.content as { text: string }).text;
      }
    };
    const reply = await future.done;
    const content = reply.content as { status: string; evalue?: string };
    return content.status === 'ok' ? said.trim() : `Not undone: ${content.evalue ?? content.status}`;
  }

  /** The kernel, if it is LooseLeaf's. */
  private async looseleafKernel(): Promise<Kernel.IKernelConnection | null> {
    const kernel = this.panel.sessionContext.session?.kernel ?? null;
    if (!kernel) {
      return null;
    }
    const info = await kernel.info;
    return info.implementation === 'looseleaf' ? kernel : null;
  }

  private async onKernel(): Promise<void> {
    const kernel = await this.looseleafKernel();
    if (!kernel || kernel === this.kernelSeen) {
      return;
    }
    this.kernelSeen = kernel;
    kernel.anyMessage.connect((_, args) => this.onMessage(args.msg, args.direction));
    // what was typed (and pinned) before the kernel was there
    for (const cell of this.panel.content.widgets) {
      if (cell.model.type === 'code') {
        this.badge(cell);
        this.schedule(cell.model);
      }
    }
  }

  /** The cell's badge, made (with its click to pin) the first time. */
  private badge(cell: Cell): HTMLElement {
    let badge = cell.node.querySelector<HTMLElement>('.ll-badge');
    if (!badge) {
      badge = document.createElement('div');
      badge.className = 'll-badge';
      badge.addEventListener('click', () => void this.cyclePin(cell));
      // bottom right of the input: the active cell's toolbar takes its top right
      const input = cell.node.querySelector<HTMLElement>('.jp-Cell-inputWrapper') ?? cell.node;
      input.classList.add('ll-has-badge');
      input.appendChild(badge);
      renderBadge(badge, pinOf(cell.model), null, null, false);
    }
    return badge;
  }

  /** LooseLeaf's choice -> GPU -> CPU -> LooseLeaf's choice. */
  private async cyclePin(cell: Cell): Promise<void> {
    const next: Pin = { gpu: 'cpu', cpu: null, none: 'gpu' }[pinOf(cell.model) ?? 'none'] as Pin;
    if (next) {
      cell.model.setMetadata('looseleaf', { device: next });
    } else {
      cell.model.deleteMetadata('looseleaf');
    }
    renderBadge(this.badge(cell), next, null, null, this.unchanged(cell));
    await this.sendPin(cell.model);
    this.schedule(cell.model); // a prepared worker follows the pin
  }

  private async sendPin(model: ICellModel): Promise<void> {
    const comm = await this.openComm();
    if (comm) {
      comm.send({ action: 'pin', cell_id: model.id, device: pinOf(model) });
    }
  }

  private watchCells(): void {
    for (const cell of this.panel.content.widgets) {
      const model = cell.model;
      if (model.type !== 'code' || this.watched.has(model)) {
        continue;
      }
      this.watched.add(model);
      model.contentChanged.connect(() => this.schedule(model));
      if (this.kernelSeen) {
        this.badge(cell);
        // a cell pasted or set whole: the change that made it came before this watch
        if (model.sharedModel.getSource()) {
          this.schedule(model);
        }
      }
    }
  }

  /** Send the cell's text now if it was not sent within THROTTLE_MS, else at the end of it. */
  private schedule(model: ICellModel): void {
    const id = model.id;
    if (this.timers.has(id)) {
      return; // the pending send takes the latest text
    }
    const wait = Math.max(0, (this.lastSent.get(id) ?? 0) + THROTTLE_MS - Date.now());
    this.timers.set(
      id,
      setTimeout(() => {
        this.timers.delete(id);
        this.lastSent.set(id, Date.now());
        const code = model.sharedModel.getSource();
        // a blank cell needs no worker (and would take a prepared slot)
        if (code.trim()) {
          void this.sendEdit(id, code);
        }
      }, wait)
    );
  }

  private async sendEdit(cellId: string, code: string): Promise<void> {
    const comm = await this.openComm();
    if (comm) {
      // a cell the platform has said nothing of yet (a later edit that changes
      // nothing the plan depends on brings no new plan, so it keeps its state)
      const cell = this.panel.content.widgets.find(c => c.model.id === cellId);
      const badge = cell?.node.querySelector<HTMLElement>('.ll-badge');
      if (cell && badge && !badge.dataset.state) {
        renderBadge(badge, pinOf(cell.model), null, { state: 'planning' }, false);
      }
      comm.send({ action: 'edit', cell_id: cellId, code });
    }
  }

  /** The edit comm on the current kernel, opened once per kernel (a restart gives a new one). */
  private async openComm(): Promise<Kernel.IComm | null> {
    const kernel = await this.looseleafKernel();
    if (!kernel) {
      return null;
    }
    if (this.comm && !this.comm.isDisposed && this.commKernel === kernel) {
      return this.comm;
    }
    this.comm = kernel.createComm(COMM_TARGET);
    this.commKernel = kernel;
    this.comm.onMsg = msg => this.onCommMsg(msg.content.data as Record<string, unknown>);
    this.comm.open({});
    // a new kernel knows no pins yet
    for (const cell of this.panel.content.widgets) {
      if (pinOf(cell.model)) {
        this.comm.send({ action: 'pin', cell_id: cell.model.id, device: pinOf(cell.model) });
      }
    }
    return this.comm;
  }

  /** Whether the cell's text is the text it last ran. */
  private unchanged(cell: Cell): boolean {
    return this.ranText.get(cell.model.id) === cell.model.sharedModel.getSource();
  }

  /** What the kernel says on the comm: a cell's live state, or the session's totals. */
  private onCommMsg(data: Record<string, unknown>): void {
    if (data.action === 'state') {
      const cell = this.panel.content.widgets.find(c => c.model.id === data.cell_id);
      if (cell) {
        renderBadge(this.badge(cell), pinOf(cell.model), null, data as unknown as LiveState, this.unchanged(cell));
      }
    } else if (data.action === 'cost') {
      // kept on the badge: before the next Run it says what the last one cost
      const cell = this.panel.content.widgets.find(c => c.model.id === data.cell_id);
      if (cell) {
        const badge = this.badge(cell);
        badge.dataset.cost = JSON.stringify(data);
        renderBadge(badge, pinOf(cell.model), null, null, this.unchanged(cell));
      }
    } else if (data.action === 'session') {
      this.totals = data as unknown as SessionTotals;
      this.onTotals(this);
    }
  }

  private onMessage(msg: KernelMessage.IMessage, direction: 'send' | 'recv'): void {
    const type = msg.header.msg_type;
    if (direction === 'send' && type === 'execute_request') {
      const cellId = (msg.metadata as { cellId?: string }).cellId;
      if (cellId) {
        this.runs.set(msg.header.msg_id, cellId);
        this.ranText.set(cellId, (msg.content as { code?: string }).code ?? '');
        // Run carries the text: an edit still waiting for the throttle is moot
        clearTimeout(this.timers.get(cellId));
        this.timers.delete(cellId);
        // the last run's cost is this run's once it is told
        const cell = this.panel.content.widgets.find(c => c.model.id === cellId);
        delete cell?.node.querySelector<HTMLElement>('.ll-badge')?.dataset.cost;
      }
    } else if (direction === 'recv' && type === 'execute_reply') {
      const parent = (msg.parent_header as KernelMessage.IHeader).msg_id;
      const cellId = this.runs.get(parent);
      this.runs.delete(parent);
      const placement = (msg.metadata as { looseleaf?: Placement }).looseleaf;
      const cell = this.panel.content.widgets.find(c => c.model.id === cellId);
      if (cell && placement) {
        renderBadge(this.badge(cell), pinOf(cell.model), placement, null, this.unchanged(cell));
      }
    }
  }
}

/** Where a worker is: ` on host-0/slot 1`, or ` on host-0` for a CPU worker. */
function where(s: { host?: string; slot?: number | null }): string {
  if (!s.host) {
    return '';
  }
  return s.slot === null || s.slot === undefined ? ` on ${s.host}` : ` on ${s.host}/slot ${s.slot}`;
}

/** The closure's size in words. */
function vars(n: number | undefined): string {
  return n === 1 ? '1 var' : `${n ?? 0} vars`;
}

/** The live state in words (after the closure's size, once a plan said it), or
 * null where the last run's words say more. */
function stateWords(s: LiveState): string | null {
  const words = liveWords(s);
  return words !== null && s.closure !== undefined && s.state !== 'planned' ? `${vars(s.closure)} · ${words}` : words;
}

function liveWords(s: LiveState): string | null {
  switch (s.state) {
    case 'planned':
      // a CPU cell has no worker to prepare; a GPU one waits for a host
      return s.device === 'gpu' ? `${vars(s.closure)} · planned` : vars(s.closure);
    case 'planning':
      return 'planning';
    case 'queued':
      return 'queued';
    case 'preparing':
      return `preparing${where(s)}`;
    case 'ready':
      return `ready${where(s)}`;
    case 'running':
      return `running${where(s)}`;
    case 'saving':
      return 'saving';
    case 'released':
      return `worker released (${(s.outcome ?? '').replace(/_/g, ' ')})`;
    case 'failed':
      return 'failed';
    default:
      return null; // saved: the run's words follow from its reply
  }
}

/** The badge's words: the pin, the device, then the worker's live state, or
 * after a run how its worker was prepared and its start delay. */
export function badgeText(
  pin: Pin,
  p: Placement | null,
  live: LiveState | null,
  showRun: boolean,
  cost: RunCost | null = null
): string {
  const parts = pin ? [`pinned ${pin.toUpperCase()}`] : [];
  const run = showRun && live?.state !== 'running' && live?.state !== 'saving' ? p : null;
  const device = run ? run.device : (live?.device ?? p?.device);
  const words = live ? stateWords(live) : null;
  if (device) {
    parts.push(device.toUpperCase());
  }
  if (run) {
    if (run.prepare) {
      parts.push(run.prepare === 'speculative' ? 'prepared' : run.prepare);
    }
    if (typeof run.start_delay_ms === 'number') {
      parts.push(`started in ${Math.round(run.start_delay_ms)} ms`);
    }
    if (cost) {
      parts.push(costWords(cost));
    }
    // a worker prepared again for the same text (to run it again)
    if (live?.state === 'ready') {
      parts.push('ready');
    }
  } else if (words) {
    parts.push(words);
  }
  return parts.length ? parts.join(' · ') : 'auto';
}

/** Show `pin`, the live state `live` if one came, and the last run `p` (each
 * kept on the badge until a newer one replaces it); the run's words while
 * `showRun` (the cell's text is the text that ran). */
function renderBadge(
  badge: HTMLElement,
  pin: Pin,
  p: Placement | null,
  live: LiveState | null,
  showRun: boolean
): void {
  badge.dataset.pin = pin ?? '';
  if (p) {
    badge.dataset.run = JSON.stringify(p);
    badge.dataset.prepare = p.prepare ?? '';
    badge.dataset.startDelayMs = String(p.start_delay_ms ?? '');
    // the run's reply is the last word on it
    delete badge.dataset.live;
    badge.dataset.state = 'saved';
  }
  if (live) {
    // the planned device and why stay while the worker's state moves on
    const before = badge.dataset.live ? (JSON.parse(badge.dataset.live) as LiveState) : null;
    const merged: LiveState =
      live.state === 'planned'
        ? live
        : { ...live, device: live.device ?? before?.device, device_reason: before?.device_reason, closure: before?.closure };
    badge.dataset.live = JSON.stringify(merged);
    badge.dataset.state = live.state;
  }
  const last = badge.dataset.run ? (JSON.parse(badge.dataset.run) as Placement) : null;
  const now = badge.dataset.live ? (JSON.parse(badge.dataset.live) as LiveState) : null;
  const cost = badge.dataset.cost ? (JSON.parse(badge.dataset.cost) as RunCost) : null;
  badge.textContent = badgeText(pin, last, now, showRun, cost);
  badge.dataset.device = (showRun && last?.device) || now?.device || last?.device || '';
  const why = now?.device_reason ?? last?.device_reason;
  const closure = now?.closure ?? last?.closure;
  const plan = why ? `${why}; closure of ${closure ?? 0} variables. ` : '';
  const ran = last
    ? `Last run${where(last)}, ${last.prepare ?? ''} worker, started in ${Math.round(last.start_delay_ms ?? 0)} ms. `
    : '';
  const paid = cost ? `Last run cost ${costWords(cost)} (ran ${cost.run_seconds.toFixed(2)} s). ` : '';
  badge.title = `${plan}${ran}${paid}Click: pin to GPU, to CPU, or let LooseLeaf choose.`;
}

/** The side panel: the current notebook's session. */
class SessionPanel extends Widget {
  /** What the last undo answered (shown under its button). */
  private undone = '';
  /** The totals shown. */
  private totals: SessionTotals | null = null;

  /** `undo`: undo the current notebook's last cell (null: no notebook). */
  constructor(private undo: () => Promise<string> | null) {
    super();
    this.id = 'looseleaf-session';
    this.addClass('ll-session-panel');
    this.title.label = 'LooseLeaf';
    this.title.caption = 'LooseLeaf: this notebook\'s session';
    this.render(null);
  }

  /** Show `t`, the totals of the current notebook's session (null: none yet). */
  render(t: SessionTotals | null): void {
    this.totals = t;
    this.node.replaceChildren();
    const h = document.createElement('h3');
    h.textContent = 'LooseLeaf session';
    this.node.appendChild(h);
    if (!t) {
      const p = document.createElement('p');
      p.textContent = 'No cell has run on LooseLeaf in this notebook yet.';
      this.node.appendChild(p);
      return;
    }
    const saved = t.pinned_gpu_seconds > 0 ? 1 - t.gpu_slot_seconds / t.pinned_gpu_seconds : null;
    // a session of short GPU cells uses hundredths of a second: shown, not 0.0
    const slotSeconds = t.gpu_slot_seconds.toFixed(t.gpu_slot_seconds < 10 ? 2 : 1);
    const rows: [string, string, string][] = [
      ['gpu-slot-seconds', 'GPU-slot seconds used', slotSeconds],
      ['pinned-gpu-seconds', 'A pinned GPU would have held', t.pinned_gpu_seconds.toFixed(1)],
      ['saved', 'GPU time saved', saved === null ? '–' : `${Math.round(saved * 100)}%`],
      ['cells', 'Cells run (GPU)', `${t.cells} (${t.gpu_cells})`],
      ['hit-rate', 'Speculation hit rate', t.hit_rate === null ? '–' : `${Math.round(t.hit_rate * 100)}%`],
      ['conservative', 'Cells run conservatively', String(t.conservative)],
      ['faulted', 'Cells that faulted names in', String(t.faulted)],
      ['failed', 'Cells the platform failed', String(t.failed)]
    ];
    const table = document.createElement('table');
    for (const [key, label, value] of rows) {
      const tr = table.insertRow();
      tr.dataset.key = key;
      tr.insertCell().textContent = label;
      tr.insertCell().textContent = value;
    }
    this.node.appendChild(table);
    this.renderUndo();
  }

  /** A button that takes the session's state back to before its last cell. */
  private renderUndo(): void {
    const button = document.createElement('button');
    button.className = 'll-undo jp-mod-styled';
    button.textContent = 'Undo last cell';
    button.title = 'Variables go back to before the last cell ran; outputs and files stay as they are.';
    const said = document.createElement('p');
    said.className = 'll-undo-said';
    said.textContent = this.undone;
    button.onclick = async () => {
      const undone = this.undo();
      if (!undone) {
        return;
      }
      button.disabled = true;
      try {
        this.undone = await undone;
      } catch (e) {
        this.undone = `Not undone: ${e}`;
      }
      // (the panel may have been drawn again meanwhile)
      this.render(this.totals);
    };
    this.node.appendChild(button);
    this.node.appendChild(said);
  }
}

const plugin: JupyterFrontEndPlugin<void> = {
  id: 'looseleaf-jupyterlab:plugin',
  description: 'Streams cell edits to the LooseLeaf kernel and shows where each cell ran.',
  autoStart: true,
  requires: [INotebookTracker],
  activate: (app: JupyterFrontEnd, tracker: INotebookTracker) => {
    const links = new WeakMap<NotebookPanel, NotebookLink>();
    const current = () => (tracker.currentWidget ? links.get(tracker.currentWidget) : undefined);
    const side = new SessionPanel(() => current()?.undo() ?? null);
    app.shell.add(side, 'right', { rank: 900 });
    tracker.widgetAdded.connect((_, panel) => {
      const link = new NotebookLink(panel, l => {
        if (l === current()) {
          side.render(l.totals);
        }
      });
      links.set(panel, link);
    });
    tracker.currentChanged.connect(() => side.render(current()?.totals ?? null));
  }
};

export default plugin;
