// The page: it fills a request from the form, asks the library (trainmem.js: the C++ core in WebAssembly, its
// C API in include/trainmem/c_api.h) and shows the answer. Nothing here computes a number; bytes are shown as
// the library gives them, with a binary unit beside.
"use strict";

// The fields shown first; every other field of the library's table is under "All fields".
const MAIN_FIELDS = ["model", "task", "batch", "seq", "precision", "optimizer", "lora", "gpu", "attention",
                     "checkpointing"];
const PASTED = "config.json";  // the model field's value, and the request's file name, of a pasted config
const DEBOUNCE_MS = 250;

let lib = null;     // the WebAssembly module
let fields = [];    // the library's field table (trainmem_fields_json)
let timer = null;
let requested = 0;  // inputs changed this many times; the page has answered body.dataset.done of them

function call(fn, request) {
  const text = request === undefined ? lib.ccall(fn, "string", [], [])
                                     : lib.ccall(fn, "string", ["string"], [JSON.stringify(request)]);
  return JSON.parse(text);
}

const $ = (id) => document.getElementById(id);
function el(tag, attrs = {}, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  for (const c of children) e.append(c);
  return e;
}

// 3,221,225,472 B -> "3.00 GiB", 18,087,936 B -> "17.2 MiB" (binary units, as the CLI's tables)
function human(bytes) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let v = Number(bytes), i = 0;
  while (Math.abs(v) >= 1024 && i < units.length - 1) { v /= 1024; ++i; }
  return i === 0 ? `${v} B` : `${v.toFixed(i >= 3 ? 2 : 1)} ${units[i]}`;
}
function bytesCell(id, label, bytes, note) {
  return el("div", {class: "card", id},
            el("div", {class: "label"}, label),
            el("div", {class: "value", "data-bytes": String(bytes)}, human(bytes)),
            el("div", {class: "exact"}, `${Number(bytes).toLocaleString("en-US")} B`),
            note ? el("div", {class: "note"}, note) : "");
}

