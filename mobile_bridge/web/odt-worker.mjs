// The browser client in a Web Worker, so that training never blocks the page (see WorkerClient
// in odt-web.mjs, which starts and drives it). Messages: { id, op, args } in; { id, value } or
// { id, error } out, and { id, progress } while `fit` runs. Weights leave by transfer (no copy).
import { OdtClient } from "./odt-web.mjs";

let client = null;

const ops = {
  async load(ortUrl, wasmPaths, numThreads, baseUrl, options) {
    const ort = await import(ortUrl);
    ort.env.wasm.wasmPaths = wasmPaths;
    ort.env.wasm.numThreads = numThreads; // ORT falls back to 1 unless the page is cross-origin isolated
    client = await OdtClient.load(ort, baseUrl, options);
    return { value: { description: client.description, engineName: client.engineName,
                      executionProvider: client.executionProvider, threads: ort.env.wasm.numThreads,
                      isolated: self.crossOriginIsolated } };
  },
  async trainStep(_id, batch, size) {
    return { value: await client.trainStep(batch, size) };
  },
  async fit(id, data, count, options) {
    const onProgress = (progress) => self.postMessage({ id, progress });
    const losses = await client.fit(data, count, { ...options, onProgress });
    return { value: { losses, lastEpoch: client.lastEpoch } };
  },
  async getWeights() {
    const weights = await client.getWeights();
    return { value: weights, transfer: [weights.buffer] };
  },
  async setWeights(_id, weights) {
    await client.setWeights(weights);
    return { value: null };
  },
  async setLearningRate(_id, lr) {
    client.setLearningRate(lr);
    return { value: null };
  },
  async saveState(_id, key) {
    await client.saveState(key);
    return { value: null };
  },
  async restoreState(_id, key) {
    await client.restoreState(key);
    return { value: null };
  },
};

self.onmessage = async ({ data: { id, op, args } }) => {
  try {
    if (!(op in ops)) throw new Error(`unknown operation ${op}`);
    if (op !== "load" && client === null) throw new Error("the worker has no bundle loaded yet");
    const { value, transfer = [] } = await (op === "load" ? ops.load(...args) : ops[op](id, ...args));
    self.postMessage({ id, value }, transfer);
  } catch (error) {
    self.postMessage({ id, error: { name: error.name, message: error.message } });
  }
};
