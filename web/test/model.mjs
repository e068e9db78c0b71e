// End-to-end test of the real-model page (web/model.html): headless
// Chromium (WebGPU on SwiftShader) loads SmolLM2-135M from the local
// server, generates greedily through the page's own controls, and checks
// the tokens against the committed reference fixture (llama.cpp's, in
// model/tests/fixture/reference.json). Then a 4-beam request: at every
// step the shared-block count the page draws must equal the block
// manager's and the recount from the block tables; the beams must share
// the prompt's blocks and branch, and every block must come back at the
// end. A second prompt with the same system prompt must hit the prefix
// cache. The page again with the split-K decode matmul: greedy tokens
// equal the fixture's. Saves web/screenshot-model.png (or $PAGEDATTN_MODEL_SCREENSHOT)
// mid-generation of the beams.
//
// Usage: node model.mjs http://127.0.0.1:PORT/   (scripts/web-test.sh runs it)

import { chromium } from 'playwright-core';
import { mkdtempSync, readFileSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';

const base = process.argv[2] || process.env.PAGEDATTN_URL;
if (!base) {
  console.error('usage: node model.mjs <url of the served web/ folder>');
  process.exit(2);
}
const here = dirname(fileURLToPath(import.meta.url));
const fixture = JSON.parse(readFileSync(join(here, '..', '..', 'model', 'tests', 'fixture', 'reference.json'), 'utf8'));
const GREEDY_TOKENS = 16;
const BEAM_TOKENS = 8;
// Split-K on SwiftShader runs a workgroup per output column: about 28 s a
// decode step there (49,152 head columns), so 2 tokens (the prefill's and
// one split-K step).
const SPLITK_TOKENS = 2;
const LIMIT_MS = 600_000;
const screenshot = process.env.PAGEDATTN_MODEL_SCREENSHOT || join(here, '..', 'screenshot-model.png');

const failures = [];
function check(ok, what) {
  console.log(`${ok ? 'ok  ' : 'FAIL'} ${what}`);
  if (!ok) failures.push(what);
}
const watchdog = setTimeout(() => {
  console.error(`FAIL: no result within ${LIMIT_MS / 1000} s`);
  process.exit(1);
}, LIMIT_MS);

const userDataDir = mkdtempSync(join(tmpdir(), 'pagedattn-chromium-'));
const ctx = await chromium.launchPersistentContext(userDataDir, {
  executablePath: '/usr/bin/chromium',
  headless: false, // `--headless=new` below
  viewport: { width: 1280, height: 1000 },
  args: ['--headless=new', '--no-sandbox', '--disable-background-networking', '--disable-component-update',
    '--disable-sync', '--no-first-run', '--disable-quic', '--enable-unsafe-webgpu'],
});
const t0 = Date.now();
const pageErrors = [];
const secs = () => ((Date.now() - t0) / 1000).toFixed(1);
try {
  const page = ctx.pages()[0] || (await ctx.newPage());
  page.on('pageerror', (e) => pageErrors.push(`pageerror: ${e.message}`));
  page.on('console', (m) => {
    if (m.type() === 'error') pageErrors.push(`console.error: ${m.text()}`);
  });
  const state = () => page.evaluate(() => window.pagedattnModel);

  await page.goto(new URL('model.html?autoload', base).href, { waitUntil: 'load' });
  await page.waitForFunction(() => {
    const s = window.pagedattnModel;
    return s && (s.ready || s.error);
  }, null, { timeout: 300_000 });
  let s = await state();
  if (s.error) throw new Error(`page reported: ${s.error}`);
  console.log(`loaded in ${secs()} s: ${s.info.adapter}, kernel ${s.info.kernel}, ${s.info.num_blocks} blocks`);
  check(s.adapter && s.adapter.backend === 'BrowserWebGpu', `the model runs on WebGPU (${s.adapter && s.adapter.name})`);
  check(s.loadTotal > 0 && s.loadBytes === s.loadTotal, `the download showed progress to its end (${s.loadBytes} of ${s.loadTotal} bytes)`);

  // 1. Greedy, through the page's controls, against the fixture.
  const g = fixture.greedy[0];
  await page.fill('#prompt', g.user);
  await page.selectOption('#mode', 'greedy');
  await page.fill('#max_tokens', String(GREEDY_TOKENS));
  const tg = Date.now();
  await page.click('#generate');
  await page.waitForFunction(() => {
    const s = window.pagedattnModel;
    return s.error || (s.snapshot && s.snapshot.requests.length === 1 && s.snapshot.requests[0].finished && !s.running);
  }, null, { timeout: LIMIT_MS });
  s = await state();
  if (s.error) throw new Error(`page reported: ${s.error}`);
  const added = s.added[0];
  check(JSON.stringify(added.prompt_ids) === JSON.stringify(g.prompt_ids),
    `the page's tokenizer gives the fixture's ${g.prompt_ids.length} prompt ids`);
  const got = s.snapshot.requests[0].sequences[0].tokens;
  const want = g.tokens.slice(0, GREEDY_TOKENS);
  check(JSON.stringify(got) === JSON.stringify(want),
    `greedy: ${got.length} tokens identical to the reference (${JSON.stringify(got.slice(0, 6))}…)`);
  const text = await page.locator('#texts .txt').first().textContent();
  check(text.length > 20 && text === s.snapshot.requests[0].sequences[0].text, `the text is shown: "${text.slice(0, 60)}…"`);
  console.log(`greedy ${GREEDY_TOKENS} tokens in ${((Date.now() - tg) / 1000).toFixed(1)} s (prefill ${s.snapshot.numbers.prefill_tokens_per_s.toFixed(1)} tokens/s, decode ${s.snapshot.numbers.decode_tokens_per_s.toFixed(1)} tokens/s)`);
  check(s.snapshot.numbers.used === 0, `the finished request's blocks are free again (${s.snapshot.numbers.used} used)`);

  // 2. Four beams: the drawn shared count against the engine's at every step.
  const b = fixture.beam[0];
  await page.fill('#prompt', b.user);
  await page.selectOption('#mode', 'beam');
  await page.fill('#n', '4');
  await page.fill('#max_tokens', String(BEAM_TOKENS));
  const stepsBefore = s.snapshot.numbers.steps;
  const hitsBefore = s.snapshot.numbers.prefix_hit_tokens;
  await page.click('#generate');
  let mismatches = 0;
  let compared = 0;
  let peak = 0;
  let branched = false;
  let shot = false;
  let lastSteps = stepsBefore;
  for (;;) {
    await page.waitForFunction((n) => {
      const s = window.pagedattnModel;
      return s.error || (s.snapshot && s.snapshot.numbers.steps > n) || (s.snapshot && s.snapshot.requests[1] && s.snapshot.requests[1].finished && !s.running);
    }, lastSteps, { timeout: LIMIT_MS });
    s = await state();
    if (s.error) throw new Error(`page reported: ${s.error}`);
    const snap = s.snapshot;
    lastSteps = snap.numbers.steps;
    const dom = Number(await page.locator('#num-shared').textContent());
    // The page may have drawn a newer snapshot than the one read; compare
    // what was drawn from this very snapshot: state.shown is set by draw().
    if (s.shown.shared !== snap.numbers.shared || snap.numbers.shared !== snap.numbers.shared_recount) mismatches += 1;
    if (dom !== snap.numbers.shared && !s.running) mismatches += 1;
    compared += 1;
    peak = Math.max(peak, snap.numbers.shared);
    const r = snap.requests[1];
    if (r && r.sequences.length === 4 && !r.finished) {
      const tables = snap.seqs.filter((q) => q.request === r.request).map((q) => q.table);
      if (tables.length === 4 && new Set(tables.map((t) => t[0])).size === 1
        && new Set(tables.map((t) => t[t.length - 1])).size > 1) branched = true;
      if (!shot && branched && snap.numbers.shared > 0) {
        await page.screenshot({ path: screenshot });
        console.log(`screenshot at step ${snap.numbers.steps}: ${screenshot}`);
        shot = true;
      }
    }
    if (r && r.finished && !s.running) break;
  }
  s = await state();
  const r = s.snapshot.requests[1];
  check(mismatches === 0, `the page's shared-block count equals the engine's and the tables' at each of ${compared} steps read`);
  check(peak > 0, `the beams shared blocks (peak ${peak} shared, engine peak ${s.snapshot.numbers.peak_blocks_shared})`);
  check(branched, 'four beams shared their prompt\'s first block and branched into their own last blocks');
  check(shot, 'a screenshot was taken mid-generation');
  check(r.sequences.length === 4 && r.sequences.every((q) => q.tokens.length > 0), `4 beams finished (${r.sequences.map((q) => q.tokens.length).join(', ')} tokens)`);
  check(s.snapshot.requests[1].prompt_tokens === b.prompt_ids.length, `the beam prompt has the fixture's ${b.prompt_ids.length} ids`);
  check(s.snapshot.numbers.prefix_hit_tokens > hitsBefore,
    `the second prompt reused the first one's system prompt from the prefix cache (${s.snapshot.numbers.prefix_hit_tokens - hitsBefore} tokens)`);
  const n = s.snapshot.numbers;
  check(n.used === 0 && n.sequences === 0 && n.free + n.evictable === n.total,
    `every block back at the end (${n.used} used, ${n.free} free + ${n.evictable} cached of ${n.total})`);
  check(s.snapshot.problems.length === 0, `bookkeeping consistent${s.snapshot.problems.length ? `: ${s.snapshot.problems[0]}` : ''}`);
  check(n.contiguous_blocks > n.peak_blocks_used, `paging held fewer blocks than contiguous reservation (${n.peak_blocks_used} < ${n.contiguous_blocks})`);
  check(pageErrors.length === 0, `no page or console errors${pageErrors.length ? `: ${pageErrors.slice(0, 3).join(' | ')}` : ''}`);

  // 3. The split-K decode matmul (what a GPU's browser runs; SwiftShader
  // gets the tiled one by default): the page again, greedy against the
  // fixture.
  await page.goto(new URL('model.html?autoload&decode_matmul=split-k', base).href, { waitUntil: 'load' });
  await page.waitForFunction(() => {
    const s = window.pagedattnModel;
    return s && (s.ready || s.error);
  }, null, { timeout: 300_000 });
  s = await state();
  if (s.error) throw new Error(`page reported: ${s.error}`);
  check(s.info.decode_matmul === 'split-k', `the page loaded with the split-K decode matmul (${s.info.decode_matmul})`);
  await page.fill('#prompt', g.user);
  await page.selectOption('#mode', 'greedy');
  await page.fill('#max_tokens', String(SPLITK_TOKENS));
  const tk = Date.now();
  await page.click('#generate');
  await page.waitForFunction(() => {
    const s = window.pagedattnModel;
    return s.error || (s.snapshot && s.snapshot.requests.length === 1 && s.snapshot.requests[0].finished && !s.running);
  }, null, { timeout: LIMIT_MS });
  s = await state();
  if (s.error) throw new Error(`page reported: ${s.error}`);
  const gotK = s.snapshot.requests[0].sequences[0].tokens;
  check(JSON.stringify(gotK) === JSON.stringify(g.tokens.slice(0, SPLITK_TOKENS)),
    `split-K greedy: ${gotK.length} tokens identical to the reference, in ${((Date.now() - tk) / 1000).toFixed(1)} s (decode ${s.snapshot.numbers.decode_tokens_per_s.toFixed(1)} tokens/s)`);
  check(pageErrors.length === 0, `no page or console errors with split-K${pageErrors.length ? `: ${pageErrors.slice(0, 3).join(' | ')}` : ''}`);

  // 4. A file that is not a model: one clear message, and the page still works.
  const bad = join(mkdtempSync(join(tmpdir(), 'pagedattn-bad-')), 'not-a-model.gguf');
  (await import('node:fs')).writeFileSync(bad, 'this is not a GGUF file');
  await page.setInputFiles('#load-file', bad);
  await page.waitForFunction(() => window.pagedattnModel.error && !window.pagedattnModel.loading, null, { timeout: 60_000 });
  s = await state();
  check(/could not be loaded/.test(s.error) && await page.locator('#fatal').isVisible(), `a bad file is refused on the page: "${s.error.slice(0, 90)}"`);
} catch (e) {
  failures.push(String(e && e.stack ? e.stack : e));
  console.error(`FAIL: ${e && e.message ? e.message : e}`);
  for (const p of pageErrors) console.error(`  ${p}`);
} finally {
  await ctx.close();
  rmSync(userDataDir, { recursive: true, force: true });
}
clearTimeout(watchdog);
console.log(`${failures.length ? 'FAILED' : 'passed'} in ${secs()} s`);
process.exit(failures.length ? 1 : 0);
