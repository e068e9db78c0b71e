// The page's glue: reads the controls, drives the Rust demo (compiled to wasm,
// see web/src/lib.rs) one step at a time, and draws the snapshot each step returns.
// No paging or attention logic lives here; the numbers drawn are the library's.
//
// `window.pagedattnState` mirrors what the page shows, for the end-to-end
// test in web/test/ (and for anyone poking at the console).

import init, * as wasm from './pkg/pagedattn.js';

const $ = (id) => document.getElementById(id);
const FIELDS = ['block_size', 'num_blocks', 'requests', 'samples', 'seed', 'kv_dtype'];
const STALL_STEPS = 64;

const state = {
  ready: false,
  error: null,
  webgpu: false,
  backend: null,
  adapter: null,
  config: null,
  running: false, // the Play loop is on
  busy: false, // a step is in flight (its result not yet absorbed and drawn)
  steps: 0,
  done: false,
  maxErr: 0,
  lastErr: null,
  lastCopies: 0,
  // Cascade: steps that read shared prompts once, and K/V bytes read vs
  // what plain decode reads (all steps so far).
  cascadeSteps: 0,
  kvRead: 0,
  kvPlain: 0,
  // Layer 0's decode time in cascade steps (wall clock, submit to
  // readback): with the cascade, and plain decode of the same step.
  cascadeMs: 0,
  plainMs: 0,
  tolerance: null,
  errorsFinite: true,
  used: 0,
  free: 0,
  shared: 0,
  total: 0,
  sequences: 0,
  copiesTotal: 0,
  peakShared: 0,
  peakUsed: 0,
  peakSequences: 0,
  consistent: true,
  problems: [],
  gpuErrors: [],
  stepMs: null,
  stepMsTotal: 0,
  gpuMs: null,
};
window.pagedattnState = state;

let demo = null;
let snap = null;
let busy = null; // the step in flight, if any
let idleSteps = 0;
let log = [];

function fatal(msg) {
  state.error = msg;
  const el = $('fatal');
  el.textContent = msg;
  el.hidden = false;
}

function readConfig() {
  const num = (id) => Math.max(0, Math.floor(Number($(id).value) || 0));
  return {
    block_size: num('block_size'),
    num_blocks: Math.min(4096, Math.max(8, num('num_blocks'))),
    requests: Math.min(64, Math.max(1, num('requests'))),
    samples: Math.min(8, Math.max(1, num('samples'))),
    seed: Math.min(4294967295, num('seed')),
    kv_dtype: $('kv_dtype').value,
  };
}

// Colors: hue by request (golden angle, so neighbours differ), shade by sample.
const hue = (req) => (req * 137.508 + 200) % 360;
function blockColor(b) {
  if (b.refs === 0) return '#e7e9ec';
  if (b.request < 0) return 'hsl(0 0% 40%)';
  const h = hue(b.request);
  if (b.refs > 1) return `hsl(${h} 65% 32%)`;
  return `hsl(${h} 62% ${46 + (b.sample % 4) * 7}%)`;
}
const paleColor = (b) => (b.request < 0 ? '#bbb' : `hsl(${hue(b.request)} 60% 87%)`);
const seqColor = (q) => `hsl(${hue(q.request)} 62% ${46 + (q.sample % 4) * 7}%)`;
const seqName = (q) => `r${q.request}·s${q.sample}`;

let grid = { cols: 1, cell: 1, gap: 1 };

