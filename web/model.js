// The real-model page: loads a GGUF into the Rust engine (compiled to wasm,
// web/src/model.rs), queues the prompts the visitor types, runs one
// scheduler step at a time on WebGPU and draws what each step's snapshot
// says: the text of every sequence, the pool, the block tables. No model or
// paging logic lives here; every number drawn is the engine's.
//
// `window.pagedattnModel` mirrors what the page shows, for the end-to-end
// test (web/test/model.mjs) and the console.

import init, * as wasm from './pkg/pagedattn.js';

const $ = (id) => document.getElementById(id);
const MODEL_URL = 'models/SmolLM2-135M-Instruct.Q4_1.gguf';

const state = {
  webgpu: false,
  adapter: null,
  error: null,
  loading: false,
  loadBytes: 0,
  loadTotal: 0,
  ready: false,
  running: false,
  snapshot: null,
  // What the page shows, as drawn (the test compares it with the engine's).
  shown: { shared: null, used: null, free: null, blocks: 0 },
  added: [],
  peakShared: 0,
  steps: 0,
  log: [],
};
window.pagedattnModel = state;

let model = null;
let paused = false;

function fatal(msg) {
  state.error = msg;
  const el = $('fatal');
  el.textContent = msg;
  el.hidden = false;
}

function note(msg) {
  state.log.push(msg);
  const li = document.createElement('li');
  li.textContent = msg;
  const ol = $('log');
  ol.prepend(li);
  while (ol.children.length > 40) ol.lastChild.remove();
}

const hue = (request) => (request * 67 + 210) % 360;
function colour(request, seq) {
  const light = seq < 0 ? 34 : 42 + (seq % 4) * 8;
  return `hsl(${hue(request)} 60% ${light}%)`;
}

// Reads a Response body with progress; resolves to its bytes.
async function readWithProgress(resp, total) {
  const reader = resp.body.getReader();
  const parts = [];
  let got = 0;
  const bar = $('load-progress');
  bar.hidden = false;
  for (;;) {
    const { done, value } = await reader.read();
    if (done) break;
    parts.push(value);
    got += value.length;
    state.loadBytes = got;
    if (total > 0) bar.value = got / total;
    $('load-status').textContent = `Downloading the model: ${(got / 2 ** 20).toFixed(1)}${total ? ` of ${(total / 2 ** 20).toFixed(1)}` : ''} MiB`;
  }
  const out = new Uint8Array(got);
  let at = 0;
  for (const p of parts) {
    out.set(p, at);
    at += p.length;
  }
  return out;
}

function loadConfig() {
  const num = (id) => Math.max(0, Math.floor(Number($(id).value) || 0));
  return {
    num_blocks: Math.min(1024, Math.max(8, num('num_blocks'))),
    block_size: num('block_size'),
    max_batch_tokens: 64,
    kv_dtype: 'f32',
    // `?decode_matmul=split-k` (or `tiled`): the decode matmul, instead of
    // the engine's pick for this adapter (the test runs both).
    decode_matmul: new URLSearchParams(location.search).get('decode_matmul') || 'auto',
  };
}

async function load(bytesPromise, what) {
  if (state.loading) return;
  state.loading = true;
  state.ready = false;
  $('generate').disabled = true;
  $('fatal').hidden = true;
  state.error = null;
  try {
    const bytes = await bytesPromise;
    $('load-status').textContent = `Uploading ${(bytes.length / 2 ** 20).toFixed(1)} MiB of weights and compiling the kernels…`;
    await new Promise((r) => setTimeout(r, 0));
    model = await wasm.WebModel.load(bytes, JSON.stringify(loadConfig()));
    const info = JSON.parse(model.info());
    state.info = info;
    state.ready = true;
    $('load-status').textContent = `Model: ${what} (${info.file_mib.toFixed(1)} MiB), ready.`;
    $('load-progress').hidden = true;
    $('generate').disabled = false;
    drawInfo(info);
    draw(JSON.parse(model.snapshot()));
    note(`loaded ${what}: ${info.layers} layers, ${info.heads}/${info.kv_heads} heads, pool of ${info.num_blocks} blocks`);
  } catch (e) {
    fatal(`The model could not be loaded: ${e && e.message ? e.message : e}`);
    $('load-progress').hidden = true;
    if (model) {
      // The model loaded before stays usable.
      state.ready = true;
      $('generate').disabled = false;
    } else {
      $('load-status').textContent = 'Model: not loaded.';
    }
  } finally {
    state.loading = false;
  }
}

async function loadServed() {
  const resp = await fetch(MODEL_URL).catch((e) => {
    throw new Error(`no model at ${MODEL_URL} (${e.message}): run scripts/fetch-model.sh, then scripts/serve-web.sh, or pick a GGUF file`);
  });
  if (!resp.ok) {
    throw new Error(`${MODEL_URL}: HTTP ${resp.status}; run scripts/fetch-model.sh, then scripts/serve-web.sh, or pick a GGUF file`);
  }
  const total = Number(resp.headers.get('content-length')) || 0;
  state.loadTotal = total;
  return readWithProgress(resp, total);
}

