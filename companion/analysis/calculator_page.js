// The calculator of chapter 13 for the static book: the arithmetic of
// companion/analysis/calculator.py (count_params, kv_cache_bytes_per_token,
// kv_cache_bytes, flops_per_token) on the dials' values, in exact integers (BigInt).
// tests/browser/test_html.py sets every preset and random dials and requires these
// numbers to equal companion.calc's for the same configuration.
(function () {
  "use strict";
  const root = document.currentScript.closest(".calc");
  const spec = JSON.parse(root.querySelector("script.calc-data").textContent);
  const dial = (name) => root.querySelector("#calc-" + name);
  const NORMS_PER_LAYER = { pre: 2n, post: 2n, sandwich: 4n, post_branch: 2n };

  function read() {
    const c = {};
    for (const [name, kind] of Object.entries(spec.kinds)) {
      const el = dial(name);
      if (kind === "bool") c[name] = el.checked;
      else if (kind === "int") c[name] = BigInt(parseInt(el.value || "0", 10));
      else c[name] = el.value;
    }
    // the pattern is repeated to the depth, as chapter 13's build() does
    const letters = c.layer_types.replace(/[^FSL]/gi, "").toUpperCase() || "F";
    const kinds = [];
    for (let i = 0; i < Number(c.n_layers); i++) kinds.push(spec.letters[letters[i % letters.length]]);
    c.layer_types = kinds;
    return c;
  }

  function attention(c) {
    const d = c.d_model, h = c.n_heads, D = c.head_dim;
    const qOut = h * D * (c.attn_output_gate ? 2n : 1n);
    const kvOut = c.n_kv_heads * D;
    const matrices = d * (qOut + 2n * kvOut) + h * D * d;
    let extra = (c.qkv_bias ? qOut + 2n * kvOut : 0n) + (c.bias ? d : 0n);
    if (c.qk_norm === "head") extra += 2n * D;
    else if (c.qk_norm === "full") extra += h * D + kvOut;
    if (c.attn_sinks) extra += h;
    return [matrices + extra, matrices];
  }

  function latent(c) {
    const d = c.d_model, h = c.n_heads, r = c.kv_lora_rank, rq = c.q_lora_rank;
    const qHeads = h * c.head_dim;
    const q = rq === 0n ? d * qHeads : d * rq + rq * qHeads;
    const kvA = d * (r + c.qk_rope_head_dim);
    const kvB = r * h * (c.qk_nope_head_dim + c.v_head_dim);
    const matrices = q + kvA + kvB + h * c.v_head_dim * d;
    return [matrices + rq + r, matrices];
  }

  function deltanet(c) {
    const d = c.d_model, hv = c.linear_value_heads;
    const keys = c.linear_key_heads * c.linear_key_dim, values = hv * c.linear_value_dim;
    const weights = d * (2n * keys + 2n * values) + d * 2n * hv
      + (2n * keys + values) * c.linear_conv_kernel + values * d;
    return [weights + 2n * hv + c.linear_value_dim, weights];
  }

  function denseFfn(c) {
    const d = c.d_model, f = c.d_ff, glu = c.ffn === "glu";
    const matrices = (glu ? 3n : 2n) * d * f;
    return [matrices + (c.bias ? (glu ? 2n * f : f) + d : 0n), matrices];
  }

  function tally(c) {
    const t = { total: 0n, active: 0n, macs: 0n };
    const add = (total, active, macs) => {
      t.total += total;
      t.active += active === null ? total : active;
      t.macs += macs;
    };
    const d = c.d_model, v = c.vocab_size;
    add(v * d, null, 0n);
    if (c.position === "learned") add(c.max_seq_len * d, null, 0n);
    const norm = d * (c.norm === "layernorm" && c.bias ? 2n : 1n);
    c.layer_types.forEach((kind, layer) => {
      const [p, w] = kind === "linear" ? deltanet(c) : c.kv_lora_rank > 0n ? latent(c) : attention(c);
      add(p, null, w);
      if (c.n_experts > 0n && BigInt(layer) >= c.dense_layers) {
        const e = c.n_experts, k = c.experts_per_token, fe = c.expert_d_ff;
        add(e * d + (c.router_bias ? e : 0n) + (c.router_selection_bias ? e : 0n), null, e * d);
        const one = 3n * d * fe + (c.expert_kind === "gpt_oss" ? 2n * fe + d : 0n);
        add(e * one, k * one, k * 3n * d * fe);
        if (c.shared_d_ff > 0n) {
          const shared = 3n * d * c.shared_d_ff + (c.shared_expert_gate ? d : 0n);
          add(shared, null, shared);
        }
      } else {
        const [fp, fw] = denseFfn(c);
        add(fp, null, fw);
      }
      add(NORMS_PER_LAYER[c.norm_placement] * norm, null, 0n);
    });
    if (c.norm_placement !== "post") add(norm, null, 0n);
    add(c.tie_embeddings ? 0n : v * d, null, v * d);
    return t;
  }

  const cacheWidth = (c) =>
    c.kv_lora_rank > 0n ? c.kv_lora_rank + c.qk_rope_head_dim : 2n * c.n_kv_heads * c.head_dim;
  const min = (a, b) => (a < b ? a : b);

  function kvBytes(c, tokens) {
    let total = 0n;
    for (const kind of c.layer_types) {
      if (kind === "linear") {
        const hk = c.linear_key_heads, hv = c.linear_value_heads;
        const dk = c.linear_key_dim, dv = c.linear_value_dim;
        total += hv * dk * dv * c.state_dtype_bytes;
        total += (2n * hk * dk + hv * dv) * (c.linear_conv_kernel - 1n) * c.dtype_bytes;
      } else {
        const kept = kind === "sliding" ? min(tokens, c.sliding_window) : tokens;
        total += kept * cacheWidth(c) * c.dtype_bytes;
      }
    }
    return c.batch * total;
  }

  function flops(c, macs) {
    let mixing = 0n;
    for (const kind of c.layer_types) {
      if (kind === "linear") {
        mixing += 6n * c.linear_value_heads * c.linear_key_dim * c.linear_value_dim;
        continue;
      }
      const s = kind === "sliding" ? min(c.context, c.sliding_window) : c.context;
      const dv = c.kv_lora_rank > 0n ? c.v_head_dim : c.head_dim;
      mixing += 2n * s * c.n_heads * (c.head_dim + dv);
    }
    return 2n * macs + mixing;
  }

  // 8030261248 -> "8.03 B"; bytes in KiB, MiB, GiB
  function human(n, unit) {
    const x = Number(n);
    if (unit === "bytes") {
      const units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
      let i = 0, y = x;
      while (y >= 1024 && i < units.length - 1) { y /= 1024; i++; }
      return (i ? y.toFixed(2) : String(y)) + " " + units[i];
    }
    const steps = [[1e12, " T"], [1e9, " B"], [1e6, " M"], [1e3, " k"]];
    for (const [size, name] of steps) if (x >= size) return (x / size).toFixed(2) + name;
    return String(x);
  }

  function show(id, value, unit) {
    const el = root.querySelector("#calc-" + id);
    el.dataset.value = value.toString();
    el.textContent = human(value, unit);
    el.title = value.toLocaleString("en-US");
  }

  function update() {
    const c = read();
    const problems = [];
    if (c.n_kv_heads < 1n || c.n_heads % c.n_kv_heads !== 0n) problems.push("n_heads must be a multiple of n_kv_heads");
    if (c.n_experts > 0n && (c.experts_per_token < 1n || c.experts_per_token > c.n_experts)) problems.push("top-k must be between 1 and the number of experts");
    if (c.layer_types.includes("sliding") && c.sliding_window < 1n) problems.push("sliding layers need a window");
    root.querySelector(".calc-problems").textContent = problems.join("; ");
    const t = tally(c);
    show("total", t.total, "count");
    show("active", t.active, "count");
    const perLayer = cacheWidth(c) * c.dtype_bytes;
    show("kv-per-token", BigInt(c.layer_types.filter((k) => k !== "linear").length) * perLayer, "bytes");
    show("kv-total", kvBytes(c, c.context), "bytes");
    show("flops-per-token", flops(c, t.macs), "count");
  }

  function load(name) {
    for (const [field, value] of Object.entries(spec.presets[name])) {
      const el = dial(field);
      if (spec.kinds[field] === "bool") el.checked = value;
      else el.value = String(value);
    }
    update();
  }

  dial("preset").addEventListener("change", (e) => load(e.target.value));
  root.querySelectorAll("input, select").forEach((el) => {
    if (el.id === "calc-preset") return;
    el.addEventListener("input", update);
    el.addEventListener("change", update);
  });
  load(dial("preset").value);
})();
