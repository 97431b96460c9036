// SecAgg+ primitives for the browser, interoperable with Flower 1.41's (flwr.common.secure_aggregation):
// the same masks bit for bit, keys Python loads, shares Python combines, tokens Python decrypts.
//
//   masks(seed, 2 ** 32, [[1], [64, 128]])      numpy's legacy RandomState(seed32).randint(0, range - 1, shape)
//   await generateKeyPair()                     ECDH P-384: { privateKey, privatePem (PKCS8), publicPem (SPKI) }
//   await sharedKey(privateKey, publicPem)      HKDF-SHA256 of the ECDH secret, base64url: a Fernet key
//   await fernetEncrypt(key, bytes) / fernetDecrypt(key, token)
//   createShares(secret, threshold, count)      Shamir over GF(2^128), Flower's share layout
//   combineShares(shares)
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

export { toBase64, fromBase64 };