// "fp32 | fp16-amp | bf16-amp: ..." -> the choices a help text starts with, or null for a free-form field
function choices(help) {
  const head = help.split(/[:(]/)[0];
  if (!head.includes(" | ")) return null;
  const words = head.split("|").map((w) => w.trim());
  return words.every((w) => /^[a-z0-9][a-z0-9.,-]*$/.test(w)) ? words : null;
}

function fieldInput(f, models, gpus) {
  const id = `f-${f.name}`;
  let input;
  if (f.name === "model") {
    input = el("select", {id});
    for (const m of models) input.append(el("option", {value: m.name}, `${m.name} (${m.model_type}, ${(m.parameters / 1e9).toFixed(2)} B)`));
    input.append(el("option", {value: PASTED}, "config.json (paste it below)"));
    input.value = f.default;
  } else if (f.name === "gpu") {
    input = el("select", {id});
    input.append(el("option", {value: ""}, "none"));
    for (const g of gpus) input.append(el("option", {value: g.name}, `${g.name} (${g.torch_name})`));
  } else if (f.repeatable) {
    input = el("textarea", {id, rows: "2", placeholder: "one per line", spellcheck: "false"});
  } else if (choices(f.help)) {
    input = el("select", {id});
    input.append(el("option", {value: ""}, f.default ? `default (${f.default})` : "default"));
    for (const c of choices(f.help)) input.append(el("option", {value: c}, c));
  } else {
    input = el("input", {id, type: "text", placeholder: f.default || "default", spellcheck: "false"});
  }
  input.dataset.field = f.name;
  input.title = f.help;
  return el("div", {class: "field"}, el("label", {for: id, title: f.help}, f.flag), input);
}

// The form as a request: only what the user set (the rest is the library's default, as with the CLI's flags)
function request() {
  const out = {fields: {}, plots: ["breakdown", "timeline"]};
  for (const input of document.querySelectorAll("[data-field]")) {
    const f = input.dataset.field, v = input.value.trim();
    if (v === "") continue;
    if (input.tagName === "TEXTAREA") {
      const lines = v.split("\n").map((s) => s.trim()).filter((s) => s);
      if (lines.length) out.fields[f] = lines;
    } else {
      out.fields[f] = v;
    }
  }
  if (out.fields.model === PASTED) out.files = {[PASTED]: $("config").value};
  return out;
}

function cliCommand(req) {
  const quote = (s) => (/^[A-Za-z0-9_.,:=+\/-]+$/.test(s) ? s : `'${s.replace(/'/g, "'\\''")}'`);
  const words = ["trainmem", "estimate"];
  for (const f of fields) {
    const v = req.fields[f.name];
    if (v === undefined) continue;
    for (const one of Array.isArray(v) ? v : [v]) words.push(f.flag, quote(one));
  }
  return words.join(" ");
}

function showError(answer) {
  $("error").hidden = false;
  $("error").textContent = `trainmem: ${answer.error}`;
  $("error").dataset.field = answer.field || "";
}

// The library's last answers as they came, for the browser's console (and the page's test):
// trainmemPage.estimate / .fit are the C API's JSON (c_api.h); trainmemPage.call("trainmem_estimate_json",
// {fields: {...}, timeline: {by: "event"}}) asks it anything.
window.trainmemPage = {estimate: null, fit: null, plan: null, call};

function renderEstimate(answer) {
  window.trainmemPage.estimate = answer;
  const e = answer.estimate, m = e.memory;
  const peaks = $("peaks");
  peaks.replaceChildren(
      bytesCell("peak-allocated", "peak allocated", m.peak_allocated_bytes, "torch.cuda.max_memory_allocated()"),
      bytesCell("peak-reserved", "peak reserved", m.peak_reserved_bytes, "torch.cuda.max_memory_reserved()"),
      m.device_total_bytes === undefined ? ""
          : bytesCell("device-total", "on the device", m.device_total_bytes, "what nvidia-smi shows"));
  const tbody = $("breakdown").querySelector("tbody");
  tbody.replaceChildren();
  for (const c of e.peak_components) {
    // a share of the live tensors at the peak, as the CLI's table
    const live = m.live_tensors_at_peak_bytes;
    const share = live ? (100 * c.bytes / live).toFixed(1) + "%" : "";
    tbody.append(el("tr", {"data-component": c.name}, el("td", {}, c.name),
                    el("td", {class: "num", "data-bytes": String(c.bytes)}, human(c.bytes)),
                    el("td", {class: "num"}, share), el("td", {}, c.note)));
  }
  const v = $("verdict");
  v.hidden = !e.device;
  if (e.device) {
    const d = e.device;
    v.className = d.fits ? "fits" : "oom";
    v.dataset.fits = String(d.fits);
    v.dataset.headroom = String(d.headroom_bytes);
    v.textContent = d.fits
        ? `Fits the ${d.torch_name}: ${human(d.peak_reserved_on_this_gpu_bytes)} reserved at the peak of ${human(d.usable_bytes)} usable, ${human(d.headroom_bytes)} to spare.`
        : `Does not fit the ${d.torch_name}: at least ${human(-d.headroom_bytes)} more would be needed.`;
  }
  $("breakdown-svg").innerHTML = answer.svg.breakdown || "";
  $("timeline-svg").innerHTML = answer.svg.timeline || "";
  $("estimate-table").textContent = answer.table;
  const w = $("warnings");
  w.replaceChildren(...answer.warnings.map((s) => el("li", {}, `warning: ${s}`)));
}

// fit: the largest micro-batch at this sequence length that fits the GPU (the batch field is fit's to find)
function renderFit(req) {
  const box = $("fit");
  box.hidden = false;
  $("fit-table").textContent = "";
  window.trainmemPage.fit = null;
  if (!req.fields.gpu) {
    box.textContent = "Choose a GPU to see the largest micro-batch that fits it (trainmem fit).";
    box.dataset.largest = "";
    return;
  }
  const fitReq = {fields: {...req.fields}, files: req.files, fit: {solve: "batch", margin: "5%"}};
  delete fitReq.fields.batch;
  const a = call("trainmem_fit_json", fitReq);
  window.trainmemPage.fit = a;
  if (!a.ok) {
    box.textContent = `fit: ${a.error}`;
    box.dataset.largest = "";
    return;
  }
  const r = a.fit;
  box.dataset.largest = r.largest === null || r.largest === undefined ? "none" : String(r.largest);
  const head = r.largest
      ? `trainmem fit: the largest micro-batch that fits is ${r.largest} (at --seq ${r.setup.seq}, keeping ${human(r.margin_bytes)} free).`
      : "trainmem fit: even a micro-batch of 1 does not fit.";
  const items = (r.suggestions || []).slice(0, 4).map((s) =>
      el("li", {}, el("code", {}, s.change), ` (${s.what})` + (s.largest ? `: up to ${s.largest}` : "")));
  box.replaceChildren(el("div", {id: "fit-answer"}, head), items.length ? el("ul", {}, ...items) : "");
  $("fit-table").textContent = a.table;
}

// plan: the form's fields (less what plan chooses or derives) over the cluster named here; on request, as it
// simulates many setups
function runPlan() {
  const req = request();
  const planReq = {fields: {...req.fields, gpus: $("plan-gpus").value.trim()}, files: req.files,
                   plan: {global_batch: $("plan-global-batch").value.trim()}};
  for (const f of ["gpu", "batch", "grad_accum", "dp", "micro_batches"]) delete planReq.fields[f];
  document.body.dataset.plan = "busy";
  $("plan-answer").textContent = "Planning…";
  setTimeout(() => {
    const t0 = performance.now();
    const a = call("trainmem_plan_json", planReq);
    window.trainmemPage.plan = a;
    if (!a.ok) {
      $("plan-answer").textContent = `trainmem: ${a.error}`;
      $("plan-table").textContent = "";
      document.body.dataset.plan = "error";
      return;
    }
    const best = a.plan.rows[0];
    $("plan-answer").textContent = best
        ? `Fastest of ${a.plan.ranked_total} setups that fit: ${best.family}, ${Math.round(best.time.tokens_per_second).toLocaleString("en-US")} tokens/s (planned in ${Math.round(performance.now() - t0)} ms).`
        : "No setup fits: every family is listed below with its reason.";
    $("plan-table").textContent = a.table;
    document.body.dataset.plan = "ready";
  }, 0);
}

function update() {
  const n = requested;
  const req = request();
  $("config-box").hidden = req.fields.model !== PASTED;
  $("cli-command").textContent = cliCommand(req);
  $("error").hidden = true;
  document.body.dataset.state = "busy";
  $("status").textContent = "Simulating…";
  // let the browser paint "Simulating…" before the (synchronous) simulation
  setTimeout(() => {
    const t0 = performance.now();
    const answer = call("trainmem_estimate_json", req);
    if (answer.ok) {
      renderEstimate(answer);
      renderFit(req);
      $("status").textContent = `Simulated in ${Math.round(performance.now() - t0)} ms (estimate and fit).`;
    } else {
      showError(answer);
      $("status").textContent = "";
    }
    if (n === requested) document.body.dataset.state = answer.ok ? "ready" : "error";
    document.body.dataset.done = String(n);
  }, 0);
}

function changed() {
  document.body.dataset.requested = String(++requested);
  clearTimeout(timer);
  timer = setTimeout(update, DEBOUNCE_MS);
}

async function main() {
  lib = await createTrainmem();
  fields = call("trainmem_fields_json").fields;
  const models = call("trainmem_models_json").models, gpus = call("trainmem_gpus_json").gpus;
  for (const f of MAIN_FIELDS.map((name) => fields.find((x) => x.name === name))) {
    $("main-fields").append(fieldInput(f, models, gpus));
  }
  for (const group of ["model", "training", "runtime"]) {
    const box = el("fieldset", {}, el("legend", {}, group));
    for (const f of fields.filter((x) => x.group === group && !MAIN_FIELDS.includes(x.name))) {
      box.append(fieldInput(f, models, gpus));
    }
    $("more-fields").append(box);
  }
  $("plan-run").addEventListener("click", runPlan);
  $("scenario").addEventListener("input", changed);
  $("scenario").addEventListener("change", changed);
  changed();
}

main().catch((e) => {
  document.body.dataset.state = "error";
  $("status").textContent = `The library did not load: ${e}`;
});
