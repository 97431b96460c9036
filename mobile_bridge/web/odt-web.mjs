// Browser client for ondevice-training bundles. It trains on either onnxruntime-web build it is given:
// the current one (1.30: plain inference sessions over the bundle's portable step graphs, the parameters
// and optimizer state owned here) or 1.19.2's training build (TrainingSession over the classic graphs).
//
//   const ort = await import("/ort/ort.wasm.min.mjs");          // or /ort/ort.training.wasm.min.mjs
//   const client = await OdtClient.load(ort, "/bundle/", { publicKeyPem });
//   await client.fit({ input: Float32Array, labels: BigInt64Array }, { epochs: 1, batchSize: 32, onProgress });
//   const weights = await client.getWeights();   // Float32Array in manifest order
//   await client.setWeights(weights);
//   client.setLearningRate(1e-3);                // portable: the rate is an input (else the bundle's schedule)
//   await client.saveState("digits");            // portable: parameters, moments and step, checksummed, in IndexedDB
//   await client.restoreState("digits");         // after a page reload, say
//
// Or the same client in a Web Worker, so that training never blocks the page:
//
//   const client = await WorkerClient.load("/bundle/", { ortUrl: "/ort/ort.wasm.min.mjs", wasmPaths: "/ort/" });
//
// Every check happens before ORT sees the data: ORT web reports bad dtypes or shapes as bare numbers.
//
// A device in federated rounds behind the bridge (plain or secure rounds alike):
//
//   const device = await BridgeClient.register(base, "phone-7", code);
//   await device.joinRound(client, async (task) => { await client.setWeights(task.weights); ...; return { count, metrics }; });

import { SecAggError, SecureRound } from "./odt-secagg.mjs";

export class BundleError extends Error {
  constructor(message) {
    super(message);
    this.name = "BundleError";
  }
}

export class InputError extends Error {
  constructor(message) {
    super(message);
    this.name = "InputError";
  }
}

const CLASSIC_FILES = ["training_model.onnx", "eval_model.onnx", "optimizer_model.onnx", "checkpoint"];
const SCHEMA_FILE = "manifest.schema.json";
const ARRAYS = { float32: Float32Array, int64: BigInt64Array, int32: Int32Array };
const FROZEN_ARRAYS = { float32: Float32Array, int8: Int8Array }; // parameters.bin's frozen arrays (an int8 base)

async function fetchBytes(url, headers = {}) {
  // Revalidated, never taken from the HTTP cache as is: a bundle rebuilt at the same URL would fail its hashes.
  const response = await fetch(url, { headers, cache: "no-cache" });
  if (!response.ok) throw new BundleError(`cannot fetch ${url}: HTTP ${response.status}`);
  return new Uint8Array(await response.arrayBuffer());
}

async function sha256Hex(bytes) {
  const digest = new Uint8Array(await crypto.subtle.digest("SHA-256", bytes));
  return Array.from(digest, (b) => b.toString(16).padStart(2, "0")).join("");
}

function pemToBytes(pem) {
  const body = pem.replace(/-----(BEGIN|END) PUBLIC KEY-----/g, "").replace(/\s+/g, "");
  return Uint8Array.from(atob(body), (c) => c.charCodeAt(0));
}

/** Verify bundle.json against bundle.sig with an Ed25519 public key (PEM, SubjectPublicKeyInfo). */
export async function verifySignature(descriptionBytes, signatureBytes, publicKeyPem) {
  let key;
  try {
    key = await crypto.subtle.importKey("spki", pemToBytes(publicKeyPem), { name: "Ed25519" }, false, ["verify"]);
  } catch (error) {
    throw new BundleError(`the public key is not an Ed25519 PEM key (${error.message})`);
  }
  const ok = await crypto.subtle.verify({ name: "Ed25519" }, key, signatureBytes, descriptionBytes);
  if (!ok) throw new BundleError("the bundle's signature does not match: altered after signing or signed with another key");
}

// The manifest's JSON Schema (shipped in every bundle, hashed like its other files) describes
// bundle.json as #/$defs/bundle. These are the same few keywords, and the same messages, as
// ondevice/schema.py's interpreter; a browser test checks that both refuse the same damage alike.
const TYPES = { object: "an object", array: "a list", string: "a string", integer: "an integer", number: "a number",
  boolean: "true or false", null: "null" };

class SchemaProblem extends Error {
  constructor(where, expected, found) {
    super(`${where || "the document"} must be ${expected}`);
    Object.assign(this, { where: where || "the document", expected, found });
  }
}

/** The first place where `value` breaks `node` (whose $refs point into `defs`), or null. */
export function conforms(value, node, defs) {
  try {
    check(value, node, "", defs);
  } catch (error) {
    if (error instanceof SchemaProblem) return error;
    throw error;
  }
  return null;
}

const resolve = (ref, defs) => defs[ref.replace("#/$defs/", "")];
const join = (where, key) => (where ? `${where}.${key}` : key);
const canonical = (v) => (v !== null && typeof v === "object" && !Array.isArray(v)
  ? `{${Object.keys(v).sort().map((k) => `${JSON.stringify(k)}:${canonical(v[k])}`).join(",")}}`
  : Array.isArray(v) ? `[${v.map(canonical).join(",")}]` : JSON.stringify(v));

function phrase(node, defs) {
  if ("title" in node) return node.title;
  if ("$ref" in node) return phrase(resolve(node.$ref, defs), defs);
  if ("enum" in node) return `one of [${node.enum.map((e) => `'${e}'`).join(", ")}]`;
  if ("const" in node) return JSON.stringify(node.const);
  if ("anyOf" in node) return node.anyOf.map((b) => phrase(b, defs)).join(" or ");
  let words = TYPES[node.type] ?? "a valid value";
  if ("minimum" in node) words += ` >= ${node.minimum}`;
  if ("exclusiveMinimum" in node) words += ` > ${node.exclusiveMinimum}`;
  return words;
}

function isType(value, kind) {
  if (kind === "integer") return Number.isInteger(value);
  if (kind === "number") return typeof value === "number" && Number.isFinite(value);
  if (kind === "object") return value !== null && typeof value === "object" && !Array.isArray(value);
  if (kind === "array") return Array.isArray(value);
  if (kind === "null") return value === null;
  return typeof value === kind;
}

