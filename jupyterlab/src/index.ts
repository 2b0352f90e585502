// LooseLeaf in JupyterLab. For notebooks on the LooseLeaf kernel:
// - each code cell's text goes to the kernel as it changes, on the `looseleaf`
//   comm (ADR 45), at most once per THROTTLE_MS per cell, so that the platform
//   prepares the cell's worker before Run;
// - after a run, a badge on the cell says where it ran and how its worker was
//   prepared, from the execute reply's `metadata.looseleaf`.
import { JupyterFrontEnd, JupyterFrontEndPlugin } from '@jupyterlab/application';
import { Cell, ICellModel } from '@jupyterlab/cells';
import { INotebookTracker, NotebookPanel } from '@jupyterlab/notebook';
import { Kernel, KernelMessage } from '@jupyterlab/services';

/** The kernel's comm target for edits (src/kernel/mod.rs, EDIT_COMM_TARGET). */
const COMM_TARGET = 'looseleaf';

/** Typing sends a cell's text at most this often (the latest text wins). */
const THROTTLE_MS = 250;

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
    // what was typed before the kernel was there
    for (const cell of this.panel.content.widgets) {
      if (cell.model.type === 'code') {
        this.schedule(cell.model);
      }
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
        showBadge(cell, placement);
      }
    }
  }
}

/** The badge's words: device, how the worker was prepared, start delay. */
export function badgeText(p: Placement): string {
  const parts = [(p.device ?? '?').toUpperCase()];
  if (p.prepare) {
    parts.push(p.prepare === 'speculative' ? 'prepared' : p.prepare);
  }
  if (typeof p.start_delay_ms === 'number') {
    parts.push(`started in ${Math.round(p.start_delay_ms)} ms`);
  }
  return parts.join(' · ');
}

function showBadge(cell: Cell, p: Placement): void {
  let badge = cell.node.querySelector<HTMLElement>('.ll-badge');
  if (!badge) {
    badge = document.createElement('div');
    badge.className = 'll-badge';
    cell.node.appendChild(badge);
  }
  badge.textContent = badgeText(p);
  badge.dataset.device = p.device ?? '';
  badge.dataset.prepare = p.prepare ?? '';
  const where = p.host ? ` on ${p.host}${p.slot === null || p.slot === undefined ? '' : ` slot ${p.slot}`}` : '';
  badge.title = `${p.device_reason ?? ''}; closure of ${p.closure ?? 0} variables; ran${where}`;
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