function drawPool() {
  const canvas = $('pool');
  const blocks = snap.blocks;
  const n = blocks.length;
  const cssW = canvas.clientWidth || 720;
  // Wider than tall; small pools get big readable cells.
  const cols = Math.max(8, Math.ceil(Math.sqrt(n * 2.4)));
  const rows = Math.ceil(n / cols);
  const cell = Math.min(40, Math.floor(cssW / cols)); // small pools: readable, not huge
  const gap = cell >= 10 ? 2 : 1;
  const cssH = rows * cell;
  const dpr = window.devicePixelRatio || 1;
  canvas.width = Math.round(cssW * dpr);
  canvas.height = Math.round(cssH * dpr);
  canvas.style.height = `${cssH}px`;
  const g = canvas.getContext('2d');
  g.setTransform(dpr, 0, 0, dpr, 0, 0);
  g.clearRect(0, 0, cssW, cssH);
  grid = { cols, cell, gap };
  const bs = snap.block_size;
  const cascadeBlocks = new Set(snap.step ? snap.step.cascade_blocks : []);
  g.textAlign = 'center';
  g.textBaseline = 'middle';
  g.font = `700 ${Math.max(8, Math.floor(cell * 0.5))}px system-ui, sans-serif`;
  for (let i = 0; i < n; i++) {
    const b = blocks[i];
    const x = (i % cols) * cell;
    const y = Math.floor(i / cols) * cell;
    const w = cell - gap;
    if (b.refs === 0) {
      g.fillStyle = blockColor(b);
      g.fillRect(x, y, w, w);
    } else {
      // The filled part of the block in full color, its empty slots pale:
      // the waste paging leaves is at most one partial block per sequence.
      const fw = Math.max(1, Math.round((w * b.fill) / bs));
      g.fillStyle = paleColor(b);
      g.fillRect(x, y, w, w);
      g.fillStyle = blockColor(b);
      g.fillRect(x, y, fw, w);
    }
    // Blocks of shared segments the cascade attended once this step: a gold
    // bar along the top.
    if (cascadeBlocks.has(i)) {
      g.fillStyle = '#f2b400';
      g.fillRect(x, y, w, Math.max(2, Math.round(cell / 6)));
    }
    // Copies are ringed black-and-white, which stands out on every hue.
    if (b.copied_to) {
      const lw = Math.max(2, Math.round(cell / 8));
      g.strokeStyle = '#111';
      g.lineWidth = lw;
      g.strokeRect(x + lw / 2, y + lw / 2, w - lw, w - lw);
      g.strokeStyle = '#fff';
      g.lineWidth = 1;
      g.strokeRect(x + lw + 0.5, y + lw + 0.5, w - 2 * lw - 1, w - 2 * lw - 1);
    } else if (b.copied_from) {
      g.strokeStyle = '#111';
      g.lineWidth = 2;
      g.setLineDash([3, 2]);
      g.strokeRect(x + 1, y + 1, w - 2, w - 2);
      g.setLineDash([]);
    }
    if (b.refs > 1 && cell >= 11) {
      g.fillStyle = '#fff';
      g.fillText(String(b.refs), x + w / 2, y + w / 2 + 1);
    }
  }
}

function holdersOf(block) {
  return snap.seqs.filter((q) => q.table.includes(block)).map(seqName);
}

function onHover(ev) {
  if (!snap) return;
  const r = $('pool').getBoundingClientRect();
  const col = Math.floor((ev.clientX - r.left) / grid.cell);
  const row = Math.floor((ev.clientY - r.top) / grid.cell);
  const i = row * grid.cols + col;
  const b = col < grid.cols ? snap.blocks[i] : undefined;
  if (!b) {
    $('hover').textContent = 'Hover a block for its owners.';
    return;
  }
  $('hover').textContent = b.refs === 0
    ? `block ${i}: free`
    : `block ${i}: ref count ${b.refs}, held by ${holdersOf(i).join(', ')}; ${b.fill}/${snap.block_size} slots filled`
      + (b.copied_to ? '; just written by copy-on-write' : '');
}

function dl(el, rows) {
  el.replaceChildren();
  for (const [k, v, cls] of rows) {
    const dt = document.createElement('dt');
    dt.textContent = k;
    const dd = document.createElement('dd');
    dd.textContent = v;
    if (cls) dd.className = cls;
    el.append(dt, dd);
  }
}

const fmtErr = (x) => (x === null || x === undefined ? '–' : Number(x).toExponential(2));