function admits(node, value, defs) {
  const typed = "$ref" in node && !("type" in node) ? resolve(node.$ref, defs) : node;
  return !("type" in typed) || isType(value, typed.type);
}

function check(value, node, where, defs) {
  const fail = (expected) => {
    throw new SchemaProblem(where, node.title ?? expected ?? phrase(node, defs), value);
  };
  if ("$ref" in node) check(value, resolve(node.$ref, defs), where, defs);
  if ("anyOf" in node && node.anyOf.every((branch) => conforms(value, branch, defs) !== null)) {
    const typed = node.anyOf.filter((branch) => admits(branch, value, defs));
    if (typed.length === 1) check(value, typed[0], where, defs); // null or an object, and it is an object: say what is wrong inside it
    fail();
  }
  if ("type" in node && !isType(value, node.type)) fail();
  if ("const" in node && value !== node.const) fail();
  if ("enum" in node && !node.enum.includes(value)) fail();
  if (typeof value === "number" && (value < (node.minimum ?? -Infinity) || value <= (node.exclusiveMinimum ?? -Infinity))) fail();
  if (typeof value === "string" && (value.length < (node.minLength ?? 0) || ("pattern" in node && !new RegExp(node.pattern, "u").test(value)))) fail();
  if (isType(value, "object")) {
    const properties = node.properties ?? {};
    for (const key of node.required ?? []) {
      if (key in value) continue;
      if (key in properties) throw new SchemaProblem(join(where, key), phrase(properties[key], defs), "nothing");
      fail(`an object with '${key}'`);
    }
    if (Object.keys(value).length < (node.minProperties ?? 0)) fail();
    for (const [key, item] of Object.entries(value)) {
      if ("propertyNames" in node) check(key, node.propertyNames, `${where}['${key}']`, defs);
      if (key in properties) check(item, properties[key], join(where, key), defs);
      else if ("additionalProperties" in node) check(item, node.additionalProperties, `${where}['${key}']`, defs);
    }
  }
  if (Array.isArray(value)) {
    if (value.length < (node.minItems ?? 0)) fail();
    if (node.uniqueItems && new Set(value.map(canonical)).size !== value.length) fail();
    const prefix = node.prefixItems ?? [];
    value.forEach((item, i) => {
      const child = i < prefix.length ? prefix[i] : node.items;
      if (child !== undefined) check(item, child, `${where}[${i}]`, defs);
    });
  }
}

/** Check a bundle description against the schema the bundle carries (its bytes hashed in bundle.json). */
export function checkDescription(description, schema) {
  const problem = conforms(description, { $ref: "#/$defs/bundle" }, schema.$defs);
  if (problem) {
    throw new BundleError(`bundle.json: ${problem.where} must be ${problem.expected}, found ${JSON.stringify(problem.found)?.slice(0, 80)}; rebuild the bundle.`);
  }
}

/** Check one named array against the bundle's spec; returns an ORT tensor. `batch`: the examples; `lengths`:
 * the other named dimensions' sizes (a text's "seq"), filled from the first array that has one and checked
 * against every later one, so that token ids and their mask must agree. */
export function toTensor(ort, spec, values, batch, lengths = {}) {
  const Expected = ARRAYS[spec.dtype];
  if (!Expected) throw new InputError(`${spec.name}: dtype ${spec.dtype} is not supported in the browser`);
  if (!(values instanceof Expected)) {
    const found = values?.constructor?.name ?? typeof values;
    throw new InputError(`${spec.name} must be a ${Expected.name} (${spec.dtype}), got ${found}`);
  }
  const named = (d) => typeof d === "string" && d !== "batch";
  const open = [...new Set(spec.shape.filter((d) => named(d) && !(d in lengths)))];
  if (open.length > 1) {
    throw new InputError(`${spec.name}: its dimensions ${open} are all dynamic; give an input whose shape fixes them first`);
  }
  const known = spec.shape.map((d) => (d === "batch" ? batch : d in lengths ? lengths[d] : d));
  if (open.length === 1) {
    const rest = count(known.filter((d) => typeof d === "number"));
    const length = values.length / rest;
    if (!Number.isInteger(length) || length < 1) {
      throw new InputError(`${spec.name} needs a multiple of ${rest} values for shape [${spec.shape}] with batch ${batch}, got ${values.length}`);
    }
    lengths[open[0]] = length;
  }
  const dims = spec.shape.map((d) => (d === "batch" ? batch : d in lengths ? lengths[d] : d));
  const size = count(dims);
  if (values.length !== size) {
    throw new InputError(`${spec.name} needs ${size} values for shape [${dims}], got ${values.length}`);
  }
  if (Expected === Float32Array && !values.every(Number.isFinite)) throw new InputError(`${spec.name} holds NaN/Inf`);
  return new ort.Tensor(spec.dtype, values, dims);
}

/** The number of values of a tensor of this shape. */
const count = (shape) => shape.reduce((a, b) => a * b, 1);

/** A float32 tensor over `array`'s values of the placed tensor `t` (`{shape, offset}`), without a copy. */
const tensorAt = (ort, array, t) => new ort.Tensor("float32", array.subarray(t.offset, t.offset + count(t.shape)), t.shape);

/** A bundle file's bytes, fetched and checked against the bundle's hash table. */
async function fetchChecked(base, name, description, headers) {
  const entry = description.files[name];
  if (!entry) throw new BundleError(`bundle.json lists no ${name}`);
  const bytes = await fetchBytes(`${base}${name}`, headers);
  if ((await sha256Hex(bytes)) !== entry.sha256) throw new BundleError(`${name} was altered (sha256 differs)`);
  return bytes;
}

/** ORT-web's WebAssembly throws a bare number (a C++ exception) for models it cannot run. */
function openError(error, build) {
  const cause = error instanceof Error ? error.message : `error ${error}`;
  return new BundleError(`ONNX Runtime Web could not open the bundle's models (${cause}); `
                         + `check that the bundle was made for this client's ONNX Runtime Web (${build})`);
}

