// JupyterHub in headless Chromium, as its users would (tests/jupyterhub.rs):
// alice and bob each log in to the Hub, start their server, open NOTEBOOK (on
// the LooseLeaf kernel) in their JupyterLab and run it; then they, and the Hub's
// admin `hubadmin`, open the LooseLeaf frontend's dashboard, which logs them in
// through the Hub's OAuth. Prints one JSON line: per user, the kernel, the
// cell's output, the users the dashboard's sessions belong to, and the Hub token
// the dashboard was given. A step that fails leaves a screenshot in $OUT.
//
// Environment: HUB_URL, FRONTEND_URL, PASSWORD, NOTEBOOK, KERNEL_NAME, CHROMIUM, OUT.
import { env, kernelIdle, launch, MINUTE, stepper } from "./common.mjs";

const [hub, frontend, password, notebook, kernelName, out] = [
  "HUB_URL", "FRONTEND_URL", "PASSWORD", "NOTEBOOK", "KERNEL_NAME", "OUT",
].map(env);
const { browser } = await launch({ width: 1200, height: 900 });
const seen = {};

// A fresh browser profile (its own cookies) logged in to the Hub as `user`.
async function loggedIn(user) {
  const context = await browser.newContext({ viewport: { width: 1200, height: 900 } });
  const page = await context.newPage();
  page.setDefaultTimeout(2 * MINUTE);
  const step = stepper(page, out);
  await step(`${user}-login`, async () => {
    await page.goto(`${hub}/hub/login?next=${encodeURIComponent("/hub/home")}`);
    await page.locator("input[name=username]").fill(user);
    await page.locator("input[name=password]").fill(password);
    await page.locator("input[type=submit], button[type=submit]").first().click();
    await page.waitForURL(/\/hub\/home/, { timeout: MINUTE });
  });
  return { page, step };
}

// The users the dashboard's sessions table names, once it lists `atLeast` rows.
async function dashboardUsers(page, step, who, atLeast) {
  return step(`${who}-dashboard`, async () => {
    await page.goto(`${frontend}/`);
    // not logged in: the page sends the browser through the Hub's OAuth and back
    await page.waitForFunction((n) => document.querySelectorAll("#sessions tbody tr").length >= n,
      atLeast, { timeout: MINUTE });
    const users = await page.locator("#sessions tbody tr td:nth-child(2)").allTextContents();
    const token = await page.evaluate(() => sessionStorage.getItem("looseleaf-token"));
    return { users, token };
  });
}

try {
  for (const user of ["alice", "bob"]) {
    const { page, step } = await loggedIn(user);
    const mine = (seen[user] = {});
    await step(`${user}-spawn`, async () => {
      // the spawn page starts the server, then goes on to the notebook
      const next = `/user/${user}/lab/tree/${notebook}`;
      await page.goto(`${hub}/hub/spawn/${user}?next=${encodeURIComponent(next)}`);
      await page.waitForFunction(() => window.jupyterapp?.shell.currentWidget?.sessionContext?.isReady,
        null, { timeout: 3 * MINUTE });
      await kernelIdle(page, kernelName);
      mine.kernel = await page.evaluate(() => window.jupyterapp.shell.currentWidget.sessionContext.session.kernel.name);
    });
    await step(`${user}-run`, async () => {
      await page.evaluate(() => window.jupyterapp.commands.execute("notebook:run-all-cells"));
      await page.waitForFunction(() => {
        const nb = window.jupyterapp.shell.currentWidget.content;
        return nb.widgets[0].model.outputs.length > 0;
      }, null, { timeout: 2 * MINUTE });
      await kernelIdle(page, kernelName);
      mine.output = await page.evaluate(() => {
        const outputs = window.jupyterapp.shell.currentWidget.content.widgets[0].model.outputs.toJSON();
        return outputs.map((o) => o.text ?? o.ename ?? "").join("");
      });
    });
    const { users, token } = await dashboardUsers(page, step, user, 1);
    Object.assign(mine, { dashboard_users: users, token });
  }
  const { page, step } = await loggedIn("hubadmin");
  const { users } = await dashboardUsers(page, step, "hubadmin", 2);
  seen.hubadmin = { dashboard_users: users };
  console.log(JSON.stringify(seen));
} finally {
  await browser.close();
}