function drawNumbers() {
  const n = snap.numbers;
  const pct = (x) => `${((100 * x) / n.total).toFixed(0)}%`;
  const contig = n.contiguous_blocks;
  dl($('numbers'), [
    ['blocks used / free', `${n.used} (${pct(n.used)}) / ${n.free}`],
    ['blocks shared (ref > 1)', `${n.shared}`],
    ['pool (blocks × tokens)', `${n.total} × ${snap.block_size}`],
    ['sequences live / waiting', `${n.sequences} / ${n.waiting}`],
    ['tokens logical → stored', `${n.logical_tokens} → ${n.tokens_stored}`],
    ['saved by sharing', `${n.logical_tokens - n.tokens_stored} tokens`],
    ['waste (empty slots held)', `${n.waste_pct.toFixed(1)}%`],
    ['contiguous would reserve', `${contig} blocks`
      + (contig > n.total ? ' (> pool!)' : n.used ? ` (${(contig / n.used).toFixed(1)}×)` : ''),
      contig > n.total ? 'bad' : ''],
  ]);
  $('contig-note').textContent = `Contiguous: each live sequence reserves its prompt + the most `
    + `${n.max_output} output tokens up front, nothing shared between samples.`;
  const c = snap.check;
  const s = snap.step;
  const errOk = state.errorsFinite && state.maxErr < c.tolerance;
  dl($('kernels'), [
    ['backend', state.webgpu ? 'WebGPU' : state.backend || '–', state.webgpu ? 'ok' : 'bad'],
    ['step', s ? `${s.step + 1}${snap.done ? ' (finished)' : ''}` : '–'],
    ['admitted / forked / finished', s ? `${s.admitted} / ${s.forked} / ${s.finished}` : '–'],
    ['write_kv tokens · decode seqs', s ? `${s.written} · ${s.decoded} (× 2 layers)` : '–'],
    ['copy_blocks (CoW) now / total', s ? `${s.copied} / ${c.total_copies}` : '–'],
    ['max rel. error, this step', s && s.decoded ? fmtErr(s.max_rel_err) : '–',
      !s || !s.decoded ? '' : s.max_rel_err < c.tolerance ? 'ok' : 'bad'],
    [`worst error (tolerance ${c.tolerance.toExponential(0)})`, fmtErr(c.worst_err), errOk ? 'ok' : 'bad'],
    ['time per step (avg)', state.stepMs === null ? '–'
      : `${state.stepMs.toFixed(1)} ms (${(state.stepMsTotal / Math.max(1, state.steps)).toFixed(1)})`],
    ['block accounting', c.consistent ? 'consistent' : 'INCONSISTENT', c.consistent ? 'ok' : 'bad'],
    ['shared segments read once (gold)', s && s.decoded
      ? (s.cascade_segments ? `${s.cascade_segments}` : 'none (plain decode)') : '–'],
    ['K/V read per layer, this step: cascade / plain', s && s.decoded
      ? `${(s.kv_bytes / 1e3).toFixed(1)} / ${(s.kv_bytes_plain / 1e3).toFixed(1)} KB` : '–'],
    ['K/V read so far: cascade / plain', state.kvPlain
      ? `${(state.kvRead / 1e6).toFixed(2)} / ${(state.kvPlain / 1e6).toFixed(2)} MB (${state.cascadeSteps} cascade steps)` : '–'],
    ['decode time, layer 0, this step: cascade / plain', s && s.cascade_segments
      ? `${s.decode_ms.toFixed(2)} / ${s.decode_ms_plain.toFixed(2)} ms` : s && s.decoded ? `${s.decode_ms.toFixed(2)} ms (plain decode)` : '–'],
    ['decode time so far, cascade steps: cascade / plain', state.cascadeSteps
      ? `${state.cascadeMs.toFixed(1)} / ${state.plainMs.toFixed(1)} ms` : '–'],
  ]);
  if (!c.consistent) $('kernels').lastChild.title = c.problems.join('\n');
  $('pool-caption').textContent =
    `${n.total} blocks of ${snap.block_size} tokens · K/V ${c.kv_dtype === 'f16' ? 'packed f16' : c.kv_dtype} · 2 layers × 2 KV heads × 64`;
}

function drawTables() {
  const copiedTo = new Set(snap.blocks.flatMap((b, i) => (b.copied_to ? [i] : [])));
  const rows = snap.seqs.map((q) => {
    const row = document.createElement('div');
    row.className = 'row';
    const name = document.createElement('span');
    name.className = 'name';
    name.style.color = seqColor(q);
    name.textContent = seqName(q);
    const len = document.createElement('span');
    len.className = 'len';
    len.textContent = `${q.len} tok, +${q.remaining}`;
    const chips = document.createElement('span');
    chips.className = 'chips';
    for (const id of q.table) {
      const b = snap.blocks[id];
      const chip = document.createElement('span');
      chip.className = 'chip' + (b.refs > 1 ? ' shared' : '') + (copiedTo.has(id) ? ' copied' : '');
      chip.style.background = blockColor(b);
      chip.textContent = id;
      chip.title = `block ${id}, ref count ${b.refs}`;
      chips.append(chip);
    }
    row.append(name, len, chips);
    return row;
  });
  if (!rows.length) {
    const p = document.createElement('p');
    p.textContent = snap.done ? 'All requests finished; every block is back in the pool.' : 'No live sequences.';
    rows.push(p);
  }
  $('tables').replaceChildren(...rows);
}