/** The learning rate of optimizer step `step` (0-based) on the bundle's schedule: ondevice.lr_at. */
export function rateAt(step, { kind, base, total, warmup = 0, min_lr: minLr = 0 }) {
  if (kind === "constant") return base;
  if (step < warmup) return (base * (step + 1)) / warmup;
  const progress = Math.min(Math.max(step - warmup, 0) / Math.max(total - warmup, 1), 1);
  if (kind === "linear") return minLr + (base - minLr) * (1 - progress);
  return minLr + (base - minLr) * 0.5 * (1 + Math.cos(Math.PI * progress));
}

/** `[lr, lr_corrected, lr * weight_decay]` for AdamW step `step` (1-based) in float32, as ORT's kernel and
 * the Python portable engine (ondevice.engines.portable.adamw_rates) compute them. */
export function adamwRates(lr, step, [beta1, beta2], weightDecay) {
  const f = Math.fround;
  const alpha = f(1 - f(Math.pow(f(beta1), step)));
  const beta = f(1 - f(Math.pow(f(beta2), step)));
  const rate = f(lr);
  return [rate, f(rate * f(f(Math.sqrt(beta)) / alpha)), f(rate * f(weightDecay))];
}

/** onnxruntime-web 1.19.2's training build over the classic graphs (rates baked into the optimizer graph). */
class ClassicEngine {
  static async open(ort, base, description, headers) {
    if (description.optimizer === "sgd") {
      // Measured: ONNX Runtime Web 1.19.2 opens the training and eval models but fails to create the SGD
      // optimizer session (SGDOptimizerV2), with a bare number for an error.
      throw new BundleError("this bundle trains with SGD, whose optimizer graph ONNX Runtime Web 1.19 cannot run; "
                            + "use onnxruntime-web 1.30 (the portable graphs), or generate the artifacts with "
                            + "--optimizer adamw");
    }
    const files = {};
    for (const name of CLASSIC_FILES) files[name] = await fetchChecked(base, name, description, headers);
    try {
      return new ClassicEngine(ort, await ort.TrainingSession.create({
        checkpointState: files["checkpoint"],
        trainModel: files["training_model.onnx"],
        evalModel: files["eval_model.onnx"],
        optimizerModel: files["optimizer_model.onnx"],
      }), description);
    } catch (error) {
      throw openError(error, "1.19");
    }
  }

  constructor(ort, session, description) {
    Object.assign(this, { name: "classic", ort, session, description, provider: "wasm" });
  }

  /** One part's forward and backward, its loss gradient scaled by `scale` (ORT accumulates the parts). */
  async trainStep(feeds, scale) {
    const name = this.description.loss_scale;
    if (name) feeds[name] = new this.ort.Tensor("float32", new Float32Array([scale]), []);
    return this.session.runTrainStep(feeds);
  }

  async optimizerStep() {
    await this.session.runOptimizerStep();
  }

  async resetGrad() {
    await this.session.lazyResetGrad();
  }

  async getWeights() {
    return new Float32Array((await this.session.getContiguousParameters(true)).data);
  }

  async setWeights(weights) {
    await this.session.loadParametersBuffer(new Uint8Array(weights.buffer, weights.byteOffset, weights.byteLength), true);
  }
}

const STATE = ["value", "momentum0", "momentum1"]; // the flat vectors a saved state holds

/**
 * The current onnxruntime-web over the portable step graphs (as ondevice.engines.portable in Python): the
 * training graph takes the parameters as inputs and returns each one's gradient; the optimizer graph updates
 * one flat vector each of parameters, gradients and AdamW's moments, with the learning rate as an input.
 */
class PortableEngine {
  static async open(ort, base, description, headers, provider) {
    const layout = description.portable;
    // Frozen arrays (a LoRA's base): the bundle's browser graphs read them from parameters.bin as initializers,
    // copied into ORT's memory once per session instead of on every run (MiniLM's 90 MB a step).
    const graphs = layout.frozen.length ? layout.browser : layout;
    if (!graphs) throw new BundleError("this bundle's portable graphs read frozen weights as inputs; rebuild it with odt bundle");
    const bytes = {};
    for (const name of [graphs.training, layout.optimizer, graphs.step, layout.parameters]) {
      bytes[name] = await fetchChecked(base, name, description, headers);
    }
    const values = bytes[layout.parameters];
    const size = description.weights.size;
    for (const t of layout.frozen) { // each frozen array as stored: float32, or an int8 base's int8 rows
      const end = t.byte_offset + count(t.shape) * FROZEN_ARRAYS[t.dtype].BYTES_PER_ELEMENT;
      if (t.byte_offset < size * 4 || end > values.byteLength || t.byte_offset % FROZEN_ARRAYS[t.dtype].BYTES_PER_ELEMENT) {
        throw new BundleError(`${layout.parameters} (${values.byteLength} bytes) has no ${t.dtype} ${t.name} of shape [${t.shape}] at byte ${t.byte_offset}; rebuild the bundle`);
      }
    }
    if (values.byteLength < size * 4) throw new BundleError(`${layout.parameters} holds ${values.byteLength} bytes, fewer than the ${size} weights; rebuild the bundle`);
    const options = { executionProviders: [provider], graphOptimizationLevel: "all" };
    if (layout.frozen.length) options.externalData = [{ path: layout.parameters, data: values }];
    const open = async (graph) => {
      try {
        return await ort.InferenceSession.create(graph, options);
      } catch (error) {
        throw openError(error, "1.30 or later");
      }
    };
    // The step graph runs whole batches, the training graph a memory plan's parts: each session opens on first
    // use (SmolLM2's int8 bundle took 20.0 s to load with both opened, 9.9 and 11.9 s with one:
    // benchmarks.smollm2_bundle), and each holds its own copy of the frozen arrays.
    const lazy = (graph) => {
      let opened = null;
      return () => (opened ??= open(graph));
    };
    const sessions = { optimizer: await open(bytes[layout.optimizer]), step: lazy(bytes[graphs.step]),
                       training: lazy(bytes[graphs.training]) };
    return new PortableEngine(ort, description, sessions, values, provider);
  }

