// Drive JupyterLab in headless Chromium as a user would: open a notebook, choose
// the LooseLeaf kernel in the kernel dialog, run all cells, see an image, type a
// GPU cell and see its badge say it ran on a prepared worker, interrupt
// a looping cell, move a slider and read its value back, restart; then leave the
// kernel idle until Jupyter Server culls it, open the notebook again and find its
// variables there. Prints one JSON line of what it saw; tests/jupyterlab.rs
// asserts on it. A step that fails leaves a screenshot in $OUT.
//
// Environment: LAB_URL, LAB_TOKEN, NOTEBOOK (path under the server's root),
// KERNEL_NAME, KERNEL_DISPLAY, CHROMIUM (the browser binary), OUT (a folder).
import { chooseKernel, env, kernelIdle as idle, launch, MINUTE, stepper } from "./common.mjs";

const [base, token, notebook, kernelName, kernelDisplay, out] = [
  "LAB_URL", "LAB_TOKEN", "NOTEBOOK", "KERNEL_NAME", "KERNEL_DISPLAY", "OUT",
].map(env);
const { browser, page } = await launch({ width: 1400, height: 1000 });
page.setDefaultTimeout(2 * MINUTE);
const seen = {};
const step = stepper(page, out);

// What the open notebook's cells hold (JupyterLab's own models).
const cells = () => page.evaluate(() => {
  const nb = window.jupyterapp.shell.currentWidget.content;
  return nb.widgets.map((c) => ({
    type: c.model.type,
    count: c.model.type === "code" ? c.model.executionCount : null,
    outputs: c.model.type === "code" ? c.model.outputs.toJSON() : [],
  }));
});
const kernelIdle = (name) => idle(page, name);
// a command is started, not awaited: running a cell resolves only when it ends
const command = (id) => page.evaluate((id) => { window.jupyterapp.commands.execute(id); }, id);
// a new last cell holding `source`, run
async function runNewCell(source) {
  await page.evaluate((source) => {
    const nb = window.jupyterapp.shell.currentWidget.content;
    nb.activeCellIndex = nb.widgets.length - 1;
  }, source);
  await command("notebook:insert-cell-below");
  await page.evaluate((source) => {
    window.jupyterapp.shell.currentWidget.content.activeCell.model.sharedModel.setSource(source);
  }, source);
  await command("notebook:run-cell");
}
const lastOutputs = async () => (await cells()).at(-1).outputs;
// a screenshot with the last cell's badge in view (JupyterLab's news question,
// if it is up, would cover it)
async function shotOfLastCell(name) {
  await page.locator(".jp-toast-button", { hasText: "No" }).click({ timeout: 2000 }).catch(() => {});
  await page.locator(".jp-Notebook .jp-Cell").last().scrollIntoViewIfNeeded();
  await page.screenshot({ path: `${out}/${name}.png` });
}
// the last cell's badge reaches `state`; if it does not, the error says where it is
async function lastBadgeState(state) {
  const badge = page.locator(".jp-Notebook .jp-Cell").last().locator(".ll-badge");
  try {
    await page.locator(".jp-Notebook .jp-Cell").last().locator(`.ll-badge[data-state='${state}']`)
      .waitFor({ timeout: MINUTE });
  } catch (e) {
    const now = await badge.evaluate((b) => JSON.stringify({ text: b.textContent, ...b.dataset })).catch(() => "none");
    throw new Error(`the badge never said ${state}; it says ${now}`);
  }
  return badge.evaluate((b) => ({ text: b.textContent, ...b.dataset }));
}
// the last cell has an output and the kernel is idle again
async function lastCellPrinted() {
  await page.waitForFunction(() => {
    const nb = window.jupyterapp.shell.currentWidget.content;
    return nb.widgets.at(-1).model.outputs.length > 0;
  }, null, { timeout: 2 * MINUTE });
  await kernelIdle(kernelName);
}