function logEvents(prev, next) {
  const s = next.step;
  if (!s) return;
  const at = `step ${s.step + 1}: `;
  const before = new Map((prev ? prev.seqs : []).map((q) => [q.id, q]));
  const after = new Set(next.seqs.map((q) => q.id));
  for (const q of next.seqs) {
    if (!before.has(q.id) && q.sample === 0) log.push([at + `${seqName(q)} admitted, prompt ${q.len} tokens`, '']);
  }
  if (s.forked) log.push([at + `${s.forked} forks share their prompt's blocks`, '']);
  for (const [src, dst] of s.copies) log.push([at + `copy-on-write: block ${src} → ${dst}`, 'copy']);
  for (const [id, q] of before) if (!after.has(id)) log.push([at + `${seqName(q)} finished, blocks released`, '']);
  log = log.slice(-40);
  $('log').replaceChildren(...log.slice(-10).reverse().map(([t, cls]) => {
    const li = document.createElement('li');
    li.textContent = t;
    li.className = cls;
    return li;
  }));
}

function render() {
  drawPool();
  drawNumbers();
  drawTables();
}

function absorb(next) {
  const n = next.numbers;
  const c = next.check;
  const s = next.step;
  Object.assign(state, {
    done: next.done,
    used: n.used,
    free: n.free,
    shared: n.shared,
    total: n.total,
    sequences: n.sequences,
    copiesTotal: c.total_copies,
    tolerance: c.tolerance,
    kvDtype: c.kv_dtype,
    maxErr: c.worst_err,
    lastErr: s ? s.max_rel_err : null,
    lastCopies: s ? s.copied : 0,
    cascadeSteps: state.cascadeSteps + (s && s.cascade_segments > 0 ? 1 : 0),
    kvRead: state.kvRead + (s ? s.kv_bytes : 0),
    kvPlain: state.kvPlain + (s ? s.kv_bytes_plain : 0),
    cascadeMs: state.cascadeMs + (s && s.cascade_segments > 0 ? s.decode_ms : 0),
    plainMs: state.plainMs + (s && s.cascade_segments > 0 ? s.decode_ms_plain : 0),
    gpuMs: s ? s.gpu_ms : null,
    gpuErrors: c.gpu_errors,
    peakShared: Math.max(state.peakShared, n.shared),
    peakUsed: Math.max(state.peakUsed, n.used),
    peakSequences: Math.max(state.peakSequences, n.sequences),
  });
  if (s && !Number.isFinite(s.max_rel_err)) state.errorsFinite = false;
  if (!c.consistent) {
    state.consistent = false;
    state.problems.push(...c.problems.map((p) => `step ${state.steps}: ${p}`));
  }
  logEvents(snap, next);
  snap = next;
}

async function step() {
  if (busy || !demo || (snap && snap.done)) return busy;
  state.busy = true;
  busy = (async () => {
    try {
      const t0 = performance.now();
      const next = JSON.parse(await demo.step());
      state.stepMs = performance.now() - t0;
      state.stepMsTotal += state.stepMs;
      state.steps += 1;
      const s = next.step;
      idleSteps = s.written === 0 && s.admitted === 0 && !next.done ? idleSteps + 1 : 0;
      absorb(next);
      render();
      if (idleSteps >= STALL_STEPS) {
        pause();
        fatal(`No progress for ${STALL_STEPS} steps: the pool is too small for this workload. Enlarge the pool or shrink the requests, then Reset.`);
      }
    } catch (e) {
      pause();
      fatal(`Step failed: ${e && e.message ? e.message : e}` + (window.pagedattnPanic ? ` (${window.pagedattnPanic})` : ''));
    } finally {
      busy = null;
      state.busy = false;
      buttons();
    }
  })();
  return busy;
}

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

// Each Play starts a new loop; a paused loop still asleep must not resume.
let loopId = 0;

async function play() {
  if (state.running) return;
  state.running = true;
  const id = ++loopId;
  buttons();
  while (state.running && id === loopId && snap && !snap.done && !state.error) {
    await step();
    await sleep(Number($('delay').value));
  }
  if (id === loopId) state.running = false;
  buttons();
}

// Stops the Play loop from starting another step. A step already in flight
// still lands: the page is paused once `!state.running && !state.busy`
// (`settled()` resolves then), which is what the end-to-end test waits for.
function pause() {
  state.running = false;
  buttons();
}

async function settled() {
  while (busy) await busy;
}

function buttons() {
  const live = !!demo && !!snap && !snap.done && !state.error;
  $('play').disabled = !live;
  $('play').textContent = state.running ? 'Pause' : 'Play';
  $('step').disabled = !live || state.running || !!busy;
}