  /** `sessions`: the optimizer update, and `training()` and `step()`, which open the training graph's session and
   * the fused one (the training graph and the update: a whole step in one run) on first use. */
  constructor(ort, description, { training, optimizer, step }, values, provider) {
    const size = description.weights.size;
    Object.assign(this, { name: "portable", ort, description, training, optimizer, fused: step, provider });
    this.flat = { value: new Float32Array(values.buffer.slice(values.byteOffset, values.byteOffset + size * 4)),
                  grad: new Float32Array(size), momentum0: new Float32Array(size), momentum1: new Float32Array(size) };
    this.step = 0;
    this.pending = 0; // parts whose gradients the accumulator holds
    this.staged = null; // a fused step's updated vectors, applied by optimizerStep
    this.learningRate = null; // null: the bundle's schedule
  }

  /** The bundle's optimizer settings (the manifest's AdamW betas and weight decay). */
  get hyper() {
    return this.description.portable.optimizer_options;
  }

  /** One part's forward and backward; its gradients add into the accumulator (a mean loss's are averaged
   * over the parts before the update, as the Python trainer does). A `whole` step runs the fused graph
   * instead, which computes the update too: `optimizerStep` then applies it. */
  async trainStep(feeds, _scale, whole) {
    const tensors = this.description.weights.tensors;
    for (const t of tensors) feeds[t.name] = tensorAt(this.ort, this.flat.value, t);
    if (whole && this.pending === 0) {
      const fused = await this.fused();
      Object.assign(feeds, this.updateFeeds(false, fused));
      this.staged = await fused.run(feeds);
      return this.staged;
    }
    const results = await (await this.training()).run(feeds);
    const grad = this.flat.grad;
    for (const t of tensors) {
      const part = results[`${t.name}_grad`].data;
      if (this.pending === 0) grad.set(part, t.offset);
      else for (let i = 0; i < part.length; i++) grad[t.offset + i] += part[i];
    }
    this.pending++;
    return results;
  }

  /** The update's inputs for the next optimizer step: the rates, the moments (and the parameters and gradients
   * unless the fused graph gathers them itself). */
  updateFeeds(vectors, session = this.optimizer) {
    const { ort, flat } = this;
    const lr = this.learningRate ?? rateAt(this.step, this.description.learning_rate);
    const rates = this.description.optimizer === "adamw"
      ? adamwRates(lr, this.step + 1, this.hyper.betas, this.hyper.weight_decay) : [Math.fround(lr), Math.fround(lr), 0];
    const scalar = (v) => new ort.Tensor("float32", new Float32Array([v]), []);
    const vector = (v) => new ort.Tensor("float32", v, [v.length]);
    const candidates = { "odt.lr": scalar(rates[0]), "odt.lr_corrected": scalar(rates[1]), "odt.lr_decay": scalar(rates[2]),
      "odt.momentum0": vector(flat.momentum0), "odt.momentum1": vector(flat.momentum1),
      ...(vectors ? { "odt.parameters": vector(flat.value), "odt.gradients": vector(flat.grad) } : {}) };
    const wanted = session.inputNames;
    return Object.fromEntries(Object.entries(candidates).filter(([name]) => wanted.includes(name)));
  }

  async optimizerStep() {
    const { flat } = this;
    let results = this.staged;
    if (!results) {
      const mean = (this.description.loss?.options?.reduction ?? "mean") === "mean";
      if (this.pending > 1 && mean) {
        const scale = Math.fround(1 / this.pending);
        for (let i = 0; i < flat.grad.length; i++) flat.grad[i] *= scale;
      }
      results = await this.optimizer.run(this.updateFeeds(true));
    }
    this.step++;
    flat.value.set(results["odt.parameters.updated"].data);
    if (this.description.optimizer === "adamw") {
      flat.momentum0.set(results["odt.momentum0.updated"].data);
      flat.momentum1.set(results["odt.momentum1.updated"].data);
    }
  }

  async resetGrad() {
    this.pending = 0;
    this.staged = null;
  }

  async getWeights() {
    return this.flat.value.slice();
  }

  async setWeights(weights) {
    this.flat.value.set(weights);
  }

  /** Everything a resumed run needs, as one byte buffer: a JSON header line, then the parameters and moments
   * (saved between steps: no gradient is pending). */
  state() {
    const header = new TextEncoder().encode(`${JSON.stringify({ step: this.step, learningRate: this.learningRate,
                                                                 size: this.flat.value.length })}\n`);
    const out = new Uint8Array(header.length + 12 * this.flat.value.length);
    out.set(header);
    let at = header.length;
    for (const kind of STATE) {
      const v = this.flat[kind];
      out.set(new Uint8Array(v.buffer, v.byteOffset, v.byteLength), at);
      at += v.byteLength;
    }
    return out;
  }

  restore(bytes) {
    const end = bytes.indexOf(10);
    const header = JSON.parse(new TextDecoder().decode(bytes.subarray(0, end)));
    const size = this.flat.value.length;
    if (header.size !== size || bytes.length !== end + 1 + 12 * size) {
      throw new InputError(`the saved state holds ${header.size} weights, this bundle trains ${size}: it was saved from another bundle`);
    }
    const values = new Float32Array(bytes.buffer.slice(bytes.byteOffset + end + 1, bytes.byteOffset + bytes.length));
    STATE.forEach((kind, i) => this.flat[kind].set(values.subarray(i * size, (i + 1) * size)));
    Object.assign(this, { step: header.step, learningRate: header.learningRate, pending: 0, staged: null });
  }
}

const STATE_DB = "odt-state";

/** The IndexedDB store of saved client states (one record per key). */
function stateStore(mode, work) {
  return new Promise((resolve, reject) => {
    const open = indexedDB.open(STATE_DB, 1);
    open.onupgradeneeded = () => open.result.createObjectStore("states");
    open.onerror = () => reject(new BundleError(`cannot open IndexedDB: ${open.error?.message}`));
    open.onsuccess = () => {
      const db = open.result;
      const transaction = db.transaction("states", mode);
      const request = work(transaction.objectStore("states"));
      transaction.oncomplete = () => { db.close(); resolve(request.result); };
      transaction.onerror = () => { db.close(); reject(new BundleError(`IndexedDB: ${transaction.error?.message}`)); };
    };
  });
}

