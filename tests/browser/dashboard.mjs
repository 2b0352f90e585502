// Watch LooseLeaf's dashboard in headless Chromium as an operator would: it shows
// the host's slots, the session and its execution; then, without a reload, the
// next execution appears. Prints one JSON line per stage; tests/dashboard.rs
// drives the cells between them. Leaves a screenshot of the page in $OUT.
//
// Environment: DASHBOARD_URL, SESSION (its id), FIRST_EXEC, CHROMIUM, OUT.
// Reads the second execution's id from stdin once it printed stage "first".
import { createInterface } from "node:readline";
import { env, launch, MINUTE } from "./common.mjs";

const [url, session, firstExec, out] = ["DASHBOARD_URL", "SESSION", "FIRST_EXEC", "OUT"].map(env);
const input = createInterface({ input: process.stdin });
const lines = input[Symbol.asyncIterator]();

const { browser, page } = await launch({ width: 1300, height: 900 });
page.setDefaultTimeout(2 * MINUTE);
const errors = [];
page.on("pageerror", (e) => errors.push(e.message));

// what the page shows of execution `exec`: its row's cells, or null
const row = (exec) => page.evaluate((exec) => {
  const tr = document.querySelector(`tr[data-exec="${exec}"]`);
  return tr ? [...tr.cells].map((c) => c.textContent) : null;
}, exec);
const seen = async () => ({
  session_shown: await page.evaluate((s) => !!document.querySelector(`tr[data-session="${s}"]`), session),
  slots: await page.$$eval(".host .slot", (els) => els.map((e) => e.textContent)),
  status: await page.textContent("#status"),
});

try {
  await page.goto(url);
  await page.waitForFunction((exec) => {
    const tr = document.querySelector(`tr[data-exec="${exec}"]`);
    // the slot is free again once the host's next status says so
    return tr && tr.cells[7].textContent === "ok" && document.querySelector(".host .slot.free");
  }, firstExec);
  console.log(JSON.stringify({ stage: "first", row: await row(firstExec), ...(await seen()) }));

  const second = (await lines.next()).value.trim();
  await page.waitForFunction((exec) => {
    const tr = document.querySelector(`tr[data-exec="${exec}"]`);
    return tr && tr.cells[7].textContent === "ok";
  }, second);
  // for a person to look at; a browser slow to draw (fonts cached on first use)
  // does not fail what the page showed
  const shot = await page.screenshot({ path: `${out}/dashboard.png`, fullPage: true })
    .then(() => null, (e) => e.message);
  const rows = await page.$$eval("#executions tbody tr", (trs) => trs.length);
  console.log(JSON.stringify({
    stage: "second", row: await row(second), rows, reloaded: false, errors, screenshot_error: shot, ...(await seen()),
    used: await page.textContent("#used"), pinned: await page.textContent("#pinned"),
  }));
} catch (e) {
  await page.screenshot({ path: `${out}/dashboard-failed.png`, fullPage: true }).catch(() => {});
  console.error(`dashboard: ${e.message}; page errors: ${errors.join("; ")}`);
  process.exitCode = 1;
} finally {
  await browser.close();
  input.close(); // stdin would keep node running
}
