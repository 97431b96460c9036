// SecAgg+ primitives for the browser, interoperable with Flower 1.41's (flwr.common.secure_aggregation):
// the same masks bit for bit, keys Python loads, shares Python combines, tokens Python decrypts.
//
//   masks(seed, 2 ** 32, [[1], [64, 128]])      numpy's legacy RandomState(seed32).randint(0, range - 1, shape)
//   await generateKeyPair()                     ECDH P-384: { privateKey, privatePem (PKCS8), publicPem (SPKI) }
//   await sharedKey(privateKey, publicPem)      HKDF-SHA256 of the ECDH secret, base64url: a Fernet key
//   await fernetEncrypt(key, bytes) / fernetDecrypt(key, token)
//   createShares(secret, threshold, count)      Shamir over GF(2^128), Flower's share layout
//   combineShares(shares)
//   new SecureRound()                           one device's side of a round: Flower's client stages
//
// Only Web Crypto and BigInt: no dependency. tests/mobile_bridge/test_secagg_web.py checks each
// piece in headless Chromium against Flower's Python functions.

const encoder = new TextEncoder();

// ---------------------------------------------------------------------------------------------
// Masks: MT19937 seeded like numpy's legacy RandomState(int), drawn like its randint (masked
// rejection on 32-bit draws, which is numpy's legacy path for ranges below 2^32).

class MT19937 {
  constructor(seed) {
    this.state = new Uint32Array(624);
    this.state[0] = seed >>> 0;
    for (let i = 1; i < 624; i++) {
      const previous = this.state[i - 1] ^ (this.state[i - 1] >>> 30);
      this.state[i] = (Math.imul(1812433253, previous) + i) >>> 0;
    }
    this.index = 624;
  }

  next() {
    if (this.index >= 624) this.twist();
    let y = this.state[this.index++];
    y ^= y >>> 11;
    y ^= (y << 7) & 0x9d2c5680;
    y ^= (y << 15) & 0xefc60000;
    y ^= y >>> 18;
    return y >>> 0;
  }

  twist() {
    const s = this.state;
    for (let i = 0; i < 624; i++) {
      const y = (s[i] & 0x80000000) | (s[(i + 1) % 624] & 0x7fffffff);
      s[i] = s[(i + 397) % 624] ^ (y >>> 1) ^ (y & 1 ? 0x9908b0df : 0);
    }
    this.index = 0;
  }
}

/** Flower's pseudo_rand_gen: one Float64Array of integers per shape (values below 2^53: exact). */
export function masks(seed, numRange, shapes) {
  if (seed.length % 4) throw new Error("a mask seed is a whole number of 32-bit words");
  let seed32 = 0;
  const view = new DataView(seed.buffer, seed.byteOffset, seed.byteLength);
  for (let i = 0; i < seed.length; i += 4) seed32 = (seed32 ^ view.getUint32(i, true)) >>> 0;
  const generator = new MT19937(seed32);
  const span = numRange - 2; // randint(0, numRange - 1) draws from [0, numRange - 2]
  if (span > 0xffffffff) throw new Error("mask ranges above 2^32 are not supported");
  let mask = span;
  for (let shift = 1; shift <= 16; shift *= 2) mask |= mask >>> shift;
  mask >>>= 0;
  return shapes.map((shape) => {
    const out = new Float64Array(shape.reduce((a, b) => a * b, 1));
    for (let i = 0; i < out.length; i++) {
      let value;
      do value = (generator.next() & mask) >>> 0; while (value > span);
      out[i] = value;
    }
    return out;
  });
}

// ---------------------------------------------------------------------------------------------
// Keys: ECDH on P-384 (Flower's SECP384R1), PEM encodings as `cryptography` writes and reads them.

