// Run a function of the browser client in headless Chromium and print its JSON result.
//   node tools/run-in-browser.mjs URL TASK.json
// The page at URL must serve odt-web.mjs at /odt-web.mjs and onnxruntime-web's dist at /ort/.
import { readFileSync } from "node:fs";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { chromium } from "playwright-core";

const [url, taskPath] = process.argv.slice(2);
const task = JSON.parse(readFileSync(taskPath, "utf8"));
const profile = mkdtempSync(join(tmpdir(), "odt-chromium-"));
const context = await chromium.launchPersistentContext(profile, {
  executablePath: process.env.CHROMIUM ?? "/usr/bin/chromium",
  headless: true,
  // WebGPU: Chromium offers an adapter only with --enable-unsafe-webgpu here (SwiftShader, software).
  args: ["--no-sandbox", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync",
         ...(task.webgpu ? ["--enable-unsafe-webgpu"] : ["--disable-gpu"])],
});
try {
  const page = await context.newPage();
  page.on("console", (message) => process.stderr.write(`[browser] ${message.text()}\n`));
  await page.goto(url);
  if (task.click || task.clicks) {
    // Drive the demo page like a person: (choose a file,) click, wait for the status line; repeat.
    if (task.name) await page.fill("#name", task.name);
    if (task.enrolment) await page.fill("#enrolment", task.enrolment);
    if (task.file) await page.setInputFiles("#file", task.file);
    const statuses = [];
    for (const selector of task.clicks ?? [task.click]) {
      await page.evaluate(() => { document.getElementById("status").textContent = "clicked"; });
      await page.click(selector);
      await page.waitForFunction(() => /^(done|error)/.test(document.getElementById("status").textContent), null,
                                 { timeout: task.timeoutMs ?? 120000 });
      statuses.push(await page.textContent("#status"));
    }
    if (task.screenshot) await page.screenshot({ path: task.screenshot, fullPage: true });
    const losses = await page.evaluate(() => window.losses);
    process.stdout.write(JSON.stringify({ ok: statuses.every((s) => s === "done"), status: statuses.at(-1), statuses,
                                          losses, log: await page.textContent("#log") }));
    process.exit(0);
  }
  const run = async (task) => {
    // Two SecureRound nodes through share_keys; node 2 then gets `token` as node 1's shares: the sources
    // it rejects, and node 1's proof (the one-off key of its real ciphertext to node 2, with its public key).
    async function forgedShares(s, token) {
      const [one, two] = [new s.SecureRound(), new s.SecureRound()];
      const setup = { stage: "setup", sample_num: 2, share_num: 2, threshold: 2, clipping_range: 4,
                      target_range: 2 ** 20, mod_range: 2 ** 32, max_weight: 1000 };
      const keys = [];
      for (const [node, round] of [["1", one], ["2", two]]) {
        const answer = await round.answer({ ...setup, node });
        keys.push([node, answer.pk1, answer.pk2]);
      }
      const sent = await one.answer({ stage: "share_keys", node: "1", keys });
      await two.answer({ stage: "share_keys", node: "2", keys });
      const collect = { stage: "collect_masked_vectors", node: "2", sources: ["1"], ciphertexts: [s.toBase64(token)],
                        ephemeral: sent.ephemeral, order: [[0, 2]], clipping_norm: null };
      await two.collect(collect, new Float32Array(2), new Float32Array(2), 10);
      return { rejected: two.rejected, secret: one.prove({ accusers: ["2"] }).secrets[0], ephemeral: sent.ephemeral[0],
               again: (() => { try { return one.prove({ accusers: ["2"] }); } catch (error) { return error.name; } })() };
    }
    if (task.secagg) {
      // The SecAgg+ primitives against Flower's Python ones: inputs and outputs as base64.
      const s = await import("/odt-secagg.mjs");
      const b = (text) => s.fromBase64(text);
      const e = (bytes) => s.toBase64(bytes);
      const t = task.secagg;
      const pair = await s.generateKeyPair();
      const again = await s.importPrivateKey(pair.privatePem); // a key rebuilt from its PEM (as from shares)
      return {
        ok: true,
        masks: t.seeds.map((seed) => s.masks(b(seed), t.range, t.shapes).map((m) => Array.from(m))),
        publicPem: e(pair.publicPem),
        privatePem: e(pair.privatePem),
        shared: e(await s.sharedKey(pair.privateKey, b(t.publicPem))),
        sharedAgain: e(await s.sharedKey(again, b(t.publicPem))),
        token: e(await s.fernetEncrypt(b(t.fernetKey), b(t.plaintext))),
        decrypted: e(await s.fernetDecrypt(b(t.fernetKey), b(t.pythonToken))),
        shares: s.createShares(b(t.secret), t.threshold, t.count).map(e),
        combined: e(s.combineShares(t.pythonShares.map(b))),
        forged: await forgedShares(s, b(t.forgedToken)),
      };
    }
    if (task.secureRound) {
      // A SecAgg+ round of `nodes` SecureRound clients in this page (all in one group): each node's
      // seconds per stage, for the benchmark (benchmarks/secure.py).
      const s = await import("/odt-secagg.mjs");
      const { nodes: count, size } = task.secureRound;
      const ids = Array.from({ length: count }, (_, i) => String(1000 + i));
      const rounds = ids.map(() => new s.SecureRound());
      const seconds = { setup: [], share_keys: [], collect_masked_vectors: [], unmask: [] };
      const timed = async (stage, i, work) => {
        const t0 = performance.now();
        const value = await work();
        seconds[stage][i] = (performance.now() - t0) / 1000;
        return value;
      };
      const setup = { stage: "setup", sample_num: count, share_num: count, threshold: Math.ceil(count / 2),
                      clipping_range: 4, target_range: 2 ** 22, mod_range: 2 ** 32, max_weight: 1000 };
      const keys = [];
      for (let i = 0; i < count; i++) {
        const answer = await timed("setup", i, () => rounds[i].answer({ ...setup, node: ids[i] }));
        keys.push([ids[i], answer.pk1, answer.pk2]);
      }
      const inbox = new Map(ids.map((id) => [id, { sources: [], ciphertexts: [], ephemeral: [] }]));
      for (let i = 0; i < count; i++) {
        const answer = await timed("share_keys", i, () => rounds[i].answer({ stage: "share_keys", node: ids[i], keys }));
        answer.destinations.forEach((to, k) => {
          inbox.get(to).sources.push(ids[i]);
          inbox.get(to).ciphertexts.push(answer.ciphertexts[k]);
          inbox.get(to).ephemeral.push(answer.ephemeral[k]);
        });
      }
      const start = new Float32Array(size).map((_, k) => Math.sin(k));
      const trained = start.map((v, k) => v + 0.01 * Math.cos(k));
      for (let i = 0; i < count; i++) {
        const stage = { stage: "collect_masked_vectors", node: ids[i], ...inbox.get(ids[i]), order: [[0, size]],
                        clipping_norm: null };
        await timed("collect_masked_vectors", i, () => rounds[i].collect(stage, start, trained, 100));
        if (rounds[i].rejected.length) throw new Error(`node ${ids[i]} rejected the shares of ${rounds[i].rejected}`);
      }
      for (let i = 0; i < count; i++) {
        await timed("unmask", i, () => rounds[i].answer({ stage: "unmask", node: ids[i], active: ids, dead: [] }));
      }
      return { ok: true, seconds };
    }
    if (task.providers) {
      // One model on WASM and on WebGPU (onnxruntime-web's WebGPU build), the same feeds: every output of both.
      const ort = await import("/ort/ort.min.mjs");
      ort.env.wasm.wasmPaths = "/ort/";
      ort.env.wasm.numThreads = 1;
      const arrays = { int64: (d) => BigInt64Array.from(d.map(BigInt)), float32: (d) => Float32Array.from(d) };
      const outputs = {};
      for (const ep of ["wasm", "webgpu"]) {
        const session = await ort.InferenceSession.create(task.providers.url, { executionProviders: [ep] });
        const feeds = Object.fromEntries(Object.entries(task.providers.feeds).map(
          ([name, f]) => [name, new ort.Tensor(f.dtype, arrays[f.dtype](f.data), f.shape)]));
        const results = await session.run(feeds);
        outputs[ep] = Object.fromEntries(Object.entries(results).map(([name, t]) => [name, Array.from(t.data, Number)]));
      }
      return { ok: true, outputs, adapter: !!(await navigator.gpu?.requestAdapter?.()) };
    }
    const ortBase = task.ortBase ?? "/ort/";
    // The current build runs the portable graphs (its WebGPU build for `"provider": "webgpu"`); `"build":
    // "training"` takes 1.19.2's training build (classic graphs).
    const file = task.build === "training" ? "ort.training.wasm.min.mjs" : task.provider === "webgpu" ? "ort.min.mjs"
      : "ort.wasm.min.mjs";
    const ortModule = `${ortBase}${file}`;
    const ort = await import(ortModule);
    ort.env.wasm.wasmPaths = ortBase;
    // Threads need a cross-origin isolated page (COOP/COEP headers); ORT falls back to 1 without.
    ort.env.wasm.numThreads = task.threads ?? 1;
    if (task.kernel) {
      // One operator's speed alone: an inference session over a one-node model, each run timed.
      const k = task.kernel;
      const session = await ort.InferenceSession.create(k.url, { executionProviders: ["wasm"] });
      const feeds = {};
      for (const [name, dims] of Object.entries(k.inputs)) {
        const data = new Float32Array(dims.reduce((a, b) => a * b, 1)).map((_, i) => ((i * 7919) % 1000) / 1000 - 0.5);
        feeds[name] = new ort.Tensor("float32", data, dims);
      }
      const times = [];
      for (let i = 0; i < k.runs; i++) {
        const t = performance.now();
        await session.run(feeds);
        times.push(performance.now() - t);
      }
      await session.release();
      return { ok: true, times, isolated: self.crossOriginIsolated, threads: ort.env.wasm.numThreads };
    }
    const odt = await import(task.module ?? "/odt-web.mjs");
    if (task.bridge) {
      // One device's round (plain or secure): register, load the bundle, then BridgeClient.joinRound.
      const b = task.bridge;
      const device = await odt.BridgeClient.register(location.origin, b.name, b.enrolment ?? "");
      const client = await device.loadBundle(ort, { publicKeyPem: task.publicKeyPem ?? null });
      const data = { input: Float32Array.from(b.input), labels: BigInt64Array.from(b.labels.map(BigInt)) };
      const count = b.labels.length;
      let losses = [];
      const round = await device.joinRound(client, async (job) => {
        await client.setWeights(job.weights);
        const epochs = odt.localEpochs(job.config, count);
        losses = await client.fit(data, count, { epochs, batchSize: Number(job.config["batch-size"] ?? 32) });
        const epoch = client.lastEpoch;
        return { count, metrics: {
          "train-loss": losses[losses.length - 1],
          "train-accuracy": epoch.seen ? epoch.correct / epoch.seen : 0,
          "skipped-steps": epoch.skipped,
        } };
      }, { timeoutMs: b.timeoutMs ?? 120000 });
      const weights = await client.getWeights();
      return { ok: true, round: round.round, secure: round.secure, losses, weights: Array.from(weights) };
    }
    const t0 = performance.now();
    try {
      const options = { publicKeyPem: task.publicKeyPem ?? null, executionProvider: task.provider ?? "wasm" };
      const client = task.worker  // the same client in a Web Worker
        ? await odt.WorkerClient.load("/bundle/", { ...options, ortUrl: ortModule, wasmPaths: ortBase,
                                                    numThreads: task.threads ?? 1 })
        : await odt.OdtClient.load(ort, "/bundle/", options);
      const loaded = performance.now() - t0;
      if (task.weights) await client.setWeights(Float32Array.from(task.weights));
      if (task.corrupt) {
        // Flip one byte of a saved state in IndexedDB (as a failing disk or a meddling script would).
        await new Promise((resolve, reject) => {
          const open = indexedDB.open("odt-state", 1);
          open.onsuccess = () => {
            const store = open.result.transaction("states", "readwrite").objectStore("states");
            const get = store.get(task.corrupt);
            get.onsuccess = () => {
              const record = get.result;
              record.bytes[record.bytes.length - 1] ^= 1;
              store.put(record, task.corrupt).onsuccess = resolve;
            };
          };
          open.onerror = reject;
        });
      }
      if (task.restore) await client.restoreState(task.restore);
      const initial = Array.from(await client.getWeights());
      const losses = [];
      const stepTimes = [];
      const appliedSteps = [];
      // The page's responsiveness while it trains: the longest gap between ticks of a 4 ms timer.
      const ticks = [performance.now()];
      const timer = setInterval(() => ticks.push(performance.now()), 4);
      const typed = (step) => {
        const batch = {};
        for (const spec of client.specs) {
          const Array_ = spec.dtype === "int64" ? BigInt64Array : Float32Array;
          batch[spec.name] = spec.dtype === "int64" ? Array_.from(step[spec.name].map(BigInt)) : Array_.from(step[spec.name]);
        }
        return batch;
      };
      for (const step of task.steps ?? []) {
        const batch = typed(step);
        if (step.lr !== undefined) await client.setLearningRate(step.lr); // a rate change before this step
        const s0 = performance.now();
        const { loss, applied } = await client.trainStep(batch, step.size);
        appliedSteps.push(applied);
        stepTimes.push(performance.now() - s0);
        if (stepTimes.length === 1) task.sinceOpenMs = performance.now(); // ms since the page's navigation began
        losses.push(loss);
      }
      await new Promise((resolve) => setTimeout(resolve, 10));
      clearInterval(timer);
      ticks.push(performance.now());
      const longestStallMs = Math.max(...ticks.slice(1).map((t, i) => t - ticks[i]));
      if (task.save) await client.saveState(task.save);
      let badInput = null;
      if (task.badInput) {
        try {  // true: a float64 array for digits; or a step of its own (JSON, typed as the steps are)
          const bad = task.badInput === true ? { input: new Float64Array(4), labels: new BigInt64Array(1) } : typed(task.badInput);
          await client.trainStep(bad, task.badInput.size ?? 1);
        } catch (error) {
          badInput = `${error.name}: ${error.message}`;
        }
      }
      return { ok: true, loadMs: loaded, longestStallMs, firstStepMs: stepTimes[0] ?? null, sinceOpenMs: task.sinceOpenMs ?? null, stepTimes, losses,
               applied: appliedSteps, engine: client.engineName,
               provider: client.executionProvider, adapter: !!(await navigator.gpu?.requestAdapter?.()), isolated: self.crossOriginIsolated, threads: client.threads ?? ort.env.wasm.numThreads,
               initial, weights: Array.from(await client.getWeights()), badInput,
               parts: task.parts ? client.partSize(task.parts) : null };
    } catch (error) {
      return { ok: false, error: `${error.name}: ${error.message}` };
    }
  };
  let result;
  if (task.reloadAfter) {
    // Train, save the state, reload the page (a fresh client from the bundle), restore it, train on.
    const key = "resume";
    const first = await page.evaluate(run, { ...task, steps: task.steps.slice(0, task.reloadAfter), save: key });
    await page.reload();
    const second = await page.evaluate(run, { ...task, steps: task.steps.slice(task.reloadAfter), restore: key,
                                              corrupt: task.corruptOnReload ? key : undefined });
    result = { ...second, ok: first.ok && second.ok, error: first.error ?? second.error, initial: first.initial,
               saved: first.weights, restored: second.initial, losses: [...(first.losses ?? []), ...(second.losses ?? [])] };
  } else {
    result = await page.evaluate(run, task);
  }
  process.stdout.write(JSON.stringify(result));
} finally {
  await context.close();
  rmSync(profile, { recursive: true, force: true });
}
