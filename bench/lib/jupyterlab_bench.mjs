// bench/jupyterlab's browser: opens one notebook in JupyterLab on the LooseLeaf
// kernel and goes through its code cells in order. A cell listed in TYPED (the
// bench left it empty) is typed a character at a time at CPS characters a second,
// then run at once; every other cell is run as it is. Prints one JSON line: per
// typed cell, what its execute reply's `metadata.looseleaf` said (device, how its
// worker was prepared, start delay), whether the typed text equals the source,
// and whether the LooseLeaf extension was active in the page.
//
// Environment: LAB_URL, LAB_TOKEN, NOTEBOOK, KERNEL_DISPLAY, KERNEL_NAME, CHROMIUM,
// OUT (a folder for screenshots), TYPED (a JSON object: code-cell position ->
// source), CPS.
import { chooseKernel, env, kernelIdle as idle, launch, MINUTE, stepper } from "../../tests/browser/common.mjs";

const [base, token, notebook, kernelDisplay, kernelName, out] = [
  "LAB_URL", "LAB_TOKEN", "NOTEBOOK", "KERNEL_DISPLAY", "KERNEL_NAME", "OUT",
].map(env);
const typed = JSON.parse(env("TYPED"));
const keyDelay = 1000 / Number(env("CPS"));
const { browser, page } = await launch({ width: 1400, height: 1000 });
page.setDefaultTimeout(5 * MINUTE);
const seen = { cells: [] };
const step = stepper(page, out);
const kernelIdle = () => idle(page, kernelName, 3 * MINUTE);
const command = (id) => page.evaluate((id) => { window.jupyterapp.commands.execute(id); }, id);

const workspace = notebook.replace(/[^A-Za-z0-9]/g, "-");
try {
  await step("open", async () => {
    // a workspace of its own: no tab of an earlier notebook is restored
    await page.goto(`${base}/lab/workspaces/${workspace}/tree/${notebook}?token=${token}`);
    await page.waitForFunction(() => window.jupyterapp?.shell.currentWidget?.sessionContext?.isReady,
      null, { timeout: 3 * MINUTE });
    await chooseKernel(page, kernelDisplay, kernelName);
    // JupyterLab's question about its news would sit over the cells
    await page.locator(".jp-toast-button", { hasText: "No" }).click({ timeout: 3000 }).catch(() => {});
    seen.extension_active = await page.evaluate(() => window.jupyterapp.hasPlugin("looseleaf-jupyterlab:plugin")
      && window.jupyterapp.isPluginActivated?.("looseleaf-jupyterlab:plugin") !== false);
    // every execute reply, by the cell its request named (with or without the extension)
    await page.evaluate(() => {
      window.llReplies = {};
      const requests = {};
      const kernel = window.jupyterapp.shell.currentWidget.sessionContext.session.kernel;
      kernel.anyMessage.connect((_, { msg, direction }) => {
        if (direction === "send" && msg.header.msg_type === "execute_request") {
          requests[msg.header.msg_id] = msg.metadata.cellId;
        } else if (direction === "recv" && msg.header.msg_type === "execute_reply") {
          const cell = requests[msg.parent_header.msg_id];
          if (cell) window.llReplies[cell] = { status: msg.content.status, looseleaf: msg.metadata.looseleaf ?? null };
        }
      });
    });
  });

  const positions = await page.evaluate(() => window.jupyterapp.shell.currentWidget.content.widgets
    .map((c, i) => [i, c.model.type]).filter(([, t]) => t === "code").map(([i]) => i));
  for (const [k, index] of positions.entries()) {
    const source = typed[String(k)];
    await step(`cell-${k}`, async () => {
      const cellId = await page.evaluate((index) => {
        const nb = window.jupyterapp.shell.currentWidget.content;
        nb.activeCellIndex = index;
        nb.mode = "command";
        return nb.widgets[index].model.id;
      }, index);
      if (source !== undefined) {
        await command("notebook:enter-edit-mode");
        await page.locator(".jp-Notebook .jp-Cell.jp-mod-active .cm-content").waitFor({ timeout: MINUTE });
        // one character at a time, as text input: no key bindings, so the
        // editor adds no indentation or brackets of its own (JupyterLab's
        // auto-closing brackets are off by default too)
        const start = Date.now();
        for (const [i, ch] of [...source].entries()) {
          if (ch === "\n") {
            // a line break as an editor transaction: text input of a newline makes
            // Chromium's contenteditable split a paragraph (an extra line)
            await page.evaluate(() => {
              const view = window.jupyterapp.shell.currentWidget.content.activeCell.editor.editor;
              view.dispatch(view.state.replaceSelection("\n"), { userEvent: "input.type", scrollIntoView: true });
            });
          } else {
            await page.keyboard.insertText(ch);
          }
          const next = start + (i + 1) * keyDelay;
          if (next > Date.now()) await page.waitForTimeout(next - Date.now());
        }
        const now = await page.evaluate(() =>
          window.jupyterapp.shell.currentWidget.content.activeCell.model.sharedModel.getSource());
        if (now !== source) throw new Error(`typed text differs from the source: ${JSON.stringify(now)}`);
      }
      await command("notebook:run-cell");
      await page.waitForFunction((id) => window.llReplies[id], cellId, { timeout: 5 * MINUTE });
      if (source !== undefined) {
        const reply = await page.evaluate((id) => window.llReplies[id], cellId);
        seen.cells.push({ position: k, ...reply });
      }
    });
  }
  await kernelIdle();
  await page.screenshot({ path: `${out}/${workspace}-end.png` });
  // its kernel (and the kernel's embedded cluster) ends with the notebook
  await page.evaluate(() => window.jupyterapp.shell.currentWidget.sessionContext.shutdown());
} finally {
  await browser.close();
}
console.log(JSON.stringify(seen));