const toBase64 = (bytes) => btoa(String.fromCharCode(...bytes));
const fromBase64 = (text) => Uint8Array.from(atob(text), (c) => c.charCodeAt(0));
const toBase64Url = (bytes) => toBase64(bytes).replace(/\+/g, "-").replace(/\//g, "_");
const fromBase64Url = (text) => fromBase64(text.replace(/-/g, "+").replace(/_/g, "/"));

function pem(label, der) {
  const body = toBase64(new Uint8Array(der)).match(/.{1,64}/g).join("\n");
  return encoder.encode(`-----BEGIN ${label}-----\n${body}\n-----END ${label}-----\n`);
}

function der(pemBytes) {
  const text = new TextDecoder().decode(pemBytes);
  return fromBase64(text.replace(/-----(BEGIN|END) [A-Z ]+-----/g, "").replace(/\s+/g, ""));
}

const CURVE = { name: "ECDH", namedCurve: "P-384" };

export async function generateKeyPair() {
  const pair = await crypto.subtle.generateKey(CURVE, true, ["deriveBits"]);
  return {
    privateKey: pair.privateKey,
    privatePem: pem("PRIVATE KEY", await crypto.subtle.exportKey("pkcs8", pair.privateKey)),
    publicPem: pem("PUBLIC KEY", await crypto.subtle.exportKey("spki", pair.publicKey)),
  };
}

export async function importPrivateKey(privatePem) {
  return crypto.subtle.importKey("pkcs8", der(privatePem), CURVE, true, ["deriveBits"]);
}

/** Flower's generate_shared_key: HKDF-SHA256 (no salt, no info) of the ECDH secret, base64url bytes. */
export async function sharedKey(privateKey, publicPem) {
  const peer = await crypto.subtle.importKey("spki", der(publicPem), CURVE, false, []);
  const secret = await crypto.subtle.deriveBits({ name: "ECDH", public: peer }, privateKey, 384);
  const hkdf = await crypto.subtle.importKey("raw", secret, "HKDF", false, ["deriveBits"]);
  const derived = await crypto.subtle.deriveBits(
    { name: "HKDF", hash: "SHA-256", salt: new Uint8Array(), info: new Uint8Array() }, hkdf, 256);
  return encoder.encode(toBase64Url(new Uint8Array(derived)));
}

// ---------------------------------------------------------------------------------------------
// Fernet (AES-128-CBC + HMAC-SHA256), as the `cryptography` package's.

async function fernetKeys(key) {
  const raw = fromBase64Url(new TextDecoder().decode(key));
  if (raw.length !== 32) throw new Error("a Fernet key is 32 bytes, base64url-encoded");
  return {
    sign: await crypto.subtle.importKey("raw", raw.slice(0, 16), { name: "HMAC", hash: "SHA-256" }, false, ["sign", "verify"]),
    encrypt: await crypto.subtle.importKey("raw", raw.slice(16), "AES-CBC", false, ["encrypt", "decrypt"]),
  };
}

export async function fernetEncrypt(key, plaintext) {
  const keys = await fernetKeys(key);
  const iv = crypto.getRandomValues(new Uint8Array(16));
  const body = new Uint8Array(await crypto.subtle.encrypt({ name: "AES-CBC", iv }, keys.encrypt, plaintext));
  const head = new Uint8Array(25);
  head[0] = 0x80;
  new DataView(head.buffer).setBigUint64(1, BigInt(Math.floor(Date.now() / 1000)));
  head.set(iv, 9);
  const signed = new Uint8Array([...head, ...body]);
  const mac = new Uint8Array(await crypto.subtle.sign("HMAC", keys.sign, signed));
  return encoder.encode(toBase64Url(new Uint8Array([...signed, ...mac])));
}

export async function fernetDecrypt(key, token) {
  const keys = await fernetKeys(key);
  const data = fromBase64Url(new TextDecoder().decode(token));
  if (data.length < 57 || data[0] !== 0x80) throw new Error("not a Fernet token");
  const signed = data.slice(0, data.length - 32);
  if (!(await crypto.subtle.verify("HMAC", keys.sign, data.slice(data.length - 32), signed))) {
    throw new Error("the Fernet token's signature does not match");
  }
  const plain = await crypto.subtle.decrypt({ name: "AES-CBC", iv: signed.slice(9, 25) }, keys.encrypt, signed.slice(25));
  return new Uint8Array(plain);
}

// ---------------------------------------------------------------------------------------------
// Shamir's secret sharing over GF(2^128), as pycryptodome's Shamir (ssss=False) under Flower's
// create_shares/combine_shares: the secret PKCS#7-padded to 16-byte chunks, each chunk shared
// apart; a share is a 4-byte little-endian index followed by the chunks' 16-byte shares.

const IRREDUCIBLE = (1n << 128n) | 0x87n; // 1 + x + x^2 + x^7 + x^128

function multiply(a, b) {
  let product = 0n;
  while (b) {
    if (b & 1n) product ^= a;
    a <<= 1n;
    if (a >> 128n) a ^= IRREDUCIBLE;
    b >>= 1n;
  }
  return product;
}

function degree(a) {
  return a.toString(2).length - 1;
}

function inverse(a) {
  let [r0, r1, s0, s1] = [a, IRREDUCIBLE, 1n, 0n];
  while (r1 > 0n) {
    let [q, r] = [0n, r0];
    while (r && degree(r) >= degree(r1)) {
      const shift = BigInt(degree(r) - degree(r1));
      q ^= 1n << shift;
      r ^= r1 << shift;
    }
    [r0, r1] = [r1, r];
    [s0, s1] = [s1, s0 ^ carryless(q, s1)];
  }
  return s0;
}

function carryless(a, b) {
  let product = 0n;
  for (; b; b >>= 1n, a <<= 1n) if (b & 1n) product ^= a;
  return product;
}

const toBig = (bytes) => bytes.reduce((value, byte) => (value << 8n) | BigInt(byte), 0n);
const fromBig = (value) => Uint8Array.from({ length: 16 }, (_, i) => Number((value >> BigInt(8 * (15 - i))) & 0xffn));

export function createShares(secret, threshold, count) {
  const padding = 16 - (secret.length % 16);
  const padded = new Uint8Array([...secret, ...new Array(padding).fill(padding)]);
  const shares = Array.from({ length: count }, (_, i) => {
    const share = new Uint8Array(4 + padded.length);
    new DataView(share.buffer).setUint32(0, i + 1, true);
    return share;
  });
  for (let chunk = 0; chunk < padded.length; chunk += 16) {
    const coefficients = Array.from({ length: threshold - 1 }, () => toBig(crypto.getRandomValues(new Uint8Array(16))));
    coefficients.push(toBig(padded.slice(chunk, chunk + 16)));
    shares.forEach((share, i) => {
      let value = 0n; // Horner's method at x = i + 1
      for (const c of coefficients) value = multiply(BigInt(i + 1), value) ^ c;
      share.set(fromBig(value), 4 + chunk);
    });
  }
  return shares;
}

export function combineShares(shares) {
  const points = shares.map((s) => [BigInt(new DataView(s.buffer, s.byteOffset).getUint32(0, true)), s]);
  const length = shares[0].length - 4;
  const padded = new Uint8Array(length);
  for (let chunk = 0; chunk < length; chunk += 16) {
    let secret = 0n; // Lagrange interpolation at 0: in GF(2^n), x_m - x_j is x_m ^ x_j
    for (const [xj, sj] of points) {
      let numerator = 1n;
      let denominator = 1n;
      for (const [xm] of points) {
        if (xm === xj) continue;
        numerator = multiply(numerator, xm);
        denominator = multiply(denominator, xm ^ xj);
      }
      secret ^= multiply(toBig(sj.slice(4 + chunk, 20 + chunk)), multiply(numerator, inverse(denominator)));
    }
    padded.set(fromBig(secret), chunk);
  }
  const padding = padded[padded.length - 1];
  if (padding < 1 || padding > 16) throw new Error("the shares do not rebuild a padded secret");
  return padded.slice(0, padded.length - padding);
}

// ---------------------------------------------------------------------------------------------
// One device's side of a secure round: the stages of Flower's secaggplus_mod over the bridge's JSON
// (mobile_bridge/secagg.py lists the fields). Node ids are decimal strings (uint64, beyond a Number).

export class SecAggError extends Error {
  constructor(message) {
    super(message);
    this.name = "SecAggError";
  }
}

const STAGES = ["setup", "share_keys", "collect_masked_vectors", "odt-prove", "unmask"];
const OPTIONAL = new Set(["odt-prove"]); // only a node a peer accuses is asked to prove its shares

function littleEndian(value, bytes) {
  const out = new Uint8Array(bytes);
  const view = new DataView(out.buffer);
  if (bytes === 8) view.setBigUint64(0, BigInt(value), true);
  else view.setUint32(0, value, true);
  return out;
}

/** Python's round(): halves to the even neighbour. */
function roundHalfEven(x) {
  const floor = Math.floor(x);
  const rest = x - floor;
  if (rest !== 0.5) return Math.round(x);
  return floor % 2 === 0 ? floor : floor + 1;
}

export class SecureRound {
  constructor() {
    this.stage = null;
  }

  /** Check that `secagg` is the stage after the last one answered, for this node. */
  begin(secagg) {
    const next = this.stage === null ? 0 : STAGES.indexOf(this.stage) + 1;
    const allowed = [STAGES[next], ...(OPTIONAL.has(STAGES[next]) ? [STAGES[next + 1]] : [])];
    if (!allowed.includes(secagg.stage)) throw new SecAggError(`expected the ${allowed.join(" or ")} stage, got ${secagg.stage}`);
    if (this.stage !== null && secagg.node !== this.node) throw new SecAggError("the stage is for another node");
    this.stage = secagg.stage;
  }

  /** The answer to a key stage (setup, share_keys, unmask): an object for the bridge's JSON. */
  async answer(secagg) {
    this.begin(secagg);
    if (secagg.stage === "setup") return this.setup(secagg);
    if (secagg.stage === "share_keys") return this.shareKeys(secagg);
    if (secagg.stage === "odt-prove") return this.prove(secagg);
    if (secagg.stage === "unmask") return this.unmask(secagg);
    throw new SecAggError(`the ${secagg.stage} stage is answered with collect()`);
  }

  async setup(s) {
    Object.assign(this, {
      node: s.node, shareNum: s.share_num, threshold: s.threshold, clippingRange: s.clipping_range,
      targetRange: s.target_range, modRange: s.mod_range, maxWeight: s.max_weight,
    });
    this.pair1 = await generateKeyPair(); // pairwise masks
    this.pair2 = await generateKeyPair(); // encrypting shares to the other nodes
    this.seedShares = new Map();
    this.keyShares = new Map();
    this.sent = new Map(); // node -> the one-off private key (PEM) of the ciphertext sent to it
    return { pk1: toBase64(this.pair1.publicPem), pk2: toBase64(this.pair2.publicPem) };
  }

  async shareKeys(s) {
    if (s.keys.length < this.threshold) throw new SecAggError("fewer neighbours than the threshold");
    const all = s.keys.flatMap(([, a, b]) => [a, b]);
    if (new Set(all).size !== all.length) throw new SecAggError("some public keys are identical");
    this.publicKeys = new Map(s.keys.map(([node, a, b]) => [node, [fromBase64(a), fromBase64(b)]]));
    const own = this.publicKeys.get(this.node);
    if (!own || toBase64(own[0]) !== toBase64(this.pair1.publicPem) || toBase64(own[1]) !== toBase64(this.pair2.publicPem)) {
      throw new SecAggError("this node's public keys are listed wrongly");
    }
    this.seed = crypto.getRandomValues(new Uint8Array(32));
    const seedShares = createShares(this.seed, this.threshold, this.shareNum);
    const keyShares = createShares(this.pair1.privatePem, this.threshold, this.shareNum);
    const destinations = [];
    const ciphertexts = [];
    const ephemeral = [];
    let index = 0;
    for (const [node, [, pk2]] of this.publicKeys) {
      if (node === this.node) {
        this.seedShares.set(node, seedShares[index]);
        this.keyShares.set(node, keyShares[index]);
      } else {
        // each ciphertext under a one-off key pair, so that this node can prove one without the others
        const oneOff = await generateKeyPair();
        const key = await sharedKey(oneOff.privateKey, pk2);
        this.sent.set(node, oneOff.privatePem);
        const share = seedShares[index];
        const plaintext = new Uint8Array([...littleEndian(this.node, 8), ...littleEndian(node, 8),
                                          ...littleEndian(share.length, 4), ...share, ...keyShares[index]]);
        destinations.push(node);
        ciphertexts.push(toBase64(await fernetEncrypt(key, plaintext)));
        ephemeral.push(toBase64(oneOff.publicPem));
      }
      index++;
    }
    return { destinations, ciphertexts, ephemeral };
  }

  /** The shares `source` sent under one-off public key `ephemeral` (PEM), or null when they do not open. */
  async open(source, token, ephemeral) {
    let plain;
    try {
      plain = await fernetDecrypt(await sharedKey(this.pair2.privateKey, ephemeral), token);
    } catch {
      return null;
    }
    if (plain.length < 20) return null;
    const view = new DataView(plain.buffer, plain.byteOffset, plain.byteLength);
    const [from, to, length] = [view.getBigUint64(0, true), view.getBigUint64(8, true), view.getUint32(16, true)];
    if (String(from) !== source || String(to) !== this.node || 20 + length > plain.length) return null;
    return [plain.slice(20, 20 + length), plain.slice(20 + length)];
  }

  /**
   * The collect stage: the global and trained weight buffers (Float32Array, manifest order) and the
   * example count -> the masked vector (Uint32Array: the weight factor, then the update's values in
   * `secagg.order`), quantized, weighted and masked as Flower's client does. The sources whose
   * shares do not open are left out and listed in `this.rejected` (the update's `rejected`): the
   * server asks each to prove its ciphertext, and excludes whoever lied.
   */
  async collect(secagg, start, trained, numExamples) {
    this.begin(secagg);
    if (secagg.ciphertexts.length + 1 < this.threshold) throw new SecAggError("fewer neighbours than the threshold");
    const available = [];
    this.rejected = [];
    for (let i = 0; i < secagg.sources.length; i++) {
      const source = secagg.sources[i];
      const usable = this.publicKeys.has(source) && source !== this.node && !available.includes(source);
      const ephemeral = secagg.ephemeral?.[i];
      const shares = usable && typeof ephemeral === "string" ? await this.open(source, fromBase64(secagg.ciphertexts[i]), fromBase64(ephemeral)) : null;
      if (!shares) {
        this.rejected.push(source);
        continue;
      }
      [this.seedShares, this.keyShares].forEach((held, k) => held.set(source, shares[k]));
      available.push(source);
    }
    const update = new Float64Array(trained.length);
    for (let i = 0; i < update.length; i++) update[i] = trained[i] - start[i];
    if (secagg.clipping_norm !== null && secagg.clipping_norm !== undefined) {
      // Flower's fixedclipping_mod: scale the update to the norm, then the weights are start + update (float32)
      const norm = Math.sqrt(update.reduce((sum, v) => sum + v * v, 0));
      const scale = Math.min(1, secagg.clipping_norm / norm);
      for (let i = 0; i < update.length; i++) update[i] = Math.fround(start[i] + Math.fround(update[i] * scale)) - start[i];
    }
    const weight = roundHalfEven((numExamples / this.maxWeight) * this.targetRange);
    const ratio = weight / this.targetRange;
    const [c, quantizer] = [this.clippingRange, this.targetRange / (2 * this.clippingRange)];
    const total = secagg.order.reduce((sum, [, size]) => sum + size, 0);
    const vector = new Float64Array(1 + total);
    vector[0] = weight;
    let k = 1;
    for (const [offset, size] of secagg.order) {
      for (let i = offset; i < offset + size; i++) {
        const value = (Math.min(c, Math.max(-c, update[i] * ratio)) + c) * quantizer;
        let q = Math.ceil(value); // stochastic rounding, as Flower's quantize
        if (Math.random() < q - value) q -= 1;
        vector[k++] = q;
      }
    }
    const range = this.modRange;
    const add = (mask, sign) => {
      for (let i = 0; i < vector.length; i++) vector[i] = (((vector[i] + sign * mask[i]) % range) + range) % range;
    };
    add(masks(this.seed, range, [[vector.length]])[0], 1);
    const own = BigInt(this.node);
    for (const node of available) {
      const key = await sharedKey(this.pair1.privateKey, this.publicKeys.get(node)[0]);
      add(masks(key, range, [[vector.length]])[0], own > BigInt(node) ? 1 : -1);
    }
    return Uint32Array.from(vector);
  }

  /** The prove stage: the one-off private key of the ciphertext sent to each accuser, once a round. */
  prove(s) {
    const secrets = s.accusers.map((node) => this.sent.get(node));
    if (!secrets.length || secrets.some((secret) => !secret)) throw new SecAggError("asked to prove shares it did not send");
    this.sent.clear(); // answered once: a second request reveals nothing more
    return { secrets: secrets.map(toBase64) };
  }

  unmask(s) {
    if (s.active.length < this.threshold) throw new SecAggError("fewer survivors than the threshold");
    const shares = [...s.active.map((n) => this.seedShares.get(n)), ...s.dead.map((n) => this.keyShares.get(n))];
    if (shares.some((share) => !share)) throw new SecAggError("asked for a share this node does not hold");
    return { nodes: [...s.active, ...s.dead], shares: shares.map(toBase64) };
  }
}

export { toBase64, fromBase64 };