export class OdtClient {
  constructor(ort, engine, description) {
    this.ort = ort;
    this.engine = engine;
    this.description = description;
    this.specs = [...description.inputs, ...description.targets];
    // A memory plan's micro-batch splits each step into parts (the classic graphs scale each part's loss
    // gradient through the bundle's loss-scale input; the portable engine averages the parts' gradients).
    this.micro = engine.name === "portable" || description.loss_scale ? description.micro_batch_size ?? null : null;
  }

  /** Which engine trains: "portable" (current onnxruntime-web) or "classic" (its 1.19.2 training build). */
  get engineName() {
    return this.engine.name;
  }

  /** Where the portable graphs run: "webgpu" or "wasm". */
  get executionProvider() {
    return this.engine.provider;
  }

  /** Fetch a bundle, check its signature (when a key is given) and every hash, then open ORT: the portable
   * graphs on a current onnxruntime-web, the classic ones on 1.19.2's training build.
   * `executionProvider: "webgpu"` (opt-in; needs onnxruntime-web's WebGPU build, ort.min.mjs) runs the
   * portable graphs on the browser's GPU where it offers an adapter, and on WASM where it offers none;
   * `client.executionProvider` says which. */
  static async load(ort, baseUrl, { publicKeyPem = null, headers = {}, executionProvider = "wasm" } = {}) {
    if (!["wasm", "webgpu"].includes(executionProvider)) {
      throw new InputError(`executionProvider must be "wasm" or "webgpu", got ${JSON.stringify(executionProvider)}`);
    }
    const base = baseUrl.endsWith("/") ? baseUrl : `${baseUrl}/`;
    const descriptionBytes = await fetchBytes(`${base}bundle.json`, headers);
    if (publicKeyPem) {
      const signature = await fetch(`${base}bundle.sig`, { headers });
      if (!signature.ok) throw new BundleError("the bundle is not signed (bundle.sig missing) but a public key was given");
      await verifySignature(descriptionBytes, new Uint8Array(await signature.arrayBuffer()), publicKeyPem);
    }
    let description;
    try {
      description = JSON.parse(new TextDecoder().decode(descriptionBytes));
    } catch (error) {
      throw new BundleError(`bundle.json is not valid JSON (${error.message}); rebuild the bundle.`);
    }
    const schemaEntry = description?.files?.[SCHEMA_FILE];
    if (!schemaEntry) throw new BundleError(`bundle.json lists no ${SCHEMA_FILE}: rebuild the bundle with odt bundle`);
    const schemaBytes = await fetchBytes(`${base}${SCHEMA_FILE}`, headers);
    if ((await sha256Hex(schemaBytes)) !== schemaEntry.sha256) throw new BundleError(`${SCHEMA_FILE} was altered (sha256 differs)`);
    checkDescription(description, JSON.parse(new TextDecoder().decode(schemaBytes)));
    let engine;
    const classic = Boolean(description.files["optimizer_model.onnx"]); // generated without the training build: none
    if (typeof ort.TrainingSession === "function" && classic) engine = await ClassicEngine.open(ort, base, description, headers);
    else if (description.portable) {
      const gpu = executionProvider === "webgpu" && (await globalThis.navigator?.gpu?.requestAdapter?.()) != null;
      engine = await PortableEngine.open(ort, base, description, headers, gpu ? "webgpu" : "wasm");
    }
    else {
      throw new BundleError("this bundle has no portable graphs, which this onnxruntime-web (no training build) needs; "
                            + "regenerate the artifacts with odt generate and bundle them again");
    }
    return new OdtClient(ort, engine, description);
  }

  feeds(batch, size) {
    const feeds = {};
    const lengths = {}; // a text's "seq": one length for every input of the step
    for (const spec of this.specs) {
      if (!(spec.name in batch)) throw new InputError(`missing input ${spec.name}; expected ${this.specs.map((s) => s.name)}`);
      feeds[spec.name] = toTensor(this.ort, spec, batch[spec.name], size, lengths);
    }
    return feeds;
  }

  /** The examples per part of a step of `size`: the largest divisor of `size` up to the plan's micro-batch
   * (as Python's Trainer.micro_batches), or `size` without a plan. */
  partSize(size) {
    if (!this.micro || this.micro >= size) return size;
    let part = this.micro;
    while (size % part !== 0) part--;
    return part;
  }

  /** One optimizer step on a batch of `size` examples, skipped when the loss or a gradient is not finite.
   * With a memory plan the batch trains in parts whose gradients add up to the whole batch's, then one
   * optimizer step. */
  async trainStep(batch, size) {
    const part = this.partSize(size);
    const mean = (this.description.loss?.options?.reduction ?? "mean") === "mean";
    let loss = 0;
    let correct = null;
    let finite = true;
    const whole = this.feeds(batch, size); // checks the whole batch before any part trains
    // The bundle's finite check: the L2 norm of the loss and every gradient, computed in the graph.
    const check = this.description.finite_check;
    for (let start = 0; start < size; start += part) {
      const piece = part === size ? batch : this.slice(batch, size, start, part);
      const feeds = part === size ? whole : this.feeds(piece, part);
      const results = await this.engine.trainStep(feeds, mean ? part / size : 1, part === size);
      const [lossOut, scores] = Object.values(results); // the graph's outputs in order: loss, scores, ...
      const partLoss = Number(lossOut.data[0]);
      loss += mean ? (partLoss * part) / size : partLoss;
      const partCorrect = this.countCorrect(scores, piece, part);
      if (partCorrect !== null) correct = (correct ?? 0) + partCorrect;
      finite &&= check ? Number.isFinite(Number(results[check].data[0])) : Number.isFinite(partLoss);
    }
    if (finite) await this.engine.optimizerStep();
    await this.engine.resetGrad();
    return { loss, correct, applied: finite };
  }

