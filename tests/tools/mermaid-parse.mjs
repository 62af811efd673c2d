// Parses Mermaid diagrams with Mermaid's own parser (in Node, over jsdom): reads diagrams
// from stdin, one per `stateDiagram-v2` header, prints `ok` or `FAIL <message>` for each and
// exits 1 when any fails. Usage: node mermaid-parse.mjs <node_modules dir holding mermaid
// and jsdom>. `scripts/setup-deps --test` installs them (tests/graph.rs uses this).
import { createRequire } from 'node:module';
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { pathToFileURL } from 'node:url';

const modules = process.argv[2];
const require = createRequire(join(modules, 'noop.js'));
const { JSDOM } = require('jsdom');
const dom = new JSDOM('<!doctype html><html><body></body></html>');
globalThis.window = dom.window;
globalThis.document = dom.window.document;
const entry = require.resolve('mermaid');
const { default: mermaid } = await import(pathToFileURL(entry).href);
const text = readFileSync(0, 'utf8');
let failed = 0;
for (const chunk of text.split(/\n(?=stateDiagram-v2)/)) {
  if (!chunk.trim()) continue;
  try {
    await mermaid.parse(chunk);
    console.log('ok');
  } catch (e) {
    failed++;
    console.log('FAIL ' + String(e.message || e).replace(/\n/g, ' ').slice(0, 600));
  }
}
process.exit(failed ? 1 : 0);
