// What the browser drivers share (tests/browser/*.mjs, bench/lib/jupyterlab_bench.mjs):
// their environment, headless Chromium with the flags our machines need, steps
// that leave a screenshot when they fail, and JupyterLab's kernel dialog.
import { chromium } from "playwright-core";

export const MINUTE = 60_000;

export function env(name) {
  const v = process.env[name];
  if (!v) throw new Error(`${name} is not set`);
  return v;
}

/** Chromium ($CHROMIUM) and a page of `viewport`; Playwright gives it a fresh profile. */
export async function launch(viewport) {
  const browser = await chromium.launch({
    executablePath: env("CHROMIUM"),
    headless: true,
    args: ["--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
      "--disable-component-update", "--disable-sync"],
  });
  const page = await browser.newPage({ viewport });
  return { browser, page };
}

/** `step(name, fn)`: runs fn; if it throws, a screenshot `out/name.png` is kept. */
export function stepper(page, out) {
  return async function step(name, fn) {
    try {
      return await fn();
    } catch (e) {
      await page.screenshot({ path: `${out}/${name}.png` }).catch(() => {});
      throw new Error(`step ${name}: ${e.message}`);
    }
  };
}

/** The open notebook's kernel is `name` and idle. */
export function kernelIdle(page, name, timeout = 2 * MINUTE) {
  return page.waitForFunction((name) => {
    const ctx = window.jupyterapp.shell.currentWidget?.sessionContext;
    return ctx?.session?.kernel?.name === name && ctx.kernelDisplayStatus === "idle";
  }, name, { timeout });
}

/** Choose kernel `display` in the dialog a user opens from the notebook's toolbar. */
export async function chooseKernel(page, display, name) {
  await page.evaluate(() => { window.jupyterapp.commands.execute("notebook:change-kernel"); });
  const dialog = page.locator(".jp-Dialog");
  await dialog.waitFor({ timeout: MINUTE });
  await dialog.locator("select").selectOption({ label: display });
  await dialog.locator(".jp-mod-accept").click();
  await kernelIdle(page, name);
}
