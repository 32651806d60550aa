// A conformance implementation of the rng kind (SPEC §1), written from spec/ alone: Node.js,
// standard library only. Run inside fixtures/ by the runner, one process per case:
//     python3 spec/run.py --impl "node ../example/rng.mjs" --kind rng
// Any other kind is answered with a name no case expects, so its cases fail.
import { readFileSync } from "node:fs";

const MASK = (1n << 64n) - 1n;
const GAMMA = 0x9e3779b97f4a7c15n;

class UsageError extends Error {}

function mix64(z) {
  z = ((z ^ (z >> 30n)) * 0xbf58476d1ce4e5b9n) & MASK;
  z = ((z ^ (z >> 27n)) * 0x94d049bb133111ebn) & MASK;
  return z ^ (z >> 31n);
}

// A 64-bit field: a string of decimal digits (README.md, "Encoding"); anything else is refused.
function decimal(value) {
  if (typeof value !== "string" || !/^-?[0-9]+$/.test(value)) throw new UsageError();
  return BigInt(value);
}

function labelWords(label) {
  if (typeof label === "string") {
    const bytes = new TextEncoder().encode(label);
    const words = [2n, BigInt(bytes.length)];
    for (let j = 0; j < bytes.length; j += 8) {
      let word = 0n;
      for (let k = 7; k >= 0; k--) word = (word << 8n) | BigInt(bytes[j + k] ?? 0);
      words.push(word);
    }
    return words;
  }
  if (label !== null && typeof label === "object" && Object.keys(label).join() === "int") {
    const value = decimal(label.int);
    if (value < -(1n << 63n) || value > MASK) throw new UsageError();
    return [1n, value & MASK];
  }
  throw new UsageError();
}

const u64 = (key, i) => mix64((key + (i + 1n) * GAMMA) & MASK);
const hex = (word) => "0x" + word.toString(16).padStart(16, "0");

function rng(input) {
  const seed = input.seed === null ? 42n : decimal(input.seed);
  if (seed < 0n || seed > MASK) throw new UsageError();
  let key = seed;
  for (const label of input.labels) {
    for (const word of labelWords(label)) key = mix64(((key ^ word) + GAMMA) & MASK);
  }
  const n = decimal(input.below_n);
  if (n < 1n || n > MASK + 1n) throw new UsageError();
  const ids = input.permute;
  if (!ids.every((id) => Number.isInteger(id) && id >= 0) || new Set(ids).size !== ids.length) {
    throw new UsageError();
  }
  const indices = input.indices.map(decimal);
  if (indices.some((i) => i < 0n || i > MASK)) throw new UsageError();
  const byWord = (a, b) => {
    const x = u64(key, BigInt(a));
    const y = u64(key, BigInt(b));
    return x < y ? -1 : x > y ? 1 : a - b;
  };
  return {
    key: hex(key),
    u64: indices.map((i) => hex(u64(key, i))),
    below: indices.map((i) => ((u64(key, i) * n) >> 64n).toString()),
    permutation: [...ids].sort(byWord),
  };
}

const KINDS = { rng };
const request = JSON.parse(readFileSync(0, "utf8"));
let answer;
try {
  const kind = KINDS[request.kind];
  answer = kind ? kind(request.input) : { error: `kind ${request.kind} is not implemented` };
} catch (error) {
  if (!(error instanceof UsageError)) throw error;
  answer = { error: "UsageError" };
}
process.stdout.write(JSON.stringify(answer));