  /** Examples [start, start + count) of a batch of `size` (views, no copies). */
  slice(batch, size, start, count) {
    const piece = {};
    for (const spec of this.specs) {
      const per = batch[spec.name].length / size;
      piece[spec.name] = batch[spec.name].subarray(start * per, (start + count) * per);
    }
    return piece;
  }

  /** Correct argmax predictions of a classifier's batch (null when the bundle is no classifier). */
  countCorrect(scores, batch, size) {
    const classes = this.description.num_classes;
    const target = this.description.targets[0];
    if (!classes || !scores || !target || scores.data.length !== size * classes) return null;
    let correct = 0;
    for (let row = 0; row < size; row++) {
      let best = 0;
      for (let c = 1; c < classes; c++) if (scores.data[row * classes + c] > scores.data[row * classes + best]) best = c;
      if (BigInt(best) === BigInt(batch[target.name][row])) correct++;
    }
    return correct;
  }

  /** Epochs over `data` (arrays keyed by input name, `count` examples) in order; progress per step. */
  async fit(data, count, { epochs = 1, batchSize = 32, onProgress = () => {} } = {}) {
    const losses = [];
    this.lastEpoch = { correct: 0, seen: 0, skipped: 0 };
    const steps = epochs * Math.ceil(count / batchSize);
    for (let epoch = 0; epoch < epochs; epoch++) {
      for (let start = 0; start < count; start += batchSize) {
        const size = Math.min(batchSize, count - start);
        const { loss, correct, applied } = await this.trainStep(this.slice(data, count, start, size), size);
        if (start === 0) this.lastEpoch = { correct: 0, seen: 0, skipped: this.lastEpoch.skipped };
        if (correct !== null) Object.assign(this.lastEpoch, { correct: this.lastEpoch.correct + correct, seen: this.lastEpoch.seen + size });
        if (!applied) this.lastEpoch.skipped++;
        losses.push(loss);
        onProgress({ step: losses.length, steps, loss });
      }
    }
    return losses;
  }

  /** Trainable weights as one Float32Array in manifest order (the federated exchange format). */
  async getWeights() {
    return this.engine.getWeights();
  }

  async setWeights(weights) {
    const expected = this.description.weights.size;
    if (!(weights instanceof Float32Array) || weights.length !== expected) {
      throw new InputError(`weights must be a Float32Array of ${expected} values, got ${weights?.length}`);
    }
    if (!weights.every(Number.isFinite)) throw new InputError("weights hold NaN/Inf");
    await this.engine.setWeights(weights);
  }

  /** The learning rate of the next optimizer steps (portable engine; null: back to the bundle's schedule). */
  setLearningRate(lr) {
    if (this.engine.name !== "portable") {
      throw new InputError("onnxruntime-web 1.19.2's training build has no learning-rate setter: the bundle's rate is baked in");
    }
    if (lr !== null && !(typeof lr === "number" && Number.isFinite(lr) && lr > 0)) {
      throw new InputError(`the learning rate must be a finite number > 0 (or null for the bundle's schedule), got ${lr}`);
    }
    this.engine.learningRate = lr;
  }

  /** Save the training state (parameters, moments, step, rate) under `key` in IndexedDB, with its sha256 and
   * the bundle's identity, replacing the previous record in one transaction. */
  async saveState(key) {
    this.portableOnly("saveState");
    const bytes = this.engine.state();
    const record = { bytes, sha256: await sha256Hex(bytes), bundle: this.description.manifest_sha256 };
    await stateStore("readwrite", (store) => store.put(record, key));
  }

  /** Restore what `saveState(key)` saved; refuses a record that is missing, damaged or of another bundle. */
  async restoreState(key) {
    this.portableOnly("restoreState");
    const record = await stateStore("readonly", (store) => store.get(key));
    if (!record) throw new InputError(`no saved state named ${JSON.stringify(key)} in this browser`);
    if (record.bundle !== this.description.manifest_sha256) {
      throw new InputError(`the state ${JSON.stringify(key)} was saved from another bundle; start afresh or load that bundle`);
    }
    if ((await sha256Hex(record.bytes)) !== record.sha256) {
      throw new InputError(`the state ${JSON.stringify(key)} is damaged (sha256 differs); start afresh`);
    }
    this.engine.restore(record.bytes);
  }

  /** The optimizer steps taken (portable engine; the classic build keeps no count the page can read). */
  get step() {
    return this.engine.step ?? null;
  }

  portableOnly(what) {
    if (this.engine.name !== "portable") throw new InputError(`${what} needs the current onnxruntime-web (the portable graphs)`);
  }
}

const ERRORS = { BundleError, InputError };

/**
 * OdtClient's methods, run by a Web Worker (odt-worker.mjs): the page's thread only posts
 * messages, so it stays responsive while ORT trains. Batches and weights are posted once per call
 * (a `fit` posts its data once, not per step); weights come back by transfer, without a copy.
 */
export class WorkerClient {
  constructor(worker) {
    this.worker = worker;
    this.pending = new Map();
    this.nextId = 0;
    worker.onmessage = ({ data }) => {
      const call = this.pending.get(data.id);
      if (!call) return;
      if (data.progress) return call.onProgress(data.progress);
      this.pending.delete(data.id);
      if (data.error) {
        const error = new (ERRORS[data.error.name] ?? Error)(data.error.message);
        error.name = data.error.name;
        call.reject(error);
      } else call.resolve(data.value);
    };
    worker.onerror = (event) => {
      event.preventDefault();
      const error = new BundleError(`the training worker failed: ${event.message ?? "it could not start"}`);
      for (const call of this.pending.values()) call.reject(error);
      this.pending.clear();
    };
  }

