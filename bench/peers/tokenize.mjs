// The JavaScript tokenizers kuai's tokenizer.json reader is compared with (and timed against):
//   node tokenize.mjs MODULES PEER CORPUS [--time | --whole]
// prints the token ids of every line of CORPUS (one line of ids per line), with --whole the ids of
// the whole file as one text (newlines and all) on one line, or with --time only
// the time of encoding all lines, the faster of two passes (the peer at its best), in ms. MODULES is the node_modules folder scripts/setup.sh
// --hf-tokenizers fills; PEER is one of
//   llama-tokenizer-js    LLaMA-1/2 (its own vocabulary; BOS and the leading space, its defaults)
//   llama3-tokenizer-js   LLaMA-3 (no BOS: the tokenizer.json it is compared with adds none)
//   gpt-3-encoder         GPT-2
//   lenml:FILE            transformers.js (@lenml/tokenizers) reading the tokenizer.json FILE
//                         (and the tokenizer_config.json beside it), special tokens added
import { readFileSync } from 'node:fs';
import { createRequire } from 'node:module';
import { dirname, join, resolve } from 'node:path';
import { pathToFileURL } from 'node:url';

const [modulesArg, peer, corpus, ...rest] = process.argv.slice(2);
if (!modulesArg || !peer || !corpus) {
  console.error('usage: node tokenize.mjs MODULES PEER CORPUS [--time]');
  process.exit(2);
}
const modules = resolve(modulesArg);
const timeOnly = rest.includes('--time');
const whole = rest.includes('--whole');
const load = async (rel) => import(pathToFileURL(join(modules, rel)).href);

let encode;
if (peer === 'llama-tokenizer-js') {
  const t = (await load('llama-tokenizer-js/llama-tokenizer.js')).default;
  // It returns no ids at all for an empty text; a tokenizer.json's template still adds BOS.
  encode = (s) => (s.length ? t.encode(s) : [1]);
} else if (peer === 'llama3-tokenizer-js') {
  const t = (await load('llama3-tokenizer-js/bundle/llama3-tokenizer-with-baked-data.js')).default;
  encode = (s) => t.encode(s, { bos: false, eos: false });
} else if (peer === 'gpt-3-encoder') {
  const t = createRequire(join(modules, 'x.js'))('gpt-3-encoder');
  encode = (s) => t.encode(s);
} else if (peer.startsWith('lenml:')) {
  const file = peer.slice('lenml:'.length);
  const { TokenizerLoader } = await load('@lenml/tokenizers/dist/main.mjs');
  const t = TokenizerLoader.fromPreTrained({
    tokenizerJSON: JSON.parse(readFileSync(file, 'utf8')),
    tokenizerConfig: JSON.parse(readFileSync(join(dirname(file), 'tokenizer_config.json'), 'utf8')),
  });
  encode = (s) => t.encode(s, { add_special_tokens: true });
} else {
  console.error(`unknown peer "${peer}"`);
  process.exit(2);
}

const all = readFileSync(corpus, 'utf8');
let lines = all.split('\n');
if (lines.length && lines[lines.length - 1] === '') lines.pop();
if (whole) {
  process.stdout.write(encode(all).join(' ') + '\n');
} else if (timeOnly) {
  // Two timed passes, the faster reported: the first includes the JIT's compiling, the second
  // was slower on some runs (its collector busier).
  let best = Infinity;
  let n = 0;
  for (let pass = 0; pass < 2; ++pass) {
    const t0 = process.hrtime.bigint();
    n = 0;
    for (const line of lines) n += encode(line).length;
    best = Math.min(best, Number(process.hrtime.bigint() - t0) / 1e6);
  }
  console.log(`${best.toFixed(3)} ms ${n} tokens`);
} else {
  const out = [];
  for (const line of lines) out.push(encode(line).join(' '));
  process.stdout.write(out.join('\n') + (out.length ? '\n' : ''));
}