try {
  await step("open", async () => {
    await page.goto(`${base}/lab/tree/${notebook}?token=${token}`);
    await page.waitForFunction(() => window.jupyterapp?.shell.currentWidget?.sessionContext?.isReady,
      null, { timeout: 2 * MINUTE });
  });

  await step("choose-kernel", async () => {
    await chooseKernel(page, kernelDisplay, kernelName);
    seen.kernel = await page.evaluate(() => window.jupyterapp.shell.currentWidget.sessionContext.session.kernel.name);
  });

  await step("launcher-logo", async () => {
    // the kernelspec's logo on the launcher's card for the kernel, drawn
    await command("launcher:create");
    const card = page.locator(".jp-LauncherCard", { hasText: kernelDisplay }).first();
    await card.waitFor({ timeout: MINUTE });
    const img = card.locator("img").first();
    await img.waitFor({ timeout: MINUTE });
    await page.waitForFunction((i) => i.complete, await img.elementHandle(), { timeout: MINUTE });
    seen.launcher_logo = await img.evaluate((i) => ({ src: i.getAttribute("src"), width: i.naturalWidth }));
    await command("application:close");
  });

  await step("run-all", async () => {
    await command("notebook:run-all-cells");
    await page.waitForFunction(() => {
      const w = window.jupyterapp.shell.currentWidget;
      const code = w.content.widgets.filter((c) => c.model.type === "code");
      return code.every((c) => c.model.executionCount !== null) && w.sessionContext.kernelDisplayStatus === "idle";
    }, null, { timeout: 5 * MINUTE });
    const all = (await cells()).filter((c) => c.type === "code");
    seen.code_cells = all.length;
    seen.executed = all.filter((c) => c.count !== null).length;
    seen.errors = all.flatMap((c) => c.outputs).filter((o) => o.output_type === "error").map((o) => o.ename);
    seen.png_outputs = all.flatMap((c) => c.outputs).filter((o) => o.data && o.data["image/png"]).length;
    // shown, not only in the model: a rendered image with pixels
    await page.locator(".jp-RenderedImage img").first().scrollIntoViewIfNeeded();
    seen.images_rendered = await page.locator(".jp-RenderedImage img").evaluateAll(
      (imgs) => imgs.filter((i) => i.complete && i.naturalWidth > 0).length);
  });

  await step("typed", async () => {
    // the LooseLeaf extension streams the cell's text as it is typed (20
    // characters a second), so its GPU worker is prepared before Run; after Run
    // the cell's badge says so
    const source = "%%gpu\ntyped = len(x) * 2\nprint(typed)";
    await page.evaluate(() => {
      const nb = window.jupyterapp.shell.currentWidget.content;
      nb.activeCellIndex = nb.widgets.length - 1;
    });
    await command("notebook:insert-cell-below");
    await command("notebook:enter-edit-mode");
    await page.locator(".jp-Notebook .jp-Cell.jp-mod-active .cm-content").waitFor({ timeout: MINUTE });
    // every state the cell's badge goes through, from its first keystroke
    await page.evaluate(() => {
      window.llStates = [];
      const cell = window.jupyterapp.shell.currentWidget.content.activeCell.node;
      new MutationObserver(() => {
        const b = cell.querySelector(".ll-badge");
        if (b?.dataset.state && window.llStates.at(-1) !== b.dataset.state) window.llStates.push(b.dataset.state);
      }).observe(cell, { subtree: true, attributes: true, childList: true });
    });
    await page.keyboard.type(source, { delay: 50 });
    seen.typed_source_equal = await page.evaluate((source) =>
      window.jupyterapp.shell.currentWidget.content.activeCell.model.sharedModel.getSource() === source, source);
    await page.waitForTimeout(3000); // the user reads what they typed
    // its worker is ready before Run, and the badge says where
    seen.typed_ready_badge = await lastBadgeState("ready");
    await shotOfLastCell("typed-ready");
    await command("notebook:run-cell");
    await lastCellPrinted();
    seen.typed_output = (await lastOutputs()).map((o) => o.text || o.ename).join("");
    const badge = page.locator(".jp-Notebook .jp-Cell").last().locator(".ll-badge");
    await badge.waitFor({ timeout: MINUTE });
    seen.typed_badge = await badge.evaluate((b) => ({ text: b.textContent, ...b.dataset }));
    // what the run cost comes once its slot is released, and stays for the next Run
    const costed = page.locator(".jp-Notebook .jp-Cell").last().locator(".ll-badge[data-cost]");
    await costed.waitFor({ timeout: MINUTE });
    seen.typed_cost_badge = await costed.evaluate((b) => ({ text: b.textContent, title: b.title, ...b.dataset }));
    seen.typed_states = await page.evaluate(() => window.llStates);
    await page.screenshot({ path: `${out}/typed.png` });
  });

  await step("into-cpu", async () => {
    // a GPU cell's worker is prepared; the user edits it into a CPU cell: the
    // badge says CPU and that the prepared worker was released
    await page.evaluate(() => {
      const nb = window.jupyterapp.shell.currentWidget.content;
      nb.activeCellIndex = nb.widgets.length - 1;
    });
    await command("notebook:insert-cell-below");
    const setSource = (source) => page.evaluate((source) => {
      window.jupyterapp.shell.currentWidget.content.activeCell.model.sharedModel.setSource(source);
    }, source);
    await setSource("%%gpu\nlater = len(x) * 3\nprint(later)");
    const badge = page.locator(".jp-Notebook .jp-Cell").last().locator(".ll-badge");
    seen.before_cpu_badge = await lastBadgeState("ready");
    await setSource("later = len(x) * 3\nprint(later)");
    seen.cpu_badge = await lastBadgeState("released");
    await shotOfLastCell("into-cpu");
    await command("notebook:run-cell");
    await lastCellPrinted();
    seen.cpu_output = (await lastOutputs()).map((o) => o.text || o.ename).join("");
    await page.waitForFunction(() => {
      const b = document.querySelectorAll(".jp-Notebook .jp-Cell");
      return b[b.length - 1].querySelector(".ll-badge")?.dataset.prepare;
    }, null, { timeout: MINUTE });
    seen.cpu_ran_badge = await badge.evaluate((b) => ({ text: b.textContent, ...b.dataset }));
  });

  await step("side-panel", async () => {
    // the session's totals, in the right sidebar
    await page.locator('.jp-SideBar [data-id="looseleaf-session"]').click();
    const panel = page.locator("#looseleaf-session");
    await panel.locator("tr[data-key='cells']").waitFor({ timeout: MINUTE });
    seen.panel = await panel.evaluate((p) => Object.fromEntries(
      [...p.querySelectorAll("tr")].map((r) => [r.dataset.key, r.cells[1].textContent])));
    await page.screenshot({ path: `${out}/side-panel.png` });
    // the panel's Undo takes back the last cell (it bound `later`)
    await panel.locator("button.ll-undo").click();
    await page.waitForFunction(() => document.querySelector("#looseleaf-session .ll-undo-said")?.textContent,
      null, { timeout: MINUTE });
    seen.panel_undo = await panel.locator(".ll-undo-said").textContent();
    await page.locator('.jp-SideBar [data-id="looseleaf-session"]').click(); // closed again
    await runNewCell("print('later' in dir(), len(x))");
    await lastCellPrinted();
    seen.after_panel_undo = (await lastOutputs()).map((o) => o.text || o.ename).join("");
  });

  await step("pin", async () => {
    // a click on a cell's badge pins it to GPU: kept in the cell's metadata, and
    // the cell (no GPU sign in it) runs on a GPU
    await page.evaluate(() => {
      const nb = window.jupyterapp.shell.currentWidget.content;
      nb.activeCellIndex = nb.widgets.length - 1;
    });
    await command("notebook:insert-cell-below");
    await page.evaluate(() => {
      window.jupyterapp.shell.currentWidget.content.activeCell.model.sharedModel.setSource(
        "pinned = len(x) + 1\nprint(pinned)");
    });
    // JupyterLab's own question about its news, if it is up, would take the click
    await page.locator(".jp-toast-button", { hasText: "No" }).click({ timeout: 5000 }).catch(() => {});
    const badge = page.locator(".jp-Notebook .jp-Cell").last().locator(".ll-badge");
    await badge.click();
    seen.pin_metadata = await page.evaluate(() =>
      window.jupyterapp.shell.currentWidget.content.activeCell.model.getMetadata("looseleaf"));
    await command("notebook:run-cell");
    await lastCellPrinted();
    seen.pinned_output = (await lastOutputs()).map((o) => o.text || o.ename).join("");
    await page.waitForFunction(() => {
      const b = document.querySelectorAll(".jp-Notebook .jp-Cell");
      return b[b.length - 1].querySelector(".ll-badge")?.dataset.prepare;
    }, null, { timeout: MINUTE });
    seen.pinned_badge = await badge.evaluate((b) => ({ text: b.textContent, device: b.dataset.device }));
  });

  await step("interrupt", async () => {
    await runNewCell("import time\nlooping = 1\nprint('looping', flush=True)\nwhile True:\n    time.sleep(0.1)");
    await page.waitForFunction(() => {
      const nb = window.jupyterapp.shell.currentWidget.content;
      return JSON.stringify(nb.widgets.at(-1).model.outputs.toJSON()).includes("looping");
    }, null, { timeout: 2 * MINUTE });
    // the toolbar's interrupt button
    await page.locator('.jp-NotebookPanel-toolbar [data-command="notebook:interrupt-kernel"]').click();
    await kernelIdle(kernelName);
    seen.interrupted = (await lastOutputs()).filter((o) => o.output_type === "error").map((o) => o.ename);
    await runNewCell("print(looping)");
    await lastCellPrinted(); // idle alone may be seen before the cell starts
    seen.after_interrupt = (await lastOutputs()).map((o) => o.text || o.ename).join("");
  });

  await step("widget", async () => {
    // ipywidgets (ADR 33): a slider is drawn, the user moves it with the
    // keyboard, and a later cell reads the value it was moved to
    await runNewCell("import ipywidgets as W\nslider = W.IntSlider(value=3)\nslider");
    const handle = page.locator(".widget-slider .noUi-handle").last();
    await handle.waitFor({ timeout: 2 * MINUTE });
    await kernelIdle(kernelName);
    seen.slider_drawn = await page.locator(".widget-slider").count();
    await handle.focus();
    await page.keyboard.press("ArrowRight");
    await page.keyboard.press("ArrowRight");
    await page.locator(".widget-readout", { hasText: "5" }).last().waitFor({ timeout: MINUTE });
    await kernelIdle(kernelName);
    await runNewCell("print(slider.value)");
    await lastCellPrinted();
    seen.slider_value = (await lastOutputs()).map((o) => o.text || o.ename).join("");
  });

  await step("restart", async () => {
    await command("kernelmenu:restart");
    const dialog = page.locator(".jp-Dialog");
    await dialog.waitFor({ timeout: MINUTE });
    await dialog.locator(".jp-mod-accept").click();
    await kernelIdle(kernelName);
    // a fresh session: what the notebook defined is gone
    await runNewCell("print(looping)");
    await lastCellPrinted();
    seen.after_restart = (await lastOutputs()).map((o) => o.ename || o.text).join("");
  });

  await step("culled", async () => {
    // Jupyter Server's culler (MappingKernelManager.cull_idle_timeout) shuts the
    // idle kernel down; the notebook, opened again, gets a new kernel that
    // resumes its session: its variables are there
    await runNewCell("culled_x = 41");
    await page.waitForFunction(() => {
      const nb = window.jupyterapp.shell.currentWidget.content;
      return nb.widgets.at(-1).model.executionCount !== null;
    }, null, { timeout: 2 * MINUTE });
    await kernelIdle(kernelName);
    // saved (with its kernel) before the page goes: the server opens it again from disk
    await page.evaluate(() => window.jupyterapp.commands.execute("docmanager:save"));
    await page.waitForFunction(() => !window.jupyterapp.shell.currentWidget.context.model.dirty,
      null, { timeout: MINUTE });
    const id = await page.evaluate(() => window.jupyterapp.shell.currentWidget.sessionContext.session.kernel.id);
    // the laptop closed: no client is connected (Jupyter culls only those)
    await page.goto("about:blank");
    const deadline = Date.now() + 3 * MINUTE;
    for (;;) {
      const kernels = await (await fetch(`${base}/api/kernels?token=${token}`)).json();
      if (!kernels.some((k) => k.id === id)) break;
      if (Date.now() > deadline) throw new Error(`the kernel was never culled: ${JSON.stringify(kernels)}`);
      await new Promise((r) => setTimeout(r, 1000));
    }
    seen.culled = true;
    await page.goto(`${base}/lab/tree/${notebook}?token=${token}`);
    await page.waitForFunction(() => window.jupyterapp?.shell.currentWidget?.sessionContext?.isReady,
      null, { timeout: 2 * MINUTE });
    await kernelIdle(kernelName);
    await runNewCell("print(culled_x + 1)");
    await lastCellPrinted();
    seen.after_cull = (await lastOutputs()).map((o) => o.text || o.ename).join("");
  });
} finally {
  await page.screenshot({ path: `${out}/last.png` }).catch(() => {});
  await browser.close();
}
console.log(JSON.stringify(seen));