function drawInfo(info) {
  const rows = [
    ['decode kernel', `${info.kernel} (the library's pick for this adapter)`],
    ['decode matmul', info.decode_matmul],
    ['shape', `${info.layers} layers, d ${info.d_model}, ${info.heads} heads / ${info.kv_heads} KV, head_dim ${info.head_dim}`],
    ['vocabulary', info.vocab],
    ['embedding', info.embed_format],
    ['K/V', `${info.kv_dtype}, blocks of ${info.block_size} tokens (${(info.block_bytes / 1024).toFixed(0)} KiB over all layers)`],
  ];
  $('info').replaceChildren(...rows.flatMap(([k, v]) => {
    const dt = document.createElement('dt');
    dt.textContent = k;
    const dd = document.createElement('dd');
    dd.textContent = String(v);
    return [dt, dd];
  }));
}

function genConfig() {
  const num = (id) => Number($(id).value) || 0;
  return {
    prompt: $('prompt').value,
    mode: $('mode').value,
    n: Math.max(1, Math.min(8, Math.floor(num('n')))),
    max_tokens: Math.max(1, Math.min(512, Math.floor(num('max_tokens')))),
    temperature: num('temperature'),
    top_k: Math.max(0, Math.floor(num('top_k'))),
    top_p: 1.0,
    seed: Math.max(0, Math.floor(num('seed'))),
  };
}

async function run() {
  if (state.running) return;
  state.running = true;
  paused = false;
  $('stop').disabled = false;
  try {
    for (;;) {
      if (paused) break;
      const snap = JSON.parse(await model.step());
      state.steps += 1;
      draw(snap);
      if (snap.done) break;
      // Let the page paint between steps.
      await new Promise((r) => setTimeout(r, 0));
    }
  } catch (e) {
    fatal(`A step failed: ${e && e.message ? e.message : e}`);
  } finally {
    state.running = false;
    $('stop').disabled = true;
  }
}

function generate(ev) {
  ev.preventDefault();
  if (!model) return;
  const cfg = genConfig();
  try {
    const added = JSON.parse(model.generate(JSON.stringify(cfg)));
    state.added.push({ ...added, mode: cfg.mode, n: cfg.n });
    note(`request r${added.request}: ${cfg.mode}${cfg.mode === 'greedy' ? '' : ` x${cfg.n}`}, ${added.prompt_ids.length} prompt tokens`);
    $('fatal').hidden = true;
  } catch (e) {
    fatal(`Request refused: ${e && e.message ? e.message : e}`);
    return;
  }
  run();
}