async function reset() {
  pause();
  await settled();
  $('fatal').hidden = true;
  if (state.error && state.ready) state.error = null;
  const cfg = readConfig();
  const max = await wasm.max_blocks(cfg.block_size);
  if (cfg.num_blocks > max) cfg.num_blocks = max; // the adapter's binding limit
  for (const f of FIELDS) $(f).value = cfg[f];
  if (demo) demo.free();
  demo = null;
  try {
    demo = await wasm.WebDemo.create(JSON.stringify(cfg));
  } catch (e) {
    fatal(`Could not set up the pool: ${e && e.message ? e.message : e}`);
    buttons();
    return;
  }
  Object.assign(state, {
    config: cfg, steps: 0, done: false, maxErr: 0, lastErr: null, errorsFinite: true,
    copiesTotal: 0, peakShared: 0, peakUsed: 0, peakSequences: 0, consistent: true,
    cascadeSteps: 0, kvRead: 0, kvPlain: 0, cascadeMs: 0, plainMs: 0,
    problems: [], stepMs: null, stepMsTotal: 0, gpuMs: null,
  });
  snap = null;
  log = [];
  idleSteps = 0;
  $('log').replaceChildren();
  absorb(JSON.parse(demo.snapshot()));
  render();
  buttons();
}

async function main() {
  // URL parameters preset the controls: ?seed=3&samples=4&autoplay=1
  const params = new URLSearchParams(location.search);
  for (const f of FIELDS) if (params.has(f)) $(f).value = params.get(f);
  if (params.has('delay')) $('delay').value = params.get('delay');

  const howTo = 'Use a recent Chrome, Edge or Safari, or Firefox with WebGPU enabled; on Linux, '
    + 'Chromium needs --enable-unsafe-webgpu. The page must come from http://localhost or https.';
  if (!('gpu' in navigator)) {
    $('adapter').textContent = 'WebGPU is not available.';
    fatal(`WebGPU is not available in this browser (no navigator.gpu), so the kernels cannot run. ${howTo}`);
    return;
  }
  try {
    await init();
  } catch (e) {
    fatal(`Could not load the wasm module (run scripts/build-web.sh first): ${e}`);
    return;
  }
  // Every decode kernel variant against the f64 reference on this adapter
  // (the end-to-end test calls it; results as JSON rows).
  window.pagedattnKernelCheck = async (seed) => JSON.parse(await wasm.kernel_check(BigInt(seed)));
  window.pagedattnMlaCheck = async (seed) => JSON.parse(await wasm.mla_check(BigInt(seed)));
  let info;
  try {
    info = JSON.parse(await wasm.adapter());
  } catch (e) {
    // The library's message carries a hint for native installs; keep it for the console.
    console.warn(`pagedattn: ${e && e.message ? e.message : e}`);
    $('adapter').textContent = 'WebGPU is not available.';
    fatal(`WebGPU is not available: the browser has the API but gave no adapter, so the kernels cannot run. ${howTo}`);
    return;
  }
  if (!info.name) {
    // wgpu leaves the name empty on the web; the browser's own info says more.
    try {
      const a = await navigator.gpu.requestAdapter();
      const i = a && (a.info || (a.requestAdapterInfo && (await a.requestAdapterInfo())));
      if (i) info.name = [i.vendor, i.architecture, i.description].filter(Boolean).join(' ');
    } catch (_) { /* the name is cosmetic */ }
  }
  Object.assign(state, { adapter: info, backend: info.backend, webgpu: info.webgpu });
  const adapterEl = $('adapter');
  const name = document.createElement('b');
  name.textContent = info.name || 'unnamed adapter';
  adapterEl.replaceChildren(
    'Adapter: ', name,
    ` · ${info.webgpu ? 'WebGPU' : info.backend} · storage binding ${info.max_storage_binding_mib} MiB`
      + ` · ${info.storage_buffers_per_stage} storage buffers/stage`
      + ` · shader-f16 ${info.shader_f16 ? 'available (unused)' : 'absent'}: packed f16 path`,
  );

  $('controls').addEventListener('submit', (ev) => {
    ev.preventDefault();
    reset();
  });
  $('play').addEventListener('click', () => (state.running ? pause() : play()));
  $('step').addEventListener('click', () => step());
  $('pool').addEventListener('mousemove', onHover);
  window.addEventListener('resize', () => snap && drawPool());

  await reset();
  state.ready = true;
  if (params.get('autoplay') === '1') play();
}

main();