  /**
   * Start a worker and load a bundle in it (every hash checked, the signature with a key).
   * `ortUrl`: an onnxruntime-web module (ort.wasm.min.mjs, or 1.19.2's ort.training.wasm.min.mjs); `wasmPaths`: the
   * folder of its .wasm files.
   */
  static async load(baseUrl, { ortUrl, wasmPaths, numThreads = 1, publicKeyPem = null, headers = {},
                               executionProvider = "wasm", workerUrl = new URL("./odt-worker.mjs", import.meta.url) } = {}) {
    if (!ortUrl || !wasmPaths) throw new InputError("WorkerClient.load needs ortUrl and wasmPaths (onnxruntime-web's files)");
    const absolute = (url) => new URL(url, location.href).href; // the worker resolves URLs against its own
    const client = new WorkerClient(new Worker(workerUrl, { type: "module" }));
    try {
      const loaded = await client.call("load", [absolute(ortUrl), absolute(wasmPaths), numThreads, absolute(baseUrl),
                                                { publicKeyPem, headers, executionProvider }]);
      Object.assign(client, loaded, { specs: [...loaded.description.inputs, ...loaded.description.targets] });
      return client;
    } catch (error) {
      client.terminate();
      throw error;
    }
  }

  call(op, args, onProgress = () => {}) {
    const id = this.nextId++;
    return new Promise((resolve, reject) => {
      this.pending.set(id, { resolve, reject, onProgress });
      try {
        this.worker.postMessage({ id, op, args });
      } catch (error) { // e.g. arguments that cannot be cloned
        this.pending.delete(id);
        reject(new InputError(`cannot send ${op}'s arguments to the worker: ${error.message}`));
      }
    });
  }

  trainStep(batch, size) {
    return this.call("trainStep", [batch, size]);
  }

  async fit(data, count, { epochs = 1, batchSize = 32, onProgress = () => {} } = {}) {
    const { losses, lastEpoch } = await this.call("fit", [data, count, { epochs, batchSize }], onProgress);
    this.lastEpoch = lastEpoch;
    return losses;
  }

  getWeights() {
    return this.call("getWeights", []);
  }

  setWeights(weights) {
    return this.call("setWeights", [weights]);
  }

  setLearningRate(lr) {
    return this.call("setLearningRate", [lr]);
  }

  saveState(key) {
    return this.call("saveState", [key]);
  }

  restoreState(key) {
    return this.call("restoreState", [key]);
  }

  /** Stop the worker (and ORT in it); pending calls fail. */
  terminate() {
    this.worker.terminate();
    for (const call of this.pending.values()) call.reject(new BundleError("the training worker was stopped"));
    this.pending.clear();
  }
}

/**
 * Typed arrays for a bundle's feeds from plain arrays keyed by name (numbers, or numeric strings
 * for int64): `{ data, count }`, with `count` examples. Works for any input names and dtypes.
 */
export function arraysFor(description, plain) {
  const specs = [...description.inputs, ...description.targets];
  const data = {};
  let count = null;
  for (const spec of specs) {
    const values = plain[spec.name];
    if (!values) throw new InputError(`the data has no ${spec.name}; expected ${specs.map((s) => s.name).join(", ")}`);
    const Typed = ARRAYS[spec.dtype];
    if (!Typed) throw new InputError(`${spec.name}: dtype ${spec.dtype} is not supported in the browser`);
    const flat = values.flat(Infinity);
    data[spec.name] = Typed === BigInt64Array ? BigInt64Array.from(flat, (v) => BigInt(v)) : Typed.from(flat);
    const per = spec.shape.slice(1).reduce((a, b) => a * (typeof b === "number" ? b : 1), 1);
    const examples = flat.length / per;
    if (!Number.isInteger(examples) || (count !== null && examples !== count)) {
      throw new InputError(`${spec.name} holds ${flat.length} values: not ${count ?? "a whole number of"} examples of ${per}`);
    }
    count = examples;
  }
  return { data, count };
}

/** Arrays of an uncompressed `.npz` (numpy.savez) as plain arrays keyed by name. */
export function parseNpz(bytes) {
  const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  const out = {};
  let at = 0;
  while (at + 30 <= bytes.length && view.getUint32(at, true) === 0x04034b50) {
    const method = view.getUint16(at + 8, true);
    let size = view.getUint32(at + 18, true);
    const nameLength = view.getUint16(at + 26, true);
    const extraLength = view.getUint16(at + 28, true);
    const name = new TextDecoder().decode(bytes.subarray(at + 30, at + 30 + nameLength)).replace(/\.npy$/, "");
    const start = at + 30 + nameLength + extraLength;
    if (method !== 0) throw new InputError(`${name}: compressed .npz (savez_compressed) is not supported; use numpy.savez`);
    if (size === 0xffffffff) size = zip64Size(view, at + 30 + nameLength, extraLength, name);  // numpy writes zip64
    out[name] = parseNpy(bytes.subarray(start, start + size), name);
    at = start + size;
  }
  if (!Object.keys(out).length) throw new InputError("not an .npz archive (numpy.savez)");
  return out;
}

function zip64Size(view, at, length, name) {
  for (let p = at; p + 4 <= at + length; p += 4 + view.getUint16(p + 2, true)) {
    if (view.getUint16(p, true) === 0x0001) {
      const size = view.getBigUint64(p + 4, true);  // the uncompressed size comes first
      if (size > BigInt(Number.MAX_SAFE_INTEGER)) throw new InputError(`${name}: too large`);
      return Number(size);
    }
  }
  throw new InputError(`${name}: zip64 member without its size`);
}

function parseNpy(bytes, name) {
  const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  const major = bytes[6];
  const headerLength = major === 1 ? view.getUint16(8, true) : view.getUint32(8, true);
  const offset = major === 1 ? 10 : 12;
  const header = new TextDecoder().decode(bytes.subarray(offset, offset + headerLength));
  const descr = /'descr':\s*'([^']+)'/.exec(header)?.[1];
  if (/'fortran_order':\s*True/.test(header)) throw new InputError(`${name}: Fortran-ordered arrays are not supported`);
  const kinds = { "<f4": Float32Array, "<f8": Float64Array, "<i8": BigInt64Array, "<i4": Int32Array, "|u1": Uint8Array,
                  "|b1": Uint8Array };
  const Typed = kinds[descr];
  if (!Typed) throw new InputError(`${name}: dtype ${descr} is not supported (use float32, float64, int64 or int32)`);
  const data = bytes.slice(offset + headerLength);
  const array = new Typed(data.buffer, 0, data.byteLength / Typed.BYTES_PER_ELEMENT);
  return Typed === BigInt64Array ? Array.from(array, (v) => v.toString()) : Array.from(array);
}

