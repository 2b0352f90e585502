// LooseLeaf in JupyterLab. For notebooks on the LooseLeaf kernel:
// - each code cell's text goes to the kernel as it changes, on the `looseleaf`
//   comm (ADR 45), at most once per THROTTLE_MS per cell, so that the platform
//   prepares the cell's worker before Run;
// - after a run, a badge on the cell says where it ran and how its worker was
//   prepared, from the execute reply's `metadata.looseleaf`;
// - a click on the badge pins the cell to GPU, then CPU, then back to LooseLeaf's
//   choice; the pin is kept in the cell's metadata (`looseleaf.device`, which
//   plain Jupyter ignores) and sent to the kernel, which applies it to the cell's
//   edits and runs.
import { JupyterFrontEnd, JupyterFrontEndPlugin } from '@jupyterlab/application';
import { Cell, ICellModel } from '@jupyterlab/cells';
import { INotebookTracker, NotebookPanel } from '@jupyterlab/notebook';
import { Kernel, KernelMessage } from '@jupyterlab/services';

/** The kernel's comm target for edits (src/kernel/mod.rs, EDIT_COMM_TARGET). */
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

/** The edit stream and badges of one notebook. */
class NotebookLink {
  private comm: Kernel.IComm | null = null;
  private commKernel: Kernel.IKernelConnection | null = null;
  private watched = new WeakSet<ICellModel>();
  private timers = new Map<string, ReturnType<typeof setTimeout>>();
  private lastSent = new Map<string, number>();
  /** execute_request msg_id -> the cell it runs (JupyterLab's metadata.cellId). */
  private runs = new Map<string, string>();
  private kernelSeen: Kernel.IKernelConnection | null = null;

  constructor(private panel: NotebookPanel) {
    panel.sessionContext.kernelChanged.connect(() => this.onKernel());
    panel.content.modelContentChanged.connect(() => this.watchCells());
    void panel.sessionContext.ready.then(() => this.onKernel());
    this.watchCells();
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
      renderBadge(badge, pinOf(cell.model), null);
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
    renderBadge(this.badge(cell), next, null);
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
        void this.sendEdit(id, model.sharedModel.getSource());
      }, wait)
    );
  }

  private async sendEdit(cellId: string, code: string): Promise<void> {
    const comm = await this.openComm();
    if (comm) {
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
    this.comm.open({});
    // a new kernel knows no pins yet
    for (const cell of this.panel.content.widgets) {
      if (pinOf(cell.model)) {
        this.comm.send({ action: 'pin', cell_id: cell.model.id, device: pinOf(cell.model) });
      }
    }
    return this.comm;
  }

  private onMessage(msg: KernelMessage.IMessage, direction: 'send' | 'recv'): void {
    const type = msg.header.msg_type;
    if (direction === 'send' && type === 'execute_request') {
      const cellId = (msg.metadata as { cellId?: string }).cellId;
      if (cellId) {
        this.runs.set(msg.header.msg_id, cellId);
      }
    } else if (direction === 'recv' && type === 'execute_reply') {
      const parent = (msg.parent_header as KernelMessage.IHeader).msg_id;
      const cellId = this.runs.get(parent);
      this.runs.delete(parent);
      const placement = (msg.metadata as { looseleaf?: Placement }).looseleaf;
      const cell = this.panel.content.widgets.find(c => c.model.id === cellId);
      if (cell && placement) {
        renderBadge(this.badge(cell), pinOf(cell.model), placement);
      }
    }
  }
}

/** The badge's words: the pin, then the last run's device, how its worker was
 * prepared and its start delay. */
export function badgeText(pin: Pin, p: Placement | null): string {
  const parts = pin ? [`pinned ${pin.toUpperCase()}`] : [];
  if (p) {
    parts.push((p.device ?? '?').toUpperCase());
    if (p.prepare) {
      parts.push(p.prepare === 'speculative' ? 'prepared' : p.prepare);
    }
    if (typeof p.start_delay_ms === 'number') {
      parts.push(`started in ${Math.round(p.start_delay_ms)} ms`);
    }
  }
  return parts.length ? parts.join(' · ') : 'auto';
}

/** Show `pin` and, if the cell ran, `p` (a pin change alone keeps the last run's words). */
function renderBadge(badge: HTMLElement, pin: Pin, p: Placement | null): void {
  badge.dataset.pin = pin ?? '';
  const last = p ?? (badge.dataset.run ? (JSON.parse(badge.dataset.run) as Placement) : null);
  if (p) {
    badge.dataset.run = JSON.stringify(p);
    badge.dataset.device = p.device ?? '';
    badge.dataset.prepare = p.prepare ?? '';
  }
  badge.textContent = badgeText(pin, last);
  const ran = last
    ? `${last.device_reason ?? ''}; closure of ${last.closure ?? 0} variables; ran` +
      (last.host ? ` on ${last.host}` : '') +
      (last.slot === null || last.slot === undefined ? '' : ` slot ${last.slot}`) +
      '. '
    : '';
  badge.title = `${ran}Click: pin to GPU, to CPU, or let LooseLeaf choose.`;
}

const plugin: JupyterFrontEndPlugin<void> = {
  id: 'looseleaf-jupyterlab:plugin',
  description: 'Streams cell edits to the LooseLeaf kernel and shows where each cell ran.',
  autoStart: true,
  requires: [INotebookTracker],
  activate: (_app: JupyterFrontEnd, tracker: INotebookTracker) => {
    tracker.widgetAdded.connect((_, panel) => {
      new NotebookLink(panel);
    });
  }
};

export default plugin;