function draw(snap) {
  state.snapshot = snap;
  const n = snap.numbers;
  state.peakShared = Math.max(state.peakShared, n.shared);
  // Texts.
  const texts = $('texts');
  const reqs = snap.requests.slice().reverse();
  if (reqs.length) {
    texts.replaceChildren(...reqs.map((r) => {
      const div = document.createElement('div');
      div.className = 'req';
      const h = document.createElement('h3');
      h.textContent = `r${r.request} · ${r.mode} · “${r.prompt.slice(0, 80)}” (${r.prompt_tokens} prompt tokens)${r.finished ? ' · finished' : ''}${r.aborted ? ' · aborted' : ''}`;
      div.append(h);
      r.sequences.forEach((s, i) => {
        const row = document.createElement('div');
        row.className = `seq${s.done && !r.finished ? ' ended' : ''}`;
        const who = document.createElement('span');
        who.className = 'who';
        who.style.background = colour(r.request, i);
        who.textContent = r.mode === 'beam' ? `beam ${i}` : r.mode === 'sample' ? `sample ${i}` : 'greedy';
        const txt = document.createElement('span');
        txt.className = 'txt';
        txt.textContent = s.text;
        if (r.mode === 'beam') {
          const sc = document.createElement('span');
          sc.className = 'score';
          sc.textContent = `  (logprob ${s.score.toFixed(2)})`;
          txt.append(sc);
        }
        row.append(who, txt);
        div.append(row);
      });
      return div;
    }));
  }
  // The pool.
  const grid = $('grid');
  const cells = snap.blocks.map((b, i) => {
    const c = document.createElement('div');
    c.className = 'cell';
    if (b.refs === 0) {
      c.classList.add('free');
    } else {
      const bg = colour(b.request < 0 ? 0 : b.request, b.sample);
      const fill = Math.round((100 * b.fill) / snap.info.block_size);
      c.style.background = b.refs > 1
        ? (b.request < 0 ? '#444' : `hsl(${hue(b.request)} 65% 30%)`)
        : `linear-gradient(90deg, ${bg} ${fill}%, hsl(${hue(b.request)} 60% 86%) ${fill}%)`;
      if (b.refs > 1) c.textContent = String(b.refs);
    }
    if (b.copied_to) c.classList.add('copied');
    if (b.copied_from) c.classList.add('source');
    c.title = `block ${i}: ${b.refs ? `ref count ${b.refs}, ${b.fill} tokens${b.request >= 0 ? `, r${b.request}` : ''}${b.sample >= 0 ? ` seq ${b.sample}` : ''}` : 'free'}`;
    return c;
  });
  grid.replaceChildren(...cells);
  // Counted from what was drawn.
  state.shown = {
    shared: snap.blocks.filter((b) => b.refs > 1).length,
    used: snap.blocks.filter((b) => b.refs > 0).length,
    free: snap.blocks.filter((b) => b.refs === 0).length,
    blocks: cells.length,
  };
  $('pool-caption').textContent = `${n.total} blocks of ${snap.info.block_size} tokens · step ${n.steps}`;
  // Tables.
  const shared = new Set(snap.blocks.map((b, i) => (b.refs > 1 ? i : -1)).filter((i) => i >= 0));
  $('tables').replaceChildren(...snap.seqs.map((s) => {
    const row = document.createElement('div');
    row.className = 'row';
    const tag = document.createElement('span');
    tag.className = 'tag';
    tag.style.background = colour(s.request, s.index);
    tag.textContent = `r${s.request} #${s.index} (${s.len})`;
    row.append(tag);
    s.table.forEach((b, i) => {
      const el = document.createElement(shared.has(b) ? 'b' : 'span');
      el.textContent = String(b);
      row.append(el, document.createTextNode(i + 1 < s.table.length ? ' ' : ''));
    });
    return row;
  }));
  // Numbers.
  const rows = [
    ['blocks used', `${n.used} of ${n.total}`, 'used'],
    ['shared blocks', n.shared, 'shared'],
    ['free (prefix-cached)', `${n.free + n.evictable} (${n.evictable})`, 'free'],
    ['sequences', n.sequences, 'sequences'],
    ['prefix-cache hits', `${n.prefix_hit_tokens} tokens`, 'prefix'],
    ['copy-on-write copies', `${n.copies_total} (this step ${snap.copies.length})`, 'copies'],
    ['peak used / shared', `${n.peak_blocks_used} / ${n.peak_blocks_shared}`, 'peak'],
    ['contiguous would hold', `${n.contiguous_blocks} blocks`, 'contiguous'],
    ['prefill', `${n.prefill_tokens_per_s.toFixed(1)} tokens/s`, 'prefill'],
    ['decode', `${n.decode_tokens_per_s.toFixed(1)} tokens/s`, 'decode'],
    ['last step', `${n.last_step_ms.toFixed(0)} ms`, 'step'],
  ];
  $('numbers').replaceChildren(...rows.flatMap(([k, v, id]) => {
    const dt = document.createElement('dt');
    dt.textContent = k;
    const dd = document.createElement('dd');
    dd.id = `num-${id}`;
    dd.textContent = String(v);
    return [dt, dd];
  }));
  $('contig-note').textContent = n.contiguous_blocks > 0
    ? `Paged, the requests so far peaked at ${n.peak_blocks_used} blocks; reserving prompt + max tokens per sequence, unshared, takes ${n.contiguous_blocks}.`
    : '';
  if (snap.copies.length) note(`step ${n.steps}: copy-on-write ${snap.copies.map((c) => `${c[0]}→${c[1]}`).join(', ')}`);
  if (snap.problems.length) fatal(`Bookkeeping disagrees: ${snap.problems.join('; ')}`);
}

async function main() {
  $('gen').addEventListener('submit', generate);
  $('stop').addEventListener('click', () => { paused = true; });
  $('load-served').addEventListener('click', () => load(loadServed(), MODEL_URL.split('/').pop()));
  $('load-file').addEventListener('change', (ev) => {
    const f = ev.target.files && ev.target.files[0];
    if (f) load(f.arrayBuffer().then((b) => new Uint8Array(b)), f.name);
  });
  if (!navigator.gpu) {
    fatal('This browser has no WebGPU (navigator.gpu is missing): use a recent Chrome, Edge or Firefox, or Chromium with --enable-unsafe-webgpu.');
    $('adapter').textContent = 'No WebGPU.';
    $('load-served').disabled = true;
    return;
  }
  state.webgpu = true;
  try {
    await init();
    const a = JSON.parse(await wasm.adapter());
    state.adapter = a;
    $('adapter').innerHTML = '';
    const b = document.createElement('b');
    b.textContent = a.name || 'unnamed adapter';
    $('adapter').append(b, document.createTextNode(` · ${a.backend} · storage binding ${a.max_storage_binding_mib} MiB`));
  } catch (e) {
    fatal(`WebGPU is present but no adapter opened: ${e && e.message ? e.message : e}`);
    return;
  }
  // `?autoload` (and the test) loads the served model at once.
  if (new URLSearchParams(location.search).has('autoload')) {
    load(loadServed(), MODEL_URL.split('/').pop());
  }
}

main();