/**
 * Epochs a device trains for a task's `config`: `local-epochs`, or more until it has taken at least
 * `local-steps` optimizer steps (the rule of Python's federated.task.local_epochs).
 */
export function localEpochs(config, count) {
  const epochs = Number(config["local-epochs"] ?? 1);
  const batchSize = Math.min(Number(config["batch-size"] ?? 32), count);
  const steps = Number(config["local-steps"] ?? 0);
  return Math.max(epochs, Math.ceil(steps / Math.ceil(count / batchSize)));
}

/** A device's side of the bridge protocol (see mobile_bridge/README.md). */
export class BridgeClient {
  constructor(baseUrl, deviceId, token) {
    this.base = baseUrl.replace(/\/$/, "");
    this.deviceId = deviceId;
    this.token = token;
  }

  /** Enrol with the bridge's enrolment secret or a one-time code from `odt bridge enroll`. */
  static async register(baseUrl, name, enrolment = "") {
    const response = await fetch(`${baseUrl.replace(/\/$/, "")}/v1/devices`, {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ name, enrolment }),
    });
    if (!response.ok) throw new BundleError(`registration refused: HTTP ${response.status} ${await response.text()}`);
    const { device_id, token } = await response.json();
    return new BridgeClient(baseUrl, device_id, token);
  }

  get headers() {
    return { Authorization: `Bearer ${this.token}` };
  }

  loadBundle(ort, options = {}) {
    return OdtClient.load(ort, `${this.base}/v1/bundle/`, { ...options, headers: this.headers });
  }

  /** The bundle in a Web Worker (a WorkerClient; `options` as for WorkerClient.load). */
  loadBundleInWorker(options) {
    return WorkerClient.load(`${this.base}/v1/bundle/`, { ...options, headers: this.headers });
  }

  /** Poll until the server has a task for this device (HTTP 204 means: not yet); its weights arrive binary
   * (a secure round's key stages have none: `task.secagg` says what to answer). */
  async nextTask({ pollMs = 500, timeoutMs = 120000 } = {}) {
    const end = Date.now() + timeoutMs;
    while (Date.now() < end) {
      const response = await fetch(`${this.base}/v1/task`, { headers: this.headers });
      if (response.status === 200) {
        const task = await response.json();
        if (!task.weights_url) return task;
        const bytes = await fetchBytes(`${this.base}${task.weights_url}`, this.headers);
        if (bytes.byteLength !== 4 * task.weights_size) throw new BundleError("the task's weights have the wrong size");
        task.weights = new Float32Array(bytes.buffer, bytes.byteOffset, task.weights_size);
        return task;
      }
      if (response.status !== 204) throw new BundleError(`task request failed: HTTP ${response.status}`);
      await new Promise((resolve) => setTimeout(resolve, pollMs));
    }
    throw new BundleError(`no task within ${timeoutMs} ms`);
  }

  /** The trained weights go up binary (float32 little-endian), or in a secure round the masked vector
   * (Uint32Array); counts and metrics in the query. */
  async pushUpdate(task, weights, numExamples, metrics = {}, rejected = []) {
    const query = new URLSearchParams({
      num_examples: String(numExamples), bundle_sha256: task.bundle_sha256, metrics: JSON.stringify(metrics),
    });
    if (rejected.length) query.set("rejected", rejected.join(","));
    const response = await fetch(`${this.base}/v1/tasks/${task.task_id}/update?${query}`, {
      method: "POST",
      headers: { ...this.headers, "Content-Type": "application/octet-stream" },
      body: weights,
    });
    if (response.status !== 202) throw new BundleError(`update refused: HTTP ${response.status} ${await response.text()}`);
  }

  /** The answer to a secure round's key stage (or `{ declined: "why" }` to any stage). */
  async pushAnswer(task, answer) {
    const response = await fetch(`${this.base}/v1/tasks/${task.task_id}/secagg`, {
      method: "POST",
      headers: { ...this.headers, "Content-Type": "application/json" },
      body: JSON.stringify(answer),
    });
    if (response.status !== 202) throw new BundleError(`answer refused: HTTP ${response.status} ${await response.text()}`);
  }

  /**
   * Take part in one round: pull tasks until this device's part is done, and resolve to
   * `{ round, secure, count, metrics }`. `train(task)` sets `task.weights` on `client`, trains and
   * resolves to `{ count, metrics }`. A plain round is one task: train, push the weights. A secure
   * round (`task.secagg`) is four (five when a peer accuses this device and it proves its shares): the
   * device answers the SecAgg+ key stages itself, trains in the collect stage and pushes only its masked
   * update, naming the peers whose shares it could not open (odt-secagg.mjs); neither the bridge nor its
   * relay sees the update. A stage this device cannot answer (it joined after the round's setup,
   * say) is declined: the server counts it as dropped, and the device waits for the next round.
   */
  async joinRound(client, train, options = {}) {
    let secure = null;
    let trained = null;
    for (;;) {
      const task = await this.nextTask(options);
      const stage = task.secagg?.stage;
      if (!stage) {
        const result = await train(task);
        await this.pushUpdate(task, await client.getWeights(), result.count, result.metrics);
        return { round: task.round, secure: false, ...result };
      }
      if (stage === "setup") secure = new SecureRound();
      try {
        if (!secure) throw new SecAggError(`joined the round at its ${stage} stage, after the setup`);
        if (stage === "collect_masked_vectors") {
          const start = Float32Array.from(task.weights); // train() may hand task.weights to a worker
          trained = await train(task);
          const masked = await secure.collect(task.secagg, start, await client.getWeights(), trained.count);
          await this.pushUpdate(task, masked, trained.count, trained.metrics, secure.rejected);
        } else {
          await this.pushAnswer(task, await secure.answer(task.secagg));
          if (stage === "unmask") return { round: task.round, secure: true, ...trained };
        }
      } catch (error) {
        if (!(error instanceof SecAggError)) throw error;
        secure = null;
        await this.pushAnswer(task, { declined: error.message });
      }
    }
  }
}
